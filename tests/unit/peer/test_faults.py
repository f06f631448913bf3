"""TEST ONLY faults: ``--faulty-output-rate`` makes rpc_step return corrupted hidden states, repeatably."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarm.models.faults import OutputFaults, seed_of
from swarm.models.loading import resolve_model
from swarm.peer.cli import build_parser
from swarm.peer.config import PeerConfig, SessionConfig
from swarm.peer.executor import Executor
from swarm.peer.handlers import PeerHandlers
from swarm.peer.state import Identity, Peer
from swarm.settings import from_arguments
from swarm.wire import Hop, StepReply, StepRequest

pytestmark = pytest.mark.timeout(60)


def test_the_rate_is_the_fraction_of_corrupted_outputs_and_the_draws_repeat_by_seed() -> None:
    hidden = torch.randn(3, 8)
    assert torch.equal(OutputFaults(0.0, 1).corrupt(hidden), hidden)
    always = OutputFaults(1.0, 1)
    assert not torch.allclose(always.corrupt(hidden), hidden, rtol=0.1, atol=0.1)
    assert always.corrupt(hidden.bfloat16()).dtype == torch.bfloat16

    def pattern(seed: int) -> list[bool]:
        faults = OutputFaults(0.3, seed)
        return [not torch.equal(faults.corrupt(hidden), hidden) for _ in range(400)]

    assert pattern(7) == pattern(7) != pattern(8)
    assert 80 < sum(pattern(7)) < 160
    assert seed_of("peer1") == seed_of("peer1") != seed_of("peer2")
    with pytest.raises(ValueError, match="faulty output rate"):
        OutputFaults(1.5, 0)


def test_the_skip_rate_is_the_fraction_of_skipped_forwards_and_leaves_the_corruption_pattern_alone() -> None:
    hidden = torch.randn(3, 8)
    assert not any(OutputFaults(0.0, 1).skip_forward() for _ in range(100))
    skipping = OutputFaults(0.0, 1, skip_rate=0.5)
    draws = [skipping.skip_forward() for _ in range(400)]
    assert 150 < sum(draws) < 250 and skipping.skipped == sum(draws)
    again = OutputFaults(0.0, 1, skip_rate=0.5)
    assert draws == [again.skip_forward() for _ in range(400)]
    plain, both = OutputFaults(0.3, 7), OutputFaults(0.3, 7, skip_rate=0.5)
    for _ in range(50):
        both.skip_forward()
        assert torch.equal(plain.corrupt(hidden), both.corrupt(hidden))
    with pytest.raises(ValueError, match="faulty skip rate"):
        OutputFaults(0.0, 0, skip_rate=-1.0)


def test_the_peer_flag_is_parsed_and_checked() -> None:
    args = build_parser().parse_args(["join", "--faulty-output-rate", "0.5"])
    assert from_arguments(PeerConfig, args).faulty_output_rate == 0.5
    assert PeerConfig().faulty_output_rate == 0.0
    with pytest.raises(ValueError, match="faulty_output_rate"):
        PeerConfig(faulty_output_rate=-0.1)
    args = build_parser().parse_args(["join", "--faulty-skip-rate", "0.25"])
    assert from_arguments(PeerConfig, args).faulty_skip_rate == 0.25
    assert PeerConfig().faulty_skip_rate == 0.0
    with pytest.raises(ValueError, match="faulty_skip_rate"):
        PeerConfig(faulty_skip_rate=2.0)


def test_a_faulty_peer_returns_corrupted_hidden_states_from_rpc_step() -> None:
    torch.set_num_threads(1)
    source = resolve_model("tiny")
    identity = Identity("QmSelf", "unit", ("/ip4/127.0.0.1/tcp/1/p2p/QmSelf",), 1 << 30, 6)
    peer = Peer(identity, source.spec, Executor(), SessionConfig())
    peer.serve(source.load_blocks(0, 2, cache_tokens=64))
    honest = PeerHandlers(peer, p2p=None)  # type: ignore[arg-type]
    faulty = PeerHandlers(peer, p2p=None, faults=OutputFaults(1.0, 0))  # type: ignore[arg-type]
    hidden = torch.randn(4, source.spec.hidden_size)

    def request(sid: str) -> StepRequest:
        return StepRequest(sid, 0, hidden, 0, 2, 16, source.spec.weights_hash)

    async def main() -> tuple[torch.Tensor, torch.Tensor]:
        task = asyncio.create_task(peer.executor.run())
        try:
            good = await honest.rpc_step(request("s1"), "QmClient")
            bad = await faulty.rpc_step(request("s2"), "QmClient")
            return good.hidden, bad.hidden
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    good, bad = asyncio.run(main())
    assert good.shape == bad.shape and not torch.allclose(good, bad, rtol=0.1, atol=0.1)


def test_a_skipping_peer_returns_its_own_output_with_faked_timings_for_the_hops_it_skipped() -> None:
    torch.set_num_threads(1)
    source = resolve_model("tiny")
    identity = Identity("QmSelf", "unit", ("/ip4/127.0.0.1/tcp/1/p2p/QmSelf",), 1 << 30, 6)
    peer = Peer(identity, source.spec, Executor(), SessionConfig())
    peer.serve(source.load_blocks(0, 2, cache_tokens=64))
    skipper = PeerHandlers(peer, p2p=None, faults=OutputFaults(0.0, 0, skip_rate=1.0))  # type: ignore[arg-type]
    hidden = torch.randn(4, source.spec.hidden_size)
    rest = (Hop("QmB", (), 2, 4), Hop("QmC", (), 4, 6))

    async def main() -> tuple[StepReply, StepReply]:
        task = asyncio.create_task(peer.executor.run())
        try:
            alone = await skipper.rpc_step(
                StepRequest("s1", 0, hidden, 0, 2, 16, source.spec.weights_hash), "Qm"
            )
            request = StepRequest("s2", 0, hidden, 0, 2, 16, source.spec.weights_hash, route_rest=rest)
            return alone, await skipper.rpc_step(request, "Qm")  # no p2p: it never forwards
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    alone, skipped = asyncio.run(main())
    assert torch.equal(alone.hidden, skipped.hidden)  # its own layers only, honestly computed
    assert [(t.peer_id, t.start, t.end) for t in skipped.timings] == [
        ("QmSelf", 0, 2),
        ("QmB", 2, 4),
        ("QmC", 4, 6),
    ]
    assert skipper.faults is not None and skipper.faults.skipped == 1
