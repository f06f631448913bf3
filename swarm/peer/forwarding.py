"""Decode steps leaving this peer on the same route go together: one message (a StepBatch), not one each.

The executor runs the decode steps of several sessions as one forward call, and their handlers all resume in the
same turn of the event loop, each with a step for its session's next hop. Sent one by one, every step costs a
message and its acknowledgement through both p2pd daemons and both event loops, and the next hop waits for the
group's last message before computing it (docs/benchmarks.md has the traced costs). The ``Forwarder`` holds
the steps bound for one peer until the loop's next turn and sends them together; the next hop runs each as its
own step (its own deadline, session and errors) and answers one outcome per step.

Which steps. The reply to a message comes when its last step is answered, so the steps of one message share
their slowest one's delay. Only one-token ``wait_result`` steps are held (not resends), and only with steps
bound for the same *whole remaining route*: a step is acknowledged once every hop after it has accepted it, so
the steps of one message share every hop that could hold its reply back, and a slow or hostile hop further down
one route never holds back sessions that do not pass it. A step held at the next hop itself (waiting for its
session's earlier step, say) delays only acknowledgements, not tokens: a client whose output has arrived does
not wait for its step's acknowledgement (client/chain.py). Relayed steps (acknowledged only once their route has
computed them) and prefills go alone (one message each anyway).

A single step goes alone, as before. A next hop of an earlier release answers that it does not know the message
kind, before running anything, and its steps are then sent one by one; any other failure of the message is the
failure of each of its steps (it may have run them: they are never sent twice).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from swarm.errors import ProtocolError, SwarmError
from swarm.wire import MAX_FORWARDED_STEPS, UNKNOWN_KIND, Hop, StepAck, StepReply, StepRequest

logger = logging.getLogger(__name__)

Answer = StepAck | StepReply  # a wait_result step's acknowledgement, or a relayed step's output
_Route = tuple[str, tuple[str, ...], tuple[Hop, ...]]  # next hop's peer id and addresses, the hops after it
SendOne = Callable[[Hop, StepRequest, float], Awaitable[Answer]]  # (hop, step, timeout_s) -> its answer
SendMany = Callable[[Hop, list[StepRequest], float], Awaitable[list[Answer | SwarmError]]]


@dataclass
class _Held:
    hop: Hop
    request: StepRequest
    timeout_s: float
    future: asyncio.Future[Answer]


class Forwarder:
    """Sends steps to their next hop, the one-token ones on the same remaining route in one message per loop turn."""

    def __init__(self, send_one: SendOne, send_many: SendMany) -> None:
        self._send_one = send_one
        self._send_many = send_many
        # route (next hop, the hops after it) -> steps for it, in arrival order: steps that name other addresses
        # for the same peer go apart, so a route with wrong ones fails only its own steps
        self._held: dict[_Route, list[_Held]] = {}
        self._sending: set[asyncio.Task[None]] = set()
        self.messages = 0  # messages sent, and the steps they carried (the peer's log line shows the ratio)
        self.steps = 0

    async def forward(self, hop: Hop, request: StepRequest, timeout_s: float) -> Answer:
        """``request``'s answer from ``hop`` (and every hop after it), or its error, within ``timeout_s``."""
        if not batchable(request):
            self.messages += 1
            self.steps += 1
            return await self._send_one(hop, request, timeout_s)
        loop = asyncio.get_running_loop()
        held = _Held(hop, request, timeout_s, loop.create_future())
        key = (hop.peer_id, hop.maddrs, request.route_rest)
        queue = self._held.setdefault(key, [])
        queue.append(held)
        # the first for this route this turn: the other handlers resumed with it add theirs
        if len(queue) == 1:
            loop.call_soon(self._flush, key)
        return await held.future

    def _flush(self, key: _Route) -> None:
        held = [h for h in self._held.pop(key, []) if not h.future.cancelled()]
        for start in range(0, len(held), MAX_FORWARDED_STEPS):
            task = asyncio.get_running_loop().create_task(
                self._send(held[start : start + MAX_FORWARDED_STEPS])
            )
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
        except Exception as e:
            if isinstance(e, ProtocolError) and UNKNOWN_KIND in str(e):
                # a peer of an earlier release, which refused the message unread: nothing ran there
                logger.debug("sending %d steps one by one to %s: %s", len(held), held[0].hop.peer_id[-8:], e)
                await asyncio.gather(
                    *(self._settle(h, self._send_one(h.hop, h.request, h.timeout_s)) for h in held)
                )
                return
            for h in held:  # the message failed as a whole (it may have run them): every step of it did
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


def batchable(request: StepRequest) -> bool:
    """Whether ``request`` may go in one message with others for the same route: a one-token ``wait_result``
    step (not a resend), which every hop acknowledges once the hops after it have it (see the module doc)."""
    return request.hidden.shape[0] == 1 and request.wait_result and not request.resend_tokens


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
