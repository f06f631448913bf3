"""Spot-checks and checked failure claims, on the in-process chain (real tiny BlockRanges) against transformers.

Peers here are BlockRanges in this process (client.local); a lying peer adds noise to its outputs with the
same OutputFaults a real peer gets from ``--faulty-output-rate``. The router picks "b" before its replica
"b2" (lowest latency, ties by id), so "b" is the peer on the route and "b2" the checker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import pytest
import torch

from client.client import AsyncSwarmClient
from client.config import ClientConfig
from client.local import LocalChain, LocalRoutes, in_process_client
from client.spot import agree, relative_error
from swarm.errors import TransportError
from swarm.models.faults import OutputFaults
from swarm.models.head import SamplingParams
from swarm.models.loading import ModelSource
from swarm.testing.reference import greedy_reference
from swarm.types import LayerRange, NodeID

pytestmark = pytest.mark.timeout(120)

PROMPT_IDS = [5, 17, 42, 99, 7, 3, 250, 11]
SPLIT = {"a": (0, 2), "b": (2, 4), "b2": (2, 4), "c": (4, 6)}


class Reports:
    def __init__(self) -> None:
        self.sent: list[tuple[NodeID, LayerRange, str]] = []

    async def report(self, accused_peer_id: NodeID, layers: LayerRange, reason: str) -> None:
        self.sent.append((accused_peer_id, layers, reason))


class ShiftedOutputs(OutputFaults):
    """A liar that is consistent with itself: the same wrong answer for the same input, every time."""

    def __init__(self) -> None:
        super().__init__(1.0, 0)

    def corrupt(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + 1.0


@pytest.fixture(scope="module")
def expected(tiny_source: ModelSource) -> list[int]:
    return greedy_reference(tiny_source, PROMPT_IDS, 10)


def make_client(
    source: ModelSource, ranges: dict[str, tuple[int, int]], rate: float, seed: int = 0, blocking: bool = True
) -> tuple[AsyncSwarmClient, LocalChain, Reports]:
    """Checks block their step unless ``blocking`` is False (the default of real clients)."""
    blocks = {p: source.load_blocks(a, b, cache_tokens=4096) for p, (a, b) in ranges.items()}
    config = ClientConfig(
        retry_delay_s=0.0,
        spot_check_rate=rate,
        spot_check_seed=seed,
        spot_check_tokens=4,
        spot_check_blocking=blocking,
    )
    reports = Reports()
    client = in_process_client(source.load_head(), blocks, None, config, reports=reports)
    assert isinstance(client.chain, LocalChain)
    return client, client.chain, reports


def generate(client: AsyncSwarmClient, steps: int = 10) -> list[int]:
    return asyncio.run(client.generate_ids(PROMPT_IDS, steps, SamplingParams()))


def test_honest_peers_pass_every_check_and_outputs_stay_exact(
    tiny_source: ModelSource, expected: list[int]
) -> None:
    client, _, reports = make_client(tiny_source, SPLIT, rate=1.0)
    assert generate(client) == expected
    assert client.checker.checks_run == 10 and not client.checker.excluded and not reports.sent
    session = client.last_session
    assert session is not None and session.failovers == 0


def test_a_lying_peer_is_caught_excluded_and_reported_and_greedy_output_stays_exact(
    tiny_source: ModelSource, expected: list[int]
) -> None:
    client, chain, reports = make_client(tiny_source, SPLIT, rate=1.0)
    chain.faulty[NodeID("b")] = OutputFaults(1.0, seed=1)
    assert generate(client) == expected
    assert client.checker.excluded == {"b"}
    assert client.checker.steps_served["b"] == 1  # its first step was checked, and never used
    assert [(p, layers) for p, layers, _ in reports.sent] == [("b", LayerRange(2, 4))]
    assert isinstance(client.routes, LocalRoutes) and client.routes.bans.is_banned(NodeID("b"))
    session = client.last_session
    assert session is not None and [s.peer_id for s in session.stages] == ["a", "b2", "c"]
    # later sessions never go through it, even once its ban has run out
    client.routes.bans.succeeded(NodeID("b"))
    assert generate(client, 3) == expected[:3]
    assert client.checker.steps_served["b"] == 1


def test_background_checks_pass_honest_peers_one_at_a_time_and_outputs_stay_exact(
    tiny_source: ModelSource, expected: list[int]
) -> None:
    client, _, reports = make_client(tiny_source, SPLIT, rate=1.0, blocking=False)
    assert generate(client) == expected
    assert 1 <= client.checker.checks_run <= 10
    assert not client.checker.excluded and not reports.sent and client.checker.running == 0
    session = client.last_session
    assert session is not None and session.failovers == 0


def test_a_session_goes_on_stepping_while_its_one_check_runs(
    tiny_source: ModelSource, expected: list[int]
) -> None:
    client, _, _ = make_client(tiny_source, SPLIT, rate=1.0, blocking=False)
    release = asyncio.Event()
    started: list[int] = []

    async def held_check(stages: object, token_ids: Sequence[int]) -> None:
        started.append(len(token_ids))
        await release.wait()

    client.checker.check = held_check  # type: ignore[method-assign,assignment]

    async def run() -> list[int]:
        async with asyncio.timeout(60):  # a check that blocked its step would never end
            out = await client.generate_ids(PROMPT_IDS, 10, SamplingParams())
        assert client.checker.running == 1  # every step was due; only the first started one
        release.set()
        await client.checker.aclose()
        return out

    assert asyncio.run(run()) == expected
    assert started == [len(PROMPT_IDS)]


def test_a_background_check_drops_a_liar_from_the_next_step_and_later_sessions_are_exact(
    tiny_source: ModelSource, expected: list[int]
) -> None:
    client, chain, reports = make_client(tiny_source, SPLIT, rate=1.0, blocking=False)
    chain.faulty[NodeID("b")] = OutputFaults(1.0, seed=1)
    generate(client)  # its first tokens came through the liar while the check ran
    assert client.checker.excluded == {"b"}
    assert [(p, layers) for p, layers, _ in reports.sent] == [("b", LayerRange(2, 4))]
    session = client.last_session
    assert session is not None and session.failovers >= 1
    assert [s.peer_id for s in session.stages] == ["a", "b2", "c"]
    served = client.checker.steps_served["b"]
    assert generate(client) == expected
    assert client.checker.steps_served["b"] == served


def test_at_a_low_rate_a_lying_peer_is_caught_within_a_few_steps(tiny_source: ModelSource) -> None:
    client, chain, _ = make_client(tiny_source, SPLIT, rate=0.25, seed=3)
    chain.faulty[NodeID("b")] = OutputFaults(1.0, seed=1)
    for _ in range(6):
        generate(client)
        if client.checker.excluded:
            break
    assert client.checker.excluded == {"b"}
    assert 1 <= client.checker.steps_served["b"] <= 30


def test_a_lying_checker_cannot_get_the_honest_peer_banned(
    tiny_source: ModelSource, expected: list[int]
) -> None:
    client, chain, reports = make_client(tiny_source, SPLIT, rate=1.0)
    chain.faulty[NodeID("b2")] = OutputFaults(1.0, seed=2)  # b2 only ever answers checks
    assert generate(client) == expected
    assert client.checker.excluded == {"b2"}  # its two answers to one input differ: it lies
    assert [p for p, _, _ in reports.sent] == ["b2"]
    session = client.last_session
    assert session is not None and session.failovers == 0 and session.stages[1].peer_id == "b"


def test_a_consistent_liar_is_outvoted_by_a_third_holder(
    tiny_source: ModelSource, expected: list[int]
) -> None:
    client, chain, _ = make_client(tiny_source, {**SPLIT, "b3": (2, 4)}, rate=1.0)
    chain.faulty[NodeID("b")] = ShiftedOutputs()
    assert generate(client) == expected
    assert client.checker.excluded == {"b"}


def test_two_consistent_peers_that_disagree_get_nobody_banned(
    tiny_source: ModelSource, caplog: pytest.LogCaptureFixture
) -> None:
    """With two holders, a liar that always gives the same wrong answer cannot be told from the honest one."""
    client, chain, reports = make_client(tiny_source, SPLIT, rate=1.0)
    chain.faulty[NodeID("b2")] = ShiftedOutputs()
    with caplog.at_level(logging.WARNING, logger="client.spot"):
        generate(client, 2)
    assert not client.checker.excluded and not reports.sent
    assert "cannot tell who lies" in caplog.text


def test_tolerance_follows_the_looser_dtype() -> None:
    torch.manual_seed(0)
    exact = torch.randn(16, 64) * 30
    assert agree(exact, exact.to(torch.bfloat16))  # rounding to bfloat16 is within its tolerance
    assert not agree(exact, exact + 0.01 * exact.norm() / 32)  # 1% off is far past float32's
    assert agree(exact.to(torch.bfloat16), (exact * 1.01).to(torch.bfloat16))
    assert relative_error(exact, exact[:8]) == float("inf")
    assert relative_error(exact, exact * float("nan")) == float("inf")


# --- failed_peer_id claims --------------------------------------------------------------------------------


def _claim_at_step_4(client: AsyncSwarmClient, chain: LocalChain, named: str) -> None:
    """From step 4 on, the route's first hop answers "the hop after me is silent", naming `named`."""

    def hook(n: int) -> None:
        if n == 4:
            assert client.last_session is not None
            claim = TransportError("next hop did not answer")
            claim.failed_peer_id = named
            chain.refusing[client.last_session.stages[0].peer_id] = claim

    chain.on_step = hook


