"""The two threads per device that run torch, fed by bounded queues, batching concurrent decode steps.

The event loop never runs torch: the peer submits jobs and awaits their futures. A step names the BlockRange it
runs on (a peer serves one range, or two while it moves). Each thread serves its own lane: one-token (decode)
steps and plain calls on one, prefill chunks on the other, at a lower OS priority (``prefill_nice``). Prefill
is compute-bound and decode latency-bound (Sarathi, Splitwise): when every peer of a pipelined long prompt
computes at once on fewer cores than that, a decode step still gets a core at once instead of a share of it
behind the chunks. Niceness does not give it the GIL, the caches or the hand-offs around the step, so a chunk
also waits between two of its layers for the decode call running beside it (a long prompt's chunk, with
``device_decode_wait_s``, for those of the other peers on the device too), and while others decode here the
peers of one device take turns for their chunks (swarm/peer/turns.py; ``busy_prefill_share`` can add pauses).
A long prefill runs as chunks, small ones while other sessions decode here (on a GPU the decode kernels still
queue behind a chunk's). Each lane takes its oldest job and gathers the queued steps of *other* sessions on the
*same* BlockRange into one ``BlockRange.forward`` call, within a budget of steps and tokens (the prefill lane's
tokens held to one small chunk's while others decode): continuous batching at step granularity. A short prefill
(``ride_along_tokens``: a spot-check's window) that comes while others decode here (a decode step within the
wait it would have) goes on the decode lane instead and waits there for their next forward call (one period of
the decode calls here plus ``batch_window_s``, ``ride_wait_s`` at most), which takes it as a few more rows of the
same products: on a CPU a forward call's cost is mostly reading the weights, and a call of its own on the
prefill thread read them all once more. If no decode call comes, it goes to the prefill thread: alone on the
decode lane it would hold back the steps that come just after it. Nor does it ride where its rows would move
the call to another form of products (here a decode call of the default model, 4-bit, goes to F.linear with a
16-token window). A full queue is a CapacityError at once, not a backlog.

A batch of decode steps waits a moment for the steps it expects: the rest of a group (``group_window_s``: a
client's sessions of one round, or the steps one forward call of the hop before sent here, StepRequest.batch_id),
and the lone sessions due here within ``batch_window_s``. A session decoding at a steady pace comes back one
period after its last step here (the time its step takes around the route and through its client); sessions of
separate clients arrive out of step, and an idle executor would start each alone (a client's own sessions come
as its groups, not tracked by pace). Waiting for the ones due lines them up, and once batched they travel the
route together as a group and come back together: on a CPU, where a decode step's cost is reading the weights,
a forward call of 8 decode steps costs about 1.6 of one. Only a route's first hop sees lone sessions (later
hops get groups), so only it waits by pace. A session that stops coming (it ended, or waits for its user) is no
longer due once it is a window late.

Opening and closing sessions also go through the decode lane (``call``), never while a chunk runs, so a
KV cache is only ever touched by one torch thread at a time: a session's own steps take turns too, whatever
lane they run on. A call waits for a running chunk on its own, beside the lane, and the decode steps queued
after it go on meanwhile: clients open sessions all the time (every spot-check opens some), and a call waiting
in line held every decode step behind it until the chunk ended (traced: decode steps queued 45-125 ms behind a
session open while a 128-token chunk ran). The BlockRange's own admission check (free cache tokens) turns into
a CapacityError.

Steps of one session run in position order, whatever order they arrive in: a client pipelines a long prompt
as consecutive chunks sent without waiting (client/session.py), and two chunks may overtake each other on the
way. ``forward`` holds a step whose position is past the session's cached length until the earlier steps have
run; if one of them fails here, the steps waiting behind it fail at once (SessionError) instead of at their
deadline, so the client's failover starts without delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from swarm.errors import CapacityError, SessionError, SwarmError
from swarm.models.blocks import BlockRange, Step
from swarm.models.threads import name_os_thread
from swarm.peer.config import ExecutorConfig
from swarm.peer.turns import DecodeCalls, DeviceTurns

logger = logging.getLogger(__name__)

# the lanes' torch threads as the OS names them (swarm.models.threads: CPU per thread tells the lanes apart)
DECODE_THREAD = "swarm-decode"
PREFILL_THREAD = "swarm-prefill"
_T = TypeVar("_T")
_MAX_FAILED_SESSIONS = 4096  # failed-step marks kept for steps waiting behind them
_ARRIVALS_HORIZON_S = 5.0  # a session whose decode steps stopped this long ago is forgotten (_Arrivals)
Group = tuple[str, int]  # (key, size): a client's decode steps of one round (StepRequest.batch_id/batch_size)


@dataclass(frozen=True)
class StepResult:
    hidden: torch.Tensor
    queue_s: float  # from submit to the start of its forward call
    compute_s: float  # the forward call it was part of
    # the decode steps of its forward call going on to the same next hop, as a group for that hop to wait for
    # (a fresh id, their count); None when it goes on alone (see Executor.forward)
    onward_group: Group | None = None


@dataclass
class _Job:
    call: Callable[[], Any] | None  # a plain call (open, close, measure), or
    step: Step | None  # one forward step (batchable when it is a decode step)
    blocks: BlockRange | None  # what the step runs on
    future: asyncio.Future[Any]
    group: Group | None = None  # the client's decode steps sent together with this one
    onward: str = ""  # the next hop it goes on to, if any (its forward call's steps for it go as a group)
    paced: bool = (
        False  # a lone decode step at its route's first hop: its batch may wait for sessions due here
    )
    long_prefill: bool = False  # a chunk of a prefill longer than one chunk (it takes this device's turns)
    # a chunk of a prompt longer than one idle chunk (prefill_chunk_tokens): it waits for the device's decode calls
    yields_to_device: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    started: bool = False  # its forward call began (it runs to its end even if its caller gives up)
    finished: asyncio.Event = field(default_factory=asyncio.Event)  # ... and has ended

    @property
    def session_id(self) -> str | None:
        return self.step.session_id if self.step is not None else None

    @property
    def tokens(self) -> int:
        return self.step.hidden.shape[0] if self.step is not None else 0


@dataclass
class _Lane:
    """One torch thread and the queue of jobs it serves."""

    queue: asyncio.Queue[_Job]
    thread: ThreadPoolExecutor


class _Arrivals:
    """When each session's decode steps reached the executor, to tell which sessions are due soon."""

    def __init__(self) -> None:
        # session -> (its last decode step's arrival, the time since the one before, or inf); oldest first
        self._seen: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def note(self, session_id: str, now: float) -> None:
        last, _ = self._seen.pop(session_id, (None, math.inf))
        period = now - last if last is not None and now - last < _ARRIVALS_HORIZON_S else math.inf
        self._seen[session_id] = (now, period)
        while self._seen and next(iter(self._seen.values()))[0] < now - _ARRIVALS_HORIZON_S:  # gone quiet
            self._seen.popitem(last=False)

    def forget(self, session_id: str) -> None:
        self._seen.pop(session_id, None)

    def pacing(self, now: float, late_s: float) -> int:
        """Sessions stepping here by their pace now: seen within the horizon, and not more than ``late_s`` past
        their next step's due time (one seen once has no pace yet, and counts until it goes quiet)."""
        return sum(1 for last, period in self._seen.values() if last + period >= now - late_s)

    def due(self, present: set[str | None], now: float, late_s: float, within_s: float) -> bool:
        """Whether a session other than ``present`` is due within ``within_s`` (its last arrival plus its last
        period), and not already more than ``late_s`` late."""
        return any(
            now - late_s <= last + period <= now + within_s
            for sid, (last, period) in self._seen.items()
            if sid not in present
        )


