"""Links measured over an emulated network: two tiny-model peers in their own namespaces, 20 Mbit/s one way
and 100 Mbit/s the other, 50 ms one way, announce the round trip and the bandwidth of each direction."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.models.loading import ModelSource
from swarm.testing import LocalSwarm
from swarm.testing.wan import EmulatedNet, LinkSpec, namespaces_unavailable

# The figures it checks are measured rates through libp2p on a shared machine: run apart, as the other
# wallclock tests are, so another test's load does not read as a slow link.
pytestmark = [
    pytest.mark.integration,
    pytest.mark.wallclock,
    pytest.mark.timeout(400),
    pytest.mark.skipif(namespaces_unavailable() is not None, reason=str(namespaces_unavailable())),
]

FIXED = ["--no-follow-plan", "--no-plan"]
DELAY_S = 0.050
UP_BITS_S, DOWN_BITS_S = 20e6, 100e6  # p1 -> p2, p2 -> p1


def test_peers_announce_both_directions_of_a_slow_long_link(tmp_path: Path, tiny_source: ModelSource) -> None:
    with EmulatedNet("fslk", ["p1", "p2", "cl"], LinkSpec(delay_s=0.001, bandwidth_bits_s=1e9)) as net:
        net.set_link("p1", "p2", LinkSpec(DELAY_S, UP_BITS_S))
        net.set_link("p2", "p1", LinkSpec(DELAY_S, DOWN_BITS_S))
        with LocalSwarm(tmp_path, model="tiny:0", net=net) as swarm:
            first = swarm.start_peer("0:3", name="p1", host="p1", extra_args=FIXED, timeout_s=180)
            second = swarm.start_peer("3:6", name="p2", host="p2", extra_args=FIXED, timeout_s=180)
            argv = [
                sys.executable,
                "-m",
                "tests.integration.wan_links",
                "--initial-peers",
                *swarm.initial_peers,
            ]
            argv += ["--model-hash", tiny_source.spec.weights_hash, "--peers", "2"]
            reader = swarm.popen("cl", argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = reader.communicate(timeout=240)
            assert reader.returncode == 0, err.decode(errors="replace")[-3000:]
    links = json.loads(out.decode().strip().splitlines()[-1])
    print(json.dumps(links))  # the figures (docs/benchmarks.md)
    for src, dst, up, down in (
        (first, second, UP_BITS_S, DOWN_BITS_S),
        (second, first, DOWN_BITS_S, UP_BITS_S),
    ):
        rtt_s, up_bytes_s, down_bytes_s = links[src.peer_id][dst.peer_id]
        assert rtt_s == pytest.approx(2 * DELAY_S, rel=0.2)
        measured = {up: up_bytes_s, down: down_bytes_s}
        # The thin direction within a quarter of its rate, from either end. The fast one at 100 ms RTT is
        # read from probes of 128-256 KiB (10-20 ms of transfer), where a loaded host's jitter weighs: it must
        # read as clearly the faster (the planner's question) and never above its rate.
        assert measured[UP_BITS_S] == pytest.approx(UP_BITS_S / 8, rel=0.25)
        assert 1.5 * measured[UP_BITS_S] <= measured[DOWN_BITS_S] <= 1.25 * DOWN_BITS_S / 8
