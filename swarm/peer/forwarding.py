"""Decode steps leaving this peer for the same next hop go as one message (a StepBatch), not one each.

The executor runs the decode steps of several sessions as one forward call, and their handlers all resume in the
same turn of the event loop, each with a step for its session's next hop. Sent one by one, every step costs a
message and its acknowledgement through both p2pd daemons and both event loops: at 8 client processes on 3
peers, a middle peer's event loop spent about 1.5 ms of CPU per step (py-spy), mostly on messages, more than
the step's own share of a forward call of 4. The ``Forwarder`` holds the steps bound for one peer until the loop's next turn and sends them together; the next
hop runs each as its own step (its own deadline, session, route and errors) and answers one outcome per step.

Only one-token steps are held (a prefill is one message anyway), whether sent with ``wait_result`` (answered by
an acknowledgement) or relayed (answered by the route's output, which then travels back batched as well). A
single step goes alone, as before. A next hop that does not know StepBatch answers ProtocolError before running
anything, and its steps are then sent one by one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from swarm.errors import ProtocolError, SwarmError
from swarm.wire import Hop, StepAck, StepReply, StepRequest

logger = logging.getLogger(__name__)

Answer = StepAck | StepReply  # a wait_result step's acknowledgement, or a relayed step's output
SendOne = Callable[[Hop, StepRequest, float], Awaitable[Answer]]  # (hop, step, timeout_s) -> its answer
SendMany = Callable[[Hop, list[StepRequest], float], Awaitable[list[Answer | SwarmError]]]


@dataclass
class _Held:
    hop: Hop
    request: StepRequest
    timeout_s: float
    future: asyncio.Future[Answer]


class Forwarder:
    """Sends steps to their next hop, the one-token ones bound for the same peer in one message per loop turn."""

    def __init__(self, send_one: SendOne, send_many: SendMany) -> None:
        self._send_one = send_one
        self._send_many = send_many
        self._held: dict[str, list[_Held]] = {}  # next hop's peer id -> steps for it, in arrival order
        self._sending: set[asyncio.Task[None]] = set()
        self.messages = 0  # messages sent, and the steps they carried (the peer's log line shows the ratio)
        self.steps = 0

    async def forward(self, hop: Hop, request: StepRequest, timeout_s: float) -> Answer:
        """``request``'s answer from ``hop`` (and every hop after it), or its error, within ``timeout_s``."""
        if request.hidden.shape[0] != 1 or request.resend_tokens:
            self.messages += 1
            self.steps += 1
            return await self._send_one(hop, request, timeout_s)
        loop = asyncio.get_running_loop()
        held = _Held(hop, request, timeout_s, loop.create_future())
        queue = self._held.setdefault(hop.peer_id, [])
        queue.append(held)
        if len(queue) == 1:  # the first for this hop this turn: the other handlers resumed with it add theirs
            loop.call_soon(self._flush, hop.peer_id)
        return await held.future

    def _flush(self, peer_id: str) -> None:
        held = [h for h in self._held.pop(peer_id, []) if not h.future.cancelled()]
        if held:
            task = asyncio.get_running_loop().create_task(self._send(held))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, held: list[_Held]) -> None:
        self.messages += 1
        self.steps += len(held)
        if len(held) == 1:
            await self._settle(held[0], self._send_one(held[0].hop, held[0].request, held[0].timeout_s))
            return
        timeout_s = max(h.timeout_s for h in held)
        try:
            outcomes = await self._send_many(held[0].hop, [h.request for h in held], timeout_s)
        except ProtocolError as e:  # e.g. a peer of an earlier release: nothing ran there
            logger.debug("sending %d steps one by one to %s: %s", len(held), held[0].hop.peer_id[-8:], e)
            await asyncio.gather(
                *(self._settle(h, self._send_one(h.hop, h.request, h.timeout_s)) for h in held)
            )
            return
        except Exception as e:  # the message failed as a whole: every step of it did
            for h in held:
                _resolve(h.future, error=e)
            return
        for h, outcome in zip(held, outcomes, strict=True):
            if isinstance(outcome, SwarmError):
                _resolve(h.future, error=outcome)
            else:
                _resolve(h.future, answer=outcome)

    async def _settle(self, held: _Held, sending: Awaitable[Answer]) -> None:
        try:
            answer = await sending
        except Exception as e:
            _resolve(held.future, error=e)
        else:
            _resolve(held.future, answer=answer)


def _resolve(
    future: asyncio.Future[Answer], answer: Answer | None = None, error: BaseException | None = None
) -> None:
    if future.done():  # its handler gave up (deadline, cancelled)
        return
    if error is not None:
        future.set_exception(error)
    else:
        assert answer is not None
        future.set_result(answer)
