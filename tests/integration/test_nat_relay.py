"""A peer no one can dial serves through another peer's circuit relay (tiny model, real peers on 127.0.0.1).

On loopback the peer "behind NAT" listens on no address at all (``--no-listen``): every connection to it must
come through a relay. The namespaced case, behind an emulated masquerading NAT, is in test_nat_relay_netns.py.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import psutil
import pytest

from swarm.dht import DHTConfig, ReachabilityConfig, SwarmDHT
from swarm.dht.node import RELAY_FAILED, RELAY_OK
from swarm.models.loading import resolve_model
from swarm.peer.config import SessionConfig
from swarm.peer.reach import check_before_join
from swarm.testing import LocalSwarm, PeerProcess
from swarm.testing.nat import PROMPT_IDS, generate, nat_relay_case, wait_for_verdict
from swarm.testing.reference import greedy_reference

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_a_peer_no_one_can_dial_serves_through_a_relay_with_equal_greedy_tokens(tmp_path: Path) -> None:
    with LocalSwarm(tmp_path, model="tiny") as swarm:
        result = nat_relay_case(swarm)
    assert result["relay_line"].startswith(RELAY_OK), result["relay_line"]
    assert result["relayed"] and result["through_nat_peer"]
    assert result["tokens"] == result["reference"]
    assert result["nat_relay_ok"]


@pytest.mark.timeout(300)
def test_with_relaying_off_the_peer_says_exactly_why_it_cannot_serve(tmp_path: Path) -> None:
    with LocalSwarm(tmp_path, model="tiny") as swarm:
        swarm.start_peer("0:3", name="public", extra_args=["--no-follow-plan"])
        nat = swarm.start_peer(
            "3:6", name="nat", extra_args=["--no-listen", "--no-relay-when-unreachable"], wait=False
        )
        line = wait_for_verdict(nat, timeout_s=120)
    assert line.startswith(RELAY_FAILED)
    assert "turned off (--no-relay-when-unreachable)" in line
    assert "could not dial us back" in line


@pytest.mark.timeout(400)
def test_when_one_of_its_relays_leaves_the_peer_is_reached_through_another(tmp_path: Path) -> None:
    fixed = ["--no-follow-plan"]
    with LocalSwarm(tmp_path, model="tiny") as swarm:
        first = swarm.start_peer("0:2", name="first", extra_args=fixed)
        swarm.start_peer("4:6", name="last", extra_args=fixed)
        spare = swarm.start_peer("4:6", name="spare", extra_args=fixed)
        relays = [spare.maddrs[0], first.maddrs[0]]  # both answer its dial-back: it serves through both
        nat = swarm.start_peer(
            "2:4", name="nat", extra_args=[*fixed, "--no-listen"], initial_peers=relays, wait=False
        )
        assert wait_for_verdict(nat, timeout_s=120).startswith(RELAY_OK)
        nat.wait_ready(60)
        assert sorted(m.split("/p2p-circuit/")[0] for m in nat.maddrs) == sorted(relays)
        spare.stop()
        answer = generate(swarm, 6, 180, None)
        expected = greedy_reference(resolve_model("tiny"), PROMPT_IDS, 6)
    assert nat.peer_id in answer["route"] and spare.peer_id not in answer["route"]
    assert answer["tokens"] == expected


@pytest.mark.timeout(400)
def test_when_its_only_relay_leaves_the_peer_rejoins_through_another(tmp_path: Path) -> None:
    fixed = ["--no-follow-plan"]
    with LocalSwarm(tmp_path, model="tiny") as swarm:
        swarm.start_peer("0:2", name="first", extra_args=fixed)
        swarm.start_peer("4:6", name="last", extra_args=fixed)
        spare = swarm.start_peer("4:6", name="spare", extra_args=fixed)
        args = [*fixed, "--no-listen", "--relay-watch-interval-s", "1"]
        nat = swarm.start_peer("2:4", name="nat", extra_args=args, initial_peers=spare.maddrs[:1], wait=False)
        verdict = wait_for_verdict(nat, timeout_s=120)
        assert verdict.startswith(RELAY_OK) and spare.peer_id[-8:] in verdict
        nat.wait_ready(60)
        spare.stop()
        rejoined = _wait_for_log(nat, "rejoining through", timeout_s=120)
        lines = _wait_for_lines(nat, RELAY_OK, count=2, timeout_s=120)
        nat.maddrs = []  # it wrote its new addresses before logging the second line: read them again
        nat.wait_ready(5)
        answer = generate(swarm, 6, 180, None)
        expected = greedy_reference(resolve_model("tiny"), PROMPT_IDS, 6)
    assert spare.peer_id[-8:] not in rejoined and spare.peer_id[-8:] not in lines[-1]
    assert all(spare.peer_id not in m for m in nat.maddrs)
    assert nat.peer_id in answer["route"] and answer["tokens"] == expected


def _wait_for_log(peer: PeerProcess, text: str, timeout_s: float) -> str:
    return _wait_for_lines(peer, text, 1, timeout_s)[0]


def _wait_for_lines(peer: PeerProcess, text: str, count: int, timeout_s: float) -> list[str]:
    """The first ``count`` lines of the peer's log holding ``text``, once there are that many."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = [line for line in peer.log_tail(500_000).splitlines() if text in line]
        if len(lines) >= count:
            return lines[:count]
        time.sleep(0.2)
    raise TimeoutError(f"{count} lines with {text!r} not in the log of {peer.name}:\n{peer.log_tail()}")


@pytest.mark.timeout(120)
def test_a_dial_back_does_not_count_the_connection_the_asker_opened(tmp_path: Path) -> None:
    """Asked over the asker's own connection, a peer must still fail to dial back a node that listens nowhere:
    libp2p would reuse that connection and tell anyone behind a NAT that it is reachable."""
    with LocalSwarm(tmp_path, model="tiny") as swarm:
        swarm.start_peer("0:6", name="asked", extra_args=["--no-follow-plan"])
        initial = tuple(swarm.initial_peers)
        timeout_s = SessionConfig().dial_back_timeout_s
        nowhere = asyncio.run(check_before_join(DHTConfig(initial_peers=initial, listen=False), timeout_s))
        listening = asyncio.run(check_before_join(DHTConfig(initial_peers=initial), timeout_s))
    assert nowhere.reachable is False and nowhere.relays == initial
    assert "could not dial us back at no address" in nowhere.detail
    assert listening.reachable is True and listening.relays == ()


@pytest.mark.timeout(120)
def test_the_daemon_runs_with_our_relay_bounds() -> None:
    reach = ReachabilityConfig(relay_max_reservations=5, relay_data_limit_bytes=12345, relay_time_limit_s=77)

    async def daemon_args() -> list[str]:
        async with await SwarmDHT.create(DHTConfig(reachability=reach), "m"):
            return [
                arg
                for proc in psutil.Process().children(recursive=True)
                if proc.name() == "p2pd"
                for arg in proc.cmdline()
            ]

    args = asyncio.run(daemon_args())
    for flag in ("-relay=1", "-relayService=1", "-relayMaxReservations=5", "-relayDataLimit=12345"):
        assert flag in args
    assert "-relayTimeLimit=77s" in args and "-natPortMap=0" in args and "-autonat=0" in args
