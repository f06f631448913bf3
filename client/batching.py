"""Batching of the client's own head work across the sessions one client runs at once.

An AsyncSwarmClient running many generations (asyncio.gather over `generate_ids`, the web face's concurrent
chats) would otherwise run the final norm + LM head once per session per token, each a [1, H] x [H, V] product
on the event loop: for SmolLM2-135M that is 28M multiply-adds, as much as a fifth of the whole model, and the
loop can read no reply while it runs. HeadBatcher collects the last hidden states sessions hand in, and runs
them as one [N, H] x [H, V] call on its own thread: the requests of one event-loop tick go together, and while
a call runs the next round gathers (continuous batching, like the peers' executor does for decode steps).

Greedy outputs stay those of the unbatched head: each row of a batched product is the same dot products.

    batcher = HeadBatcher(head)
    logits = await batcher.logits(hidden)     # hidden [H] -> logits [V], batched with whoever asks alongside

`BatchedSession` is the InferenceSession whose `forward` goes through a batcher; the session itself is left
untouched except that it hands back its last hidden state instead of running the head itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from client.liveness import StepWatch
from client.retry import RetryPolicy
from client.session import Chain, Head, InferenceSession, RouteSource
from client.spot import SpotChecker

logger = logging.getLogger(__name__)


class HeadBatcher:
    """Runs `head.logits` for every session that asks in the same round as one call, on one thread."""

    def __init__(self, head: Head, max_batch: int = 64) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.head = head
        self.max_batch = max_batch
        self.calls = 0  # batched head calls run
        self.rows = 0  # hidden states they covered; rows / calls is the mean batch size
        self.largest = 0  # largest batch seen
        self._pending: list[tuple[torch.Tensor, asyncio.Future[torch.Tensor]]] = []
        self._running = False
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="client-head")

    async def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [H] (the last layer's output for one position) -> logits [V] in float32."""
        if hidden.ndim != 1:
            raise ValueError(f"hidden must be 1-D [H], got shape {tuple(hidden.shape)}")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[torch.Tensor] = loop.create_future()
        self._pending.append((hidden, future))
        if not self._running:
            self._running = True
            loop.call_soon(self._start_round)  # after this tick, so sessions stepping alongside join in
        return await future

    def _start_round(self) -> None:
        batch = [(h, f) for h, f in self._pending[: self.max_batch] if not f.cancelled()]
        self._pending = self._pending[self.max_batch :]
        if not batch:
            self._next_round()
            return
        loop = asyncio.get_running_loop()
        done = loop.run_in_executor(self._thread, self._run, [h for h, _ in batch])
        done.add_done_callback(lambda outcome: self._finish(batch, outcome))

    def _run(self, hiddens: list[torch.Tensor]) -> list[torch.Tensor | Exception]:
        """One [N, H] -> [N, V] call; if it fails, each row alone, so one bad row fails only its own session."""
        try:
            return list(self.head.logits(torch.stack(hiddens)).unbind(0))
        except Exception as error:
            if len(hiddens) == 1:
                return [error]
        return [self._alone(h) for h in hiddens]

    def _alone(self, hidden: torch.Tensor) -> torch.Tensor | Exception:
        try:
            return self.head.logits(hidden[None])[0]
        except Exception as error:
            return error

    def _finish(
        self,
        batch: list[tuple[torch.Tensor, asyncio.Future[torch.Tensor]]],
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
        for (_, future), result in zip(batch, results, strict=True):
            if future.done():  # its session was cancelled meanwhile
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
        self._next_round()

    def _next_round(self) -> None:
        if self._pending:
            asyncio.get_running_loop().call_soon(self._start_round)
        else:
            self._running = False

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


class _LastHidden:
    """A Head whose `logits` hands the hidden states back unchanged: InferenceSession.forward then returns
    the last hidden state [H], and BatchedSession runs the real head on it through the batcher."""

    def __init__(self, head: Head) -> None:
        self.head = head

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.embed(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
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

    async def forward(self, new_ids: Sequence[int]) -> torch.Tensor:
        """Send `new_ids` through the swarm and return the logits[V] after the last of them."""
        hidden = await super().forward(new_ids)  # [H]: the head above hands it back as is
        return await self.batcher.logits(hidden)
