"""One generation for the web face: the client's decode loop, with the counts, timings and route it reports.

The web server holds one AsyncSwarmClient and runs every request through `SwarmGenerator.run`, an async
generator of events: `Piece`s of text as tokens arrive, a `Notice` when a peer failed and the session is
failing over (so the user sees why the answer paused), and one `Outcome` at the end. Closing the generator
early (the user pressed stop, or went away) cancels the step in flight and closes the session on every peer
of its route before it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from client.client import AsyncSwarmClient
from client.generation import GenerationRequest, generate_text
from client.session import InferenceSession
from client.web.errors import invalid
from client.web.metrics import WebMetrics
from client.web.openai_api import CompletionRequest
from swarm.models.head import Sampler, SamplingParams

FAILOVER_POLL_S = 0.25  # how soon a failover under way is noticed while a step is pending


@dataclass(frozen=True)
class Piece:
    text: str


@dataclass(frozen=True)
class Notice:
    text: str


@dataclass
class Outcome:
    """What a finished (or stopped) generation did; also a row of the status page's recent requests."""

    finish_reason: str = "stop"  # "stop", "length", "cancelled" or "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    route: list[dict[str, Any]] = field(default_factory=list)
    failovers: int = 0
    ttft_s: float | None = None
    duration_s: float = 0.0

    def json(self) -> dict[str, Any]:
        return {
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "route": self.route,
            "failovers": self.failovers,
            "ttft_s": self.ttft_s,
            "duration_s": self.duration_s,
        }


Event = Piece | Notice | Outcome


class _Counter:
    """Counts the tokens of one generation as they arrive and times the gaps between them."""

    def __init__(self, metrics: WebMetrics, clock: Callable[[], float]):
        self.metrics, self.clock = metrics, clock
        self.tokens = 0
        self._last_at: float | None = None

    def saw(self, token: int) -> None:
        now = self.clock()
        if self._last_at is not None:
            self.metrics.token_latency.observe(now - self._last_at)
        self._last_at = now
        self.tokens += 1
        self.metrics.tokens.inc()


class SwarmGenerator:
    """Runs requests through the swarm with one shared AsyncSwarmClient."""

    def __init__(
        self,
        client: AsyncSwarmClient,
        metrics: WebMetrics,
        peer_names: Callable[[], Mapping[str, str]] = dict,
        clock: Callable[[], float] = time.perf_counter,
        *,
        recent: int,  # WebConfig.recent_requests
        context_tokens: int,  # WebConfig.context_tokens
    ) -> None:
        self.client = client
        self.recent: deque[dict[str, Any]] = deque(maxlen=recent)  # finished requests, newest last
        self.metrics = metrics
        self.peer_names = peer_names
        self.clock = clock
        self.context_tokens = context_tokens

    def prompt_ids(self, request: CompletionRequest) -> list[int]:
        """The prompt's token ids; a 400 if it cannot be encoded or would not fit with max_tokens."""
        try:
            ids = self.client.encode(request.prompt, list(request.messages) if request.messages else None)
        except ValueError as error:
            raise invalid(str(error), "messages" if request.kind == "chat" else "prompt") from error
        if len(ids) + request.max_tokens > self.context_tokens:
            raise invalid(
                f"this model's context is {self.context_tokens} tokens; the prompt has {len(ids)} and "
                f"max_tokens asks for {request.max_tokens} more",
                "max_tokens",
                "context_length_exceeded",
            )
        return ids

    def route_json(self, session: InferenceSession) -> list[dict[str, Any]]:
        names = self.peer_names()
        return [
            {"peer_id": s.peer_id, "name": names.get(s.peer_id, s.peer_id[-8:]), "layers": s.layers.to_list()}
            for s in session.stages
        ]

    async def run(
        self, request: CompletionRequest, ids: Sequence[int], arrived_at: float
    ) -> AsyncGenerator[Event, None]:
        """Events of one generation; `arrived_at` (this generator's clock) starts the time to first token."""
        temperature = 0.0 if request.top_p == 0.0 else request.temperature
        seed = secrets.randbits(63) if request.seed is None else request.seed
        sampler = Sampler(SamplingParams(temperature, 0, request.top_p or 1.0, 1.0, seed))
        counter = _Counter(self.metrics, self.clock)
        job = GenerationRequest(tuple(ids), request.max_tokens, self.client.eos_ids, request.stop)
        session = self.client.new_session(len(ids) + request.max_tokens)
        outcome = Outcome(finish_reason="cancelled", prompt_tokens=len(ids))
        spec = session.speculation
        self.metrics.active.inc()
        try:
            greedy = sampler.params.greedy
            target = None if greedy else sampler  # a greedy pick checks drafts by itself
            text = generate_text(
                session, job, sampler.sample, self.client.tokenizer, greedy, spec, target, counter.saw
            )
            async with aclosing(text) as pieces:
                async for event in _with_failover_notices(pieces, session):
                    if isinstance(event, Piece) and outcome.ttft_s is None:
                        outcome.ttft_s = self.clock() - arrived_at
                        self.metrics.ttft.observe(outcome.ttft_s)
                    yield event
            stopped_by_length = counter.tokens >= request.max_tokens  # an EOS is never past max_tokens
            outcome.finish_reason = "length" if stopped_by_length else "stop"
        except Exception:
            outcome.finish_reason = "error"
            raise
        finally:
            self.metrics.active.dec()
            if outcome.finish_reason == "cancelled":
                self.metrics.cancelled.inc()
            await session.close()
            outcome.completion_tokens = counter.tokens
            outcome.route = self.route_json(session)
            outcome.failovers = session.failovers
            outcome.duration_s = self.clock() - arrived_at
            self.metrics.failovers.inc(session.failovers)
            if spec is not None:
                self.metrics.draft_steps.inc(spec.steps)
                self.metrics.drafted.inc(spec.drafted)
                self.metrics.accepted.inc(spec.accepted)
            self.recent.append({"at": time.time(), "kind": request.kind, **outcome.json()})
        yield outcome


async def _with_failover_notices(
    pieces: AsyncGenerator[str, None], session: InferenceSession
) -> AsyncGenerator[Piece | Notice, None]:
    """The pieces, plus a Notice whenever the session's failover count grows while we wait for a piece.

    Each `__anext__` runs as a task so the wait can be polled; if we are closed while one is pending, it is
    cancelled (which cancels the step in flight) before the caller closes the session.
    """
    seen = session.failovers
    pending: asyncio.Task[str] | None = None
    try:
        while True:
            pending = asyncio.ensure_future(pieces.__anext__())
            while not pending.done():
                await asyncio.wait([pending], timeout=FAILOVER_POLL_S)
                if session.failovers > seen:
                    seen = session.failovers
                    yield Notice("a peer failed mid-answer; failover is under way (re-routing and replaying)")
            try:
                text = pending.result()
            except StopAsyncIteration:
                return
            finally:
                pending = None
            yield Piece(text)
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pending
