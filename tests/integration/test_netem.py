"""The emulated network (swarm/testing/wan): delays and bandwidths are what was configured, a change applies
live, traffic stays between the hosts it is for, and a NAT lets connections out but none in.

Measured with plain sockets inside the namespaces (swarm/testing/wan/probe.py). The RTT and throughput checks
are the harness's own calibration: they compare real time against the configuration, hence ``wallclock``.
"""

from __future__ import annotations

import statistics
import subprocess
from collections.abc import Iterator

import pytest

from swarm.testing.wan import EmulatedNet, LinkSpec, namespaces_unavailable

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(namespaces_unavailable() is not None, reason=str(namespaces_unavailable())),
]

PORT = 7000
PINGS = 15
TOLERANCE = 0.10


@pytest.fixture(scope="module")
def net() -> Iterator[EmulatedNet]:
    with EmulatedNet("fsnt", ["a", "b", "c"]) as emulated:
        yield emulated


def median_rtt_s(net: EmulatedNet, src: str, dst: str) -> float:
    with net.probe_server(dst, PORT) as address:
        return statistics.median(net.probe(src, "rtt", address, str(PORT), str(PINGS))["rtt_s"])


def bulk_bits_s(net: EmulatedNet, src: str, dst: str, seconds: float, bits_s: float) -> float:
    """The receiver's rate for a transfer that takes ``seconds`` at ``bits_s``."""
    with net.probe_server(dst, PORT) as address:
        return float(net.probe(src, "bulk", address, str(PORT), str(int(seconds * bits_s / 8)))["bits_s"])


@pytest.mark.wallclock
@pytest.mark.timeout(60)
def test_rtt_is_twice_the_one_way_delay(net: EmulatedNet) -> None:
    net.set_all(LinkSpec(delay_s=0.025))
    assert median_rtt_s(net, "a", "b") == pytest.approx(0.050, rel=TOLERANCE)


@pytest.mark.wallclock
@pytest.mark.timeout(60)
def test_asymmetric_pair_adds_both_directions(net: EmulatedNet) -> None:
    net.set_all(LinkSpec())
    net.set_link("a", "b", LinkSpec(delay_s=0.010))
    net.set_link("b", "a", LinkSpec(delay_s=0.040))
    assert median_rtt_s(net, "a", "b") == pytest.approx(0.050, rel=TOLERANCE)
    assert median_rtt_s(net, "a", "c") < 0.005  # a -> c and back was left without delay


@pytest.mark.wallclock
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mbit_s", [20, 100])
def test_bulk_throughput_is_the_configured_bandwidth(net: EmulatedNet, mbit_s: int) -> None:
    net.set_all(LinkSpec(delay_s=0.025, bandwidth_bits_s=mbit_s * 1e6))
    rate = bulk_bits_s(net, "a", "b", seconds=3.0, bits_s=mbit_s * 1e6)
    assert rate == pytest.approx(mbit_s * 1e6, rel=TOLERANCE)


@pytest.mark.wallclock
@pytest.mark.timeout(120)
def test_asymmetric_bandwidth_each_direction(net: EmulatedNet) -> None:
    net.set_all(LinkSpec(delay_s=0.010))
    net.set_link("a", "b", LinkSpec(delay_s=0.010, bandwidth_bits_s=100e6))
    net.set_link("b", "a", LinkSpec(delay_s=0.010, bandwidth_bits_s=20e6))
    assert bulk_bits_s(net, "a", "b", 2.0, 100e6) == pytest.approx(100e6, rel=TOLERANCE)
    assert bulk_bits_s(net, "b", "a", 2.0, 20e6) == pytest.approx(20e6, rel=TOLERANCE)


