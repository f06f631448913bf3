"""Bare libp2p nodes for reachability checks: a p2pd daemon of their own, no DHT, outside the swarm.

A peer cannot learn whether others can dial it from a node it is already connected to: libp2p reuses the open
connection, so a "dial-back" over it always works, NAT or not. So the peer asked to dial back does it from a
node that listens nowhere and has no connections (``start_prober``), and a joining peer asks from a node that
listens where its DHT will (``start_listener``), before the DHT starts and with nothing else open.
"""

from __future__ import annotations

import contextlib
import logging

from hivemind.p2p import P2P, PeerID

logger = logging.getLogger(__name__)

# The options every bare node shares: no DHT service, no UPnP / NAT-PMP, no AutoNAT, never the IPFS network.
_BARE = {"dht_mode": "client", "auto_nat": False, "nat_port_map": False, "use_ipfs": False}


async def start_prober() -> P2P:
    """A node that listens nowhere (no one can call it) and dials out, circuit addresses included."""
    return await P2P.create(no_listen=True, use_relay=True, **_BARE)  # type: ignore[arg-type]


async def start_listener(host: str, port: int, listen: bool) -> P2P:
    """A node listening on ``host:port`` (nowhere when not ``listen``), as a peer's DHT would; no relay."""
    ip = "ip6" if ":" in host else "ip4"
    where = {"host_maddrs": [f"/{ip}/{host}/tcp/{port}"]} if listen else {"no_listen": True}
    return await P2P.create(use_relay=False, **where, **_BARE)  # type: ignore[arg-type]


async def visible_maddrs(p2p: P2P) -> list[str]:
    """The node's multiaddrs ending in /p2p/<its id>; none when it listens nowhere."""
    try:
        return [str(m) for m in await p2p.get_visible_maddrs()]
    except ValueError:  # hivemind raises when there are none
        return []


async def disconnect(p2p: P2P, peer_id: str) -> None:
    """Close our connections to ``peer_id``, so that the next call dials it afresh."""
    with contextlib.suppress(Exception):  # already gone, or never connected
        await p2p._client.disconnect(PeerID.from_base58(peer_id))


async def stop(p2p: P2P) -> None:
    """Stop the node's daemon; failures are logged, never raised (it is only a probe)."""
    try:
        await p2p.shutdown()
    except Exception as e:
        logger.debug("stopping a probe node failed: %r", e)
