"""The simulation's clock and its queue of timed events (one heapq; ties run in the order they were queued)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from heapq import heappop, heappush

from swarm.sim.hosts import Host
from swarm.sim.records import HOST_DONE, TIMER


class EventQueue:
    """Events are (time, sequence, kind, a, b): `kind` is one of swarm.sim.records' event kinds."""

    def __init__(self) -> None:
        self.now = 0.0
        self.pushed = 0  # events queued so far (also their tie-breaking sequence number)
        self._heap: list[tuple[float, int, int, int, object]] = []
        self._hooks: dict[int, Callable[[], None]] = {}

    def push(self, t: float, kind: int, a: int, b: object = None) -> None:
        self.pushed += 1
        heappush(self._heap, (t, self.pushed, kind, a, b))

    def at(self, t: float, action: Callable[[], None]) -> None:
        """Run `action` at simulated time t (churn events, reloads, a hand-over's end)."""
        self.pushed += 1
        self._hooks[self.pushed] = action
        self.push(t, TIMER, self.pushed)

    def fire(self, hook: int) -> None:
        """Run the action a TIMER event stands for."""
        self._hooks.pop(hook)()

    def schedule_host(self, t: float, host: Host, version: int) -> None:
        """A shared host's next completion (swarm/sim/hosts.py calls this back)."""
        self.push(t, HOST_DONE, version, host)

    def drain(self) -> Iterator[tuple[int, int, object]]:
        """(kind, a, b) of each event in time order, moving `now` to it, until none is left."""
        heap = self._heap
        while heap:
            t, _, kind, a, b = heappop(heap)
            self.now = t
            yield kind, a, b