@pytest.mark.wallclock
@pytest.mark.timeout(60)
def test_set_link_applies_live(net: EmulatedNet) -> None:
    net.set_all(LinkSpec(delay_s=0.005))
    with net.probe_server("b", PORT) as address:
        before = statistics.median(net.probe("a", "rtt", address, str(PORT), str(PINGS))["rtt_s"])
        net.set_link("a", "b", LinkSpec(delay_s=0.030))  # live: the server stays up
        after = statistics.median(net.probe("a", "rtt", address, str(PORT), str(PINGS))["rtt_s"])
    assert before == pytest.approx(0.010, rel=TOLERANCE)
    assert after == pytest.approx(0.035, rel=TOLERANCE)


def _rx_packets(net: EmulatedNet, host: str) -> int:
    device = f"{net.prefix}{net.hosts.index(host)}"
    path = f"/sys/class/net/{device}/statistics/rx_packets"
    return int(subprocess.run(net.exec_argv(host, ["cat", path]), capture_output=True, text=True).stdout)


@pytest.mark.timeout(60)
def test_traffic_stays_between_its_hosts(net: EmulatedNet) -> None:
    net.set_all(LinkSpec())
    c_before = _rx_packets(net, "c")
    b_before = _rx_packets(net, "b")
    assert bulk_bits_s(net, "a", "b", seconds=1.0, bits_s=100e6) > 0
    assert _rx_packets(net, "b") > b_before + 100  # the transfer went through b's device
    assert _rx_packets(net, "c") == c_before  # and nothing of it reached c

    # the devices live in the namespaces; the root namespace has none of them
    root_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert not [line for line in root_links.splitlines() if f": {net.prefix}" in line]
    # a namespace routes only 10.77.0.0/16, and only through its own device
    routes = subprocess.run(net.exec_argv("a", ["ip", "-4", "route"]), capture_output=True, text=True).stdout
    assert [r.split()[:3] for r in routes.splitlines()] == [["10.77.0.0/16", "dev", f"{net.prefix}0"]]
    outside = net.probe("a", "connect", "10.78.0.1", str(PORT), "1")
    assert not outside["ok"] and "unreachable" in outside["error"].lower()

    # an address in the block that no host has: the router drops it
    dropped = net.stats()["dropped_unknown"]
    assert not net.probe("a", "connect", "10.77.0.200", str(PORT), "0.5")["ok"]
    assert net.stats()["dropped_unknown"] > dropped


@pytest.fixture(scope="module")
def natted() -> Iterator[EmulatedNet]:
    with EmulatedNet("fsnn", ["pub", "home"], LinkSpec(delay_s=0.002), nat_hosts=["home"]) as emulated:
        yield emulated


@pytest.mark.timeout(60)
def test_a_natted_host_connects_out(natted: EmulatedNet) -> None:
    assert natted.address("home") != natted.public_address("home")
    assert natted.address("pub") == natted.public_address("pub")
    with natted.probe_server("pub", PORT) as address:
        # the public host answers the NAT's public address: a reply gets back only through the mapping
        assert len(natted.probe("home", "rtt", address, str(PORT), "3")["rtt_s"]) == 3
        assert natted.probe("home", "udp", address, str(PORT), "5")["ok"]


@pytest.mark.timeout(60)
def test_nobody_connects_in_to_a_natted_host(natted: EmulatedNet) -> None:
    with natted.probe_server("home", PORT), natted.probe_server("pub", PORT + 1) as pub:
        # home opens a mapping towards pub first: still nothing gets in that home did not ask for
        assert natted.probe("home", "connect", pub, str(PORT + 1), "5")["ok"]
        before = natted.stats()
        private = natted.probe("pub", "connect", natted.address("home"), str(PORT), "0.5")
        public = natted.probe("pub", "connect", natted.public_address("home"), str(PORT), "0.5")
        udp_in = natted.probe("pub", "udp", natted.public_address("home"), str(PORT), "0.5")
        after = natted.stats()
    assert not private["ok"] and not public["ok"] and not udp_in["ok"]
    assert after["dropped_unknown"] > before["dropped_unknown"]  # the private address routes nowhere
    assert after["dropped_nat"] > before["dropped_nat"]  # the public one is refused by the NAT
