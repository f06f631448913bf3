"""The executor's policy: what the next forward call runs, and what waits. Pure: no threads, no event loop, no
clock of its own (every decision takes ``now`` from the caller), so each rule can be tested on plain values.

The runner (swarm/peer/executor.py) owns the threads, the queues and the device calls; it tells the policy what
arrived and what ran, and asks it:

- ``rides_along``: does a short prefill join the decode lane's next forward call (it costs a few more rows of the
  products the decode steps read anyway) rather than a call of its own on the prefill thread?
- ``chunk_tokens`` / ``runs_whole``: how a prefill is cut. Small chunks while other sessions decode here (a chunk
  holds its session, the peer's calls, and on a GPU the decode kernels queued behind it), big ones otherwise.
- ``take``: given the first job of a lane and what is queued behind it, which jobs go into one forward call,
  within ``max_batch`` steps and ``max_batch_tokens`` tokens, one step per session, on the same block range,
  never a session's step ahead of an earlier one of its own; prefills riding on the decode lane share one busy
  chunk's tokens, and a long prompt's chunk keeps its call to one chunk's tokens.
- ``wait_s``: how long a batch of decode steps still waits for the steps it expects: the rest of a client's
  group (``group_window_s``), and lone sessions due by their pace at a route's first hop (``batch_window_s``,
  in ``paced_groups`` groups so that one computes here while the other is on the next hop).
- ``prefill_turn``: whether a prefill call takes its device's turn (swarm/peer/turns.py), alone or shared.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Literal, Protocol, TypeVar

from swarm.peer.config import ExecutorConfig

ARRIVALS_HORIZON_S = 5.0  # a session whose decode steps stopped this long ago is forgotten (Arrivals)
GROUPS_HORIZON_S = 5.0  # a client's group not seen for this long has ended (its steps come within a window)
Group = tuple[str, int]  # (key, size): a client's decode steps of one round (StepRequest.batch_id/batch_size)
Lane = Literal["decode", "prefill"]
# whether a prefill call takes the device's turn: None, no turn (nobody decodes here); False, shared; True, alone
Turn = bool | None


class Queued(Protocol):
    """What the policy reads of a queued job (the runner's jobs have these, and so do the tests' records)."""

    @property
    def session_id(self) -> str | None: ...  # None: a plain call, or a step outside any session

    @property
    def tokens(self) -> int: ...  # rows of its step (1: a decode step; 0: a plain call)

    @property
    def blocks(self) -> object: ...  # the block range it runs on (steps batch only on the same one)

    @property
    def group(self) -> Group | None: ...  # the client's decode steps sent together with it

    @property
    def paced(self) -> bool: ...  # a lone decode step at its route's first hop

    @property
    def long_prefill(self) -> bool: ...  # a chunk of a prefill cut into chunks

    @property
    def yields_to_device(self) -> bool: ...  # a chunk of a prompt longer than one idle chunk


J = TypeVar("J", bound=Queued)


class Arrivals:
    """When each session's decode steps came, to tell which sessions are due soon."""

    def __init__(self) -> None:
        # session -> (its last decode step's arrival, the time since the one before, or inf); oldest first
        self._seen: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def note(self, session_id: str, now: float) -> None:
        last, _ = self._seen.pop(session_id, (None, math.inf))
        period = now - last if last is not None and now - last < ARRIVALS_HORIZON_S else math.inf
        self._seen[session_id] = (now, period)
        while self._seen and next(iter(self._seen.values()))[0] < now - ARRIVALS_HORIZON_S:  # gone quiet
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