def test_a_hop_that_names_a_live_peer_as_silent_is_banned_itself(
    tiny_source: ModelSource, expected: list[int]
) -> None:
    client, chain, _ = make_client(tiny_source, {**SPLIT, "a2": (0, 2)}, rate=0.0)
    _claim_at_step_4(client, chain, "b")
    assert generate(client) == expected
    bans = client.routes.bans  # type: ignore[attr-defined]
    assert bans.is_banned(NodeID("a")) and not bans.is_banned(NodeID("b"))
    session = client.last_session
    assert session is not None and [s.peer_id for s in session.stages][:2] == ["a2", "b"]


def test_a_hop_that_names_a_peer_off_the_route_is_banned_itself(
    tiny_source: ModelSource, expected: list[int]
) -> None:
    client, chain, _ = make_client(tiny_source, {**SPLIT, "a2": (0, 2)}, rate=0.0)
    _claim_at_step_4(client, chain, "b2")  # b2 is not on the route: it cannot have failed this step
    assert generate(client) == expected
    bans = client.routes.bans  # type: ignore[attr-defined]
    assert bans.is_banned(NodeID("a")) and not bans.is_banned(NodeID("b2"))


def test_a_claim_about_a_peer_that_is_really_silent_bans_that_peer(
    tiny_source: ModelSource, expected: list[int]
) -> None:
    client, chain, _ = make_client(tiny_source, {**SPLIT, "a2": (0, 2)}, rate=0.0)

    def hook(n: int) -> None:
        if n == 4:  # b dies, and a says so once (a real hop reports each failure once)
            chain.dead.add(NodeID("b"))
            claim = TransportError("next hop did not answer")
            claim.failed_peer_id = "b"
            chain.refusing[NodeID("a")] = claim
        elif n == 5:
            chain.refusing.clear()

    chain.on_step = hook
    assert generate(client) == expected
    bans = client.routes.bans  # type: ignore[attr-defined]
    assert bans.is_banned(NodeID("b")) and not bans.is_banned(NodeID("a"))
    session = client.last_session
    assert session is not None and [s.peer_id for s in session.stages] == ["a", "b2", "c"]


