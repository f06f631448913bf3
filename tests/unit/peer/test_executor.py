"""The torch executor on a real tiny model: batching, ordering, admission control, errors per step."""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from swarm.errors import CapacityError, SessionError
from swarm.models.backends.cpu.matmul import PLAIN, Forms
from swarm.models.blocks import BlockRange, Step
from swarm.models.loading import resolve_model
from swarm.peer import turns as turns_module
from swarm.peer.executor import (
    DECODE_THREAD,
    PREFILL_THREAD,
    Executor,
    ExecutorConfig,
    SessionSteps,
    StepResult,
    _Job,
    _onward_groups,
)
from swarm.peer.turns import (
    PREFILL_NICE,
    DecodeCalls,
    DeviceTurns,
    SharedDevice,
    decode_calls_path,
    turns_path,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def blocks() -> BlockRange:
    torch.set_num_threads(1)
    blocks = resolve_model("tiny").load_blocks(0, 2, cache_tokens=512)
    blocks.kernels.use_forms(
        PLAIN
    )  # F.linear for any rows, whatever this CPU's calibration: prefills may ride along
    return blocks


def _hidden(blocks: BlockRange, tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, blocks.spec.hidden_size, generator=torch.Generator().manual_seed(seed))


async def _with_executor(executor: Executor, body) -> object:  # type: ignore[no-untyped-def]
    task = asyncio.create_task(executor.run())
    try:
        return await body()
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def _os_thread_name() -> str:
    """The calling thread's name in the OS (the lanes name theirs, swarm.models.threads)."""
    return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()


def test_concurrent_decode_steps_run_as_one_batch_with_the_same_results(blocks: BlockRange) -> None:
    executor = Executor(ExecutorConfig(max_batch=8, paced_groups=1))
    sessions = [f"s{i}" for i in range(4)]

    async def body() -> list[torch.Tensor]:
        for sid in sessions:
            await executor.call(lambda s=sid: blocks.open_session(s, 16))
        for i, sid in enumerate(sessions):
            await executor.forward(blocks, Step(sid, _hidden(blocks, 3, i), 0, 2, 0))
        before = executor.batches_run
        results = await asyncio.gather(
            *(
                executor.forward(blocks, Step(sid, _hidden(blocks, 1, 10 + i), 0, 2, 3))
                for i, sid in enumerate(sessions)
            )
        )
        assert executor.batches_run - before == 1, "four concurrent decode steps should make one batch"
        for sid in sessions:
            await executor.call(lambda s=sid: blocks.close_session(s))
        return [r.hidden for r in results]

    batched = asyncio.run(_with_executor(executor, body))
    # The same steps one at a time, straight on the blocks, give the same outputs.
    for i, sid in enumerate(sessions):
        blocks.open_session(sid, 16)
        blocks.forward([Step(sid, _hidden(blocks, 3, i), 0, 2, 0)])
        alone = blocks.forward([Step(sid, _hidden(blocks, 1, 10 + i), 0, 2, 3)])[0]
        blocks.close_session(sid)
        torch.testing.assert_close(batched[i], alone, atol=1e-5, rtol=1e-5)


def test_a_bad_step_fails_alone_and_its_batch_mates_succeed(blocks: BlockRange) -> None:
    executor = Executor()

    async def body() -> list[object]:
        await executor.call(lambda: blocks.open_session("good", 16))
        await executor.forward(blocks, Step("good", _hidden(blocks, 2, 0), 0, 2, 0))
        results = await asyncio.gather(
            executor.forward(blocks, Step("good", _hidden(blocks, 1, 1), 0, 2, 2)),
            executor.forward(blocks, Step("missing", _hidden(blocks, 1, 2), 0, 2, 2)),
            return_exceptions=True,
        )
        await executor.call(lambda: blocks.close_session("good"))
        return results

    good, bad = asyncio.run(_with_executor(executor, body))  # type: ignore[misc]
    assert not isinstance(good, BaseException) and good.hidden.shape == (1, blocks.spec.hidden_size)
    assert isinstance(bad, SessionError)


def test_cache_budget_and_queue_bound_give_capacity_errors(blocks: BlockRange) -> None:
    executor = Executor(ExecutorConfig(queue_jobs=2))

    async def body() -> None:
        with pytest.raises(CapacityError, match="KV cache full"):
            await executor.call(lambda: blocks.open_session("huge", 10_000))
        # Without the worker draining it, the bounded queue refuses the third job at once.
        idle = Executor(ExecutorConfig(queue_jobs=2))
        pending = [
            asyncio.ensure_future(idle.forward(blocks, Step(None, _hidden(blocks, 1, 0), 0, 2, 0)))
            for _ in range(2)
        ]
        await asyncio.sleep(0)
        with pytest.raises(CapacityError, match="busy"):
            await idle.forward(blocks, Step(None, _hidden(blocks, 1, 0), 0, 2, 0))
        for p in pending:
            p.cancel()

    asyncio.run(_with_executor(executor, body))


def test_steps_on_two_block_ranges_never_share_a_batch() -> None:
    """A peer moving between ranges serves two BlockRanges: decode steps batch only with their own range's."""
    source = resolve_model("tiny")
    old, new = source.load_blocks(0, 2, cache_tokens=64), source.load_blocks(0, 2, cache_tokens=64)
    executor = Executor(ExecutorConfig(max_batch=8))

    async def body() -> tuple[int, list[torch.Tensor]]:
        for blocks, sid in ((old, "a"), (new, "b"), (old, "c")):
            await executor.call(lambda b=blocks, s=sid: b.open_session(s, 16))
            await executor.forward(blocks, Step(sid, _hidden(blocks, 2, 0), 0, 2, 0))
        before = executor.batches_run
        results = await asyncio.gather(
            *(
                executor.forward(b, Step(sid, _hidden(b, 1, 5), 0, 2, 2))
                for b, sid in ((old, "a"), (new, "b"), (old, "c"))
            )
        )
        return executor.batches_run - before, [r.hidden for r in results]

    batches, outputs = asyncio.run(_with_executor(executor, body))
    assert batches == 2, "a and c (old range) batch together; b (new range) runs on its own"
    assert old.active_sessions == ["a", "c"] and new.active_sessions == ["b"]
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-5)  # same weights, same input


