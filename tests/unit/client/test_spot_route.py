"""The route check of spot.py: hops honest alone that lie on a forwarded route, on real tiny BlockRanges.

``RouteLiars`` is the in-process chain with two lies a single-stage check cannot see: a hop that skips the hops
after it (returns its own output, as ``--faulty-skip-rate`` makes a real peer do) and a hop that is wrong only
when a previous hop, not the client, calls it. Each test fails on a spot-checker without the route check (the
liar is never caught and greedy output goes wrong).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import torch

from client.client import AsyncSwarmClient
from client.config import ClientConfig
from client.local import LocalChain, LocalRoutes
from swarm.errors import NoRouteError
from swarm.models.head import SamplingParams
from swarm.models.loading import ModelSource
from swarm.routing.route import Stage
from swarm.types import LayerRange, NodeID, SessionID
from tests.unit.client.test_spot import PROMPT_IDS, SPLIT, Reports, expected  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(120)


class RouteLiars(LocalChain):
    """`skipping` peers return their own output when they should forward; `wrong_when_forwarded_to` peers add
    a constant when a previous hop (not the client) sends them the step. Alone, all of them are honest."""

    def __init__(self, blocks: dict[NodeID, object]) -> None:
        super().__init__(blocks)  # type: ignore[arg-type]
        self.skipping: set[NodeID] = set()
        self.wrong_when_forwarded_to: set[NodeID] = set()
        self.skipped = 0
        self.alone = 0  # stages run alone (client-relayed)

    async def run_alone(self, stage: Stage, hidden: torch.Tensor) -> torch.Tensor:
        self.alone += 1
        return await super().run_alone(stage, hidden)

    async def step(
        self,
        session_id: SessionID,
        stages: Sequence[Stage],
        position: int,
        hidden: torch.Tensor,
        max_length_tokens: int,
        *,
        relayed: bool = False,
        batch: tuple[str, int] = ("", 1),
    ) -> torch.Tensor:
        for i, stage in enumerate(stages):
            hidden = await super().step(session_id, [stage], position, hidden, max_length_tokens)
            if i > 0 and stage.peer_id in self.wrong_when_forwarded_to:
                hidden = hidden + 1.0
            if i < len(stages) - 1 and stage.peer_id in self.skipping:
                self.skipped += 1
                return hidden
        return hidden


def make_client(
    source: ModelSource, ranges: dict[str, tuple[int, int]]
) -> tuple[AsyncSwarmClient, RouteLiars, Reports]:
    blocks = {NodeID(p): source.load_blocks(a, b, cache_tokens=4096) for p, (a, b) in ranges.items()}
    chain = RouteLiars(blocks)  # type: ignore[arg-type]
    config = ClientConfig(
        retry_delay_s=0.0,
        spot_check_rate=1.0,
        spot_check_blocking=True,
        spot_check_seed=0,
        spot_check_tokens=4,
        route_wait_s=0.0,
    )
    reports = Reports()
    routes = LocalRoutes(chain, source.spec.num_layers)
    client = AsyncSwarmClient(
        config, chain=chain, routes=routes, head=source.load_head(), tokenizer=None, reports=reports
    )
    return client, chain, reports


def generate(client: AsyncSwarmClient, steps: int = 10) -> list[int]:
    return asyncio.run(client.generate_ids(PROMPT_IDS, steps, SamplingParams()))


def test_a_first_hop_that_skips_the_rest_of_the_route_is_caught_and_reported(
    tiny_source: ModelSource,
    expected: list[int],  # noqa: F811
) -> None:
    client, chain, reports = make_client(tiny_source, {**SPLIT, "a2": (0, 2)})
    chain.skipping.add(NodeID("a"))  # the router picks a (then b, c): ties go by id
    assert generate(client) == expected
    assert client.checker.excluded == {"a"} and client.checker.steps_served["a"] == 1
    assert [(p, layers) for p, layers, _ in reports.sent] == [("a", LayerRange(0, 2))]
    assert "forwarded" in reports.sent[0][2]
    session = client.last_session
    assert session is not None and [s.peer_id for s in session.stages] == ["a2", "b", "c"]
    assert chain.skipped >= 1


def test_a_middle_hop_that_skips_is_blamed_and_the_hop_after_it_is_not(
    tiny_source: ModelSource,
    expected: list[int],  # noqa: F811
) -> None:
    client, chain, reports = make_client(tiny_source, {**SPLIT, "c2": (4, 6)})
    chain.skipping.add(NodeID("b"))
    assert generate(client) == expected
    assert client.checker.excluded == {"b"}
    assert [p for p, _, _ in reports.sent] == ["b"]
    session = client.last_session
    assert session is not None and [s.peer_id for s in session.stages] == ["a", "b2", "c"]


def test_a_hop_wrong_only_when_a_peer_calls_it_is_blamed_not_its_caller(
    tiny_source: ModelSource,
    expected: list[int],  # noqa: F811
) -> None:
    client, chain, reports = make_client(tiny_source, {**SPLIT, "c2": (4, 6)})
    chain.wrong_when_forwarded_to.add(NodeID("c"))
    assert generate(client) == expected
    assert client.checker.excluded == {"c"}
    assert [p for p, _, _ in reports.sent] == ["c"]


def test_a_pair_nobody_can_tell_apart_is_avoided_by_this_client_without_a_report(
    tiny_source: ModelSource,
) -> None:
    """b skips, and nobody else holds c's layers: b2 -> c agrees, but b cannot be paired with another c. The
    client avoids both (here that leaves no route for 4:6: it fails rather than answer wrongly)."""
    client, chain, reports = make_client(tiny_source, SPLIT)
    chain.skipping.add(NodeID("b"))
    with pytest.raises(NoRouteError):
        generate(client)
    assert client.checker.avoided_pairs == [("b", "c")] and client.checker.excluded == {"b", "c"}
    assert not reports.sent
    assert isinstance(client.routes, LocalRoutes)
    assert not client.routes.bans.is_banned(NodeID("b")) and not client.routes.bans.is_banned(NodeID("c"))


def test_honest_routes_cost_one_forwarded_prefill_per_check(tiny_source: ModelSource) -> None:
    """Per check on a 3-hop route: each stage alone, one checker, and the route forwarded once (3 + 1 + 3)."""
    client, chain, _ = make_client(tiny_source, SPLIT)
    generate(client, 1)
    assert client.checker.checks_run == 1 and not client.checker.excluded
    forwarded = [tokens for _, position, tokens in chain.calls if position == 0 and tokens == 4]
    assert chain.alone == 3 + 1 and len(forwarded) == 3
