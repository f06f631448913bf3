"""Reachability: can others dial this peer, and if not, serve through another peer's circuit relay.

    check = await check_before_join(dht_config, timeout_s)   # before the DHT starts: ask initial peers to dial
                                                            # back a bare node listening where the DHT will
    if check.reachable is False and relaying allowed:       # serve through those that answered: the DHT runs as
        DHTConfig(relays=check.relays, client_mode=True)    # a client, p2pd reserves a slot at each relay, and
                                                            # our record carries <relay>/p2p-circuit/p2p/<us>
    ... later, once announced: ask a live peer to dial us back at our record's addresses, and log one line
    (RELAYED "serving through relay ..." or exactly why not).

The asked side (``DialBack``) dials from a bare node that listens nowhere and holds no connection to the asker:
over an open connection every dial-back would succeed (swarm.dht.probe).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from hivemind.p2p import P2P

from swarm.dht import DHTConfig, Directory, PeerRecord, ReachabilityConfig
from swarm.dht import probe as bare
from swarm.errors import CapacityError, ProtocolError
from swarm.transport import call_probe
from swarm.transport.channel import forget_peer, serve_raw
from swarm.wire import ErrorReply, ProbeReply, ProbeRequest, decode_request, encode_reply

logger = logging.getLogger(__name__)

MAX_ASKED = 3  # initial peers asked to dial us back before joining
MAX_DIAL_BACKS = 4  # dial-backs one peer makes at once for others; more are refused (CapacityError)
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


@dataclass(frozen=True)
class JoinCheck:
    """What the dial-back before joining found."""

    reachable: bool | None  # None: not asked (first peer, loopback) or no one answered
    relays: tuple[str, ...]  # multiaddrs (ending in /p2p/<id>) of the peers that answered: relay candidates
    detail: str  # one line, for the log


def relaying_off_reason(reach: ReachabilityConfig) -> str:
    """Why this peer may not serve through a relay; "" when it may."""
    if not reach.use_relay:
        return "relays are turned off (--no-relay)"
    if not reach.relay_when_unreachable:
        return "serving through a relay is turned off (--no-relay-when-unreachable)"
    return ""


def needs_check(config: DHTConfig) -> bool:
    """Whether to dial-back-check before joining: not as the first peer, nor listening on loopback (nothing on
    this machine is behind a NAT from itself, and every local test peer would pay a daemon's start)."""
    if not config.initial_peers:
        return False
    return not (config.listen and config.host in LOOPBACK_HOSTS)


async def check_before_join(config: DHTConfig, timeout_s: float) -> JoinCheck:
    """Ask up to MAX_ASKED initial peers to dial back a bare node that listens where our DHT will."""
    p2p = await bare.start_listener(config.host, config.port, config.listen)
    try:
        own_id = p2p.peer_id.to_base58()
        await serve_raw(p2p, _answer_probes(own_id))
        # Where others will dial the DHT: the announced addresses (a forwarded port) if any, else where we listen.
        announced = tuple(
            m if "/p2p/" in m else f"{m}/p2p/{own_id}"
            for m in config.reachability.announce_maddrs
            if config.listen
        )
        own = announced or tuple(await bare.visible_maddrs(p2p))
        answered: list[str] = []
        for maddr in _distinct_peers(config.initial_peers)[:MAX_ASKED]:
            peer_id = maddr.rsplit("/p2p/", 1)[1]
            request = ProbeRequest(dial_back_peer_id=own_id, dial_back_maddrs=own)
            try:
                reply = await call_probe(
                    p2p, peer_id, request, maddrs=[_dial_part(maddr)], timeout_s=timeout_s + 5
                )
            except Exception as e:  # down, or not a FlowSwarm peer: ask the next one
                logger.debug("dial-back request to %s failed: %r", peer_id[-8:], e)
                continue
            if reply.dial_back_ok:
                return JoinCheck(True, (), f"{peer_id[-8:]} dialled us back")
            if reply.dial_back_ok is False:
                answered.append(maddr)
        if answered:
            who = ", ".join(m.rsplit("/p2p/", 1)[1][-8:] for m in answered)
            where = ", ".join(own) or "no address: we listen nowhere"
            return JoinCheck(False, tuple(answered), f"{who} could not dial us back at {where}")
        return JoinCheck(None, (), "no initial peer answered a dial-back request")
    finally:
        await bare.stop(p2p)


async def check_after_join(
    p2p: P2P, directory: Directory, own_id: str, maddrs: Sequence[str], timeout_s: float
) -> tuple[bool | None, str]:
    """Ask a live peer (up to MAX_ASKED) to dial us back at ``maddrs``: (reachable, who said so). None when
    no other peer is live or none answered."""
    try:
        others = [(pid, r) for pid, r in (await directory.read_peers()).items() if pid != own_id]
    except (TimeoutError, OSError, RuntimeError) as e:
        return None, f"could not read the swarm: {e!r}"
    for peer_id, other in others[:MAX_ASKED]:
        request = ProbeRequest(dial_back_peer_id=own_id, dial_back_maddrs=tuple(maddrs))
        try:
            reply = await call_probe(p2p, peer_id, request, maddrs=other.maddrs, timeout_s=timeout_s + 5)
        except Exception as e:  # that peer is down: ask the next one
            logger.debug("dial-back request to %s failed: %r", peer_id[-8:], e)
            continue
        if reply.dial_back_ok:
            return True, f"{peer_id[-8:]} dialled us back"
        return False, f"{peer_id[-8:]} could not dial us back at {', '.join(maddrs) or 'no address'}"
    return None, "no other live peer answered a dial-back request"


async def watch_relays(
    read_live: Callable[[], Awaitable[Collection[str]]], relays: Sequence[str], period_s: float
) -> None:
    """Return once every relay we serve through has left the swarm: no one can reach us any more. p2pd takes
    its relays at start only, so the peer then rejoins through others (swarm.peer.server)."""
    relay_ids = {m.rsplit("/p2p/", 1)[1] for m in relays}
    while True:
        await asyncio.sleep(period_s)
        try:
            live = await read_live()
        except Exception as e:  # the DHT is slow: look again next period
            logger.debug("could not read the swarm: %r", e)
            continue
        if not relay_ids & set(live):
            logger.warning(
                "every relay we serve through (%s) has left the swarm: no one can reach us now",
                ", ".join(sorted(r[-8:] for r in relay_ids)),
            )
            return


def relay_candidates(peers: Mapping[str, PeerRecord], own_id: str, limit: int = MAX_ASKED) -> tuple[str, ...]:
    """Multiaddrs of up to ``limit`` live peers that others can dial directly (found reachable, not relayed):
    whom to ask for a dial-back, and relay through, when rejoining."""
    found = []
    for peer_id, record in peers.items():
        direct = [m for m in record.maddrs if "/p2p-circuit" not in m]
        if peer_id != own_id and record.reachable and direct and record.state == "serving":
            found.append(direct[0] if direct[0].endswith(f"/p2p/{peer_id}") else f"{direct[0]}/p2p/{peer_id}")
    return tuple(found[:limit])


class DialBack:
    """Dials peers back for their reachability checks, from a bare node started on first use."""

    def __init__(self, timeout_s: float, start: Callable[[], Awaitable[P2P]] = bare.start_prober) -> None:
        self.timeout_s = timeout_s
        self._start = start
        self._p2p: P2P | None = None
        self._starting = asyncio.Lock()
        self._dialling: set[str] = set()  # peers being dialled back: one check at a time each

    async def __call__(self, peer_id: str, maddrs: Sequence[str]) -> bool:
        """Whether ``peer_id`` answers a probe at ``maddrs`` over a connection of its own."""
        if peer_id in self._dialling:
            raise CapacityError("already dialling you back; ask again once that check is done")
        if len(self._dialling) >= MAX_DIAL_BACKS:
            raise CapacityError(f"already dialling {len(self._dialling)} peers back; ask again later")
        self._dialling.add(peer_id)
        try:
            p2p = await self._node()
            try:
                await call_probe(p2p, peer_id, maddrs=tuple(maddrs), timeout_s=self.timeout_s)
                return True
            except Exception as e:  # any failure to reach it is the answer
                logger.debug("could not dial %s back: %r", peer_id[-8:], e)
                return False
            finally:  # the next check of this peer dials afresh
                forget_peer(p2p, peer_id)
                await bare.disconnect(p2p, peer_id)
        finally:
            self._dialling.discard(peer_id)

    async def _node(self) -> P2P:
        async with self._starting:
            if self._p2p is None:
                self._p2p = await self._start()
            return self._p2p

    async def aclose(self) -> None:
        if self._p2p is not None:
            await bare.stop(self._p2p)
            self._p2p = None


def _answer_probes(own_id: str) -> Callable[[bytes, str], Awaitable[bytes]]:
    """A raw handler that answers probes only (the bare node before joining serves nothing else)."""

    async def answer(data: bytes, remote_id: str) -> bytes:
        try:
            request = decode_request(data)
        except ProtocolError as e:
            return encode_reply(ErrorReply.from_error(e, own_id))
        if not isinstance(request, ProbeRequest) or request.dial_back_peer_id or request.reply_bytes:
            error = ProtocolError("this node is checking its reachability and answers bare probes only")
            return encode_reply(ErrorReply.from_error(error, own_id))
        return encode_reply(ProbeReply(own_id, len(request.payload)))

    return answer


def _distinct_peers(maddrs: Sequence[str]) -> list[str]:
    """One multiaddr per peer id, in order; multiaddrs without /p2p/<id> are skipped."""
    seen: dict[str, str] = {}
    for maddr in maddrs:
        if "/p2p/" in maddr:
            seen.setdefault(maddr.rsplit("/p2p/", 1)[1], maddr)
    return list(seen.values())


def _dial_part(maddr: str) -> str:
    """The multiaddr without its final /p2p/<id> (what p2pd dials)."""
    return maddr.rsplit("/p2p/", 1)[0]