class Schedule:
    """The policy of one executor, with what it has seen so far (when decode steps came, what ran)."""

    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
        self.last_decode_s = -math.inf  # when a one-token step of a session last arrived
        # the two latest sessions to send one here, each with when: a short step waits to ride along only for
        # another session's decode step (a client verifying drafted tokens sends no decode step meanwhile)
        self.last_decoders: tuple[tuple[str, float], ...] = ()
        # when the decode lane's last two forward calls with a decode step began: their period (ride_wait_s)
        self.decode_calls = (-math.inf, -math.inf)
        self.decode_rows = 1  # how many decode steps the decode lane's last such call ran
        self.arrivals = Arrivals()  # lone sessions' decode steps (batch_window_s)
        # group -> (its steps that ran here already, when last): a group bigger than max_batch runs in parts,
        # and the later parts must not wait for steps that went with an earlier one
        self._group_ran: OrderedDict[Group, tuple[int, float]] = OrderedDict()

    # ------------------------------------------------------------------ what the runner tells it

    def arrived(self, session_id: str, tokens: int, paced: bool, now: float) -> None:
        """A step of ``session_id`` came (before it waits for its session's order)."""
        if tokens == 1:
            self.last_decode_s = now
            others = tuple(seen for seen in self.last_decoders if seen[0] != session_id)
            self.last_decoders = ((session_id, now), *others[:1])
            if paced:
                self.arrivals.note(session_id, now)

    def decode_call(self, rows: int, now: float) -> None:
        """A decode-lane forward call with ``rows`` decode steps begins."""
        if rows:
            self.decode_calls = (self.decode_calls[1], now)
            self.decode_rows = rows

    def ran(self, jobs: Sequence[Queued], now: float) -> None:
        """``jobs`` ran as one forward call: their groups' later parts no longer wait for them."""
        for group, count in Counter(job.group for job in jobs if job.group is not None).items():
            ran, _ = self._group_ran.pop(group, (0, now))
            self._group_ran[group] = (ran + count, now)
        while self._group_ran and next(iter(self._group_ran.values()))[1] < now - GROUPS_HORIZON_S:
            self._group_ran.popitem(last=False)

    def forget(self, session_id: str) -> None:
        """Session ``session_id`` closed: no batch waits for it any more."""
        self.arrivals.forget(session_id)

    @property
    def groups_remembered(self) -> int:
        return len(self._group_ran)

    # ------------------------------------------------------------------ prefills

    def decoding(self, now: float) -> bool:
        """Whether sessions decode here now (a one-token step within ``decode_recent_s``)."""
        return now - self.last_decode_s < self.config.decode_recent_s

    def chunk_tokens(self, now: float) -> int:
        """The size of a prefill's next chunk: ``busy_chunk_tokens`` while others decode, else
        ``prefill_chunk_tokens``."""
        if self.decoding(now):
            return min(self.config.busy_chunk_tokens, self.config.prefill_chunk_tokens)
        return self.config.prefill_chunk_tokens

    def whole_tokens(self, now: float) -> int:
        """The longest prompt that runs whole: one chunk, or while others decode a short prompt
        (``busy_prompt_tokens``; a longer one goes in busy chunks)."""
        busy_prompt = min(self.config.busy_prompt_tokens, self.config.prefill_chunk_tokens)
        return max(self.chunk_tokens(now), busy_prompt)

    def runs_whole(self, tokens: int, now: float) -> bool:
        return tokens <= self.whole_tokens(now)

    def is_long(self, tokens: int) -> bool:
        """A prompt longer than one idle chunk (not one cut only because others decode): its chunks wait for
        the device's decode calls too (swarm/peer/turns.py)."""
        return tokens > self.config.prefill_chunk_tokens

    def ride_wait_s(self) -> float:
        """How long a prefill riding along waits for a decode call: the decode calls' last period here plus
        ``batch_window_s`` (just the window before two calls), ``ride_wait_s`` at most."""
        previous, last = self.decode_calls
        period = last - previous if previous > -math.inf else 0.0
        return min(self.config.ride_wait_s, period + self.config.batch_window_s)

    def rides_along(self, tokens: int, long_prefill: bool, now: float, session_id: str | None = None) -> bool:
        """Whether a prefill of ``tokens`` (of ``session_id``) goes to the decode lane's next forward call: short
        enough (``ride_along_tokens``), and another session's decode step came here within the wait it would
        have, so one more is likely within it. The runner adds whether its rows keep the call's form of
        products."""
        short = 1 < tokens <= self.config.ride_along_tokens and not long_prefill
        wait = self.ride_wait_s()
        return short and any(sid != session_id and now - t < wait for sid, t in self.last_decoders)

    def prefill_turn(self, jobs: Sequence[Queued], now: float) -> tuple[Turn, bool]:
        """The device turn a prefill call takes (while others decode here: alone for a long prompt's chunk,
        shared for short prefills) and whether it waits between layers for the device's decode calls (a chunk
        of a prompt longer than one idle chunk, taking its turn alone)."""
        alone = any(job.long_prefill for job in jobs) if self.decoding(now) else None
        return alone, bool(alone) and any(job.yields_to_device for job in jobs)

    # ------------------------------------------------------------------ batches

    def paced_group(self, present: int, now: float) -> int:
        """The most lone sessions batched by their pace in one call: those pacing here (or, when this peer is
        behind, the ``present`` ones) in ``paced_groups`` groups."""
        pacing = max(present, self.arrivals.pacing(now, late_s=self.config.batch_window_s))
        return max(1, math.ceil(pacing / self.config.paced_groups))

    def take(
        self, first: J, taken: Sequence[J], queued: Sequence[J], lane: Lane, now: float
    ) -> tuple[list[J], list[J]]:
        """The jobs of one forward call, and the queued ones that wait (in their order): ``first`` and the jobs
        ``taken`` with it already, plus queued steps of other sessions on the same blocks within the budgets."""
        if first.session_id is None:
            return [first, *taken], list(queued)
        batch, kept = [first, *taken], []
        tokens = sum(job.tokens for job in batch)
        config, chunk = self.config, self.chunk_tokens(now)
        # a prefill-lane call with a long prompt's chunk is held to one chunk while others decode (Sarathi's
        # budget); whole short prompts share a call up to whole_tokens
        budget = config.max_batch_tokens
        if lane == "prefill":
            budget = min(budget, chunk if first.long_prefill else self.whole_tokens(now))
        # prefills riding on the decode lane share one chunk's tokens: a flood of short prompts cannot make the
        # decode steps' calls long prefill calls
        riding = sum(job.tokens for job in batch if job.tokens > 1)
        # a call holding a long prompt's chunk stays one chunk's tokens, whichever job came first
        chunked = any(job.long_prefill for job in batch)
        sessions = {
            job.session_id for job in batch
        }  # in the batch, or skipped: later steps must not overtake
        paced = sum(job.paced for job in batch)
        paced_group = self.paced_group(paced + sum(job.paced for job in queued), now) if first.paced else 0
        for job in queued:
            sid = job.session_id
            rides = job.tokens > 1 and lane == "decode"
            fits = len(batch) < config.max_batch and tokens + job.tokens <= budget
            fits &= not rides or riding + job.tokens <= chunk
            fits &= not (chunked or job.long_prefill) or tokens + job.tokens <= chunk
            fits &= not (first.paced and job.paced) or paced < paced_group  # the next group: the next call
            if sid is not None and sid not in sessions and job.blocks is first.blocks and fits:
                batch.append(job)
                tokens += job.tokens
                riding += job.tokens if rides else 0
                chunked |= job.long_prefill
                paced += job.paced
            else:
                kept.append(job)
            if sid is not None:
                sessions.add(sid)
        return batch, kept

    def group_incomplete(self, batch: Sequence[Queued]) -> bool:
        """Whether a group of the batch's steps has steps still to come."""
        groups = Counter(job.group for job in batch if job.group is not None)
        return any(count + self._ran_of(group) < group[1] for group, count in groups.items())

    def _ran_of(self, group: Group) -> int:
        ran = self._group_ran.get(group)
        return ran[0] if ran is not None else 0

    def wait_s(self, batch: Sequence[Queued], waited_s: float, now: float) -> float:
        """How much longer a batch of decode steps, waiting for ``waited_s`` so far, waits for the steps it
        expects (0: run it now): the rest of its groups (within ``group_window_s``), or lone sessions due here
        (within ``batch_window_s``, at a route's first hop, until its paced group is full)."""
        if len(batch) >= self.config.max_batch:
            return 0.0
        grouped = self.group_incomplete(batch)
        left = (self.config.group_window_s if grouped else self.config.batch_window_s) - waited_s
        if left <= 0:
            return 0.0
        if grouped:
            return left
        in_batch = sum(job.paced for job in batch)
        if not in_batch or in_batch >= self.paced_group(in_batch, now):
            return 0.0
        present = {job.session_id for job in batch}
        due = self.arrivals.due(present, now, late_s=self.config.batch_window_s, within_s=left)
        return left if due else 0.0

    def riders_wait_s(self, waited_s: float) -> float:
        """How much longer prefills riding on the decode lane with no decode step yet wait for one (0: go to
        the prefill thread)."""
        return max(0.0, self.ride_wait_s() - waited_s)
