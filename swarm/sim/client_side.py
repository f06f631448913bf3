"""The client's side of the simulation: outputs arriving from the last stage, the LM head, the next step out.

Without a client host, client_step_s is a plain delay on the send (many independent clients). With one
(SimConfig.client_host), the client is one process sharing that host's cores (swarm/sim/hosts.py): it handles
arriving messages one at a time, client_step_s per token each carries. A decode output advances its session
by one quantum and sends the next step into stage 0; a prefill output gives the first token (for a new
session) and sends the pending decode step where the replay began. Generated tokens are counted into
throughput buckets of bucket_s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from swarm.sim.hosts import CLIENT
from swarm.sim.links import send
from swarm.sim.records import CLIENT_DECODE, SRC
from swarm.sim.sessions import finish

if TYPE_CHECKING:
    from swarm.sim.engine import Simulation


def client_arrive(sim: Simulation, kind: int, payload: list) -> None:  # type: ignore[type-arg]
    """A message reached the client (kind CLIENT_DECODE or CLIENT_PREFILL)."""
    if sim.client_host is None:  # many independent clients: the head's time is a delay on the send
        if kind == CLIENT_DECODE:
            client_decode(sim, payload, sim.client_s)
        else:
            client_prefill(sim, payload, sim.client_s)
        return
    sim.client_q.append((kind, payload))
    if not sim.client_busy:
        client_next(sim)


def client_next(sim: Simulation) -> None:
    """The client process takes the next arrived message: client_step_s per token it carries."""
    kind, payload = sim.client_q[0]
    work_s = len(payload) * (sim.client_s if kind == CLIENT_DECODE else sim.config.client_step_s)
    sim.client_busy = True
    assert sim.client_host is not None
    sim.client_host.start(sim.now, CLIENT, work_s, sim._schedule_host)


def client_done(sim: Simulation) -> None:
    """The client process finished the message at the head of its queue."""
    kind, payload = sim.client_q.popleft()
    sim.client_busy = False
    if kind == CLIENT_DECODE:
        client_decode(sim, payload, 0.0)
    else:
        client_prefill(sim, payload, 0.0)
    if sim.client_q and not sim.client_busy:
        client_next(sim)


def client_decode(sim: Simulation, keys: list[int], delay_s: float) -> None:
    epoch, gen, stage, routes = sim.epoch, sim.generated, sim.stage, sim.routes
    out_len = sim.out_len
    groups: dict[int, list[int]] = {}
    counted = 0
    for key in keys:
        r = key >> 8
        if key & 255 != epoch[r] & 255:
            continue
        step = min(sim.quantum, out_len[r] - gen[r])
        counted += step
        gen[r] += step
        if gen[r] >= out_len[r]:
            finish(sim, r)
            continue
        stage[r] = 0
        first = routes[r][0]
        group = groups.get(first)
        if group is None:
            groups[first] = [key]
        else:
            group.append(key)
    count_tokens(sim, counted)
    for first, group in groups.items():
        send(sim, SRC, first, len(group) * sim.token_bytes * sim.quantum, group, False, delay_s)


def client_prefill(sim: Simulation, jobs: list[tuple[int, int]], delay_s: float) -> None:
    for key, _ in jobs:
        r = key >> 8
        if key & 255 != sim.epoch[r] & 255:
            continue
        if sim.generated[r] == 0:  # the prompt's last position gives the first output token
            sim.generated[r] = 1
            sim.first_token_s[r] = sim.now
            count_tokens(sim, 1)
            if sim.generated[r] >= sim.out_len[r]:
                finish(sim, r)
                continue
        # The pending decode step re-enters where the replay began (0 unless a partial replay).
        rs = sim.resume_stage[r]
        sim.stage[r], sim.resume_stage[r], sim.replaying[r] = rs, 0, False
        per_token = sim.token_bytes if rs == 0 else sim.act_bytes
        send(sim, SRC, sim.routes[r][rs], per_token * sim.quantum, [key], False, delay_s)


def count_tokens(sim: Simulation, tokens: int) -> None:
    """Add generated tokens to the throughput bucket of the current time."""
    b = int(sim.now / sim.config.bucket_s)
    while len(sim.buckets) <= b:
        sim.buckets.append(0)
    sim.buckets[b] += tokens