def _start_prefill_thread(nice: int, idle: bool) -> None:
    """Name the calling (prefill) thread, run it ``nice`` steps nicer than it is (Linux sets niceness per
    thread) and, with ``idle``, under the idle scheduling policy (see ExecutorConfig.prefill_idle)."""
    name_os_thread(PREFILL_THREAD)
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + nice))
    except (AttributeError, OSError) as e:  # not Linux, or not allowed: prefill just competes as an equal
        logger.info("prefill thread keeps its priority (%s)", e)
    if idle:
        try:
            os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError) as e:  # not Linux: its niceness alone
            logger.info("prefill thread keeps the normal scheduling policy (%s)", e)


class Executor:
    """Runs torch work on two worker threads (decode, prefill). Start ``run()`` in the owner's TaskGroup first."""

    def __init__(
        self,
        config: ExecutorConfig | None = None,
        name: str = "torch",
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        turns: DeviceTurns | None = None,
        decode_calls: DecodeCalls | None = None,
    ) -> None:
        self.config = config or ExecutorConfig()
        self.turns = turns  # this device's prefill turns (swarm/peer/turns.py), if taken
        self.decode_calls = decode_calls  # this device's decode calls, which long chunks wait for (turns.py)
        # when decode steps arrive: whether others decode now (_chunk_tokens), which sessions are due (_Arrivals)
        self.clock = clock
        self.sleep = sleep  # the prefill lane's pauses while others decode (busy_prefill_share)
        self._last_decode_s = -math.inf  # when a one-token step of a session was last submitted
        # when the decode lane's last two forward calls with a decode step began: their period (_ride_wait_s)
        self._decode_calls = (-math.inf, -math.inf)
        self._decode_rows = 1  # how many decode steps the decode lane's last such call ran (_rides_along)
        self._decode = _Lane(
            asyncio.Queue(self.config.queue_jobs),
            ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix=name,
                initializer=name_os_thread,
                initargs=(DECODE_THREAD,),
            ),
        )
        prefill_thread = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix=f"{name}-prefill",
            initializer=_start_prefill_thread,
            initargs=(self.config.prefill_nice, self.config.prefill_idle),
        )
        self._prefill = _Lane(asyncio.Queue(self.config.queue_jobs), prefill_thread)
        # held while a prefill chunk or a plain call runs: calls (open, close, moves) change caches and ranges
        self._calls_apart = asyncio.Lock()
        # calls the decode lane took, waiting for their turn. Unbounded, though out of the lane's bounded queue: every
        # open holds a session slot first (SessionConfig.max_open, per-remote caps), a hand-over one per session
        self._calls: asyncio.Queue[_Job] = asyncio.Queue()
        self._turns: dict[
            str, tuple[asyncio.Lock, int]
        ] = {}  # session -> (its lock, steps holding or waiting)
        self.batches_run = 0
        self.steps_run = 0
        # seconds spent in forward calls, both lanes (the "computing" share of the log line)
        self.compute_s = 0.0
        self._stepped = asyncio.Event()  # set after every forward job: steps waiting for their turn re-check
        self._failed: dict[str, int] = {}  # session -> position of its last step that failed here
        # when each lone session's decode steps came (see ExecutorConfig.batch_window_s)
        self._arrivals = _Arrivals()
        # group -> its steps that ran here already: a group bigger than max_batch runs in parts, and the later
        # parts must not wait for steps that went with an earlier one
        self._group_ran: OrderedDict[Group, int] = OrderedDict()
        # set whenever a job is queued: a batch waiting for the steps it expects looks again
        self._arrived = asyncio.Event()
        # the decode lane's forward call running now, set once it has ended (_yield_to_decode)
        self._decode_call = threading.Event()
        self._decode_call.set()

    @property
    def queued(self) -> int:
        return self._decode.queue.qsize() + self._prefill.queue.qsize() + self._calls.qsize()

    def _submit(self, job: _Job) -> asyncio.Future[Any]:
        lane = self._decode if job.tokens <= 1 or self._rides_along(job) else self._prefill
        try:
            lane.queue.put_nowait(job)
        except asyncio.QueueFull:
            raise CapacityError(f"peer is busy: {self.config.queue_jobs} requests already queued") from None
        self._arrived.set()
        return job.future

    def _rides_along(self, job: _Job) -> bool:
        """Whether prefill ``job`` joins the decode lane's next forward call (``ride_along_tokens``): only while
        a decode step came here within the wait it would have (``_ride_wait_s``), so one more is likely within
        it (a user's quick next turn after their own answer ended would wait the whole of it for nobody), and
        only if its rows leave that call's products in the form they take without it. A decode call through
        the 4-bit kernel (swarm/models/int4.py) that takes a 16-token spot-check window goes through F.linear
        instead: traced on the default model, 2 decode steps took 45-56 ms of CPU in such a call against 14
        alone, at every hop, while the window's own call on the prefill thread runs beside the decode steps."""
        short = job.tokens <= self.config.ride_along_tokens and not job.long_prefill
        if not short or job.step is None or job.blocks is None:
            return False
        recent = self.clock() - self._last_decode_s < self._ride_wait_s()
        return recent and job.blocks.same_form(self._decode_rows, job.tokens)

    def _ride_wait_s(self) -> float:
        """How long a prefill riding along waits for a decode call: the decode calls' last period here plus
        ``batch_window_s`` (just the window before two calls), ``ride_wait_s`` at most."""
        previous, last = self._decode_calls
        period = last - previous if previous > -math.inf else 0.0
        return min(self.config.ride_wait_s, period + self.config.batch_window_s)

    def _off_the_decode_lane(self, riders: list[_Job]) -> list[_Job]:
        """Prefills that rode along for nothing go to the prefill thread; those it has no room for stay."""
        for i, job in enumerate(riders):
            try:
                self._prefill.queue.put_nowait(job)
            except asyncio.QueueFull:
                return riders[i:]
        self._arrived.set()
        return []

    async def call(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` on the torch thread after the steps queued before it, and while no prefill chunk runs;
        calls run in the order they were made.

        A job whose caller is cancelled before it starts is skipped; one already running runs to its end.
        """
        loop = asyncio.get_running_loop()
        result: _T = await self._submit(_Job(fn, None, None, loop.create_future()))
        return result

    async def release(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (one that frees memory, e.g. a close) on the decode thread now, past the queue.

        It is never refused for a full queue, and runs to its end even if the caller is cancelled: a close
        that failed for being busy would leak the very memory that makes the peer busy. The decode thread keeps
        it from racing a decode step, and ``_calls_apart`` from racing a prefill chunk.
        """
        await asyncio.shield(self._release(fn))

    async def _release(self, fn: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with self._calls_apart:
                await loop.run_in_executor(self._decode.thread, fn)
        except RuntimeError:  # shut down: the caches it would free are gone with the thread
            logger.debug("executor shut down; nothing to release")

    async def forward(
        self, blocks: BlockRange, step: Step, group: Group | None = None, onward: str = "", paced: bool = True
    ) -> StepResult:
        """Run one step on ``blocks`` (possibly batched with others) and return its output with its timings.

        ``onward`` names the next hop of a step that goes on: the decode steps of one forward call bound for the
        same hop get one ``onward_group``, and the hop waits for all of them to batch them again (they reach it
        one message each, ~1 ms apart). Lone sessions are waited for by their pace (``batch_window_s``) only
        where they come lone, at the first hop (``paced``; False for a step another hop sent): a later hop that
        waited for a session due by its pace could be waiting for one held at another hop, itself waiting
        (traced with 80 ms windows).

        A session's step waits for the session's earlier steps first (see the module doc). A longer prefill
        runs as consecutive chunks, each its own job (see _chunk_tokens): other sessions' steps queued meanwhile
        run between two chunks, or with one, instead of waiting for the whole prompt. Each chunk extends the
        session's cache from where the last one ended, so the output is the whole step's."""
        sid = step.session_id
        if sid is None:
            return await self._forward_job(
                _Job(None, step, blocks, asyncio.get_running_loop().create_future())
            )
        if step.hidden.shape[0] != 1:
            group = None  # only decode steps wait for each other
        # a client's lone session at its first hop: nothing else lines its steps up with others'
        paced = paced and group is None and step.hidden.shape[0] == 1
        if step.hidden.shape[0] == 1:
            self._last_decode_s = self.clock()
            if paced:
                self._arrivals.note(sid, self._last_decode_s)
        await self._in_order(blocks, step)
        if self._failed.get(sid, -1) >= step.position:
            del self._failed[sid]  # the failed step is being replayed: the steps after it may wait again
        try:
            job = _Job(None, step, blocks, asyncio.get_running_loop().create_future(), group, onward, paced)
            result = await self._forward_chunks(job)
        except BaseException:
            self._failed[sid] = step.position
            while len(self._failed) > _MAX_FAILED_SESSIONS:  # forget the oldest: only waiters need them
                del self._failed[next(iter(self._failed))]
            self._stepped.set()
            raise
        return result

    async def _in_order(self, blocks: BlockRange, step: Step) -> None:
        """Return once the session's cache on the step's layers reaches ``step.position``: every earlier step
        has run, or is running its last layer (then this one waits for the session's turn, see ``_turn``).
        SessionError when an earlier step of the session failed here; the caller's deadline bounds
        the wait for one that has not arrived yet."""
        sid = step.session_id
        assert sid is not None
        while True:
            length = min(blocks.session_length(sid, layer) for layer in range(step.start, step.end))
            if length >= step.position:
                return
            failed = self._failed.get(sid)
            if failed is not None and failed < step.position:
                raise SessionError(
                    f"session {sid[:16]}: the step at position {failed} failed here, so the step at "
                    f"{step.position} cannot run: replay from it"
                )
            self._stepped.clear()
            await self._stepped.wait()

    async def _forward_chunks(self, job: _Job) -> StepResult:
        """``job``'s step as consecutive jobs of at most ``_chunk_tokens()`` tokens each, chosen as each is
        queued (a chunk is a prefill: no group, not paced, not sent on as a group)."""
        step, blocks = job.step, job.blocks
        assert step is not None and blocks is not None
        tokens = step.hidden.shape[0]
        if tokens <= self._whole_tokens(self._chunk_tokens()):
            return await self._forward_job(job)
        parts: list[torch.Tensor] = []
        queue_s = compute_s = 0.0
        offset = 0
        long = tokens > self.config.prefill_chunk_tokens  # not a chat prompt cut only because others decode
        while offset < tokens:
            hidden = step.hidden[offset : offset + self._chunk_tokens()]  # [<=chunk, H]
            chunk = Step(step.session_id, hidden, step.start, step.end, step.position + offset)
            part = await self._forward_job(
                _Job(
                    None,
                    chunk,
                    blocks,
                    asyncio.get_running_loop().create_future(),
                    long_prefill=True,
                    yields_to_device=long,
                )
            )
            parts.append(part.hidden)
            offset += hidden.shape[0]
            queue_s, compute_s = queue_s + part.queue_s, compute_s + part.compute_s
        return StepResult(torch.cat(parts), queue_s, compute_s)

    def _decoding(self) -> bool:
        """Whether other sessions decode here now (a one-token step within ``decode_recent_s``)."""
        return self.clock() - self._last_decode_s < self.config.decode_recent_s

    def _chunk_tokens(self) -> int:
        """Small chunks while other sessions decode here (on a GPU their kernels queue behind the chunk's, and
        calls wait for it), big ones otherwise (less overhead per token)."""
        config = self.config
        if self._decoding():
            return min(config.busy_chunk_tokens, config.prefill_chunk_tokens)
        return config.prefill_chunk_tokens

    def _whole_tokens(self, chunk: int) -> int:
        """The longest prompt that runs whole, given the chunk size now (``_chunk_tokens()``): one idle chunk,
        or while others decode here a short prompt (busy_prompt_tokens; a longer one goes in busy chunks)."""
        return max(chunk, min(self.config.busy_prompt_tokens, self.config.prefill_chunk_tokens))

    async def _forward_job(self, job: _Job) -> StepResult:
        # its queue time starts here, after the waits for its session's order
        job.submitted = time.perf_counter()
        async with self._turn(job.session_id):
            try:
                result: StepResult = await self._submit(job)
            except asyncio.CancelledError:
                # the thread still writes the session's cache: its next job waits for that, even if cancelled again
                while job.started and not job.finished.is_set():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.shield(job.finished.wait())
                raise
        return result

    @contextlib.asynccontextmanager
    async def _turn(self, session_id: str | None) -> AsyncIterator[None]:
        """One job of a session at a time, across both lanes: a replayed prefill must not rewrite a cache that
        a stale decode step of the same session is appending to on the other thread."""
        if session_id is None:
            yield
            return
        lock, users = self._turns.get(session_id) or (asyncio.Lock(), 0)
        self._turns[session_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._turns[session_id]
            if users == 1:
                del self._turns[session_id]
            else:
                self._turns[session_id] = (lock, users - 1)

    async def run(self) -> None:
        """Serve both lanes until cancelled; jobs still queued then fail with CapacityError."""
        try:
            async with asyncio.TaskGroup() as lanes:
                lanes.create_task(self._serve(self._decode))
                lanes.create_task(self._serve(self._prefill))
                lanes.create_task(self._serve_calls())
        finally:
            for queue in (self._decode.queue, self._prefill.queue, self._calls):
                while not queue.empty():
                    job = queue.get_nowait()
                    if not job.future.done():
                        job.future.set_exception(CapacityError("peer is shutting down"))
            for lane in (self._decode, self._prefill):
                lane.thread.shutdown(wait=False, cancel_futures=True)

    async def _serve(self, lane: _Lane) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await lane.queue.get()
            if first.future.cancelled():  # its caller gave up (deadline, disconnect): skip the work
                continue
            if first.call is not None:  # it waits for a running chunk beside the lane, not before its steps
                self._calls.put_nowait(first)
                continue
            batch = self._take_batch(lane, first)
            if self.config.batch_window_s > 0 or self.config.group_window_s > 0:
                batch = await self._wait_for_due(lane, batch)
            if lane is self._decode:
                await self._execute(loop, lane, batch)  # decode steps run beside a chunk
                self._stepped.set()
                continue
            async with self._calls_apart:  # a chunk and a plain call never run together
                started = time.perf_counter()
                await self._execute(loop, lane, batch)
            self._stepped.set()
            await self._pause_prefill(time.perf_counter() - started)

    async def _serve_calls(self) -> None:
        """Run the calls the decode lane took, in order, on its thread, each while no chunk runs."""
        loop = asyncio.get_running_loop()
        while True:
            job = await self._calls.get()
            async with self._calls_apart:
                await self._execute(loop, self._decode, [job])
            self._stepped.set()  # a call may extend a cache (a hand-over's chunk): steps waiting for it look again

    async def _pause_prefill(self, chunk_s: float) -> None:
        """After a chunk that took ``chunk_s``, leave the machine to decoding sessions for a while, if any
        decode here (busy_prefill_share)."""
        share = self.config.busy_prefill_share
        if share < 1 and self._decoding():
            await self.sleep(chunk_s * (1 / share - 1))

    async def _wait_for_due(self, lane: _Lane, batch: list[_Job]) -> list[_Job]:
        """A batch of decode steps, grown by the queued steps it expects: the rest of its steps' groups (sent
        together by their client, for at most ``group_window_s``), and the sessions due here within
        ``batch_window_s`` (for at most that), taking whatever else arrives meanwhile. A client naming a group
        bigger than it sends delays only the steps batched with its own, by the window at most. Short prefills
        riding along first wait for a decode step to join (``_ride_wait_s``), then go to the prefill lane."""
        if lane is self._prefill or any(job.step is None for job in batch):
            return batch  # prefill chunks and plain calls never wait
        started = time.monotonic()
        # only short prefills riding along: wait for a decode step to run with
        while not any(job.tokens == 1 for job in batch):
            left = started + self._ride_wait_s() - time.monotonic()
            if left <= 0:
                return self._off_the_decode_lane(batch)  # nobody decodes after all
            await self._next_arrival(left)
            batch = self._take_batch(lane, batch[0], batch[1:])
        started = time.monotonic()
        while len(batch) < self.config.max_batch:
            grouped = self._group_incomplete(batch)  # a group's steps are known to come; due ones only may
            window = self.config.group_window_s if grouped else self.config.batch_window_s
            left = started + window - time.monotonic()
            paced = any(job.paced for job in batch)  # later hops get groups (see forward)
            in_batch = sum(job.paced for job in batch)
            waits = paced and in_batch < self._paced_group(in_batch) and self._due(batch, left)
            if left <= 0 or not (grouped or waits):
                break
            await self._next_arrival(left)
            batch = self._take_batch(lane, batch[0], batch[1:])
        return batch

    async def _next_arrival(self, within_s: float) -> None:
        """Return once a job is queued, or after ``within_s``."""
        self._arrived.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within_s):
                await self._arrived.wait()

    def forget(self, session_id: str) -> None:
        """Session ``session_id`` closed here: no batch waits for its steps any more."""
        self._arrivals.forget(session_id)

    def _due(self, batch: list[_Job], within_s: float) -> bool:
        # Due by self.clock (time.monotonic outside tests); the wait itself is bounded in real time, so it ends
        # even under a test's frozen clock.
        present = {job.session_id for job in batch}
        return self._arrivals.due(present, self.clock(), late_s=self.config.batch_window_s, within_s=within_s)

    def _paced_group(self, present: int) -> int:
        """The most lone sessions batched by their pace in one call: those pacing here (or, when this peer is
        behind, the ``present`` ones, queued or in the batch) in ``paced_groups`` groups, so that while one
        group is on the next hop another computes here (ExecutorConfig)."""
        pacing = max(present, self._arrivals.pacing(self.clock(), late_s=self.config.batch_window_s))
        return max(1, math.ceil(pacing / self.config.paced_groups))

    def _group_incomplete(self, batch: list[_Job]) -> bool:
        groups = Counter(job.group for job in batch if job.group is not None)
        return any(count + self._group_ran.get(group, 0) < group[1] for group, count in groups.items())

    def _remember_groups(self, jobs: list[_Job]) -> None:
        for group, count in Counter(job.group for job in jobs if job.group is not None).items():
            self._group_ran[group] = self._group_ran.get(group, 0) + count
            self._group_ran.move_to_end(group)
        while len(self._group_ran) > _MAX_FAILED_SESSIONS:  # forget the oldest: a round's steps come together
            self._group_ran.popitem(last=False)

    def _take_batch(self, lane: _Lane, first: _Job, taken: list[_Job] | None = None) -> list[_Job]:
        """``first`` (and the jobs ``taken`` with it already) plus queued steps of other sessions on the same
        blocks on this lane (decode steps, or prefills) within ``max_batch`` steps and ``max_batch_tokens``
        tokens (a long prompt's chunk, and prefills riding on the decode lane: ``_chunk_tokens()``; whole prompts:
        ``_whole_tokens``); the rest of the queue keeps its order, and no step is taken past an earlier one of
        its own session."""
        if first.session_id is None:
            return [first]
        batch, kept = [first, *(taken or [])], []
        tokens = sum(job.tokens for job in batch)
        # the per-call token budget: a prefill lane's call with a long prompt's chunk is held to one chunk while
        # others decode (Sarathi's budget), or three sessions' 32-token chunks would run beside decode steps as
        # 96 tokens; whole short prompts share a call up to _whole_tokens (ExecutorConfig.busy_prompt_tokens)
        budget, chunk = self.config.max_batch_tokens, self._chunk_tokens()
        if lane is self._prefill:
            budget = min(budget, chunk if first.long_prefill else self._whole_tokens(chunk))
        # prefills riding on the decode lane (its only jobs of several tokens) share that same chunk's budget,
        # so a flood of short prompts cannot make the decode steps' calls long prefill calls
        riding = sum(job.tokens for job in batch if job.tokens > 1)
        # in the batch, or skipped: later steps of theirs must not overtake
        sessions = {job.session_id for job in batch}
        queued = []
        while not lane.queue.empty():
            job = lane.queue.get_nowait()
            if not job.future.cancelled():
                queued.append(job)
        paced = sum(job.paced for job in batch)
        paced_group = self._paced_group(paced + sum(job.paced for job in queued)) if first.paced else 0
        for job in queued:
            sid = job.session_id
            rides = job.tokens > 1 and lane is self._decode
            fits = len(batch) < self.config.max_batch and tokens + job.tokens <= budget
            fits &= not rides or riding + job.tokens <= chunk
            fits &= not job.long_prefill or tokens + job.tokens <= chunk  # a chunk's call stays one chunk
            fits &= (
                not (first.paced and job.paced) or paced < paced_group
            )  # the next group goes in the next call
            if sid is not None and sid not in sessions and job.blocks is first.blocks and fits:
                batch.append(job)
                tokens += job.tokens
                riding += job.tokens if rides else 0
                paced += job.paced
            else:
                kept.append(job)
            if sid is not None:
                sessions.add(sid)
        for job in kept:  # put back what we skipped, in order (the queue had room for them a moment ago)
            lane.queue.put_nowait(job)
        return batch

    async def _execute(self, loop: asyncio.AbstractEventLoop, lane: _Lane, jobs: list[_Job]) -> None:
        # Callers may have given up while the batch waited (for other steps, or for a call to end). Their jobs are
        # dropped here, with no await before ``started`` is set: a job marked started is one its caller's turn
        # waits for, and one not started has let its session's turn go already.
        jobs = [job for job in jobs if not job.future.cancelled()]
        if not jobs:
            return
        if jobs[0].call is not None:
            await self._call(loop, lane, jobs[0], jobs[0].call)
            return
        for job in jobs:
            job.started = True
        try:
            await self._forward(loop, lane, jobs)
        finally:
            for job in jobs:
                job.finished.set()

    async def _forward(self, loop: asyncio.AbstractEventLoop, lane: _Lane, jobs: list[_Job]) -> None:
        started = time.perf_counter()
        steps = [job.step for job in jobs if job.step is not None]
        blocks = jobs[0].blocks
        assert blocks is not None  # a step job always names its blocks
        try:
            if lane is self._decode:
                decoding = sum(job.tokens == 1 for job in jobs)
                if decoding:
                    self._decode_calls = (self._decode_calls[1], self.clock())
                    self._decode_rows = decoding
                outputs = await loop.run_in_executor(lane.thread, self._decode_forward, blocks, steps)
            else:
                # while others decode here: None, no turn; False, a shared one; True, alone
                alone = any(job.long_prefill for job in jobs) if self._decoding() else None
                device = bool(alone) and any(job.yields_to_device for job in jobs)
                outputs = await loop.run_in_executor(
                    lane.thread, self._prefill_forward, blocks, steps, alone, device
                )
        except Exception as e:
            if len(jobs) == 1:
                if not isinstance(e, SwarmError):
                    logger.exception("forward failed")
                _fail(jobs[0], e)
                return
            # One bad step must not fail its batch-mates: run each alone to find whose it was.
            logger.info("batched forward of %d steps failed (%s); retrying one by one", len(jobs), e)
            for job in jobs:
                await self._execute(loop, lane, [job])
            return
        compute_s = time.perf_counter() - started
        self._remember_groups(jobs)
        self.batches_run += 1
        self.steps_run += len(jobs)
        self.compute_s += compute_s
        onward = _onward_groups(jobs)
        for job, hidden in zip(jobs, outputs, strict=True):
            if not job.future.done():
                job.future.set_result(
                    StepResult(hidden, started - job.submitted, compute_s, onward.get(id(job)))
                )

    def _decode_forward(self, blocks: BlockRange, steps: list[Step]) -> list[torch.Tensor]:
        """``blocks.forward(steps)`` on the decode thread, marked as running for the prefill thread."""
        running = threading.Event()
        self._decode_call = running
        try:
            with self.decode_calls.running() if self.decode_calls else contextlib.nullcontext():
                return blocks.forward(steps)
        finally:
            running.set()

    def _prefill_forward(
        self, blocks: BlockRange, steps: list[Step], alone: bool | None, device: bool = False
    ) -> list[torch.Tensor]:
        """``blocks.forward(steps)`` on the prefill thread, giving way to decode steps between layers, and in
        this device's turn (``self.turns``) unless ``alone`` is None (nobody decodes here): alone for a long
        prefill's chunk, shared for short prefills. Short ones (spot-check windows) sharing their turns with each
        other matter: at 8 client processes, with spot-checks, every prefill call alone cost 5 % of the decode
        throughput (100.5 against 105.8 tok/s, alternated runs), while beside a long prompt's chunks they slowed
        decode steps as much as the chunks do (decode p99 84-86 against 67-71 ms). With ``device``, a long
        prompt's chunk waits for the decode calls of the device's other peers too (``_yield_to_device``)."""
        between_layers = self._yield_to_device if device else self._yield_to_decode
        if alone is None or self.turns is None:
            return blocks.forward(steps, between_layers)
        with self.turns.turn(alone):
            return blocks.forward(steps, between_layers)

    def _yield_to_decode(self) -> None:
        """Between two layers of a chunk, on the prefill thread: wait for the decode call running now, if any.

        A chunk's layers and a decode step share this process's GIL and the core's caches (on a GPU, the
        device's queue), so the decode step, the latency-bound one, goes first. Waiting for the call running now,
        never for the next, keeps a chunk going at least a layer per decode call under back-to-back ones."""
        self._decode_call.wait()

    def _yield_to_device(self) -> None:
        """``_yield_to_decode``, then (a chunk of a prompt longer than ``prefill_chunk_tokens``, while others
        decode here) the decode calls of the other peers on this device, which share its cores (``decode_calls``,
        at most ``device_decode_wait_s``). Shorter prefills wait only for this peer's: a chat prompt (37 tokens
        here) is cut into chunks while others decode, and when it waited for the whole device's decoding too,
        the first tokens of 8 generations one client started at once came so late that they reached 29.7-32.5
        against 48.1-59.5 tok/s (paired, 4 rounds); a spot-check's window is one call."""
        self._yield_to_decode()
        if self.decode_calls is not None:
            self.decode_calls.wait()

    async def _call(
        self, loop: asyncio.AbstractEventLoop, lane: _Lane, job: _Job, call: Callable[[], Any]
    ) -> None:
        try:
            result = await loop.run_in_executor(lane.thread, call)
        except SwarmError as e:
            _fail(job, e)
            return
        except Exception as e:
            logger.exception("executor call failed")
            _fail(job, e)
            return
        if not job.future.done():  # else its caller gave up while it ran
            job.future.set_result(result)


def _onward_groups(jobs: list[_Job]) -> dict[int, Group]:
    """The groups the decode steps of one forward call form at their next hops: (a fresh id, how many go to
    that hop), by id(job), for hops that more than one goes to. Only steps whose callers still wait count: the
    others are never sent on. A client's round is regrouped too: the next hop gets what this call computed."""
    going = [job for job in jobs if job.onward and job.tokens == 1 and not job.future.done()]
    counts = Counter(job.onward for job in going)
    if not any(count > 1 for count in counts.values()):
        return {}  # most calls: prefill chunks, or steps for different hops
    batch_id = secrets.token_hex(8)
    return {id(job): (batch_id, counts[job.onward]) for job in going if counts[job.onward] > 1}


def _fail(job: _Job, error: BaseException) -> None:
    if not job.future.done():
        job.future.set_exception(error)
