"""Where a route's last hop meets a step sent with ``wait_result`` and the client's StepWait for its output.

The client sends its StepWait to the last hop at the same time as the step to the first hop, so the wait is
usually here first, and the step, once the hops before have computed it, is handed straight to it: the waiting
handler computes it and answers the client directly, while the step's own call is acknowledged at once (the
relays' acks travel back while this hop computes). When the step comes first it is parked until its wait
arrives, for at most ``ttl_s``.

Slots are keyed by (session id, position): the session id is the client's random secret, known only to the hops
of its route. Parked steps are bounded in number and in bytes, so nobody can park memory here without waiting.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from swarm.errors import CapacityError
from swarm.models.blocks import Step
from swarm.peer.executor import Group
from swarm.peer.state import Served


@dataclass(frozen=True)
class Parked:
    """An accepted step waiting for the wait that computes it (see PeerHandlers.rpc_wait)."""

    served: Served
    step: Step
    deadline: float  # time.perf_counter() past which the step's sender no longer waits
    received: float  # time.perf_counter() when the step arrived, for its HopTiming
    group: Group | None = None  # the client's decode steps sent with this one (Executor.forward)

    @property
    def nbytes(self) -> int:
        return self.step.hidden.numel() * self.step.hidden.element_size()


@dataclass
class _Slot:
    created_s: float
    step: asyncio.Future[Parked] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    waited: bool = False


class Handoff:
    """Meets each ``wait_result`` step with its wait, whichever comes first."""

    def __init__(
        self,
        max_slots: int = 1024,
        max_parked_bytes: int = 256 * 1024**2,
        ttl_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_slots = max_slots
        self.max_parked_bytes = max_parked_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self._slots: dict[tuple[str, int], _Slot] = {}

    def _parked_bytes(self) -> int:
        return sum(s.step.result().nbytes for s in self._slots.values() if s.step.done() and not s.waited)

    def _expire(self) -> None:
        """Drop slots nobody came for within ttl_s (a client that gave up, a step that never came)."""
        now = self.clock()
        for key in [k for k, s in self._slots.items() if not s.waited and now - s.created_s > self.ttl_s]:
            del self._slots[key]

    def _slot(self, session_id: str, position: int) -> _Slot:
        key = (session_id, position)
        slot = self._slots.get(key)
        if slot is None:
            self._expire()
            if len(self._slots) >= self.max_slots:
                raise CapacityError(f"{len(self._slots)} steps already wait for their results here")
            slot = self._slots[key] = _Slot(self.clock())
        return slot

    def park(self, session_id: str, position: int, parked: Parked) -> None:
        """Hand ``parked`` to its wait (now, or when it comes). A step sent again before its wait came
        replaces the first one; a step whose wait already took one is refused."""
        slot = self._slot(session_id, position)
        if slot.step.done():
            if slot.waited:
                raise CapacityError(f"step {position} of this session is already being computed here")
            slot.step = asyncio.get_running_loop().create_future()
        if not slot.waited and self._parked_bytes() + parked.nbytes > self.max_parked_bytes:
            del self._slots[(session_id, position)]
            raise CapacityError("too many step outputs already wait for their clients here")
        slot.step.set_result(parked)

    def _supersede(self, key: tuple[str, int]) -> None:
        """Fail an earlier wait for the same step that is still without it: the client gave up on that one and
        replays (its stream closed, its handler waits on). Waits at other positions of the session stand: a
        client pipelining a long prompt waits for all its chunks at once."""
        slot = self._slots.get(key)
        if slot is not None and slot.waited and not slot.step.done():
            slot.step.set_exception(CapacityError("a newer wait for this step replaced this one"))
            del self._slots[key]

    async def take(self, session_id: str, position: int) -> Parked:
        """The step at ``position`` of ``session_id``, once it has arrived (the caller bounds the wait)."""
        key = (session_id, position)
        self._supersede(key)
        slot = self._slot(session_id, position)
        if slot.waited:
            raise CapacityError(f"step {position} of this session is already waited for")
        slot.waited = True
        try:
            return await slot.step
        finally:
            if self._slots.get(key) is slot:
                del self._slots[key]

    def __len__(self) -> int:
        return len(self._slots)
