"""Batching of the client's own head work across the sessions one client runs at once.

An AsyncSwarmClient running many generations (asyncio.gather over `generate_ids`, the web face's concurrent
chats) would otherwise run the final norm + LM head once per session per token, each a [1, H] x [H, V] product
on the event loop: for SmolLM2-135M that is 28M multiply-adds, as much as a fifth of the whole model, and the
loop can read no reply while it runs. HeadBatcher collects the last hidden states sessions hand in, and runs
them as one [N, H] x [H, V] call on its own thread: the requests of one event-loop tick go together, and while
a call runs the next round gathers (continuous batching, like the peers' executor does for decode steps).
A round also waits a moment for the sessions whose decode step is still in the swarm, and hands its sessions a
`Round`: those that go on send their next steps together under its id and their number, and the peers batch
them (see HeadBatcher and Round).

Greedy outputs stay those of the unbatched head: each row of a batched product is the same dot products.

    batcher = HeadBatcher(head)
    logits = await batcher.logits(hidden)     # hidden [H] -> logits [V], batched with whoever asks alongside

`BatchedSession` is the InferenceSession whose `forward` goes through a batcher; the session itself is left
untouched except that it hands back its last hidden state instead of running the head itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from client.liveness import StepWatch
from client.retry import RetryPolicy
from client.session import NO_BATCH, Chain, Head, InferenceSession, RouteSource
from client.spot import SpotChecker
from swarm.models.threads import name_os_thread

logger = logging.getLogger(__name__)

HEAD_THREAD = "swarm-head"  # the head's thread as the OS names it (swarm.models.threads)


class Round:
    """The sessions of one head round deciding, each after sampling, whether they send their next decode step.

    Each member either joins (its next forward is a decode step) or leaves (its generation ended, or its next
    forward is longer). The steps of those that join go out once every member has decided, or ``settle_s``
    after the first joined, and tell the peers how many were sent: a peer waits for a group's missing steps (up
    to its group window, at every hop), so a member that ended after its mates had sent, counted in their
    group, cost them that window at every hop. A member deciding after the round settled sends alone.
    Members decide within one pass of the event loop when nothing else holds them up; a caller that does more
    between tokens (the web face writing to its HTTP client) may make its mates wait, ``settle_s`` at most.
    Members on different routes are told apart (a group per route), so a peer never waits for steps that go to
    another; a peer that batches fewer steps at once than a group has counts those that ran already.
    """

    def __init__(self, members: Iterable[object]) -> None:
        self.id = secrets.token_hex(8)
        self._undecided = set(members)
        self._joined: Counter[Hashable] = Counter()  # route -> members that joined to send along it
        self._routes: dict[Hashable, int] = {}  # route -> its number in this round's group ids
        self._settled = asyncio.Event()
        if len(self._undecided) < 2:
            self._settled.set()  # nobody to go with

    def leave(self, member: object) -> None:
        """``member`` will not send a decode step with this round."""
        self._undecided.discard(member)
        if not self._undecided:
            self._settled.set()

    async def join(self, member: object, settle_s: float, route: Hashable = ()) -> tuple[str, int]:
        """(id, size) to send ``member``'s next decode step under, once the round settled; NO_BATCH alone.
        Members on different routes form a group per route: a peer counts only the steps that come to it."""
        if self._settled.is_set() or member not in self._undecided:
            return NO_BATCH
        self._undecided.discard(member)
        self._joined[route] += 1
        number = self._routes.setdefault(route, len(self._routes))
        try:
            if self._undecided:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(settle_s):
                        await self._settled.wait()
        except asyncio.CancelledError:
            if not self._settled.is_set():
                self._joined[route] -= 1  # it will not send: the others must not wait for it
            raise
        self._settled.set()  # whoever is still undecided goes alone
        size = self._joined[route]
        group_id = f"{self.id}/{number}" if number else self.id  # the first route's group: the round's own id
        return (group_id, size) if size > 1 else NO_BATCH


Rounded = tuple[torch.Tensor, Round]  # logits [V], and the round that computed them


class _Lane:
    """One group of sessions with rounds of its own (see HeadBatcher)."""

    def __init__(self) -> None:
        # (hidden [H], its future, its member, whether its argmax is all it needs)
        self.pending: list[tuple[torch.Tensor, asyncio.Future[Rounded], object, bool]] = []
        self.running = False  # a round of this lane is waiting or computing
        self.stepping: set[object] = (
            set()
        )  # sessions with a decode step in the swarm: the round waits for them
        self.late: set[object] = set()  # made a round wait in vain: not waited for until they ask
        self.timer: asyncio.TimerHandle | None = None  # a round waiting for the sessions stepping

    def missing(self) -> set[object]:
        return self.stepping - self.late


class HeadBatcher:
    """Runs `head.logits` for the sessions of a lane that ask in the same round as one call, on one thread.

    A round waits (at most ``round_wait_s``) for its lane's sessions whose decode step is in the swarm now (see
    `sent`): their replies are on the way. The sessions of one round then send their next steps together, the
    peers run them as one forward call per hop (StepRequest.batch_id), and the replies come back together for
    the next round. Without the wait, a round would begin with the first reply and split the group, and the
    peers' batches with it: fewer tokens per forward call, which is what makes a decode step cheaper per token.
    Sessions not stepping (prefilling, sampling, waiting on their reader) are not waited for, and one that made
    a round wait in vain is not waited for again until its reply arrives.

    Sessions are dealt round-robin into ``lanes`` groups with rounds of their own: while one group's steps are
    on one peer, another's can be on the next one or here, so peers on machines of their own work at the same
    time instead of taking turns (ClientConfig.batch_lanes)."""

    def __init__(
        self,
        head: Head,
        max_batch: int = 64,
        round_wait_s: float = 0.25,
        lanes: int = 1,
        settle_s: float = 0.02,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if round_wait_s < 0:
            raise ValueError(f"round_wait_s must be >= 0, got {round_wait_s}")
        if lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {lanes}")
        if settle_s < 0:
            raise ValueError(f"settle_s must be >= 0, got {settle_s}")
        self.head = head
        self.max_batch = max_batch
        self.round_wait_s = round_wait_s
        self.settle_s = settle_s  # how long a round's decode steps wait for its members to decide (Round)
        self.calls = 0  # batched head calls run
        self.rows = 0  # hidden states they covered; rows / calls is the mean batch size
        self.largest = 0  # largest batch seen
        self.waits_in_vain = 0  # rounds that waited round_wait_s and started without someone
        self._lanes = [_Lane() for _ in range(lanes)]
        self._dealt = 0  # lanes handed out so far
        self._thread = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="client-head",
            initializer=name_os_thread,
            initargs=(HEAD_THREAD,),
        )

    def lane(self) -> int:
        """The lane of a new session (round-robin)."""
        self._dealt += 1
        return (self._dealt - 1) % len(self._lanes)

    def sent(self, member: object, lane: int = 0) -> None:
        """``member`` sent a decode step: the next round of its lane may wait for its reply."""
        self._lanes[lane].stepping.add(member)

    def leave(self, member: object, lane: int = 0) -> None:
        """``member`` will not ask (its step failed, or it ended): rounds stop waiting for it."""
        state = self._lanes[lane]
        state.stepping.discard(member)
        state.late.discard(member)
        self._start_if_complete(state)

    async def logits(
        self, hidden: torch.Tensor, member: object = None, lane: int = 0, argmax_only: bool = False
    ) -> torch.Tensor:
        """hidden [H] (the last layer's output for one position) -> logits [V] in float32, for ``member``.
        ``argmax_only``: only the argmax need be exact (Head.logits); a round screens when all its rows say so."""
        return (await self.logits_in_round(hidden, member, lane, argmax_only))[0]

    async def logits_in_round(
        self, hidden: torch.Tensor, member: object = None, lane: int = 0, argmax_only: bool = False
    ) -> Rounded:
        """`logits`, and the round that computed them: the sessions of one round send their next steps together,
        and tell the peers so (StepRequest.batch_id, see Round)."""
        if hidden.ndim != 1:
            raise ValueError(f"hidden must be 1-D [H], got shape {tuple(hidden.shape)}")
        state = self._lanes[lane]
        future: asyncio.Future[Rounded] = asyncio.get_running_loop().create_future()
        state.pending.append((hidden, future, member, argmax_only))
        state.stepping.discard(member)
        state.late.discard(member)
        if not state.running:
            state.running = True
            self._schedule(state)
        else:
            self._start_if_complete(state)
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result()[1].leave(
                    member
                )  # cancelled as its logits came: its round must not wait for it
            raise

    def _start_if_complete(self, state: _Lane) -> None:
        if state.timer is not None and not state.missing():
            state.timer.cancel()
            state.timer = None
            asyncio.get_running_loop().call_soon(self._start_round, state)

    def _schedule(self, state: _Lane) -> None:
        """Start the lane's next round after this tick (so sessions stepping alongside join in), or once every
        session of it stepping has its reply here, or when ``round_wait_s`` has passed."""
        loop = asyncio.get_running_loop()
        if self.round_wait_s > 0 and state.missing():
            state.timer = loop.call_later(self.round_wait_s, self._waited_in_vain, state)
        else:
            loop.call_soon(self._start_round, state)

    def _waited_in_vain(self, state: _Lane) -> None:
        self.waits_in_vain += 1
        state.late |= state.missing()
        self._start_round(state)

    def _start_round(self, state: _Lane) -> None:
        state.timer = None
        batch = [entry for entry in state.pending[: self.max_batch] if not entry[1].cancelled()]
        state.pending = state.pending[self.max_batch :]
        if not batch:
            self._next_round(state)
            return
        loop = asyncio.get_running_loop()
        argmax_only = all(entry[3] for entry in batch)
        done = loop.run_in_executor(self._thread, self._run, [entry[0] for entry in batch], argmax_only)
        done.add_done_callback(lambda outcome: self._finish(state, batch, outcome))

    def _run(self, hiddens: list[torch.Tensor], argmax_only: bool) -> list[torch.Tensor | Exception]:
        """One [N, H] -> [N, V] call; if it fails, each row alone, so one bad row fails only its own session."""
        try:
            return list(self.head.logits(torch.stack(hiddens), argmax_only).unbind(0))
        except Exception as error:
            if len(hiddens) == 1:
                return [error]
        return [self._alone(h, argmax_only) for h in hiddens]

    def _alone(self, hidden: torch.Tensor, argmax_only: bool) -> torch.Tensor | Exception:
        try:
            return self.head.logits(hidden[None], argmax_only)[0]
        except Exception as error:
            return error

    def _finish(
        self,
        state: _Lane,
        batch: list[tuple[torch.Tensor, asyncio.Future[Rounded], object, bool]],
        outcome: asyncio.Future[list[torch.Tensor | Exception]],
    ) -> None:
        if outcome.cancelled():  # the thread was shut down under us (client closing)
            results: list[torch.Tensor | BaseException] = [asyncio.CancelledError()] * len(batch)
        elif outcome.exception() is not None:
            results = [outcome.exception()] * len(batch)  # type: ignore[list-item]
        else:
            results = list(outcome.result())
            self.calls += 1
            self.rows += len(batch)
            self.largest = max(self.largest, len(batch))
        members = [
            member
            for (_, future, member, _), result in zip(batch, results, strict=True)
            if member is not None and not future.done() and not isinstance(result, BaseException)
        ]
        round_ = Round(members)
        for (_, future, _, _), result in zip(batch, results, strict=True):
            if future.done():  # its session was cancelled meanwhile
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result((result, round_))
        self._next_round(state)

    def _next_round(self, state: _Lane) -> None:
        if state.pending:
            self._schedule(state)
        else:
            state.running = False

    def close(self) -> None:
        for state in self._lanes:
            if state.timer is not None:
                state.timer.cancel()
        self._thread.shutdown(wait=False, cancel_futures=True)


class _LastHidden:
    """A Head whose `logits` hands the hidden states back unchanged: InferenceSession.forward then returns
    the last hidden state [H], and BatchedSession runs the real head on it through the batcher."""

    def __init__(self, head: Head) -> None:
        self.head = head

    @property
    def hidden_size(self) -> int:
        return self.head.hidden_size

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.embed(ids)

    def logits(self, hidden: torch.Tensor, argmax_only: bool = False) -> torch.Tensor:
        return hidden


class BatchedSession(InferenceSession):
    """An InferenceSession whose norm + LM head run batched with the client's other sessions."""

    def __init__(
        self,
        batcher: HeadBatcher,
        chain: Chain,
        routes: RouteSource,
        policy: RetryPolicy,
        step_timeout_s: float,
        max_length_tokens: int,
        checker: SpotChecker | None = None,
        watch: StepWatch | None = None,
        prefill_chunk_tokens: int = 0,
    ) -> None:
        head = _LastHidden(batcher.head)
        super().__init__(
            chain,
            routes,
            head,
            policy,
            step_timeout_s,
            max_length_tokens,
            checker,
            watch,
            prefill_chunk_tokens,
        )
        self.batcher = batcher
        self.full_head = batcher.head  # a verified step's head runs on its own, outside the rounds
        self.lane = batcher.lane()  # the group of sessions whose rounds we share
        self.round: Round | None = None  # the round of our last logits: our next decode step goes with it

    async def forward(self, new_ids: Sequence[int], argmax_only: bool = False) -> torch.Tensor:
        """Send `new_ids` through the swarm and return the logits[V] after the last of them (InferenceSession)."""
        round_, self.round, self.batch = self.round, None, NO_BATCH
        decode = len(new_ids) == 1
        try:
            self._check_forward(new_ids)  # first: a step that cannot go must not be counted in its round
        except BaseException:
            if round_ is not None:
                round_.leave(self)
            raise
        if decode:  # the batcher's next round may wait for it
            self.batcher.sent(self, self.lane)
        try:
            await self._move_if_pending()  # to the decode route before joining a round on the route
            if round_ is not None and decode:
                self.batch = await round_.join(self, self.batcher.settle_s, self.stages)
            elif round_ is not None:
                round_.leave(self)
            hidden = await super().forward(new_ids)  # [H]: the head above hands it back as is
        except BaseException:
            self.batch = NO_BATCH  # a later step must not go under this round's id
            self.batcher.leave(self, self.lane)
            raise
        logits, self.round = await self.batcher.logits_in_round(hidden, self, self.lane, argmax_only)
        return logits

    async def forward_all(self, new_ids: Sequence[int], argmax_only: bool = False) -> torch.Tensor:
        """logits[T, V] after each of `new_ids` (InferenceSession); like a prefill, the step leaves its round."""
        round_, self.round, self.batch = self.round, None, NO_BATCH
        if round_ is not None:
            round_.leave(self)
        return await super().forward_all(new_ids, argmax_only)

    async def close(self) -> None:
        if self.round is not None:  # our generation ended: our round's next steps go without us
            self.round.leave(self)
            self.round = None
        await super().close()
