"""A peer behind an emulated home-router NAT (masquerade, replies only: swarm/testing/wan) finds at join that
no one can dial it and serves through a public peer's circuit relay; a client in its own namespace gets the
reference's greedy tokens through it. With relaying turned off it says exactly why it cannot serve."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from swarm.dht.node import RELAY_FAILED, RELAY_OK
from swarm.testing import LocalSwarm
from swarm.testing.nat import nat_relay_case
from swarm.testing.wan import EmulatedNet, LinkSpec, namespaces_unavailable

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(400),
    pytest.mark.skipif(namespaces_unavailable() is not None, reason=str(namespaces_unavailable())),
]

HOSTS = ("p0", "p1", "nat")


@pytest.fixture(scope="module")
def net() -> Iterator[EmulatedNet]:
    link = LinkSpec(delay_s=0.005, bandwidth_bits_s=100e6)
    with EmulatedNet("fsr", [*HOSTS, "cl"], link, nat_hosts=["nat"]) as emulated:
        yield emulated


def test_a_peer_behind_nat_serves_through_a_relay_with_equal_greedy_tokens(
    net: EmulatedNet, tmp_path: Path
) -> None:
    forwarded = net.stats()["forwarded"]
    with LocalSwarm(tmp_path, model="tiny", net=net) as swarm:
        result = nat_relay_case(swarm, hosts=HOSTS, client_host="cl", timeout_s=180)
        log = swarm.peers[2].log_tail(200_000)
    assert result["relay_line"].startswith(RELAY_OK), result["relay_line"]
    assert "could not dial us back" in log  # it found out at join, from the public peer
    assert result["relayed"] and result["through_nat_peer"]
    assert result["tokens"] == result["reference"]
    assert result["nat_relay_ok"]
    assert net.stats()["forwarded"] > forwarded  # through the emulated network, not loopback


def test_behind_nat_with_relaying_off_the_peer_says_exactly_why(net: EmulatedNet, tmp_path: Path) -> None:
    with LocalSwarm(tmp_path, model="tiny", net=net) as swarm:
        result = nat_relay_case(swarm, hosts=HOSTS, client_host="cl", relay=False, timeout_s=180)
    line = result["relay_line"]
    assert line.startswith(RELAY_FAILED), line
    assert (
        "turned off (--no-relay-when-unreachable)" in line
        and "could not dial us back at /ip4/10.77.1." in line
    )
    assert not result["nat_relay_ok"]
