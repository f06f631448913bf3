"""A hostile DHT node for attack tests: a fresh key of its own, and none of FlowSwarm's checks.

An attacker does not run our code, so this node skips it: it joins the swarm's DHT as a full node (it stores
and serves records, so its own copies reach readers even where honest nodes refuse to store them), signs
with its own RSA key like any peer (hivemind's RSASignatureValidator, so honest nodes accept its subkeys), but
has no schema validator: it can write any value, malformed or not, under its own subkey.

    async with hostile_node(swarm.initial_peers) as attacker:
        await attacker.store(plan_key(model_hash), {"epoch": 2**62, ...}, attacker.now() + 60)

The only module outside swarm.dht that uses hivemind, on purpose: it is the attacker's software, not ours.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time

from swarm.dht.identity import ensure_identity_file, load_private_key


class HostileNode:
    """A running hivemind DHT node with its own key and no schema (see the module docstring)."""

    def __init__(self, dht: hivemind.DHT, marker: bytes) -> None:
        self.dht = dht
        self.marker = marker  # "[owner:<our key>]": subkeys carrying it are ours to write
        self.peer_id: str = dht.peer_id.to_base58()

    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    @staticmethod
    def now() -> float:
        return float(get_dht_time())

    async def store(self, key: str, value: Any, expiration_time: float, tag: bytes = b"") -> bool:
        """Store any value under our subkey (+ `tag`, for several values under one key)."""
        future = self.dht.store(key, value, expiration_time, subkey=self.marker + tag, return_future=True)
        return bool(await future)


@contextlib.asynccontextmanager
async def hostile_node(initial_peers: Sequence[str]) -> AsyncIterator[HostileNode]:
    """A HostileNode joined to `initial_peers` on 127.0.0.1; shut down (off the loop) on exit."""
    path, _temporary = await asyncio.to_thread(ensure_identity_file, None)
    validator = RSASignatureValidator(load_private_key(path))
    dht = await asyncio.to_thread(
        hivemind.DHT,
        initial_peers=list(initial_peers),
        start=True,
        record_validators=[validator],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        identity_path=str(path),
        check_if_identity_free=False,
        use_relay=False,
        use_auto_relay=False,
        nat_port_map=False,
        auto_nat=False,
        use_ipfs=False,
    )
    try:
        yield HostileNode(dht, validator.local_public_key)
    finally:
        await asyncio.shield(asyncio.to_thread(dht.shutdown))
        path.unlink(missing_ok=True)
