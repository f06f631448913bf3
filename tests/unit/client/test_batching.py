"""One client running many generations at once: its head work is batched, and the tokens do not change."""

from __future__ import annotations

import asyncio
import random
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from client.batching import HEAD_THREAD, HeadBatcher, Round
from client.session import NO_BATCH
from swarm.models.backends.cpu.argmax import SCREENS, exact_logits
from swarm.models.head import ClientHead, SamplingParams
from swarm.models.loading import ModelSource
from tests.unit.client.test_local_generation import (
    TINY_SPLIT,
    greedy_reference,
    make_client,
)

pytestmark = pytest.mark.timeout(120)


class CountingHead:
    """The real ClientHead, counting its calls and the rows in each (and the OS name of the thread of each)."""

    def __init__(self, head: ClientHead) -> None:
        self.head = head
        self.batch_rows: list[int] = []
        self.argmax_only: list[bool] = []
        self.threads: list[str] = []

    @property
    def hidden_size(self) -> int:
        return self.head.hidden_size

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.embed(ids)

    def logits(self, hidden: torch.Tensor, argmax_only: bool = False) -> torch.Tensor:
        self.batch_rows.append(hidden.shape[0])
        self.argmax_only.append(argmax_only)
        self.threads.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())
        return self.head.logits(hidden, argmax_only)


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(320) for _ in range(rng.randrange(3, 12))] for _ in range(count)]


@pytest.mark.parametrize("seed", [0, 1])
def test_concurrent_greedy_generations_equal_sequential_and_transformers(
    tiny_source: ModelSource, seed: int
) -> None:
    reference = tiny_source.load_reference_model()
    prompts = _prompts(6, seed)
    client, _ = make_client(tiny_source, TINY_SPLIT)
    sequential = [asyncio.run(client.generate_ids(p, 9, SamplingParams())) for p in prompts]
    calls_alone = client.batcher.calls

    together = asyncio.run(client.generate_ids_batch(prompts, 9, SamplingParams()))

    assert together == sequential
    assert together == [greedy_reference(reference, p, 9) for p in prompts]
    # each generation asks the head 9 times; run together, the six share head calls
    batched_calls = client.batcher.calls - calls_alone
    assert calls_alone == 6 * 9 and batched_calls < 6 * 9 and client.batcher.largest > 1


def test_requests_of_one_tick_run_as_one_head_call_with_the_same_rows(tiny_source: ModelSource) -> None:
    head = CountingHead(tiny_source.load_head())
    batcher = HeadBatcher(head)
    hiddens = torch.randn(5, tiny_source.spec.hidden_size)

    async def ask_all() -> list[torch.Tensor]:
        return list(await asyncio.gather(*(batcher.logits(h) for h in hiddens)))

    rows = asyncio.run(ask_all())
    assert head.batch_rows == [5]
    assert head.threads == [HEAD_THREAD]  # on the head's own thread, named so per-thread CPU shows it
    alone = head.head.logits(hiddens)
    for got, want in zip(rows, alone, strict=True):
        assert torch.allclose(got, want, atol=1e-5) and int(got.argmax()) == int(want.argmax())
    batcher.close()