def test_the_cli_flag_and_client_setting_are_validated() -> None:
    with pytest.raises(ValueError, match="spot_check_rate"):
        ClientConfig(spot_check_rate=1.5)
    with pytest.raises(ValueError, match="spot_check_tokens"):
        ClientConfig(spot_check_tokens=0)


def test_a_session_drops_a_peer_that_another_session_caught(
    tiny_source: ModelSource, expected: list[int]
) -> None:
    client, chain, _ = make_client(tiny_source, SPLIT, rate=0.0)
    first = client.new_session(len(PROMPT_IDS) + 4)

    async def main() -> list[int]:
        await first.forward(PROMPT_IDS)
        assert first.stages[1].peer_id == "b"
        client.checker.excluded.add(NodeID("b"))  # as if a check of another session had caught it
        await first.forward([expected[0]])
        return [s.peer_id for s in first.stages]

    assert asyncio.run(main()) == ["a", "b2", "c"]
    assert first.failovers == 1


def test_a_referee_that_sides_with_nobody_outvotes_nobody(tiny_source: ModelSource) -> None:
    """b lies consistently, b3 (the referee) lies at random: no two answers agree, so only self-inconsistency
    counts, and the honest b2 is never blamed."""
    client, chain, _ = make_client(tiny_source, {**SPLIT, "b3": (2, 4)}, rate=1.0, seed=5)
    chain.faulty[NodeID("b")] = ShiftedOutputs()
    chain.faulty[NodeID("b3")] = OutputFaults(1.0, seed=3)
    generate(client, 3)
    assert "b2" not in client.checker.excluded


def test_a_liar_announcing_a_quant_of_its_own_is_never_on_the_route(
    tiny_source: ModelSource, expected: list[int]
) -> None:
    """A --quant is what a peer says of itself: one that says int8, where nobody else on its layers does, would
    have no checker. A client routes only through peers of its own quant (none here), so it never reaches it."""
    client, chain, reports = make_client(tiny_source, SPLIT, rate=1.0)
    chain.faulty[NodeID("b")] = ShiftedOutputs()
    chain.blocks[NodeID("b")].quant = "int8"  # its weights are float32: only its record says otherwise
    assert generate(client) == expected
    assert [c for c in chain.calls if c[0] == "b"] == [] and reports.sent == []
