"""The executor's policy on plain values: batches within budgets, order, waits, chunks, riding along, turns."""

from __future__ import annotations

import ast
import itertools
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import swarm.peer.schedule as schedule_module
from swarm.peer.config import ExecutorConfig
from swarm.peer.schedule import ARRIVALS_HORIZON_S, GROUPS_HORIZON_S, Arrivals, Group, Lane, Schedule

_ids = itertools.count()


@dataclass(frozen=True)
class Job:
    """A queued job as the policy sees it (the runner's _Job has the same fields)."""

    session_id: str | None
    tokens: int
    blocks: object = "A"
    group: Group | None = None
    paced: bool = False
    long_prefill: bool = False
    yields_to_device: bool = False
    id: int = field(default_factory=lambda: next(_ids))


def decode(sid: str, **kw: object) -> Job:
    return Job(sid, 1, **kw)  # type: ignore[arg-type]


def _schedule(decoding: bool = False, **config: object) -> Schedule:
    schedule = Schedule(ExecutorConfig(**config))  # type: ignore[arg-type]
    if decoding:
        schedule.arrived("someone", 1, paced=False, now=0.0)
    return schedule


# ---------------------------------------------------------------------- purity


def test_the_policy_imports_no_threads_event_loop_clock_or_torch() -> None:
    source = Path(schedule_module.__file__).read_text()
    try:
        tree = ast.parse(source)
    except SystemError:
        # CPython 3.11 at times raises "AST constructor recursion depth mismatch": parse again
        tree = ast.parse(source)
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {
        (node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
    }
    assert not imported & {"threading", "asyncio", "time", "torch", "concurrent"}


# ---------------------------------------------------------------------- take: examples


def test_a_batch_gathers_other_sessions_steps_on_the_same_blocks_within_max_batch() -> None:
    schedule = _schedule(max_batch=3)
    first, queued = decode("a"), [decode("a"), decode("b"), decode("c", blocks="B"), decode("d"), decode("e")]
    batch, kept = schedule.take(first, [], queued, "decode", now=0.0)
    assert [j.session_id for j in batch] == ["a", "b", "d"]
    assert kept == [queued[0], queued[2], queued[4]]


def test_no_step_overtakes_an_earlier_step_of_its_own_session_that_waits() -> None:
    schedule = _schedule(max_batch=2)
    first = decode("a")
    queued = [decode("b"), decode("c"), decode("c"), decode("b")]  # c's first waits (full), so its second too
    batch, kept = schedule.take(first, [], queued, "decode", now=0.0)
    assert [j.session_id for j in batch] == ["a", "b"]
    assert [j.session_id for j in kept] == ["c", "c", "b"]


def test_a_plain_call_runs_alone() -> None:
    call, queued = Job(None, 0), decode("a")
    assert _schedule().take(call, [], [queued], "decode", now=0.0) == ([call], [queued])


def test_a_long_prompts_chunk_keeps_its_call_to_one_chunk_while_others_decode() -> None:
    schedule = _schedule(decoding=True, busy_chunk_tokens=8, busy_prompt_tokens=24, prefill_chunk_tokens=32)
    chunk = Job("p", 8, long_prefill=True)
    prompts = [Job("x", 8), Job("y", 8)]
    batch, _ = schedule.take(chunk, [], prompts, "prefill", now=0.0)
    assert batch == [chunk]  # one chunk's budget
    whole = Job("w", 8)
    batch, kept = schedule.take(whole, [], [*prompts, Job("z", 8, long_prefill=True)], "prefill", now=0.0)
    assert [j.session_id for j in batch] == ["w", "x", "y"] and [j.session_id for j in kept] == ["z"]


def test_no_step_joins_a_call_past_the_chunk_it_holds() -> None:
    # a decode step, then a long prompt's chunk that fits the chunk budget, then another step: the last must
    # wait, or the call holding the chunk grows past one chunk's tokens (found by the property test below)
    schedule = _schedule(max_batch=3, max_batch_tokens=3, prefill_chunk_tokens=2, busy_chunk_tokens=1)
    first, chunk, step = decode("a"), Job("b", 1, long_prefill=True), decode("c")
    batch, kept = schedule.take(first, [], [chunk, step], "decode", now=10.0)
    assert batch == [first, chunk] and kept == [step]


def test_prefills_riding_on_the_decode_lane_share_one_busy_chunks_tokens() -> None:
    schedule = _schedule(decoding=True, busy_chunk_tokens=32, ride_along_tokens=16)
    riders = [Job(s, 12) for s in ("a", "b", "c")]
    batch, kept = schedule.take(riders[0], [], [*riders[1:], decode("d")], "decode", now=0.0)
    assert [j.session_id for j in batch] == ["a", "b", "d"] and kept == [riders[2]]


@pytest.mark.parametrize(("groups", "first_call"), [(1, 4), (2, 2), (4, 1)])
def test_lone_sessions_due_by_their_pace_go_in_paced_groups(groups: int, first_call: int) -> None:
    schedule = _schedule(max_batch=8, paced_groups=groups)
    sessions = ["s0", "s1", "s2", "s3"]
    for now in (0.0, 1.0):
        for sid in sessions:
            schedule.arrived(sid, 1, paced=True, now=now)
    jobs = [decode(s, paced=True) for s in sessions]
    batch, _ = schedule.take(jobs[0], [], jobs[1:], "decode", now=1.0)
    assert len(batch) == first_call


# ---------------------------------------------------------------------- take: properties

_sessions = st.sampled_from(["a", "b", "c", "d", "e"])
_jobs = st.builds(
    Job,
    session_id=_sessions,
    tokens=st.one_of(st.just(1), st.integers(2, 40)),
    blocks=st.sampled_from(["A", "A", "B"]),
    group=st.one_of(st.none(), st.sampled_from([("g", 2), ("h", 3)])),
    paced=st.booleans(),
    long_prefill=st.booleans(),
)
_configs = st.builds(
    ExecutorConfig,
    max_batch=st.integers(1, 8),
    max_batch_tokens=st.integers(1, 64),
    prefill_chunk_tokens=st.integers(1, 48),
    busy_chunk_tokens=st.integers(1, 48),
    busy_prompt_tokens=st.integers(1, 48),
    ride_along_tokens=st.integers(0, 16),
    paced_groups=st.integers(1, 3),
)


def _check_call(schedule: Schedule, batch: list[Job], lane: Lane, now: float) -> None:
    """The budgets of one forward call that took more than its first job."""
    config = schedule.config
    chunk = schedule.chunk_tokens(now)
    if len(batch) > 1:
        assert len(batch) <= config.max_batch
        assert sum(j.tokens for j in batch) <= config.max_batch_tokens or len(batch) == 1
        assert len({j.session_id for j in batch}) == len(batch), "one step per session"
        assert all(j.blocks is batch[0].blocks for j in batch)
        if lane == "decode":
            riders = sum(j.tokens for j in batch[1:] if j.tokens > 1)
            assert riders <= chunk or batch[0].tokens > 1 and riders + batch[0].tokens <= chunk
        if lane == "prefill" and batch[0].long_prefill:
            assert sum(j.tokens for j in batch) <= chunk
        if any(j.long_prefill for j in batch[1:]):
            assert sum(j.tokens for j in batch) <= chunk


@settings(max_examples=300, deadline=None)
@given(
    config=_configs,
    jobs=st.lists(_jobs, min_size=1, max_size=24),
    lane=st.sampled_from(["decode", "prefill"]),
    decoding=st.booleans(),
)
def test_draining_a_queue_runs_every_step_once_in_session_order_within_the_budgets(
    config: ExecutorConfig, jobs: list[Job], lane: Lane, decoding: bool
) -> None:
    """Take calls from a queue until it is empty: every job runs exactly once (nothing dropped or duplicated),
    each call keeps the budgets, each session's steps run in their queued order, and the jobs left keep theirs."""
    schedule = Schedule(config)
    now = 10.0
    if decoding:
        schedule.arrived("someone", 1, paced=False, now=now)
    queue, calls = list(jobs), []
    while queue:
        first, rest = queue[0], queue[1:]
        batch, kept = schedule.take(first, [], rest, lane, now)
        assert batch[0] is first and batch, "a call always runs its first job"
        assert sorted(j.id for j in batch + kept) == sorted(j.id for j in queue), "nothing dropped or doubled"
        assert [j.id for j in kept] == [j.id for j in rest if j not in batch], "the rest keep their order"
        _check_call(schedule, batch, lane, now)
        calls.append(batch)
        schedule.ran(batch, now)
        queue = kept
    ran = [j for call in calls for j in call]
    assert sorted(j.id for j in ran) == sorted(j.id for j in jobs)
    for sid in {j.session_id for j in jobs}:
        assert [j.id for j in ran if j.session_id == sid] == [j.id for j in jobs if j.session_id == sid]


@settings(max_examples=200, deadline=None)
@given(config=_configs, riders=st.lists(st.integers(2, 16), max_size=10), steps=st.integers(0, 8))
def test_riding_prefills_never_crowd_the_decode_steps_past_one_busy_chunk(
    config: ExecutorConfig, riders: list[int], steps: int
) -> None:
    """A decode step first, then any flood of short prefills and other sessions' decode steps: the call's
    riding rows stay within one busy chunk, and every decode step that has room in max_batch goes in it."""
    schedule = Schedule(config)
    schedule.arrived("d", 1, paced=False, now=0.0)
    first = decode("d")
    queued = [Job(f"r{i}", t) for i, t in enumerate(riders)] + [decode(f"s{i}") for i in range(steps)]
    batch, kept = schedule.take(first, [], queued, "decode", now=0.0)
    assert sum(j.tokens for j in batch if j.tokens > 1) <= schedule.chunk_tokens(0.0)
    decode_kept = [j for j in kept if j.tokens == 1]
    if decode_kept:
        full = len(batch) == config.max_batch or sum(j.tokens for j in batch) + 1 > config.max_batch_tokens
        assert full, "a decode step waited while the call had room"


# ---------------------------------------------------------------------- waits


def test_a_group_waits_for_its_missing_steps_within_its_window_and_not_for_parts_that_ran() -> None:
    schedule = _schedule(max_batch=2, group_window_s=0.05, batch_window_s=0.0)
    group = ("client/round", 3)
    batch = [decode("a", group=group)]
    assert schedule.wait_s(batch, waited_s=0.0, now=0.0) == pytest.approx(0.05)
    assert schedule.wait_s(batch, waited_s=0.02, now=0.0) == pytest.approx(0.03)
    assert schedule.wait_s(batch, waited_s=0.05, now=0.0) == 0.0  # the window is over
    two = [decode("a", group=group), decode("b", group=group)]
    assert schedule.wait_s(two, 0.0, 0.0) == 0.0  # max_batch reached
    schedule.ran(two, now=0.0)
    assert schedule.wait_s([decode("c", group=group)], 0.0, 0.0) == 0.0  # its group's other steps ran
    assert schedule.groups_remembered == 1
    schedule.ran([decode("x", group=("other", 1))], now=GROUPS_HORIZON_S + 1)
    assert schedule.groups_remembered == 1, "an old group is forgotten by time, not by a count"


def test_a_lone_step_at_a_first_hop_waits_only_for_a_session_due_by_its_pace() -> None:
    schedule = _schedule(max_batch=8, batch_window_s=0.08, group_window_s=0.0, paced_groups=1)
    for now in (0.0, 1.0):
        for sid in ("a", "b"):
            schedule.arrived(sid, 1, paced=True, now=now)
    schedule.arrived("a", 1, paced=True, now=2.0)
    a = [decode("a", paced=True)]
    assert schedule.wait_s(a, 0.0, now=2.0) == pytest.approx(0.08)  # b is due at 2
    assert schedule.wait_s([decode("a")], 0.0, now=2.0) == 0.0  # sent by another hop: never by pace
    assert schedule.wait_s(a, 0.0, now=2.5) == 0.0  # b is more than a window late
    schedule.forget("b")
    assert schedule.wait_s(a, 0.0, now=2.0) == 0.0  # closed


@settings(max_examples=200, deadline=None)
@given(
    config=_configs,
    windows=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    batch=st.lists(_jobs.filter(lambda j: j.tokens == 1), min_size=1, max_size=8),
    waited=st.floats(0, 2),
)
def test_a_wait_never_outlasts_its_window(
    config: ExecutorConfig, windows: tuple[float, float], batch: list[Job], waited: float
) -> None:
    schedule = Schedule(
        ExecutorConfig(max_batch=config.max_batch, batch_window_s=windows[0], group_window_s=windows[1])
    )
    for sid in ("a", "b", "c"):
        schedule.arrived(sid, 1, paced=True, now=0.0)
        schedule.arrived(sid, 1, paced=True, now=1.0)
    left = schedule.wait_s(batch, waited, now=1.5)
    assert 0.0 <= left <= max(0.0, max(windows) - waited)


def test_a_session_is_due_one_period_after_its_last_step_until_a_window_late() -> None:
    """Steps at t=0 and t=1: due at 2, so within 25 ms of it, not half a period early, and not once it is
    more than a window late; never for a batch it is already in; forgotten once closed or quiet too long."""
    arrivals = Arrivals()
    window = 0.025

    def due(now: float, present: set[str | None] | None = None) -> bool:
        return arrivals.due(present or set(), now, late_s=window, within_s=window)

    arrivals.note("a", 0.0)
    assert not due(0.99)  # one step: no pace yet
    arrivals.note("a", 1.0)
    assert [due(t) for t in (1.5, 1.98, 2.0, 2.02, 2.03)] == [False, True, True, True, False]
    assert not due(1.98, present={"a"})
    arrivals.forget("a")
    assert not due(1.98)
    arrivals.note("b", 10.0)
    arrivals.note("b", 11.0)
    arrivals.note("c", 11.0 + ARRIVALS_HORIZON_S + 1)  # b has been quiet past the horizon: forgotten
    arrivals.note("c", 12.0 + ARRIVALS_HORIZON_S + 1)
    assert not due(12.0) and len(arrivals) == 1
    assert due(13.0 + ARRIVALS_HORIZON_S + 1)  # c's own pace


# ---------------------------------------------------------------------- chunks, riding along, turns


def test_chunks_are_small_only_while_others_decode_and_short_prompts_run_whole() -> None:
    schedule = _schedule(
        prefill_chunk_tokens=32, busy_chunk_tokens=8, busy_prompt_tokens=16, decode_recent_s=1.0
    )
    assert (schedule.chunk_tokens(0.0), schedule.whole_tokens(0.0)) == (32, 32)
    schedule.arrived("d", 1, paced=False, now=10.0)
    assert (schedule.chunk_tokens(10.5), schedule.whole_tokens(10.5)) == (8, 16)
    assert schedule.runs_whole(16, 10.5) and not schedule.runs_whole(17, 10.5)
    assert schedule.chunk_tokens(11.0) == 32  # nobody decoded for decode_recent_s
    assert schedule.is_long(33) and not schedule.is_long(32)


@settings(max_examples=200, deadline=None)
@given(config=_configs, tokens=st.integers(1, 500), decoding=st.booleans())
def test_a_prompt_cut_into_chunks_covers_it_exactly(
    config: ExecutorConfig, tokens: int, decoding: bool
) -> None:
    schedule = Schedule(config)
    if decoding:
        schedule.arrived("d", 1, paced=False, now=0.0)
    if schedule.runs_whole(tokens, 0.0):
        assert tokens <= max(config.prefill_chunk_tokens, config.busy_prompt_tokens)
        return
    chunks, offset = [], 0
    while offset < tokens:
        size = min(schedule.chunk_tokens(0.0), tokens - offset)
        chunks.append(size)
        offset += size
    assert sum(chunks) == tokens and all(0 < c <= config.prefill_chunk_tokens for c in chunks)


def test_a_short_prefill_rides_only_while_a_decode_call_is_likely_within_its_wait() -> None:
    schedule = _schedule(ride_along_tokens=16, batch_window_s=0.05, ride_wait_s=0.5)
    assert not schedule.rides_along(8, long_prefill=False, now=0.0)  # nobody decodes
    schedule.arrived("d", 1, paced=False, now=0.0)
    assert schedule.rides_along(8, long_prefill=False, now=0.01)
    assert not schedule.rides_along(17, long_prefill=False, now=0.01)  # too long
    assert not schedule.rides_along(8, long_prefill=True, now=0.01)  # a chunk of a long prompt
    assert not schedule.rides_along(8, long_prefill=False, now=0.06)  # no period known: the window alone
    schedule.decode_call(1, now=0.0)
    schedule.decode_call(2, now=0.2)  # a period of 0.2 s
    assert schedule.ride_wait_s() == pytest.approx(0.25) and schedule.decode_rows == 2
    assert schedule.rides_along(8, long_prefill=False, now=0.2)
    schedule.decode_call(1, now=2.0)  # a period of 1.8 s: ride_wait_s caps it
    assert schedule.ride_wait_s() == pytest.approx(0.5)
    assert schedule.riders_wait_s(0.4) == pytest.approx(0.1) and schedule.riders_wait_s(0.6) == 0.0


def test_a_sessions_own_drafted_step_does_not_wait_for_its_own_decode_step() -> None:
    """A client verifying drafted tokens sends a short step and no decode step until it is answered: the step
    rides along only when another session decodes here, never waiting for its own session's next token."""
    schedule = _schedule(ride_along_tokens=16, batch_window_s=0.05, ride_wait_s=0.5)
    schedule.arrived("spec", 1, paced=False, now=0.0)
    assert not schedule.rides_along(5, long_prefill=False, now=0.01, session_id="spec")
    assert schedule.rides_along(5, long_prefill=False, now=0.01, session_id="other")
    schedule.arrived("d", 1, paced=False, now=0.02)
    assert schedule.rides_along(5, long_prefill=False, now=0.03, session_id="spec")
    for _ in range(3):  # one session decoding again and again keeps the other one remembered
        schedule.arrived("d", 1, paced=False, now=0.03)
    assert schedule.rides_along(5, long_prefill=False, now=0.04, session_id="d")


def test_a_prefill_takes_the_devices_turn_only_while_others_decode() -> None:
    schedule = _schedule(decode_recent_s=1.0)
    chunk, short = Job("p", 8, long_prefill=True, yields_to_device=True), Job("s", 4)
    assert schedule.prefill_turn([chunk], now=0.0) == (None, False)  # nobody decodes: no turn
    schedule.arrived("d", 1, paced=False, now=0.0)
    assert schedule.prefill_turn([chunk], now=0.5) == (True, True)  # alone, and waits for the device
    assert schedule.prefill_turn([Job("q", 8, long_prefill=True)], now=0.5) == (True, False)
    assert schedule.prefill_turn([short], now=0.5) == (False, False)  # shared with other short prefills
