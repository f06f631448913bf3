"""Reachability settings: which p2pd options and flags a peer, a client and a peer behind NAT get."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from swarm.dht import DHTConfig, ReachabilityConfig
from swarm.dht.node import circuit_maddr
from swarm.errors import CapacityError
from swarm.peer.reach import (
    MAX_DIAL_BACKS,
    DialBack,
    needs_check,
    relay_candidates,
    relaying_off_reason,
    watch_relays,
)

RELAY = "/ip4/10.0.0.1/tcp/4000/p2p/QmRelay"


def test_a_reachable_peer_relays_for_others_within_its_bounds() -> None:
    reach = ReachabilityConfig(relay_max_reservations=3, relay_data_limit_bytes=1000, relay_time_limit_s=90.0)
    assert reach.p2p_kwargs() == {
        "use_relay": True,
        "use_auto_relay": False,
        "nat_port_map": False,
        "auto_nat": False,
        "use_ipfs": False,
    }
    assert reach.daemon_flags() == {
        "relayService": "1",
        "relayMaxReservations": "3",
        "relayMaxCircuits": "16",
        "relayDataLimit": "1000",
        "relayTimeLimit": "90s",
    }


def test_a_client_dials_through_relays_but_relays_for_no_one() -> None:
    assert ReachabilityConfig().daemon_flags(relay_service=False) == {"relayService": "0"}


def test_a_peer_behind_nat_reserves_at_its_relays_at_once_and_relays_for_no_one() -> None:
    reach = ReachabilityConfig()
    kwargs = reach.p2p_kwargs((RELAY,))
    assert kwargs["use_relay"] and kwargs["use_auto_relay"] and kwargs["force_reachability"] == "private"
    assert reach.daemon_flags((RELAY,)) == {
        "trustedRelays": RELAY,
        "relayDiscovery": "0",
        "relayService": "0",
    }


def test_with_relays_off_the_daemon_gets_no_relay_flags_and_cannot_be_relayed() -> None:
    reach = ReachabilityConfig(use_relay=False)
    assert reach.daemon_flags() == {} and reach.p2p_kwargs()["use_relay"] is False
    with pytest.raises(ValueError, match="needs use_relay"):
        reach.p2p_kwargs((RELAY,))
    assert relaying_off_reason(reach) == "relays are turned off (--no-relay)"
    off = ReachabilityConfig(relay_when_unreachable=False)
    assert "--no-relay-when-unreachable" in relaying_off_reason(off)
    assert relaying_off_reason(ReachabilityConfig()) == ""


def test_a_relayed_node_is_a_dht_client_and_bounds_are_positive() -> None:
    with pytest.raises(ValueError, match="client_mode"):
        DHTConfig(relays=(RELAY,))
    DHTConfig(relays=(RELAY,), client_mode=True)
    with pytest.raises(ValueError, match="relay_time_limit_s"):
        ReachabilityConfig(relay_time_limit_s=0)


def test_the_circuit_address_goes_through_the_relay_to_the_peer() -> None:
    assert circuit_maddr(RELAY, "QmPeer") == f"{RELAY}/p2p-circuit/p2p/QmPeer"
    with pytest.raises(ValueError, match="/p2p/"):
        circuit_maddr("/ip4/10.0.0.1/tcp/4000", "QmPeer")


def test_the_check_before_joining_is_skipped_for_the_first_peer_and_on_loopback() -> None:
    assert not needs_check(DHTConfig())
    assert not needs_check(DHTConfig(initial_peers=(RELAY,), host="127.0.0.1"))
    assert needs_check(DHTConfig(initial_peers=(RELAY,), host="127.0.0.1", listen=False))
    assert needs_check(DHTConfig(initial_peers=(RELAY,), host="10.0.0.2"))


def test_the_watch_ends_once_every_relay_it_serves_through_has_left(caplog: pytest.LogCaptureFixture) -> None:
    reads = iter([{"QmRelay", "QmOther"}, {"QmOther"}])

    async def read_live() -> set[str]:
        return next(reads)

    with caplog.at_level(logging.WARNING, logger="swarm.peer.reach"):
        asyncio.run(asyncio.wait_for(watch_relays(read_live, (RELAY,), period_s=0.001), timeout=5))
    (record,) = caplog.records
    assert "every relay we serve through (QmRelay) has left" in record.getMessage()


def test_a_peer_rejoins_through_live_serving_peers_that_others_can_dial() -> None:
    def record(peer_id: str, maddrs: list[str], reachable: bool | None, state: str = "serving") -> Any:
        return SimpleNamespace(peer_id=peer_id, maddrs=maddrs, reachable=reachable, state=state)

    peers = {
        "QmMe": record("QmMe", ["/ip4/10.0.0.9/tcp/1/p2p/QmMe"], True),
        "QmA": record("QmA", ["/ip4/10.0.0.1/tcp/1/p2p/QmA"], True),
        "QmRelayed": record("QmRelayed", [f"{RELAY}/p2p-circuit/p2p/QmRelayed"], True),
        "QmUnknown": record("QmUnknown", ["/ip4/10.0.0.3/tcp/1/p2p/QmUnknown"], None),
        "QmGoing": record("QmGoing", ["/ip4/10.0.0.4/tcp/1/p2p/QmGoing"], True, "leaving"),
        "QmB": record("QmB", ["/ip4/10.0.0.2/tcp/1"], True),
    }
    assert relay_candidates(peers, "QmMe") == ("/ip4/10.0.0.1/tcp/1/p2p/QmA", "/ip4/10.0.0.2/tcp/1/p2p/QmB")
    assert relay_candidates(peers, "QmMe", limit=1) == ("/ip4/10.0.0.1/tcp/1/p2p/QmA",)


def test_a_peer_dials_back_at_most_a_few_others_at_once() -> None:
    async def run() -> None:
        started = asyncio.Event()

        async def start_never() -> Any:  # the bare node never comes up: the dial-backs wait on it
            started.set()
            await asyncio.Event().wait()

        dial = DialBack(timeout_s=1.0, start=start_never)
        first = asyncio.create_task(dial("Qm0", ()))
        await started.wait()
        with pytest.raises(CapacityError, match="already dialling you back"):  # one check at a time per peer
            await dial("Qm0", ())
        waiting = [first] + [asyncio.create_task(dial(f"Qm{i}", ())) for i in range(1, MAX_DIAL_BACKS)]
        await asyncio.sleep(0)  # let them take their places
        with pytest.raises(CapacityError, match=f"already dialling {MAX_DIAL_BACKS} peers"):
            await dial("QmOneMore", ())
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        assert not dial._dialling  # cancelled dial-backs gave their places back

    asyncio.run(run())
