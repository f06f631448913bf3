"""The decode steps of one client round that go to the same first hop travel as one message (StepBatch).

A client running many sessions sends their decode steps of a round together (client.batching.Round: the same
``batch_id``, and ``batch_size`` the steps on that route). One message each would cost a request and an
acknowledgement per session through both p2pd daemons and both event loops, on the client and on the first
hop, which at 8 sessions cost about as much CPU as the hop's forward call itself. StepGroups gathers them per
(round, first hop) and sends them as one once all ``batch_size`` are in, or ``wait_s`` after the first came (a
member that ends up not sending must not hold its mates back). The first hop takes each step of the message as
if it came alone (swarm.peer.handlers.rpc_steps), and each fails alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from swarm.errors import SwarmError
from swarm.wire import Hop, StepAck, StepReply, StepRequest

Outcome = StepAck | StepReply
SendBatch = Callable[[Hop, list[StepRequest]], Awaitable[list[Outcome | SwarmError]]]


@dataclass
class _Group:
    hop: Hop
    size: int
    timer: asyncio.TimerHandle
    members: list[tuple[StepRequest, asyncio.Future[Outcome]]] = field(default_factory=list)


class StepGroups:
    """Gathers a round's steps per first hop; ``send`` sends one group's steps as one message."""

    def __init__(self, send: SendBatch, wait_s: float) -> None:
        self._send = send
        self._wait_s = wait_s
        self._open: dict[tuple[str, str], _Group] = {}
        self._sending: set[asyncio.Task[None]] = set()

    @staticmethod
    def takes(request: StepRequest) -> bool:
        """Whether ``request`` goes with a group: one of several steps a round sends, not a resend."""
        return bool(request.batch_id) and request.batch_size > 1 and not request.resend_tokens

    async def step(self, hop: Hop, request: StepRequest) -> Outcome:
        """What sending ``request`` alone to ``hop`` would return (an acknowledgement, or the output of a
        one-hop route), or the error it would raise."""
        loop = asyncio.get_running_loop()
        key = (request.batch_id, hop.peer_id)
        group = self._open.get(key)
        if group is None:
            group = _Group(hop, request.batch_size, loop.call_later(self._wait_s, self._flush, key))
            self._open[key] = group
        future: asyncio.Future[Outcome] = loop.create_future()
        group.members.append((request, future))
        if len(group.members) >= group.size:
            self._flush(key)
        return await future

    def _flush(self, key: tuple[str, str]) -> None:
        group = self._open.pop(key, None)
        if group is None:
            return
        group.timer.cancel()
        task = asyncio.ensure_future(self._deliver(group))
        self._sending.add(task)  # held until done: the loop keeps only weak references to tasks
        task.add_done_callback(self._sending.discard)

    async def _deliver(self, group: _Group) -> None:
        try:
            outcomes = await self._send(group.hop, [request for request, _ in group.members])
        except Exception as error:  # the message as a whole failed, so did each of its steps
            for _, future in group.members:
                if not future.done():  # a member whose output came first stopped waiting (cancelled)
                    future.set_exception(error)
            return
        for (_, future), outcome in zip(group.members, outcomes, strict=True):
            if future.done():
                continue
            if isinstance(outcome, SwarmError):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)
