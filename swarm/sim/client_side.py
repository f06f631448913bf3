"""The client's side of the simulation: outputs arriving from the last stage, the LM head, the next step out.

Without a client host, client_step_s is a plain delay on the send (many independent clients). With one
(SimConfig.client_host), the client is one process sharing that host's cores (swarm/sim/hosts.py): it handles
arriving messages one at a time, client_step_s per token each carries. A decode output advances its session
by one quantum and sends the next step into stage 0; a prefill output gives the first token (for a new
session) and sends the pending decode step where the replay began. Generated tokens are counted into
throughput buckets of bucket_s.
"""

from __future__ import annotations

from collections import deque

from swarm.sim.config import SimConfig
from swarm.sim.events import EventQueue
from swarm.sim.hosts import CLIENT, Host
from swarm.sim.links import Network
from swarm.sim.records import CLIENT_DECODE, SRC, Requests
from swarm.sim.sessions import Sessions


class Client:
    """The client: `arrive` takes a message from the last stage; `buckets` counts generated tokens over time."""

    def __init__(
        self,
        requests: Requests,
        sessions: Sessions,
        network: Network,
        events: EventQueue,
        config: SimConfig,
        host: Host | None,
        act_bytes: int,
        token_bytes: int,
    ) -> None:
        self.requests = requests
        self.sessions = sessions
        self.network = network
        self.events = events
        self.config = config
        self.host = host
        self.act_bytes = act_bytes
        self.token_bytes = token_bytes
        self.quantum = config.decode_quantum_tokens
        self.step_s = config.client_step_s * self.quantum  # the head's time for one decode message's token
        self.queue: deque[tuple[int, list]] = deque()  # type: ignore[type-arg]
        self.busy = False
        self.buckets: list[int] = []  # generated tokens per bucket_s of simulated time
        self._send = network.send  # bound once: called per message

    def arrive(self, kind: int, payload: list) -> None:  # type: ignore[type-arg]
        """A message reached the client (kind CLIENT_DECODE or CLIENT_PREFILL)."""
        if self.host is None:  # many independent clients: the head's time is a delay on the send
            if kind == CLIENT_DECODE:
                self._decode(payload, self.step_s)
            else:
                self._prefill(payload, self.step_s)
            return
        self.queue.append((kind, payload))
        if not self.busy:
            self._next()

    def _next(self) -> None:
        """The client process takes the next arrived message: client_step_s per token it carries."""
        kind, payload = self.queue[0]
        work_s = len(payload) * (self.step_s if kind == CLIENT_DECODE else self.config.client_step_s)
        self.busy = True
        assert self.host is not None
        self.host.start(self.events.now, CLIENT, work_s, self.events.schedule_host)

    def done(self) -> None:
        """The client process finished the message at the head of its queue."""
        kind, payload = self.queue.popleft()
        self.busy = False
        if kind == CLIENT_DECODE:
            self._decode(payload, 0.0)
        else:
            self._prefill(payload, 0.0)
        if self.queue and not self.busy:
            self._next()

    def _decode(self, keys: list[int], delay_s: float) -> None:
        requests = self.requests
        epoch, gen, stage, routes = requests.epoch, requests.generated, requests.stage, requests.routes
        out_len = requests.out_len
        groups: dict[int, list[int]] = {}
        counted = 0
        for key in keys:
            r = key >> 8
            if key & 255 != epoch[r] & 255:
                continue
            step = min(self.quantum, out_len[r] - gen[r])
            counted += step
            gen[r] += step
            if gen[r] >= out_len[r]:
                self.sessions.finish(r)
                continue
            stage[r] = 0
            first = routes[r][0]
            group = groups.get(first)
            if group is None:
                groups[first] = [key]
            else:
                group.append(key)
        self._count(counted)
        for first, group in groups.items():
            self._send(SRC, first, len(group) * self.token_bytes * self.quantum, group, False, delay_s)

    def _prefill(self, jobs: list[tuple[int, int]], delay_s: float) -> None:
        requests = self.requests
        for key, _ in jobs:
            r = key >> 8
            if key & 255 != requests.epoch[r] & 255:
                continue
            if requests.generated[r] == 0:  # the prompt's last position gives the first output token
                requests.generated[r] = 1
                requests.first_token_s[r] = self.events.now
                self._count(1)
                if requests.generated[r] >= requests.out_len[r]:
                    self.sessions.finish(r)
                    continue
            if self.sessions.move_to_decode(r):  # split phases: decode goes on where the KV is moved to
                continue
            # The pending decode step re-enters where the replay began (0 unless a partial replay).
            rs = requests.resume_stage[r]
            requests.stage[r], requests.resume_stage[r], requests.replaying[r] = rs, 0, False
            per_token = self.token_bytes if rs == 0 else self.act_bytes
            self._send(SRC, requests.routes[r][rs], per_token * self.quantum, [key], False, delay_s)

    def _count(self, tokens: int) -> None:
        """Add generated tokens to the throughput bucket of the current time."""
        b = int(self.events.now / self.config.bucket_s)
        while len(self.buckets) <= b:
            self.buckets.append(0)
        self.buckets[b] += tokens
