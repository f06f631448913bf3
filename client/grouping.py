"""A client round's decode steps for one first hop travel as one message (StepBatch), and its waits for their
outputs at one last hop as one message (StepWaits).

A client running many sessions sends their decode steps of a round together (client.batching.Round: the same
``batch_id``, and ``batch_size`` the steps on that route). Alone, each session's step costs a request and an
acknowledgement, and its wait a request and a reply, through both p2pd daemons and both event loops (the
client's, and the first or last hop's): at 8 sessions of one client that cost about as much CPU as the hops'
forward calls. A Groups gathers them per (round, hop) and sends them as one once all ``batch_size`` are in, or
``wait_s`` after the first came (a member that ends up not sending must not hold its mates back). The hop takes
each item of the message as if it came alone (swarm.peer.handlers: rpc_steps, rpc_waits), and each fails alone.
A hop of an earlier release, which does not know the message, gets them one by one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from swarm.errors import ProtocolError, SwarmError
from swarm.wire import MAX_FORWARDED_STEPS, UNKNOWN_KIND, Hop, StepRequest

I = TypeVar("I")  # noqa: E741  what one member sends: a StepRequest or a StepWait
O = TypeVar("O")  # noqa: E741  what it gets back: a StepAck or StepReply


def groupable(request: StepRequest) -> bool:
    """Whether ``request`` (and its wait) go with a group: one of several steps a round sends, not a resend."""
    return bool(request.batch_id) and request.batch_size > 1 and not request.resend_tokens


@dataclass
class _Group(Generic[I, O]):
    hop: Hop
    size: int
    timer: asyncio.TimerHandle
    members: list[tuple[I, asyncio.Future[O]]] = field(default_factory=list)


class Groups(Generic[I, O]):
    """Gathers a round's items per hop: ``send_many`` sends one group's items as one message and answers per
    item; ``send_one`` sends an item alone (to a hop that does not know the message)."""

    def __init__(
        self,
        send_many: Callable[[Hop, list[I]], Awaitable[list[O | SwarmError]]],
        send_one: Callable[[Hop, I], Awaitable[O]],
        wait_s: float,
    ) -> None:
        self._send_many = send_many
        self._send_one = send_one
        self._wait_s = wait_s
        self._open: dict[tuple[str, str], _Group[I, O]] = {}
        self._sending: set[asyncio.Task[None]] = set()
        self._unknown: set[str] = set()  # hops that refused the message unread: each item goes alone there

    async def send(self, hop: Hop, batch: tuple[str, int], item: I) -> O:
        """What sending ``item`` alone to ``hop`` would return, or the error it would raise; ``batch`` is the
        (id, size) of the round's steps on this route (StepRequest.batch_id, batch_size)."""
        if hop.peer_id in self._unknown:
            return await self._send_one(hop, item)
        loop = asyncio.get_running_loop()
        key = (batch[0], hop.peer_id)
        group = self._open.get(key)
        if group is None:
            group = _Group(
                hop, min(batch[1], MAX_FORWARDED_STEPS), loop.call_later(self._wait_s, self._flush, key)
            )
            self._open[key] = group
        future: asyncio.Future[O] = loop.create_future()
        group.members.append((item, future))
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

    async def _deliver(self, group: _Group[I, O]) -> None:
        members = [(item, future) for item, future in group.members if not future.done()]
        if not members:  # every member stopped waiting before the group went (its step failed, say)
            return
        try:
            outcomes = await self._send_many(group.hop, [item for item, _ in members])
            for (_, future), outcome in zip(members, outcomes, strict=True):
                if future.done():  # a member whose output came first stopped waiting (cancelled)
                    continue
                if isinstance(outcome, SwarmError):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)
        except Exception as error:
            if isinstance(error, ProtocolError) and UNKNOWN_KIND in str(error):
                # a hop of an earlier release, which refused the message unread: nothing ran there
                self._unknown.add(group.hop.peer_id)
                await asyncio.gather(*(self._alone(group.hop, item, future) for item, future in members))
                return
            for _, future in members:  # the message as a whole failed, so did each of its items
                if not future.done():
                    future.set_exception(error)

    async def _alone(self, hop: Hop, item: I, future: asyncio.Future[O]) -> None:
        try:
            outcome = await self._send_one(hop, item)
        except Exception as error:
            if not future.done():
                future.set_exception(error)
            return
        if not future.done():
            future.set_result(outcome)