def test_a_long_prefill_runs_in_chunks_with_the_same_output_and_lets_decodes_through(
    blocks: BlockRange,
) -> None:
    """prefill_chunk_tokens=8: a 40-token prefill is 5 jobs; a decode step queued meanwhile runs before the
    prefill ends, and the prefill's output and the cache it leaves equal an unchunked run's."""
    chunked = Executor(ExecutorConfig(prefill_chunk_tokens=8))
    prompt = _hidden(blocks, 40, 7)
    done: list[str] = []

    async def body() -> tuple[torch.Tensor, torch.Tensor]:
        for sid in ("long", "other"):
            await chunked.call(lambda s=sid: blocks.open_session(s, 64))
        await chunked.forward(blocks, Step("other", _hidden(blocks, 3, 8), 0, 2, 0))

        async def tagged(name: str, step: Step) -> torch.Tensor:
            result = await chunked.forward(blocks, step)
            done.append(name)
            return result.hidden

        before = chunked.steps_run
        prefill = asyncio.create_task(tagged("prefill", Step("long", prompt, 0, 2, 0)))
        await asyncio.sleep(0)  # the first chunk is queued
        decode = asyncio.create_task(tagged("decode", Step("other", _hidden(blocks, 1, 9), 0, 2, 3)))
        out, _ = await asyncio.gather(prefill, decode)
        assert chunked.steps_run - before == 6, "five prefill chunks and one decode step"
        (after,) = (await chunked.forward(blocks, Step("long", _hidden(blocks, 1, 10), 0, 2, 40))).hidden[
            None
        ]
        for sid in ("long", "other"):
            await chunked.call(lambda s=sid: blocks.close_session(s))
        return out, after

    out, next_token = asyncio.run(_with_executor(chunked, body))
    assert done == ["decode", "prefill"], "the decode step must not wait for the whole prefill"
    blocks.open_session("whole", 64)
    (whole,) = blocks.forward([Step("whole", prompt, 0, 2, 0)])
    (whole_next,) = blocks.forward([Step("whole", _hidden(blocks, 1, 10), 0, 2, 40)])
    blocks.close_session("whole")
    torch.testing.assert_close(out, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(next_token, whole_next, atol=1e-5, rtol=1e-5)


def test_a_job_whose_caller_gave_up_while_queued_is_skipped(blocks: BlockRange) -> None:
    executor = Executor()
    ran: list[str] = []

    async def main() -> None:
        gave_up = asyncio.ensure_future(executor.call(lambda: ran.append("abandoned")))
        kept = asyncio.ensure_future(executor.call(lambda: ran.append("kept")))
        await asyncio.sleep(0)
        gave_up.cancel()  # e.g. its deadline passed while it waited behind others
        runner = asyncio.create_task(executor.run())
        try:
            await kept
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)

    asyncio.run(main())
    assert ran == ["kept"]