def test_a_round_screens_its_head_call_only_when_every_row_needs_just_the_argmax(
    tiny_source: ModelSource,
) -> None:
    inner = tiny_source.load_head()
    kind = next(kind for kind in SCREENS if kind.available(inner.hidden_size))
    inner.kernels.use_screen(kind(inner.lm_head_weight), 8)
    head = CountingHead(inner)
    batcher = HeadBatcher(head)
    hiddens = torch.randn(4, tiny_source.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    dense = inner.logits(hiddens)

    async def ask(flags: list[bool]) -> list[torch.Tensor]:
        order = list(range(len(flags)))
        random.Random(len(flags)).shuffle(order)  # who asks first must not matter
        asked = [batcher.logits(hiddens[i], argmax_only=flags[i]) for i in order]
        got = await asyncio.gather(*asked)
        return [got[order.index(i)] for i in range(len(flags))]

    greedy = asyncio.run(ask([True] * 4))
    mixed = asyncio.run(ask([True, False, True, True]))
    assert head.argmax_only == [True, False] and head.batch_rows == [4, 4]
    assert not all(bool(torch.isfinite(row).all()) for row in greedy)  # screened: -inf where ruled out
    assert all(bool(torch.isfinite(row).all()) for row in mixed)  # one row wants them all: dense for all
    # screened rows: the argmax of the exact logits (argmax.exact_logits); dense rows: of the dense head's
    exact = torch.stack([exact_logits(row, inner.lm_head_weight) for row in inner.norm(hiddens)])
    assert [int(r.argmax()) for r in greedy] == exact.argmax(-1).tolist()
    assert [int(r.argmax()) for r in mixed] == dense.argmax(-1).tolist()
    batcher.close()


def test_requests_arriving_while_a_call_runs_form_the_next_round(tiny_source: ModelSource) -> None:
    head = CountingHead(tiny_source.load_head())
    batcher = HeadBatcher(head, max_batch=3)
    hiddens = torch.randn(7, tiny_source.spec.hidden_size)

    async def ask_all() -> None:
        await asyncio.gather(*(batcher.logits(h) for h in hiddens))

    asyncio.run(ask_all())
    assert head.batch_rows == [3, 3, 1]  # capped at max_batch, the rest in later rounds
    batcher.close()


def test_a_bad_row_fails_only_its_own_request_and_a_cancelled_one_is_skipped(
    tiny_source: ModelSource,
) -> None:
    head = CountingHead(tiny_source.load_head())
    batcher = HeadBatcher(head)
    size = tiny_source.spec.hidden_size

    async def scenario() -> list[Any]:
        good = asyncio.ensure_future(batcher.logits(torch.randn(size)))
        bad = asyncio.ensure_future(batcher.logits(torch.randn(size + 1)))
        gone = asyncio.ensure_future(batcher.logits(torch.randn(size)))
        await asyncio.sleep(0)  # all three are queued for the same round
        gone.cancel()
        results = await asyncio.gather(good, bad, gone, return_exceptions=True)
        after = await batcher.logits(torch.randn(size))  # the batcher still serves the next round
        return [*results, after]

    good, bad, gone, after = asyncio.run(scenario())
    assert isinstance(good, torch.Tensor) and good.shape == (tiny_source.spec.vocab_size,)
    assert isinstance(bad, ValueError) and "hidden size" in str(bad)
    assert isinstance(gone, asyncio.CancelledError)
    assert isinstance(after, torch.Tensor)
    batcher.close()


def test_hidden_must_be_one_position(tiny_source: ModelSource) -> None:
    batcher = HeadBatcher(tiny_source.load_head())
    with pytest.raises(ValueError, match="1-D"):
        asyncio.run(batcher.logits(torch.randn(2, tiny_source.spec.hidden_size)))
    batcher.close()


def test_a_round_waits_for_the_sessions_stepping_and_gives_them_one_round_id(
    tiny_source: ModelSource,
) -> None:
    """Two sessions stepping: the first reply waits (the wait is long, so not by timing) for the second, they
    share one head call and one round id; a session that is not stepping is not waited for."""
    head = CountingHead(tiny_source.load_head())
    batcher = HeadBatcher(head, round_wait_s=600.0)
    size = tiny_source.spec.hidden_size
    a, b, lone = object(), object(), object()

    async def scenario() -> None:
        batcher.sent(a)
        batcher.sent(b)
        first = asyncio.ensure_future(batcher.logits_in_round(torch.randn(size), a))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not first.done() and head.batch_rows == []
        (_, round_b), (_, round_a) = await batcher.logits_in_round(torch.randn(size), b), await first
        assert round_a is round_b
        group = await asyncio.gather(round_a.join(a, 600.0), round_b.join(b, 600.0))
        assert group[0] == group[1] == (round_a.id, 2)
        async with asyncio.timeout(30):  # nobody is stepping now: no wait (the wait is 600 s)
            _, alone = await batcher.logits_in_round(torch.randn(size), lone)
        assert alone is not round_a and await alone.join(lone, 600.0) == NO_BATCH

    asyncio.run(scenario())
    assert head.batch_rows == [2, 1]
    batcher.close()


def test_a_round_stops_waiting_for_a_session_that_left_or_waited_in_vain(tiny_source: ModelSource) -> None:
    head = CountingHead(tiny_source.load_head())
    batcher = HeadBatcher(head, round_wait_s=0.01)
    size = tiny_source.spec.hidden_size
    a, failed, slow = object(), object(), object()

    async def scenario() -> None:
        for member in (a, failed, slow):
            batcher.sent(member)
        first = asyncio.ensure_future(batcher.logits(torch.randn(size), a))
        await asyncio.sleep(0)
        batcher.leave(failed)  # its step failed: no reply will come
        await first  # `slow` never answers: the round starts when the wait runs out
        assert batcher.waits_in_vain == 1
        batcher.sent(a)
        await batcher.logits(torch.randn(size), a)  # `slow` is still stepping, but is no longer waited for
        assert batcher.waits_in_vain == 1

    asyncio.run(scenario())
    assert head.batch_rows == [1, 1]
    batcher.close()


def test_sessions_of_another_lane_are_not_waited_for(tiny_source: ModelSource) -> None:
    head = CountingHead(tiny_source.load_head())
    batcher = HeadBatcher(head, round_wait_s=600.0, lanes=2)
    size = tiny_source.spec.hidden_size
    a, b = object(), object()
    lane_a, lane_b = batcher.lane(), batcher.lane()
    assert lane_a != lane_b

    async def scenario() -> None:
        batcher.sent(a, lane_a)
        batcher.sent(b, lane_b)
        async with asyncio.timeout(30):  # b steps in the other lane: a's round does not wait for it
            await batcher.logits(torch.randn(size), a, lane_a)
        await batcher.logits(torch.randn(size), b, lane_b)

    asyncio.run(scenario())
    assert head.batch_rows == [1, 1]
    batcher.close()


def test_a_round_on_two_routes_tells_each_route_only_its_own_steps() -> None:
    """Two members of a round route through one chain of peers, two through another and one through a third:
    each route's peers are told a group of the steps that come to them, under an id of its own, and the one
    alone on its route is told no group. Members are shuffled so the order they join in cannot hide a mix-up."""
    members = {name: object() for name in ("a1", "a2", "b1", "b2", "c1")}
    routes = {
        "a1": ("p0", "p1"),
        "a2": ("p0", "p1"),
        "b1": ("p2", "p3"),
        "b2": ("p2", "p3"),
        "c1": ("p0", "p3"),
    }
    order = list(members)
    random.Random(5).shuffle(order)

    async def scenario() -> dict[str, tuple[str, int]]:
        round_ = Round(members.values())
        told = await asyncio.gather(*(round_.join(members[n], 600.0, routes[n]) for n in order))
        return dict(zip(order, told, strict=True))

    told = asyncio.run(scenario())
    assert told["a1"] == told["a2"] and told["a1"][1] == 2
    assert told["b1"] == told["b2"] and told["b1"][1] == 2
    assert told["a1"][0] != told["b1"][0]
    assert told["c1"] == NO_BATCH


def test_a_round_tells_the_peers_only_the_steps_that_come() -> None:
    """Of a round of four, one ends (leaves) after two have joined and one decides after the round settled: the
    two that joined go as a group of 2 once the last undecided member left (the wait is long, so not by
    timing), and the late one goes alone. A joined member that is cancelled before the round settles does not
    count."""
    a, b, ended, late = object(), object(), object(), object()

    async def scenario() -> None:
        round_ = Round([a, b, ended, late])
        joined = [asyncio.ensure_future(round_.join(m, 600.0)) for m in (a, b)]
        for _ in range(20):
            await asyncio.sleep(0)
        assert not any(j.done() for j in joined)  # `ended` and `late` have not decided yet
        round_.leave(ended)
        round_.leave(late)
        assert await asyncio.gather(*joined) == [(round_.id, 2)] * 2
        assert await round_.join(late, 600.0) == NO_BATCH  # it left: it goes alone

        cancelled = Round([a, b, ended])
        first = asyncio.ensure_future(cancelled.join(a, 600.0))
        gone = asyncio.ensure_future(cancelled.join(b, 600.0))
        await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        cancelled.leave(ended)
        assert await first == NO_BATCH  # only `a` sends: no group

        slow = Round([a, b])
        async with asyncio.timeout(30):  # `b` never decides: `a` goes alone after the settle wait
            assert await slow.join(a, 0.01) == NO_BATCH
        assert await slow.join(b, 600.0) == NO_BATCH

    asyncio.run(scenario())


def test_sessions_that_end_at_different_times_never_overstate_their_group(tiny_source: ModelSource) -> None:
    """Concurrent generations of different lengths: every batch id the peers see is carried by exactly the
    number of steps it declares (a session that ended is not counted in its mates' group), and the tokens are
    those of the sessions run one by one. The settle wait is made endless: a session that neither joined nor
    left its round (one that ended without saying so) would hang the test instead of costing 20 ms."""
    # one lane: every session's rounds are the same group's
    client, chain = make_client(tiny_source, TINY_SPLIT, round_settle_s=600.0, batch_lanes=1)
    sent: list[tuple[str, int]] = []
    step = chain.step

    async def recording_step(*args: Any, **kwargs: Any) -> torch.Tensor:
        sent.append(kwargs.get("batch", NO_BATCH))
        return await step(*args, **kwargs)

    chain.step = recording_step  # type: ignore[method-assign]
    prompts = _prompts(5, 3)
    lengths = [2, 9, 4, 9, 6]
    random.Random(3).shuffle(lengths)
    alone = [
        asyncio.run(client.generate_ids(p, n, SamplingParams()))
        for p, n in zip(prompts, lengths, strict=True)
    ]

    async def together() -> list[list[int]]:
        jobs = (client.generate_ids(p, n, SamplingParams()) for p, n in zip(prompts, lengths, strict=True))
        async with asyncio.timeout(120):
            return list(await asyncio.gather(*jobs))

    sent.clear()
    assert asyncio.run(together()) == alone
    groups = Counter(batch for batch in sent if batch != NO_BATCH)
    assert groups and all(count == size for (_, size), count in groups.items())
    assert max(size for _, size in groups) == len(prompts)  # the sessions did go together
