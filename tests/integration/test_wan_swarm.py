"""A real swarm on an emulated network: two tiny-model peers and a client, each in its own network namespace
with 10 ms one way and 100 Mbit/s on every link (swarm/testing/wan), answer exactly like local transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarm.models.loading import ModelSource
from swarm.testing import LocalSwarm, greedy_reference
from swarm.testing.wan import EmulatedNet, LinkSpec, namespaces_unavailable

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.skipif(namespaces_unavailable() is not None, reason=str(namespaces_unavailable())),
]

PROMPT_IDS = [5, 17, 42, 99, 7, 3, 250, 11]
NEW_TOKENS = 8
FIXED = ["--no-follow-plan", "--no-plan"]


@pytest.fixture(scope="module")
def expected(tiny_source: ModelSource) -> list[int]:
    return greedy_reference(tiny_source, PROMPT_IDS, NEW_TOKENS)


@pytest.fixture(scope="module")
def net() -> Iterator[EmulatedNet]:
    with EmulatedNet("fsns", ["p1", "p2", "cl"], LinkSpec(delay_s=0.010, bandwidth_bits_s=100e6)) as emulated:
        yield emulated


def test_peers_in_namespaces_serve_a_client_in_another(
    net: EmulatedNet, tmp_path: Path, expected: list[int]
) -> None:
    with LocalSwarm(tmp_path, model="tiny:0", net=net) as swarm:
        first = swarm.start_peer("0:3", name="p1", host="p1", extra_args=FIXED, timeout_s=180)
        second = swarm.start_peer("3:6", name="p2", host="p2", extra_args=FIXED, timeout_s=180)
        assert first.maddrs[0].startswith(f"/ip4/{net.address('p1')}/tcp/")
        assert second.maddrs[0].startswith(f"/ip4/{net.address('p2')}/tcp/")
        forwarded = net.stats()["forwarded"]
        argv = [sys.executable, "-m", "tests.integration.wan_client", "--initial-peers", *swarm.initial_peers]
        argv += ["--model", "tiny:0", "--prompt-ids", ",".join(map(str, PROMPT_IDS))]
        argv += ["--new-tokens", str(NEW_TOKENS)]
        client = swarm.popen("cl", argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = client.communicate(timeout=240)
        assert client.returncode == 0, err.decode(errors="replace")[-3000:]
        answer = json.loads(out.decode().strip().splitlines()[-1])
        assert answer["tokens"] == expected
        assert [peer for peer, _ in answer["stages"]] == [first.peer_id, second.peer_id]
        assert net.stats()["forwarded"] > forwarded  # the session went through the delay line
