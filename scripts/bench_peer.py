"""Peer benchmarks, printed as JSON: join time, and a decode step through 3 forwarding peers vs locally.

    python scripts/bench_peer.py --model tiny --steps 20        # CI smoke size
    python scripts/bench_peer.py --model default --steps 30

Join time is process start to serving (``--maddr-file`` written, i.e. loaded, measured, announced), with the
model already in the local cache. The per-hop overhead is (route step - local step) / hops, where the local
step runs the same layers in-process on a BlockRange; the route step is what the client does (a step with
``wait_result`` to the first peer, which forwards to the next two, and a StepWait for the output at the last);
``relayed_*`` is the same step with the output relayed back along the chain. The two kinds of step alternate,
so both see the same (shared, noisy) machine. Fixed seeds; every number is a median over ``--steps`` decode
steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch

from swarm.models.blocks import Step
from swarm.models.loading import resolve_model
from swarm.testing import LocalSwarm, swarm_client
from swarm.transport import call_close, call_step, call_step_acked, call_wait
from swarm.wire import CloseRequest, Hop, StepRequest, StepWait


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed (after a prefill)")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    source = resolve_model(args.model)
    spec = source.spec
    n = spec.num_layers
    cuts = [0, n // 3, 2 * n // 3, n]
    ranges = [f"{cuts[i]}:{cuts[i + 1]}" for i in range(3)]
    head = source.load_head()
    local = source.load_blocks(0, n, cache_tokens=4096)
    tokens = torch.randint(
        0, spec.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)
    )
    max_length = args.prompt_tokens + args.steps + 1

    # Local baseline: the same steps through all layers in this process.
    session = uuid.uuid4().hex
    local.open_session(session, max_length)
    local.forward([Step(session, head.embed(tokens), 0, n, 0)])
    local_s = []
    for i in range(args.steps):
        hidden = head.embed(tokens[i % len(tokens)][None])
        started = time.perf_counter()
        local.forward([Step(session, hidden, 0, n, args.prompt_tokens + i)])
        local_s.append(time.perf_counter() - started)
    local.close_session(session)

    with tempfile.TemporaryDirectory() as tmp, LocalSwarm(Path(tmp), model=args.model) as swarm:
        extra = ["--no-plan", "--no-follow-plan", "--cache-tokens", "2048"]
        swarm.start_peer(ranges[0], name="b0", extra_args=extra)
        swarm.start_peer(ranges[1], name="b1", extra_args=extra, wait=False)
        swarm.start_peer(ranges[2], name="b2", extra_args=extra, wait=False)
        swarm.wait_all_ready(timeout_s=240)
        join_s = [p.ready_after_s for p in swarm.peers]
        hops = [Hop(p.peer_id, tuple(p.maddrs), cuts[i], cuts[i + 1]) for i, p in enumerate(swarm.peers)]
        route = asyncio.run(
            _route_steps(swarm, hops, head, tokens, spec.weights_hash, args.steps, max_length)
        )

    route_s = [r[0] for r in route]
    compute_s = [r[1] for r in route]
    relayed_s = [r[2] for r in route]
    local_med = statistics.median(local_s)
    route_med = statistics.median(route_s)
    relayed_med = statistics.median(relayed_s)
    print(
        json.dumps(
            {
                "model": spec.name,
                "layers": n,
                "ranges": ranges,
                "join_s": join_s,
                "join_s_first_peer": join_s[0],
                "steps": args.steps,
                "local_decode_step_ms": 1e3 * local_med,
                "route_decode_step_ms": 1e3 * route_med,
                "route_compute_ms_sum_of_hops": 1e3 * statistics.median(compute_s),
                "overhead_per_hop_ms": 1e3 * (route_med - local_med) / 3,
                "route_step_ms_p90": 1e3 * sorted(route_s)[int(0.9 * (len(route_s) - 1))],
                "relayed_decode_step_ms": 1e3 * relayed_med,
                "relayed_overhead_per_hop_ms": 1e3 * (relayed_med - local_med) / 3,
            },
            indent=2,
        )
    )


async def _route_steps(
    swarm: LocalSwarm,
    hops: list[Hop],
    head: object,
    tokens: torch.Tensor,
    model_hash: str,
    steps: int,
    max_length: int,
) -> list[tuple[float, float, float]]:
    """(wait_result step s, its compute s summed over hops, relayed step s) per decode step.

    Two sessions, one per kind of step, fed the same tokens."""
    first, *rest = hops
    last = hops[-1]
    sessions = (uuid.uuid4().hex, uuid.uuid4().hex)
    out = []
    async with swarm_client(swarm.initial_peers, model_hash) as (_dht, _directory, p2p):
        embed = head.embed  # type: ignore[attr-defined]

        def request(session: str, position: int, hidden: torch.Tensor, wait: bool) -> StepRequest:
            return StepRequest(
                session,
                position,
                hidden,
                first.start,
                first.end,
                max_length,
                model_hash,
                tuple(rest),
                60.0,
                wait,
            )

        async def waited(session: str, position: int, hidden: torch.Tensor) -> float:
            wait = call_wait(
                p2p, last.peer_id, StepWait(session, position, 60.0), maddrs=last.maddrs, timeout_s=60
            )
            _, reply = await asyncio.gather(
                call_step_acked(
                    p2p, first.peer_id, request(session, position, hidden, True), maddrs=first.maddrs
                ),
                wait,
            )
            return reply.timings[-1].compute_s

        await waited(sessions[0], 0, embed(tokens))
        await call_step(
            p2p, first.peer_id, request(sessions[1], 0, embed(tokens), False), maddrs=first.maddrs
        )
        # One kind after the other: sessions stepping in turns would each be due at the first hop while the
        # other's step runs there, and that hop waits for due lone sessions (ExecutorConfig.batch_window_s).
        waited_s = []
        for i in range(steps):
            started = time.perf_counter()
            await waited(sessions[0], len(tokens) + i, embed(tokens[i % len(tokens)][None]))
            waited_s.append(time.perf_counter() - started)
        for i in range(steps):
            started = time.perf_counter()
            reply = await call_step(
                p2p,
                first.peer_id,
                request(sessions[1], len(tokens) + i, embed(tokens[i % len(tokens)][None]), False),
                maddrs=first.maddrs,
            )
            relayed_s = time.perf_counter() - started
            out.append((waited_s[i], sum(t.compute_s for t in reply.timings), relayed_s))
        for session in sessions:
            await call_close(p2p, first.peer_id, CloseRequest(session, tuple(rest)), maddrs=first.maddrs)
    return out


if __name__ == "__main__":
    main()