@pytest.mark.parametrize("shared", [True, False], ids=["shared device", "lone peer"])
def test_a_decode_step_runs_while_a_prefill_chunk_holds_the_prefill_thread_at_a_lower_priority(
    blocks: BlockRange, monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    """The chunk's forward blocks until the decode step's result is back: with one torch thread this could
    never finish. Each thread's niceness, scheduling policy and OS name are read inside its forward: on a device
    another peer shares, the chunk's niceness is PREFILL_NICE higher and its policy the idle one; a lone peer's
    prefill thread keeps the decode thread's. Each lane's thread carries its name (per-thread CPU tells the
    lanes apart)."""
    config = ExecutorConfig(ride_along_tokens=0)  # an 8-token chunk
    executor = Executor(config, shared=SharedDevice("on") if shared else None)
    decoded = threading.Event()
    nice: dict[int, int] = {}
    policy: dict[int, int] = {}
    names: dict[int, str] = {}
    real_forward = blocks.forward

    def gated(steps: list[Step], between_layers: Callable[[], None] | None = None) -> list[torch.Tensor]:
        tokens = steps[0].hidden.shape[0]
        nice[tokens] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        policy[tokens] = os.sched_getscheduler(threading.get_native_id())
        names[tokens] = _os_thread_name()
        if tokens > 1:
            assert decoded.wait(30), "the decode step waited for the chunk"
        return real_forward(steps, between_layers)

    monkeypatch.setattr(blocks, "forward", gated)

    async def body() -> None:
        for sid in ("p", "d"):
            await executor.call(lambda s=sid: blocks.open_session(s, 16))
        chunk = asyncio.ensure_future(executor.forward(blocks, Step("p", _hidden(blocks, 8, 1), 0, 2, 0)))
        await executor.forward(blocks, Step("d", _hidden(blocks, 1, 2), 0, 2, 0))
        decoded.set()
        await chunk
        for sid in ("p", "d"):
            await executor.call(lambda s=sid: blocks.close_session(s))

    asyncio.run(_with_executor(executor, body))
    assert nice[8] == (min(19, nice[1] + PREFILL_NICE) if shared else nice[1])
    assert policy == {1: os.SCHED_OTHER, 8: os.SCHED_IDLE if shared else os.SCHED_OTHER}
    assert names == {1: DECODE_THREAD, 8: PREFILL_THREAD}


def test_a_call_waiting_for_a_running_chunk_does_not_hold_back_the_decode_steps_queued_after_it(
    blocks: BlockRange, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session opened while a chunk runs waits for the chunk's end, but the decode step queued after the open
    runs at once: the chunk's forward blocks until that step's result is back. The open still never runs beside
    the chunk, and still runs after the step queued before it."""
    executor = Executor()
    decoded, chunk_running = threading.Event(), threading.Event()
    order: list[str] = []
    real_forward = blocks.forward

    def gated(steps: list[Step], between_layers: Callable[[], None] | None = None) -> list[torch.Tensor]:
        if steps[0].hidden.shape[0] > 1:
            chunk_running.set()
            try:
                assert decoded.wait(30), "the decode step waited for the chunk behind the open"
                return real_forward(steps, between_layers)
            finally:
                chunk_running.clear()
                order.append("chunk")
        order.extend(f"step {step.session_id}" for step in steps)
        return real_forward(steps, between_layers)

    def open_x() -> None:
        assert not chunk_running.is_set(), "a session was opened while a chunk ran"
        order.append("open x")
        blocks.open_session("x", 16)

    monkeypatch.setattr(blocks, "forward", gated)

    async def body() -> None:
        for sid in ("p", "d", "e"):
            await executor.call(lambda s=sid: blocks.open_session(s, 16))
        chunk = asyncio.ensure_future(executor.forward(blocks, Step("p", _hidden(blocks, 8, 1), 0, 2, 0)))
        while not chunk_running.is_set():
            await asyncio.sleep(0.001)
        before = asyncio.ensure_future(executor.forward(blocks, Step("e", _hidden(blocks, 1, 3), 0, 2, 0)))
        await asyncio.sleep(0)  # queued: the open comes after it
        opened = asyncio.ensure_future(executor.call(open_x))
        await asyncio.sleep(0)
        await executor.forward(blocks, Step("d", _hidden(blocks, 1, 2), 0, 2, 0))
        assert not opened.done()
        decoded.set()
        await asyncio.gather(chunk, before, opened)
        for sid in ("p", "d", "e", "x"):
            await executor.call(lambda s=sid: blocks.close_session(s))

    asyncio.run(_with_executor(executor, body))
    assert order.index("step e") < order.index("step d") < order.index("chunk") < order.index("open x")


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_prefill_runs_in_small_chunks_only_while_other_sessions_decode(blocks: BlockRange) -> None:
    clock = _Clock()
    config = ExecutorConfig(prefill_chunk_tokens=32, busy_chunk_tokens=8, decode_recent_s=1.0)
    executor = Executor(config, clock=clock)

    async def prefill_jobs(sid: str) -> int:
        await executor.call(lambda: blocks.open_session(sid, 64))
        before = executor.steps_run
        await executor.forward(blocks, Step(sid, _hidden(blocks, 40, 4), 0, 2, 0))
        return executor.steps_run - before

    async def body() -> list[int]:
        jobs = [await prefill_jobs("quiet")]  # 32 + 8
        await executor.forward(blocks, Step("quiet", _hidden(blocks, 1, 5), 0, 2, 40))  # someone decodes
        clock.now += 0.5
        jobs.append(await prefill_jobs("busy"))  # 5 x 8
        clock.now += 1.0
        jobs.append(await prefill_jobs("quiet again"))
        for sid in ("quiet", "busy", "quiet again"):
            await executor.call(lambda s=sid: blocks.close_session(s))
        return jobs

    assert asyncio.run(_with_executor(executor, body)) == [2, 5, 2]


def test_a_decode_step_waits_for_a_session_due_by_its_pace_and_runs_with_it(blocks: BlockRange) -> None:
    """Sessions a and b step once a second (a fake clock). At t=2 a's step reaches an idle executor first: b is
    due (its last step plus its pace), so a waits (the window is long here, so this cannot pass by timing)
    until b's step is queued, and they run as one batch. Far later nobody is due any more (a and b are more
    than a window late): a new session's step runs at once."""
    now = [0.0]
    executor = Executor(
        ExecutorConfig(max_batch=8, batch_window_s=600.0, group_window_s=0.0, paced_groups=1),
        clock=lambda: now[0],
    )

    def step(sid: str, position: int) -> Step:
        return Step(sid, _hidden(blocks, 1, position), 0, 2, position)

    async def body() -> None:
        for sid in ("a", "b", "lone"):
            await executor.call(lambda s=sid: blocks.open_session(s, 16))
        for position in (0, 1):
            now[0] = float(position)
            await asyncio.gather(
                executor.forward(blocks, step("a", position)), executor.forward(blocks, step("b", position))
            )
        now[0] = 2.0
        before = executor.batches_run
        first = asyncio.create_task(executor.forward(blocks, step("a", 2)))
        for _ in range(20):  # let the executor take "a" and start waiting for "b"
            await asyncio.sleep(0)
        assert not first.done() and executor.batches_run == before
        await executor.forward(blocks, step("b", 2))
        await first
        assert executor.batches_run - before == 1, "a and b should have run as one batch"
        now[0] = 1000.0
        async with asyncio.timeout(30):  # a and b are 997 s late: nobody to wait for (the window is 600 s)
            await executor.forward(blocks, step("lone", 0))

    asyncio.run(_with_executor(executor, body))


@pytest.mark.parametrize(("groups", "batches"), [(1, 1), (2, 2), (4, 4)])
def test_lone_sessions_batched_by_their_pace_go_in_paced_groups(
    blocks: BlockRange, groups: int, batches: int
) -> None:
    """Four sessions step once a second (a fake clock). At t=2 their steps come together: in ``paced_groups``
    groups, so that one group can go on to the next hop while the next computes here, never waiting for the
    sessions of the next group (the window is long here, so this cannot pass by timing); the outputs are those
    of one batch."""
    now = [0.0]
    config = ExecutorConfig(max_batch=8, batch_window_s=600.0, group_window_s=0.0, paced_groups=groups)
    executor = Executor(config, clock=lambda: now[0])
    sessions = [f"paced-{groups}-{i}" for i in range(4)]
    random.Random(groups).shuffle(sessions)

    def step(sid: str, position: int) -> Step:
        return Step(sid, _hidden(blocks, 1, 10 * position + int(sid[-1])), 0, 2, position)

    async def body() -> list[torch.Tensor]:
        for sid in sessions:
            await executor.call(lambda s=sid: blocks.open_session(s, 16))
        for position in (0, 1):
            now[0] = float(position)
            await asyncio.gather(*(executor.forward(blocks, step(sid, position)) for sid in sessions))
        now[0] = 2.0
        gate = threading.Event()  # the torch thread is held until all four steps are queued
        held = asyncio.ensure_future(executor.call(gate.wait))
        before = executor.batches_run
        stepping = [asyncio.ensure_future(executor.forward(blocks, step(sid, 2))) for sid in sessions]
        for _ in range(20):
            await asyncio.sleep(0)
        gate.set()
        async with asyncio.timeout(30):
            await held
            results = await asyncio.gather(*stepping)
        assert executor.batches_run - before == batches
        for sid in sessions:
            await executor.call(lambda s=sid: blocks.close_session(s))
        return [r.hidden for r in results]

    outputs = asyncio.run(_with_executor(executor, body))
    for sid, output in zip(sessions, outputs, strict=True):
        blocks.open_session(sid, 16)
        for position in (0, 1):
            blocks.forward([step(sid, position)])
        alone = blocks.forward([step(sid, 2)])[0]
        blocks.close_session(sid)
        torch.testing.assert_close(output, alone, atol=1e-5, rtol=1e-5)


async def _ran_without_waiting(
    executor: Executor, monkeypatch: pytest.MonkeyPatch, step: Awaitable[StepResult]
) -> bool:
    """Whether ``step`` ran before its batch began to wait for steps it expects: its end and the wait's start
    are both events, so a step that would wait its long window fails the test at once instead of timing out."""
    waiting = asyncio.Event()
    real_next_arrival = executor._next_arrival

    async def noted(within_s: float) -> None:
        waiting.set()
        await real_next_arrival(within_s)

    monkeypatch.setattr(executor, "_next_arrival", noted)
    stepped, waited = asyncio.ensure_future(step), asyncio.ensure_future(waiting.wait())
    await asyncio.wait({stepped, waited}, return_when=asyncio.FIRST_COMPLETED)
    waited.cancel()
    ran = stepped.done() and not waiting.is_set()
    if not stepped.done():
        stepped.cancel()
    return ran


@pytest.mark.parametrize("grouped", [True, False], ids=["sent as groups", "lone (control)"])
def test_sessions_a_client_sends_as_groups_are_not_waited_for_by_their_pace(
    blocks: BlockRange, monkeypatch: pytest.MonkeyPatch, grouped: bool
) -> None:
    """Two sessions of one client step once a second as a group (their client lines them up itself). At t=2
    they are due, but a lone session's step waits for nobody. The control: the same two stepping as lone
    sessions are due by their pace, and the step waits for them."""
    now = [0.0]
    executor = Executor(
        ExecutorConfig(max_batch=8, batch_window_s=600.0, group_window_s=600.0), clock=lambda: now[0]
    )

    g1, g2, x = (f"{name}-{grouped}" for name in ("g1", "g2", "x"))  # the fixture's blocks outlive the test

    async def body() -> bool:
        for sid in (g1, g2, x):
            await executor.call(lambda s=sid: blocks.open_session(s, 16))
        for position in (0, 1):
            now[0] = float(position)
            group = (f"client/round{position}", 2) if grouped else None
            await asyncio.gather(
                *(executor.forward(blocks, Step(s, _hidden(blocks, 1, position), 0, 2, position), group)
                  for s in (g1, g2))
            )  # fmt: skip
        now[0] = 2.0
        step = executor.forward(blocks, Step(x, _hidden(blocks, 1, 9), 0, 2, 0))
        return await _ran_without_waiting(executor, monkeypatch, step)

    assert asyncio.run(_with_executor(executor, body)) is grouped
    assert executor.batch_waits == (0 if grouped else 1)


def test_decode_steps_a_client_sent_together_wait_for_each_other_and_run_as_one_batch(
    blocks: BlockRange,
) -> None:
    """Three steps of one group (never batched here before): the first two wait (long window, so not by
    timing) until the third is queued; a step of another group of one does not wait."""
    executor = Executor(ExecutorConfig(max_batch=8, batch_window_s=0.0, group_window_s=600.0))
    group = ("client/round1", 3)

    async def body() -> None:
        for sid in ("ga", "gb", "gc", "gd"):
            await executor.call(lambda s=sid: blocks.open_session(s, 16))
        before = executor.batches_run
        early = [
            asyncio.create_task(executor.forward(blocks, Step(s, _hidden(blocks, 1, i), 0, 2, 0), group))
            for i, s in enumerate(("ga", "gb"))
        ]
        for _ in range(20):
            await asyncio.sleep(0)
        assert not any(t.done() for t in early) and executor.batches_run == before
        await executor.forward(blocks, Step("gc", _hidden(blocks, 1, 3), 0, 2, 0), group)
        await asyncio.gather(*early)
        assert executor.batches_run - before == 1, "the group should have run as one batch"
        async with asyncio.timeout(30):  # a group of one expects nobody (the window is 600 s)
            await executor.forward(blocks, Step("gd", _hidden(blocks, 1, 4), 0, 2, 0), ("client/round2", 1))

    asyncio.run(_with_executor(executor, body))


def test_a_group_bigger_than_a_batch_runs_in_parts_and_no_part_waits_for_steps_that_ran(
    blocks: BlockRange,
) -> None:
    """Five steps of one group through an executor that batches at most two: they run as 2 + 2 + 1 and the
    window is endless, so a part waiting for steps an earlier part took would hang, not merely slow."""
    executor = Executor(ExecutorConfig(max_batch=2, batch_window_s=0.0, group_window_s=600.0))
    sessions = [f"big{i}" for i in range(5)]
    group = ("client/big-round", len(sessions))

    async def body() -> None:
        for sid in sessions:
            await executor.call(lambda s=sid: blocks.open_session(s, 16))
        before = executor.batches_run
        steps = [Step(s, _hidden(blocks, 1, i), 0, 2, 0) for i, s in enumerate(sessions)]
        async with asyncio.timeout(30):
            await asyncio.gather(*(executor.forward(blocks, step, group) for step in steps))
        assert executor.batches_run - before == 3

    asyncio.run(_with_executor(executor, body))


def test_a_step_whose_caller_gave_up_mid_forward_keeps_its_session_until_the_forward_ends(
    blocks: BlockRange, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk's caller is cancelled while its forward runs on the prefill thread. A replayed step of the same
    session (position 0) must not start on the decode thread while that forward still writes the cache."""
    executor = Executor()
    entered, release = threading.Event(), threading.Event()
    calls: list[int] = []
    real_forward = blocks.forward

    def gated(steps: list[Step], between_layers: Callable[[], None] | None = None) -> list[torch.Tensor]:
        calls.append(steps[0].hidden.shape[0])
        if steps[0].hidden.shape[0] > 1:
            entered.set()
            assert release.wait(30)
        return real_forward(steps, between_layers)

    monkeypatch.setattr(blocks, "forward", gated)

    async def body() -> None:
        session = SessionSteps()  # the session's own bookkeeping, as a Peer's session holds it
        await executor.call(lambda: blocks.open_session("gave-up", 16))
        chunk = asyncio.ensure_future(
            executor.forward(blocks, Step("gave-up", _hidden(blocks, 8, 1), 0, 2, 0), session=session)
        )
        assert await asyncio.to_thread(entered.wait, 30)
        chunk.cancel()
        replay = asyncio.ensure_future(
            executor.forward(blocks, Step("gave-up", _hidden(blocks, 1, 2), 0, 2, 0), session=session)
        )
        # until the replay either waits for the session's turn (held for the running forward) or has run
        while session.waiting < 2 and len(calls) < 2:
            await asyncio.sleep(0.001)
        assert calls == [8], "the replay ran beside the forward it replaces"
        release.set()
        await replay
        assert calls == [8, 1]
        with pytest.raises(asyncio.CancelledError):
            await chunk
        await executor.call(lambda: blocks.close_session("gave-up"))

    asyncio.run(_with_executor(executor, body))


def test_a_decode_step_whose_caller_gave_up_while_it_waited_for_its_group_never_runs(
    blocks: BlockRange,
) -> None:
    """Its caller left the session's turn at once (the step had not started), so running it later could race
    a replay of that session on the other thread: the batch drops it, and its group mate runs alone."""
    executor = Executor(ExecutorConfig(group_window_s=600.0))

    async def body() -> None:
        for sid in ("left", "mate"):
            await executor.call(lambda s=sid: blocks.open_session(s, 16))
        left = asyncio.ensure_future(
            executor.forward(blocks, Step("left", _hidden(blocks, 1, 1), 0, 2, 0), ("g", 2))
        )
        for _ in range(5):
            await asyncio.sleep(0)  # queued, taken, and waiting for the rest of its group
        assert executor.queued == 0
        left.cancel()
        await executor.forward(blocks, Step("mate", _hidden(blocks, 1, 2), 0, 2, 0), ("g", 2))
        assert (executor.batches_run, executor.steps_run) == (1, 1)
        assert blocks.session_length("left", 0) == 0 and blocks.session_length("mate", 0) == 1
        for sid in ("left", "mate"):
            await executor.call(lambda s=sid: blocks.close_session(s))

    asyncio.run(_with_executor(executor, body))


def test_decode_steps_of_one_forward_call_go_on_as_a_group_per_next_hop(blocks: BlockRange) -> None:
    """Five decode steps run as one forward call: the three lone ones and the client-grouped one bound for hop B
    get one group of 4 for B (a client's round is regrouped by what ran together), the one bound for C goes on
    alone, and the last hop's step (no next hop) has none. A later call gets a fresh group id."""
    executor = Executor(ExecutorConfig(max_batch=8, batch_window_s=0.0, group_window_s=0.0, paced_groups=1))
    onward = {"b1": "QmB", "b2": "QmB", "b3": "QmB", "c1": "QmC", "last": ""}
    sessions = [*onward, "grouped"]
    random_order = sessions[:]
    random.Random(5).shuffle(random_order)  # which session asks first must not matter

    async def step_all(position: int) -> dict[str, object]:
        before = executor.batches_run
        results = await asyncio.gather(
            *(
                executor.forward(
                    blocks,
                    Step(sid, _hidden(blocks, 1, position), 0, 2, position),
                    ("client/round", 1) if sid == "grouped" else None,
                    onward.get(sid, "QmB"),
                )
                for sid in random_order
            )
        )
        assert executor.batches_run - before == 1, "the six decode steps should make one forward call"
        return {sid: r.onward_group for sid, r in zip(random_order, results, strict=True)}

    async def body() -> tuple[dict[str, object], dict[str, object]]:
        for sid in sessions:
            await executor.call(lambda s=sid: blocks.open_session(s, 16))
        return await step_all(0), await step_all(1)

    first, second = asyncio.run(_with_executor(executor, body))  # type: ignore[misc]
    for groups in (first, second):
        assert {groups[s] for s in ("b1", "b2", "b3", "grouped")} == {groups["b1"]}
        assert groups["b1"] is not None and groups["b1"][1] == 4  # type: ignore[index]
        assert groups["c1"] is None and groups["last"] is None
    assert first["b1"][0] != second["b1"][0]  # type: ignore[index]


def test_an_onward_group_counts_only_the_steps_whose_callers_still_wait(blocks: BlockRange) -> None:
    """A step whose caller gave up (deadline) while its forward call ran is never sent on: not counted."""

    async def body() -> dict[int, tuple[str, int]]:
        loop = asyncio.get_running_loop()
        jobs = [
            _Job(None, Step(f"s{i}", _hidden(blocks, 1, i), 0, 2, 0), blocks, loop.create_future())
            for i in range(3)
        ]
        for job in jobs:
            job.onward = "QmB"
        jobs[1].future.cancel()
        return _onward_groups(jobs)

    groups = asyncio.run(body())
    assert sorted(groups.values()) == [(next(iter(groups.values()))[0], 2)] * 2 and len(groups) == 2


@pytest.mark.parametrize("paced", [False, True], ids=["sent by another hop", "first hop (control)"])
def test_a_step_another_hop_sent_never_waits_for_sessions_by_their_pace(
    blocks: BlockRange, monkeypatch: pytest.MonkeyPatch, paced: bool
) -> None:
    """Sessions p and q step once a second, sent on by another hop (not paced). At t=2 q is due, but p's step
    does not wait for it. The control: at a route's first hop (paced) p's step waits for q."""
    now = [0.0]
    executor = Executor(
        ExecutorConfig(max_batch=8, batch_window_s=600.0, group_window_s=0.0, paced_groups=1),
        clock=lambda: now[0],
    )

    p, q = f"p-{paced}", f"q-{paced}"  # the fixture's blocks outlive the test

    async def body() -> bool:
        for sid in (p, q):
            await executor.call(lambda s=sid: blocks.open_session(s, 16))
        for position in (0, 1):
            now[0] = float(position)
            await asyncio.gather(
                *(executor.forward(blocks, Step(s, _hidden(blocks, 1, position), 0, 2, position), paced=paced)
                  for s in (p, q))
            )  # fmt: skip
        now[0] = 2.0
        step = executor.forward(blocks, Step(p, _hidden(blocks, 1, 9), 0, 2, 2), paced=paced)
        return await _ran_without_waiting(executor, monkeypatch, step)

    assert asyncio.run(_with_executor(executor, body)) is not paced
    assert executor.batch_waits == int(paced)


def _gate_forward(
    blocks: BlockRange, monkeypatch: pytest.MonkeyPatch, hold: dict[str, threading.Event | None]
) -> dict[str, threading.Event]:
    """Make ``blocks.forward`` of a step of a session in ``hold`` wait for its event (None: never); returns, per
    session, an event set once its forward has begun."""
    began = {sid: threading.Event() for sid in hold}
    real_forward = blocks.forward

    def gated(steps: list[Step], between_layers: Callable[[], None] | None = None) -> list[torch.Tensor]:
        for step in steps:
            release = hold.get(step.session_id or "")
            if step.session_id in began:
                began[step.session_id].set()
            if release is not None:
                assert release.wait(30), "never released"
        return real_forward(steps, between_layers)

    monkeypatch.setattr(blocks, "forward", gated)
    return began


@pytest.mark.parametrize(
    ("decoding", "tokens", "waits"),
    [
        (True, (4, 4), True),
        (True, (4, 2), True),
        (True, (2, 4), True),
        (True, (2, 2), False),
        (False, (4, 4), False),
    ],
)
def test_prefills_of_two_peers_on_one_device_take_turns_while_others_decode(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, decoding: bool, tokens: tuple[int, int], waits: bool
) -> None:
    """Two executors sharing one turns file (two peers on one device) prefill ``tokens`` each, the first one held
    in its first call. While someone decodes on each, a chunk of a prefill longer than a chunk (busy_chunk_tokens=2)
    runs alone, and a short prefill beside other short ones only: the second begins at once only if both are
    short (busy_prompt_tokens=2: 4 tokens are a prompt cut into chunks). While nobody decodes, no turns are taken."""
    blocks = resolve_model("tiny").load_blocks(0, 2, cache_tokens=512)
    turns = tmp_path / "turns.lock"
    config = ExecutorConfig(
        busy_chunk_tokens=2, busy_prompt_tokens=2, decode_recent_s=60.0, ride_along_tokens=0
    )
    first, second = (
        Executor(config, shared=SharedDevice("on", turns=DeviceTurns(turns, wait_s=60.0))) for _ in range(2)
    )
    free_now: list[bool] = []  # what each try for a turn found, a's first
    b_tried = threading.Event()
    real_now = turns_module._Wait.now

    def tried(wait: turns_module._Wait, mode: int) -> bool:
        free_now.append(real_now(wait, mode))
        if len(free_now) == 2:
            b_tried.set()
        return free_now[-1]

    monkeypatch.setattr(turns_module._Wait, "now", tried)
    release = threading.Event()
    began = _gate_forward(blocks, monkeypatch, {"a": release, "b": None})
    a_held_when_b_began: list[bool] = []
    real_gated = blocks.forward

    def noted(steps: list[Step], between_layers: Callable[[], None] | None = None) -> list[torch.Tensor]:
        if steps[0].session_id == "b" and not a_held_when_b_began:
            a_held_when_b_began.append(not release.is_set())
        return real_gated(steps, between_layers)

    monkeypatch.setattr(blocks, "forward", noted)
    sessions = ((first, "a"), (second, "b"), (first, "da"), (second, "db"))

    async def body() -> None:
        for executor, sid in sessions:
            await executor.call(lambda s=sid: blocks.open_session(s, 16))
        if decoding:
            await first.forward(blocks, Step("da", _hidden(blocks, 1, 1), 0, 2, 0))
            await second.forward(blocks, Step("db", _hidden(blocks, 1, 2), 0, 2, 0))
        chunk_a = asyncio.ensure_future(
            first.forward(blocks, Step("a", _hidden(blocks, tokens[0], 3), 0, 2, 0))
        )
        assert await asyncio.to_thread(began["a"].wait, 30)
        chunk_b = asyncio.ensure_future(
            second.forward(blocks, Step("b", _hidden(blocks, tokens[1], 4), 0, 2, 0))
        )
        # b asks for its turn while a's chunk holds one (or begins at once, taking none), and a is let go then
        assert await asyncio.to_thread(b_tried.wait if waits else began["b"].wait, 30)
        release.set()
        await asyncio.gather(chunk_a, chunk_b)
        assert a_held_when_b_began == [not waits], "b's chunk began beside a's only where it takes no turn"
        if waits:
            assert free_now[:2] == [True, False], "a's turn kept b's from it"
        for executor, sid in sessions:
            await executor.call(lambda s=sid: blocks.close_session(s))

    async def both() -> None:
        await _with_executor(second, lambda: _with_executor(first, body))

    asyncio.run(both())


def test_a_prefill_chunk_waits_between_its_layers_for_the_decode_call_running_beside_it(
    blocks: BlockRange, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step's forward is held; a chunk of another session started beside it runs its first layer, then
    waits before its second until the decode call has ended."""
    release = threading.Event()
    began = _gate_forward(blocks, monkeypatch, {"yield-d": release})
    real_forward = blocks.forward
    reached = threading.Event()
    decode_held_when_passed: list[bool] = []

    def watched(steps: list[Step], between_layers: Callable[[], None] | None = None) -> list[torch.Tensor]:
        def hook() -> None:
            reached.set()
            assert between_layers is not None
            between_layers()
            decode_held_when_passed.append(not release.is_set())

        return real_forward(steps, hook if steps[0].hidden.shape[0] > 1 else None)

    monkeypatch.setattr(blocks, "forward", watched)
    executor = Executor(ExecutorConfig(ride_along_tokens=0))  # the chunk runs on the prefill thread

    async def body() -> None:
        for sid in ("yield-d", "yield-p"):
            await executor.call(lambda s=sid: blocks.open_session(s, 16))
        decode = asyncio.ensure_future(
            executor.forward(blocks, Step("yield-d", _hidden(blocks, 1, 1), 0, 2, 0))
        )
        assert await asyncio.to_thread(began["yield-d"].wait, 30)
        chunk = asyncio.ensure_future(
            executor.forward(blocks, Step("yield-p", _hidden(blocks, 4, 2), 0, 2, 0))
        )
        assert await asyncio.to_thread(reached.wait, 30), (
            "the chunk's first layer runs beside the decode call"
        )
        release.set()
        await asyncio.gather(decode, chunk)
        assert decode_held_when_passed == [False], "its second layer waits for the decode call"
        for sid in ("yield-d", "yield-p"):
            await executor.call(lambda s=sid: blocks.close_session(s))

    asyncio.run(_with_executor(executor, body))


@pytest.mark.parametrize(
    ("idle_chunk", "waits"), [(2, True), (4, False)], ids=["longer than an idle chunk", "cut only while busy"]
)
def test_a_long_prompts_chunks_wait_between_their_layers_for_another_peers_decode_call_on_the_device(
    blocks: BlockRange, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, idle_chunk: int, waits: bool
) -> None:
    """Two peers on one device: peer A's decode call is held. On peer B, where others decode too (its own
    decode lane idle now), a short prefill goes on beside A's call, and so do the chunks of a prompt cut only
    because others decode (within one idle chunk); a chunk of a prompt longer than an idle chunk runs its first
    layer, then waits before its second until A's call has ended."""
    release = threading.Event()
    began = _gate_forward(blocks, monkeypatch, {"device-d": release})
    real_forward = blocks.forward
    reached = threading.Event()
    passed: list[tuple[str | None, bool]] = []  # (session, A's call still held) at each chunk's second layer

    def watched(steps: list[Step], between_layers: Callable[[], None] | None = None) -> list[torch.Tensor]:
        def hook() -> None:
            reached.set()
            assert between_layers is not None
            between_layers()
            passed.append((steps[0].session_id, not release.is_set()))

        return real_forward(steps, hook if steps[0].hidden.shape[0] > 1 else None)

    monkeypatch.setattr(blocks, "forward", watched)
    path = decode_calls_path(turns_path("cpu", tmp_path))
    # chunks of 2 tokens while others decode; B's clock stands still, so one decode step keeps it decoding
    config = ExecutorConfig(
        ride_along_tokens=0, busy_chunk_tokens=2, busy_prompt_tokens=2, prefill_chunk_tokens=idle_chunk
    )
    peer_a = Executor(config, shared=SharedDevice("on", decode_calls=DecodeCalls(path, wait_s=30)))
    polled = threading.Event()  # B found the device's file held by a decode call and looks again

    def poll(seconds: float) -> None:
        polled.set()
        time.sleep(seconds)

    peer_b_calls = DecodeCalls(path, wait_s=30, sleep=poll)
    peer_b = Executor(config, clock=lambda: 0.0, shared=SharedDevice("on", decode_calls=peer_b_calls))
    sessions = ("device-d", "device-b", "device-s", "device-p")

    async def body() -> None:
        for sid in sessions:
            await peer_a.call(lambda s=sid: blocks.open_session(s, 16))
        await peer_b.forward(blocks, Step("device-b", _hidden(blocks, 1, 3), 0, 2, 0))  # others decode on B
        decode = asyncio.ensure_future(
            peer_a.forward(blocks, Step("device-d", _hidden(blocks, 1, 1), 0, 2, 0))
        )
        assert await asyncio.to_thread(began["device-d"].wait, 30)
        await peer_b.forward(blocks, Step("device-s", _hidden(blocks, 2, 4), 0, 2, 0))  # one call
        assert passed == [("device-s", True)], "a short prefill goes on beside the other peer's decode call"
        reached.clear()
        prompt = peer_b.forward(blocks, Step("device-p", _hidden(blocks, 4, 2), 0, 2, 0))  # 2 chunks
        if waits:
            long = asyncio.ensure_future(prompt)
            assert await asyncio.to_thread(reached.wait, 30), "its first layer runs beside the decode call"
            assert await asyncio.to_thread(polled.wait, 30), "before its second, it waits for A's call"
            release.set()
            await asyncio.gather(decode, long)
        else:
            await asyncio.wait_for(prompt, 10)  # a chunk waiting for A would take wait_s, 30 s, a layer
            release.set()
            await decode
        assert passed[1:] == [("device-p", not waits)] * 2, "each chunk passed its second layer as it should"
        for sid in sessions:
            await peer_a.call(lambda s=sid: blocks.close_session(s))

    async def both() -> None:
        await _with_executor(peer_b, lambda: _with_executor(peer_a, body))

    asyncio.run(both())


@pytest.mark.parametrize(
    ("prompts", "busy_prompt_tokens", "busy_calls"),
    [
        ((8, 8, 8), 8, 3),  # each prompt fills the budget of a call
        ((8, 8, 8), 16, 2),
        ((8, 8, 8), 24, 1),
        ((8, 8, 30), 24, 5),  # [8 + 8], then the 30-token prompt in busy chunks: 8 + 8 + 8 + 6, one per call
    ],
)
def test_while_others_decode_whole_prompts_share_a_call_within_the_busy_prompt_budget_and_chunks_stay_alone(
    prompts: tuple[int, ...], busy_prompt_tokens: int, busy_calls: int
) -> None:
    """Three prefills queued together run as few forward calls as fit prefill_chunk_tokens (32) when nobody
    decodes here. While someone does, the
    prompts of at most busy_prompt_tokens run whole, several sessions' in one call within that budget, and a
    longer prompt runs in busy chunks (8 tokens), each in a call of its own: a chunk joins no call beyond one
    chunk's tokens, even one of whole prompts with room for it."""
    blocks = resolve_model("tiny").load_blocks(0, 2, cache_tokens=512)
    clock = _Clock()
    config = ExecutorConfig(
        prefill_chunk_tokens=32,
        busy_chunk_tokens=8,
        busy_prompt_tokens=busy_prompt_tokens,
        decode_recent_s=1.0,
        ride_along_tokens=0,
    )
    executor = Executor(config, clock=clock)
    sessions = ["budget-x", "budget-y", "budget-z", "budget-d"]

    async def calls_for_three(again: bool) -> int:
        """Calls for the prompts sent at once (again: each session's second, after its first)."""
        before = executor.batches_run
        await asyncio.gather(
            *(
                executor.forward(blocks, Step(sid, _hidden(blocks, tokens, i), 0, 2, tokens if again else 0))
                for i, (sid, tokens) in enumerate(zip(sessions, prompts, strict=False))
            )
        )
        return executor.batches_run - before

    async def body() -> list[int]:
        for sid in sessions:
            await executor.call(lambda s=sid: blocks.open_session(s, 128))
        quiet = await calls_for_three(again=False)
        await executor.forward(blocks, Step("budget-d", _hidden(blocks, 1, 5), 0, 2, 0))  # someone decodes
        busy = await calls_for_three(again=True)
        for sid in sessions:
            await executor.call(lambda s=sid: blocks.close_session(s))
        return [quiet, busy]

    quiet_calls = 1 if sum(prompts) <= 32 else 2  # one idle chunk's budget (prefill_chunk_tokens)
    assert asyncio.run(_with_executor(executor, body)) == [quiet_calls, busy_calls]


_Note = TypeVar("_Note")


def _noted_forwards(
    blocks: BlockRange, monkeypatch: pytest.MonkeyPatch, note: Callable[[list[Step]], _Note]
) -> list[_Note]:
    """Per ``blocks.forward`` call from now on: ``note`` of its steps, taken in the thread that runs it."""
    calls: list[_Note] = []
    real_forward = blocks.forward

    def noted(steps: list[Step], between_layers: Callable[[], None] | None = None) -> list[torch.Tensor]:
        calls.append(note(steps))
        return real_forward(steps, between_layers)

    monkeypatch.setattr(blocks, "forward", noted)
    return calls


def _noted_calls(blocks: BlockRange, monkeypatch: pytest.MonkeyPatch) -> list[list[tuple[str | None, int]]]:
    """Per ``blocks.forward`` call from now on: the (session, tokens) of its steps."""
    return _noted_forwards(
        blocks, monkeypatch, lambda steps: [(step.session_id, step.hidden.shape[0]) for step in steps]
    )


def test_while_others_decode_a_short_prefill_rides_in_their_next_forward_call(
    blocks: BlockRange, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Session d decodes (a fake clock keeps it recent). A 4-token prefill of p (ride_along_tokens=4) waits on
    the decode lane (the window is long here, so this cannot pass by timing) until d's next step comes, and
    both run in one forward call, with the outputs each gets alone. A 5-token prefill goes to the prefill
    thread and runs without waiting for anyone, and so does a 4-token one once d's last step is a window old."""
    now = [0.0]
    config = ExecutorConfig(
        batch_window_s=600.0, group_window_s=0.0, decode_recent_s=1e4, ride_along_tokens=4
    )
    executor = Executor(config, clock=lambda: now[0])
    calls = _noted_calls(blocks, monkeypatch)
    d_prompt, d_step, p_prompt = _hidden(blocks, 3, 1), _hidden(blocks, 1, 2), _hidden(blocks, 4, 3)

    async def body() -> tuple[torch.Tensor, torch.Tensor]:
        for sid in ("ride-d", "ride-p", "ride-long", "ride-late"):
            await executor.call(lambda s=sid: blocks.open_session(s, 16))
        await executor.forward(blocks, Step("ride-d", d_prompt, 0, 2, 0))
        await executor.forward(blocks, Step("ride-d", _hidden(blocks, 1, 9), 0, 2, 3))  # d decodes here
        prefill = asyncio.ensure_future(executor.forward(blocks, Step("ride-p", p_prompt, 0, 2, 0)))
        await asyncio.sleep(0)  # p's task runs to its submit (nothing on the way suspends), before d's step
        assert executor._decode.queue.qsize() == 1 and executor._prefill.queue.empty(), (
            "p rides the decode lane"
        )
        decoded = await executor.forward(blocks, Step("ride-d", d_step, 0, 2, 4))
        await prefill
        assert calls[-1] == [("ride-p", 4), ("ride-d", 1)], "the prefill rides in the decode step's call"
        async with asyncio.timeout(30):  # over ride_along_tokens: the prefill thread, nothing to wait for
            await executor.forward(blocks, Step("ride-long", _hidden(blocks, 5, 4), 0, 2, 0))
        assert calls[-1] == [("ride-long", 5)]
        # d still counts as decoding here (decode_recent_s), but its last step is a window old
        now[0] += 700.0
        async with asyncio.timeout(30):
            await executor.forward(blocks, Step("ride-late", _hidden(blocks, 4, 5), 0, 2, 0))
        assert calls[-1] == [("ride-late", 4)]
        for sid in ("ride-d", "ride-p", "ride-long", "ride-late"):
            await executor.call(lambda s=sid: blocks.close_session(s))
        return (await prefill).hidden, decoded.hidden

    prefilled, decoded = asyncio.run(_with_executor(executor, body))
    monkeypatch.undo()
    _assert_as_alone(blocks, p_prompt, prefilled, d_prompt, d_step, decoded)


def _assert_as_alone(
    blocks: BlockRange,
    p_prompt: torch.Tensor,
    prefilled: torch.Tensor,
    d_prompt: torch.Tensor,
    d_step: torch.Tensor,
    decoded: torch.Tensor,
) -> None:
    """The ride tests' outputs equal each step's alone: p's prompt gave ``prefilled``; d's prompt, a decode
    step at 3 (seed 9), then ``d_step`` at 4 gave ``decoded``."""
    blocks.open_session("alone-p", 16)
    torch.testing.assert_close(prefilled, blocks.forward([Step("alone-p", p_prompt, 0, 2, 0)])[0])
    blocks.close_session("alone-p")
    blocks.open_session("alone-d", 16)
    blocks.forward([Step("alone-d", d_prompt, 0, 2, 0)])
    blocks.forward([Step("alone-d", _hidden(blocks, 1, 9), 0, 2, 3)])
    torch.testing.assert_close(decoded, blocks.forward([Step("alone-d", d_step, 0, 2, 4)])[0])
    blocks.close_session("alone-d")


@pytest.mark.parametrize("few_rows", [2, 8])
def test_a_short_prefill_rides_only_if_the_decode_call_keeps_its_form_of_products(
    few_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """d decodes one step a call. A 4-token prefill of p would make d's next call 5 rows: with the few-columns
    form up to 8 rows that call stays in it, and p rides; up to 2 rows d's call would leave it for F.linear
    (as a 4-bit decode call does for a spot-check window), so p goes to the prefill thread. Either way both
    get the outputs each gets alone."""
    blocks = resolve_model("tiny").load_blocks(0, 2, cache_tokens=512)
    blocks.kernels.use_forms(Forms(few_rows=few_rows))
    rides = few_rows >= 5
    assert blocks.same_form(1, 4) is rides
    config = ExecutorConfig(
        batch_window_s=600.0, group_window_s=0.0, decode_recent_s=1e4, ride_along_tokens=4
    )
    executor = Executor(config, clock=lambda: 0.0)
    calls = _noted_calls(blocks, monkeypatch)
    d_prompt, d_step, p_prompt = _hidden(blocks, 3, 1), _hidden(blocks, 1, 2), _hidden(blocks, 4, 3)

    async def body() -> tuple[torch.Tensor, torch.Tensor]:
        for sid in ("form-d", "form-p"):
            await executor.call(lambda s=sid: blocks.open_session(s, 16))
        await executor.forward(blocks, Step("form-d", d_prompt, 0, 2, 0))
        # one decode step a call
        await executor.forward(blocks, Step("form-d", _hidden(blocks, 1, 9), 0, 2, 3))
        prefill = asyncio.ensure_future(executor.forward(blocks, Step("form-p", p_prompt, 0, 2, 0)))
        await asyncio.sleep(0)  # p's task runs to its submit (nothing on the way suspends)
        assert executor._decode.queue.qsize() == int(rides), "p rides the decode lane iff the form holds"
        decoded = await executor.forward(blocks, Step("form-d", d_step, 0, 2, 4))
        prefilled = (await prefill).hidden
        assert ([("form-p", 4), ("form-d", 1)] in calls) is rides, calls
        assert ([("form-p", 4)] in calls) is not rides, calls
        for sid in ("form-d", "form-p"):
            await executor.call(lambda s=sid: blocks.close_session(s))
        return prefilled, decoded.hidden

    prefilled, decoded = asyncio.run(_with_executor(executor, body))
    monkeypatch.undo()
    _assert_as_alone(blocks, p_prompt, prefilled, d_prompt, d_step, decoded)


def _noted_threads(blocks: BlockRange, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[str | None]]]:
    """Per ``blocks.forward`` call from now on: the OS thread's name (decode or prefill lane) and its sessions."""
    return _noted_forwards(
        blocks, monkeypatch, lambda steps: (_os_thread_name(), [step.session_id for step in steps])
    )


def test_a_short_prefill_riding_along_goes_to_the_prefill_thread_when_no_decode_step_comes(
    blocks: BlockRange, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Someone decoded a moment ago (by the fake clock), then stopped: a short prefill waits for their next
    step (batch_window_s, real time: no period is known yet), then runs on the prefill thread, never alone on
    the decode thread, where it would hold back decode steps coming just after it."""
    now = [0.0]
    config = ExecutorConfig(
        batch_window_s=0.05, group_window_s=0.0, decode_recent_s=60.0, ride_along_tokens=8
    )
    executor = Executor(config, clock=lambda: now[0])
    calls = _noted_threads(blocks, monkeypatch)

    async def body() -> None:
        for sid in ("gone-d", "gone-p"):
            await executor.call(lambda s=sid: blocks.open_session(s, 16))
        await executor.forward(blocks, Step("gone-d", _hidden(blocks, 1, 1), 0, 2, 0))
        prefill = asyncio.ensure_future(
            executor.forward(blocks, Step("gone-p", _hidden(blocks, 4, 2), 0, 2, 0))
        )
        await asyncio.sleep(0)  # p's task runs to its submit
        assert executor._decode.queue.qsize() == 1, "p rides the decode lane first"
        async with asyncio.timeout(30):
            await prefill
        for sid in ("gone-d", "gone-p"):
            await executor.call(lambda s=sid: blocks.close_session(s))

    asyncio.run(_with_executor(executor, body))
    assert calls == [(DECODE_THREAD, ["gone-d"]), (PREFILL_THREAD, ["gone-p"])]


def test_a_riding_prefill_waits_one_period_of_the_decode_calls_here_not_just_the_window(
    blocks: BlockRange, monkeypatch: pytest.MonkeyPatch
) -> None:
    """d's decode calls come here every 2 s of the fake clock, far longer than batch_window_s (0.05 s). A short
    prefill coming 1 s after d's last call still rides (its wait is the period plus the window) and runs in
    d's next call; one coming 3 s after d's last call (past that) goes to the prefill thread at once."""
    now = [0.0]
    config = ExecutorConfig(
        batch_window_s=0.05, group_window_s=0.0, decode_recent_s=60.0, ride_along_tokens=8, ride_wait_s=600.0
    )
    executor = Executor(config, clock=lambda: now[0])
    calls = _noted_threads(blocks, monkeypatch)
    sessions = ("period-d", "period-p", "period-late")

    async def body() -> None:
        for sid in sessions:
            await executor.call(lambda s=sid: blocks.open_session(s, 16))
        for position in range(2):  # two decode calls, 2 s apart: the period here
            await executor.forward(blocks, Step("period-d", _hidden(blocks, 1, position), 0, 2, position))
            now[0] += 2.0
        now[0] -= 1.0  # 1 s after d's last step: 20 windows, within one period
        prefill = asyncio.ensure_future(
            executor.forward(blocks, Step("period-p", _hidden(blocks, 4, 5), 0, 2, 0))
        )
        await asyncio.sleep(0)
        assert executor._decode.queue.qsize() == 1, "p rides the decode lane"
        now[0] += 1.0
        await executor.forward(blocks, Step("period-d", _hidden(blocks, 1, 6), 0, 2, 2))
        await prefill
        now[0] += 3.0  # past the period and the window: nobody is due to decode soon
        late = asyncio.ensure_future(
            executor.forward(blocks, Step("period-late", _hidden(blocks, 4, 7), 0, 2, 0))
        )
        await asyncio.sleep(0)
        assert executor._decode.queue.empty(), "a prefill past the wait goes straight to the prefill thread"
        async with asyncio.timeout(30):
            await late
        for sid in sessions:
            await executor.call(lambda s=sid: blocks.close_session(s))

    asyncio.run(_with_executor(executor, body))
    assert calls[2:] == [
        (DECODE_THREAD, ["period-p", "period-d"]),
        (PREFILL_THREAD, ["period-late"]),
    ]


def test_prefills_riding_in_one_decode_call_share_one_busy_chunks_tokens(
    blocks: BlockRange, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three 12-token prefills of other sessions come while d decodes (busy_chunk_tokens=32): d's next call
    takes the first two (24 tokens), not the third, which would make it a 37-token prefill call; the third
    waits on the decode lane and rides in d's call after that."""
    config = ExecutorConfig(
        batch_window_s=600.0,
        group_window_s=0.0,
        decode_recent_s=1e4,
        ride_along_tokens=16,
        busy_chunk_tokens=32,
    )
    executor = Executor(config, clock=lambda: 0.0)
    calls = _noted_calls(blocks, monkeypatch)
    riders = ["share-a", "share-b", "share-c"]

    async def body() -> list[list[tuple[str | None, int]]]:
        for sid in ("share-d", *riders):
            await executor.call(lambda s=sid: blocks.open_session(s, 16))
        await executor.forward(blocks, Step("share-d", _hidden(blocks, 1, 1), 0, 2, 0))  # d decodes here
        prefills = [
            asyncio.ensure_future(executor.forward(blocks, Step(sid, _hidden(blocks, 12, i), 0, 2, 0)))
            for i, sid in enumerate(riders)
        ]
        await asyncio.sleep(0)  # each prefill's task runs to its submit (nothing on the way suspends)
        first = len(calls)
        await executor.forward(blocks, Step("share-d", _hidden(blocks, 1, 5), 0, 2, 1))
        await executor.forward(blocks, Step("share-d", _hidden(blocks, 1, 6), 0, 2, 2))
        await asyncio.gather(*prefills)
        for sid in ("share-d", *riders):
            await executor.call(lambda s=sid: blocks.close_session(s))
        return calls[first:]

    got = asyncio.run(_with_executor(executor, body))
    assert got == [
        [("share-a", 12), ("share-b", 12), ("share-d", 1)],
        [("share-c", 12), ("share-d", 1)],
    ]


def test_a_lone_peer_takes_no_device_lock_per_call_and_a_peer_sharing_its_device_does(
    blocks: BlockRange, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With the shared-device component on auto, a lone peer's decode calls hold no lock on the device's
    decode-calls file and its prefills take no turn; once another peer holds the device, each does."""
    held: list[str] = []
    real_running, real_turn = DecodeCalls.running, DeviceTurns.turn

    def running(calls: DecodeCalls):  # type: ignore[no-untyped-def]
        held.append("decode lock")
        return real_running(calls)

    def turn(turns: DeviceTurns, alone: bool):  # type: ignore[no-untyped-def]
        held.append("turn")
        return real_turn(turns, alone)

    monkeypatch.setattr(DecodeCalls, "running", running)
    monkeypatch.setattr(DeviceTurns, "turn", turn)
    shared = SharedDevice.for_device("cpu", "auto", tmp_path)
    executor = Executor(ExecutorConfig(ride_along_tokens=0, decode_recent_s=60.0), shared=shared)

    async def decode_and_prefill(sid: str) -> list[str]:
        await executor.call(lambda: blocks.open_session(sid, 16))
        await executor.forward(blocks, Step(sid, _hidden(blocks, 1, 1), 0, 2, 0))
        await executor.forward(blocks, Step(f"{sid}-p", _hidden(blocks, 4, 2), 0, 2, 0))
        await executor.call(lambda: blocks.close_session(sid))
        await executor.call(lambda: blocks.close_session(f"{sid}-p"))
        taken = held[:]
        held.clear()
        return taken

    async def body() -> tuple[list[str], list[str]]:
        for sid in ("solo", "solo-p", "duo", "duo-p"):
            if sid.endswith("-p"):
                await executor.call(lambda s=sid: blocks.open_session(s, 16))
        lone = await decode_and_prefill("solo")
        other = SharedDevice.for_device("cpu", "auto", tmp_path)  # a second peer joins the device
        try:
            assert shared.refresh()
            return lone, await decode_and_prefill("duo")
        finally:
            other.close()

    try:
        lone, sharing = asyncio.run(_with_executor(executor, body))
    finally:
        shared.close()
    assert lone == []
    assert sharing == ["decode lock", "turn"]
