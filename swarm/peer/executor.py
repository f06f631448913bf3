"""The two threads per device that run torch, fed by bounded queues, batching concurrent steps.

The event loop never runs torch: the peer submits jobs and awaits their futures. A step names the BlockRange it
runs on (a peer serves one range, or two while it moves). Each thread serves its own lane: one-token (decode)
steps and plain calls on one, prefill chunks on the other. Prefill is compute-bound and decode latency-bound
(Sarathi, Splitwise), so a chunk waits between two of its layers for the decode call running beside it.

What each forward call runs, and what waits, is decided by the pure policy in swarm/peer/schedule.py: the runner
here tells it what arrived and what ran, asks it, and does the waiting and the device calls. In short: a lane
takes its oldest job and gathers queued steps of *other* sessions on the *same* BlockRange into one
``BlockRange.forward`` call within a budget of steps and tokens (continuous batching at step granularity); a
long prefill runs as chunks, small ones while other sessions decode here; a short prefill that comes while others
decode rides in the decode lane's next call as a few more rows of the same products (if no decode call comes, it
goes to the prefill thread: alone on the decode lane it would hold back the steps just after it); a batch of
decode steps waits a moment for the rest of its client's group and for lone sessions due by their pace. A full
queue is a CapacityError at once, not a backlog.

Where other peers share the device, ``SharedDevice`` (swarm/peer/turns.py) adds their turns, the prefill thread's
lower priority and waits for their decode calls; for a lone peer it is off and costs nothing per call.

Opening and closing sessions also go through the decode lane (``call``), never while a chunk runs. A decode call
does run beside a chunk on the same KV cache: the cache's lock guards its pool and block tables, and a session
with a step running is never evicted for the other lane (swarm.models.kv_cache). A session's own steps take turns,
whatever lane they run on. A call waits for a running chunk on its own, beside the lane, and the decode steps queued after it go on
meanwhile. A step whose cache blocks cannot be had (kv_cache.KVCache.prepare) is a CapacityError.

Steps of one session run in position order, whatever order they arrive in: a client pipelines a long prompt as
consecutive chunks sent without waiting (client/session.py), and two chunks may overtake each other on the way.
``forward`` holds a step whose position is past the session's cached length until the earlier steps have run;
if one of them fails here, the steps waiting behind it fail at once (SessionError) instead of at their deadline,
so the client's failover starts without delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from swarm.errors import CapacityError, SessionError, SwarmError
from swarm.models.blocks import BlockRange, Step
from swarm.models.threads import name_os_thread
from swarm.peer.config import ExecutorConfig
from swarm.peer.schedule import Group, Lane, Schedule, Turn
from swarm.peer.turns import SharedDevice, lower_thread_priority

logger = logging.getLogger(__name__)

# the lanes' torch threads as the OS names them (swarm.models.threads: CPU per thread tells the lanes apart)
DECODE_THREAD = "swarm-decode"
PREFILL_THREAD = "swarm-prefill"
_T = TypeVar("_T")
__all__ = [
    "DECODE_THREAD",
    "PREFILL_THREAD",
    "Executor",
    "ExecutorConfig",
    "Group",
    "SessionSteps",
    "StepResult",
]


@dataclass(eq=False)
class SessionSteps:
    """The executor's bookkeeping of one session, held by the session itself (swarm/peer/session.py), so it
    goes when the session closes."""

    turn: asyncio.Lock = field(default_factory=asyncio.Lock)  # one job of the session at a time, both lanes
    waiting: int = 0  # jobs waiting for the turn or holding it
    failed: int | None = None  # the position of its last step that failed here


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
    # a lone decode step at its route's first hop: its batch may wait for sessions due here
    paced: bool = False
    long_prefill: bool = False  # a chunk of a prefill cut into chunks (it takes this device's turns)
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

    name: Lane
    queue: asyncio.Queue[_Job]
    thread: ThreadPoolExecutor


class Executor:
    """Runs torch work on two worker threads (decode, prefill). Start ``run()`` in the owner's TaskGroup first."""

    def __init__(
        self,
        config: ExecutorConfig | None = None,
        name: str = "torch",
        clock: Callable[[], float] = time.monotonic,
        shared: SharedDevice | None = None,
    ) -> None:
        self.config = config or ExecutorConfig()
        self.schedule = Schedule(self.config)  # what each forward call runs (swarm/peer/schedule.py)
        self.clock = clock  # the policy's clock: when steps arrive, who is due, whether others decode
        self.shared = shared  # what peers sharing this device do for each other, if any (swarm/peer/turns.py)
        self._prefill_lowered = False  # the prefill thread runs at the shared device's lower priority
        self._decode = _Lane(
            "decode",
            asyncio.Queue(self.config.queue_jobs),
            ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=name, initializer=name_os_thread, initargs=(DECODE_THREAD,)
            ),
        )
        self._prefill = _Lane(
            "prefill",
            asyncio.Queue(self.config.queue_jobs),
            ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix=f"{name}-prefill",
                initializer=name_os_thread,
                initargs=(PREFILL_THREAD,),
            ),
        )
        # held while a prefill chunk or a plain call runs: calls (open, close, moves) change caches and ranges
        self._calls_apart = asyncio.Lock()
        # calls the decode lane took, waiting for their turn. Unbounded, though out of the lane's bounded queue: every
        # open holds a session slot first (SessionConfig.max_open, per-remote caps), a hand-over one per session
        self._calls: asyncio.Queue[_Job] = asyncio.Queue()
        # the bookkeeping of sessions stepped by callers without a SessionSteps of their own (tests, tools), kept
        # while one of their steps is here: session -> (its steps, the forward calls holding it)
        self._transient: dict[str, tuple[SessionSteps, int]] = {}
        self.batches_run = 0
        self.steps_run = 0
        # seconds spent in forward calls, both lanes (the "computing" share of the log line)
        self.compute_s = 0.0
        self.batch_waits = 0  # how many batches waited for steps they expected (for tests)
        self._stepped = asyncio.Event()  # set after every forward job: steps waiting for their turn re-check
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
        """Whether prefill ``job`` joins the decode lane's next forward call (Schedule.rides_along), if its rows
        leave that call's products in the form they take without it (a 4-bit decode call that took a 16-token
        window would go through F.linear instead, at every hop)."""
        if job.step is None or job.blocks is None:
            return False
        if not self.schedule.rides_along(job.tokens, job.long_prefill, self.clock(), job.session_id):
            return False
        return job.blocks.same_form(self.schedule.decode_rows, job.tokens)

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
        self,
        blocks: BlockRange,
        step: Step,
        group: Group | None = None,
        onward: str = "",
        paced: bool = True,
        session: SessionSteps | None = None,
    ) -> StepResult:
        """Run one step on ``blocks`` (possibly batched with others) and return its output with its timings.

        ``onward`` names the next hop of a step that goes on: the decode steps of one forward call bound for the
        same hop get one ``onward_group``, and the hop waits for all of them to batch them again (they reach it
        one message each, ~1 ms apart). Lone sessions are waited for by their pace (``batch_window_s``) only
        where they come lone, at the first hop (``paced``; False for a step another hop sent): a later hop that
        waited for a session due by its pace could be waiting for one held at another hop, itself waiting.

        A session's step waits for the session's earlier steps first (see the module doc). A longer prefill
        runs as consecutive chunks, each its own job (Schedule.chunk_tokens): other sessions' steps queued
        meanwhile run between two chunks, or with one, instead of waiting for the whole prompt. Each chunk extends
        the session's cache from where the last one ended, so the output is the whole step's.

        ``session`` is the session's own bookkeeping (its turn, its failed step), which a Peer's sessions hold;
        without it, one is kept here while the session's steps are."""
        sid = step.session_id
        if sid is None:
            return await self._forward_job(
                _Job(None, step, blocks, asyncio.get_running_loop().create_future()), None
            )
        transient = session is None  # a caller outside a Peer: this session's bookkeeping is kept here
        if session is None:
            session, holders = self._transient.get(sid) or (SessionSteps(), 0)
            self._transient[sid] = (session, holders + 1)
        try:
            return await self._forward_step(blocks, step, group, onward, paced, session)
        finally:
            if transient:
                self._let_go(sid)

    def _let_go(self, sid: str) -> None:
        session, holders = self._transient[sid]
        if holders == 1:
            del self._transient[sid]
        else:
            self._transient[sid] = (session, holders - 1)

    async def _forward_step(
        self,
        blocks: BlockRange,
        step: Step,
        group: Group | None,
        onward: str,
        paced: bool,
        session: SessionSteps,
    ) -> StepResult:
        sid = step.session_id
        assert sid is not None
        tokens = step.hidden.shape[0]
        if tokens != 1:
            group = None  # only decode steps wait for each other
        # a client's lone session at its first hop: nothing else lines its steps up with others'
        paced = paced and group is None and tokens == 1
        self.schedule.arrived(sid, tokens, paced, self.clock())
        await self._in_order(blocks, step, session)
        if session.failed is not None and session.failed >= step.position:
            session.failed = None  # the failed step is being replayed: the steps after it may wait again
        try:
            job = _Job(None, step, blocks, asyncio.get_running_loop().create_future(), group, onward, paced)
            result = await self._forward_chunks(job, session)
        except BaseException:
            session.failed = step.position
            self._stepped.set()
            raise
        return result

    async def _in_order(self, blocks: BlockRange, step: Step, session: SessionSteps) -> None:
        """Return once the session's cache on the step's layers reaches ``step.position``: every earlier step
        has run, or is running its last layer (then this one waits for the session's turn, see ``_turn``).
        SessionError when an earlier step of the session failed here; the caller's deadline bounds
        the wait for one that has not arrived yet."""
        sid = step.session_id
        assert sid is not None
        while True:
            blocks.check_not_evicted(sid, step.position)  # its earlier steps' cache is gone: replay
            length = min(blocks.session_length(sid, layer) for layer in range(step.start, step.end))
            if length >= step.position:
                return
            failed = session.failed
            if failed is not None and failed < step.position:
                raise SessionError(
                    f"session {sid[:16]}: the step at position {failed} failed here, so the step at "
                    f"{step.position} cannot run: replay from it"
                )
            self._stepped.clear()
            await self._stepped.wait()

    async def _forward_chunks(self, job: _Job, session: SessionSteps) -> StepResult:
        """``job``'s step as consecutive jobs of at most ``Schedule.chunk_tokens`` tokens each, chosen as each is
        queued (a chunk is a prefill: no group, not paced, not sent on as a group)."""
        step, blocks = job.step, job.blocks
        assert step is not None and blocks is not None
        tokens = step.hidden.shape[0]
        if self.schedule.runs_whole(tokens, self.clock()):
            return await self._forward_job(job, session)
        parts: list[torch.Tensor] = []
        queue_s = compute_s = 0.0
        offset = 0
        long = self.schedule.is_long(tokens)
        while offset < tokens:
            hidden = step.hidden[offset : offset + self.schedule.chunk_tokens(self.clock())]  # [<=chunk, H]
            chunk = Step(step.session_id, hidden, step.start, step.end, step.position + offset)
            future = asyncio.get_running_loop().create_future()
            chunk_job = _Job(None, chunk, blocks, future, long_prefill=True, yields_to_device=long)
            part = await self._forward_job(chunk_job, session)
            parts.append(part.hidden)
            offset += hidden.shape[0]
            queue_s, compute_s = queue_s + part.queue_s, compute_s + part.compute_s
        return StepResult(torch.cat(parts), queue_s, compute_s)

    async def _forward_job(self, job: _Job, session: SessionSteps | None) -> StepResult:
        # its queue time starts here, after the waits for its session's order
        job.submitted = time.perf_counter()
        async with self._turn(session):
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
    async def _turn(self, session: SessionSteps | None) -> AsyncIterator[None]:
        """One job of a session at a time, across both lanes: a replayed prefill must not rewrite a cache that
        a stale decode step of the same session is appending to on the other thread."""
        if session is None:
            yield
            return
        session.waiting += 1
        try:
            async with session.turn:
                yield
        finally:
            session.waiting -= 1

    def forget(self, session_id: str) -> None:
        """Session ``session_id`` closed here: no batch waits for its steps any more."""
        self.schedule.forget(session_id)

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
                await self._execute(loop, lane, batch)
            self._stepped.set()

    async def _serve_calls(self) -> None:
        """Run the calls the decode lane took, in order, on its thread, each while no chunk runs."""
        loop = asyncio.get_running_loop()
        while True:
            job = await self._calls.get()
            async with self._calls_apart:
                await self._execute(loop, self._decode, [job])
            self._stepped.set()  # a call may extend a cache (a hand-over's chunk): steps waiting for it look again

    async def _wait_for_due(self, lane: _Lane, batch: list[_Job]) -> list[_Job]:
        """A batch of decode steps, grown by the queued steps it expects (Schedule.wait_s), taking whatever else
        arrives meanwhile. Short prefills riding along first wait for a decode step to join
        (Schedule.riders_wait_s), then go to the prefill lane. The waits are bounded in real time, so they end
        even under a test's frozen clock."""
        if lane is self._prefill or any(job.step is None for job in batch):
            return batch  # prefill chunks and plain calls never wait
        started = time.monotonic()
        while not any(job.tokens == 1 for job in batch):  # only short prefills riding along
            left = self.schedule.riders_wait_s(time.monotonic() - started)
            if left <= 0:
                return self._off_the_decode_lane(batch)  # nobody decodes after all
            await self._next_arrival(left)
            batch = self._take_batch(lane, batch[0], batch[1:])
        started = time.monotonic()
        waited = False
        while (left := self.schedule.wait_s(batch, time.monotonic() - started, self.clock())) > 0:
            if not waited:
                self.batch_waits += 1
                waited = True
            await self._next_arrival(left)
            batch = self._take_batch(lane, batch[0], batch[1:])
        return batch

    async def _next_arrival(self, within_s: float) -> None:
        """Return once a job is queued, or after ``within_s``."""
        self._arrived.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within_s):
                await self._arrived.wait()

    def _take_batch(self, lane: _Lane, first: _Job, taken: list[_Job] | None = None) -> list[_Job]:
        """``first`` (and the jobs ``taken`` with it already) plus the queued jobs the policy adds
        (Schedule.take); the rest go back to the queue in their order."""
        if first.session_id is None:
            return [first]
        queued = []
        while not lane.queue.empty():
            job = lane.queue.get_nowait()
            if not job.future.cancelled():
                queued.append(job)
        batch, kept = self.schedule.take(first, taken or [], queued, lane.name, self.clock())
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
                self.schedule.decode_call(sum(job.tokens == 1 for job in jobs), self.clock())
                outputs = await loop.run_in_executor(lane.thread, self._decode_forward, blocks, steps)
            else:
                turn, device = self.schedule.prefill_turn(jobs, self.clock())
                outputs = await loop.run_in_executor(
                    lane.thread, self._prefill_forward, blocks, steps, turn, device
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
        self.schedule.ran(jobs, self.clock())
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
        """``blocks.forward(steps)`` on the decode thread, marked as running for the prefill threads: this
        peer's always, the device's other peers' while it is shared."""
        running = threading.Event()
        self._decode_call = running
        shared = self.shared
        try:
            if shared is None or not shared.active or shared.decode_calls is None:
                return blocks.forward(steps)
            with shared.decode_calls.running():
                return blocks.forward(steps)
        finally:
            running.set()

    def _prefill_forward(
        self, blocks: BlockRange, steps: list[Step], turn: Turn, device: bool = False
    ) -> list[torch.Tensor]:
        """``blocks.forward(steps)`` on the prefill thread, giving way to this peer's decode call between layers.
        While the device is shared: at the prefill thread's lower priority, in the device's turn unless
        ``turn`` is None (nobody decodes here), and with ``device``, waiting for the other peers' decode calls
        too (``_yield_to_device``)."""
        shared = self.shared
        if shared is None or not shared.active:
            return blocks.forward(steps, self._yield_to_decode)
        if not self._prefill_lowered:
            lower_thread_priority()
            self._prefill_lowered = True
        between_layers = self._yield_to_device if device else self._yield_to_decode
        if turn is None or shared.turns is None:
            return blocks.forward(steps, between_layers)
        with shared.turns.turn(turn):
            return blocks.forward(steps, between_layers)

    def _yield_to_decode(self) -> None:
        """Between two layers of a chunk, on the prefill thread: wait for the decode call running now, if any.

        A chunk's layers and a decode step share this process's GIL and the core's caches (on a GPU, the
        device's queue), so the decode step, the latency-bound one, goes first. Waiting for the call running now,
        never for the next, keeps a chunk going at least a layer per decode call under back-to-back ones."""
        self._decode_call.wait()

    def _yield_to_device(self) -> None:
        """``_yield_to_decode``, then (a chunk of a prompt longer than ``prefill_chunk_tokens``, while others
        decode here) the decode calls of the other peers on this device, which share its cores. Shorter
        prefills wait only for this peer's: a chat prompt is cut into chunks while others decode, and its first
        token would come late if it waited for the whole device's decoding too."""
        self._yield_to_decode()
        shared = self.shared
        if shared is not None and shared.decode_calls is not None:
            shared.decode_calls.wait()

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
