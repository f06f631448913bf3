#!/usr/bin/env python
"""The paged KV cache against squatters, in memory, and in decode speed. Prints ONE JSON object.

    .venv/bin/python scripts/bench_kv.py --json kv.json                             # default model
    .venv/bin/python scripts/bench_kv.py --contiguous-tree /tmp/old --json kv.json  # against an older checkout
    .venv/bin/python scripts/bench_kv.py --quick                                    # tiny model (CI smoke)

- sybil_honest_ok: a real Peer of the tiny model (512 cache tokens) in this process, its handlers called as a
  remote would, on the real clock. 16 fresh identities fill the whole cache with one-token sessions of the
  largest size they may ask for and step each every 2 s to keep it alive; an honest client then sends a prompt
  and 40 decode steps. True if every honest step was answered on its first try within --step-timeout-s.
- sessions_fit: chat sessions of a 400-token system prompt and a 100-token answer (max_length_tokens 2048)
  that open and fill in the cache 8 reservations of 2048 tokens took before (16384 tokens), paged (opened
  until one would evict another) against reserved (16384 // 2048).
- prefix_ttft_ratio: through two real `swarm-peer join` processes on 127.0.0.1 (the layers split in two,
  --session-share-prefixes, one torch thread each) and the Python client: time to the first token of a chat
  with a 400-token system prompt and a 37-token question, over that of the next chat with the same system
  prompt and another question, after the first closed (median of 3 rounds, a new system prompt each; random
  token ids, fixed seed). prefix_hit_rate: the peers' rpc_info (prompt tokens found among shared blocks over
  those looked for, the warm-up chat included). prefix_ttft_ratio_in_process: the same through the model's
  layers in one BlockRange in this process, the first session still open.
- decode_ratio_vs_contiguous: decode tokens/s of the model's layers in one BlockRange in a process of its
  own (one torch thread; --sessions sessions of --prompt-tokens cached tokens, --steps batched decode
  steps), paged (blocks of 16 tokens) over contiguous: each session's cache one block (the layout before
  paging), or the code of --contiguous-tree (a checkout from before paging), in alternating rounds; the
  median of the rounds' ratios per session count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _decode_worker(
    model: str, sessions: list[int], prompt: int, steps: int, block_tokens: int
) -> dict[str, Any]:
    """Decode tokens/s per session count, in this process (which may run another checkout's code)."""
    import torch

    from swarm.models import Step, kv_cache
    from swarm.models.loading import resolve_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    source = resolve_model(model)
    layers = source.spec.num_layers
    cache_tokens = max(sessions) * (prompt + steps + 16)
    blocks = source.load_blocks(0, layers, cache_tokens=cache_tokens)
    paged = hasattr(kv_cache, "BLOCK_TOKENS")
    if paged and block_tokens:  # one block per session: the contiguous layout through the same code
        blocks.cache = kv_cache.KVCache(blocks.range, max(sessions) * block_tokens, block_tokens=block_tokens)
    hidden = source.spec.hidden_size
    out: dict[str, Any] = {"form": blocks.kernels.form(max(sessions)), "paged": paged}
    for count in sessions:
        ids = [f"s{count}-{i}" for i in range(count)]
        for sid in ids:
            blocks.open_session(sid, prompt + steps + 1)
            blocks.forward([Step(sid, torch.randn(prompt, hidden) * 0.1, 0, layers, 0)])
        started = time.perf_counter()
        for k in range(steps):
            blocks.forward([Step(sid, torch.randn(1, hidden) * 0.1, 0, layers, prompt + k) for sid in ids])
        out[str(count)] = count * steps / (time.perf_counter() - started)
        for sid in ids:
            blocks.close_session(sid)
    return out


def decode_ratio(args: argparse.Namespace) -> dict[str, Any]:
    """Paged over contiguous decode tokens/s, alternating processes round by round."""

    def run(tree: Path, block_tokens: int) -> dict[str, Any]:
        command = [sys.executable, str(REPO / "scripts" / "bench_kv.py"), "--worker", "--model", args.model]
        command += ["--sessions", *map(str, args.sessions), "--prompt-tokens", str(args.prompt_tokens)]
        command += ["--steps", str(args.steps), "--block-tokens", str(block_tokens)]
        env = {**os.environ, "PYTHONPATH": str(tree), "FLOWSWARM_THREADS": "1"}
        done = subprocess.run(
            command, env=env, cwd=tree, capture_output=True, text=True, timeout=1200, check=True
        )
        return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    contiguous_tree = Path(args.contiguous_tree) if args.contiguous_tree else REPO
    whole = 0 if args.contiguous_tree else (args.prompt_tokens + args.steps + 16 + 7) // 8 * 8
    rounds: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for r in range(args.rounds):
        print(f"decode round {r + 1}/{args.rounds}", file=sys.stderr)
        if r % 2:
            contiguous, paged = run(contiguous_tree, whole), run(REPO, 0)
        else:
            paged, contiguous = run(REPO, 0), run(contiguous_tree, whole)
        rounds.append((paged, contiguous))
    levels = [str(n) for n in args.sessions]
    return {
        "decode_ratio_vs_contiguous": {
            n: round(statistics.median(p[n] / c[n] for p, c in rounds), 4) for n in levels
        },
        "decode_tok_s": {
            "paged": {n: [round(p[n], 1) for p, _ in rounds] for n in levels},
            "contiguous": {n: [round(c[n], 1) for _, c in rounds] for n in levels},
        },
        "decode_form": rounds[0][0]["form"],
        "contiguous_from": "tree " + str(contiguous_tree)
        if args.contiguous_tree
        else "one block per session",
    }


def prefix_ttft_swarm(model: str, system_tokens: int = 400, question_tokens: int = 37) -> dict[str, Any]:
    """Through two peers: the first chat's time to first token over the next one's with the same system prompt."""
    import tempfile

    import torch

    from client import SwarmClient
    from swarm.models.loading import resolve_model
    from swarm.testing import LocalSwarm
    from swarm.transport import call_info

    source = resolve_model(model)
    n, vocab = source.spec.num_layers, source.spec.vocab_size
    generator = torch.Generator().manual_seed(0)

    def ids(count: int) -> list[int]:
        return [int(i) for i in torch.randint(3, vocab, (count,), generator=generator)]

    async def ttft(client: Any, prompt: list[int]) -> float:
        session = client.new_session(len(prompt) + 1)
        try:
            began = time.perf_counter()
            await session.forward(prompt, argmax_only=True)
            return time.perf_counter() - began
        finally:
            await session.close()

    async def hit_rates(client: Any, peer_ids: list[str]) -> list[float]:
        p2p = client.chain.p2p
        infos = [await call_info(p2p, peer_id, timeout_s=10.0) for peer_id in peer_ids]
        return [info.cache.prefix_hit_rate if info.cache else 0.0 for info in infos]

    extra = ["--no-follow-plan", "--session-share-prefixes"]
    ratios: list[float] = []
    with (
        tempfile.TemporaryDirectory(prefix="flowswarm-bench-kv-") as tmp,
        LocalSwarm(Path(tmp), model=model) as swarm,
    ):
        swarm.start_peer(layers=f"0:{n // 2}", name="kv-a", timeout_s=300, extra_args=extra)
        swarm.start_peer(layers=f"{n // 2}:{n}", name="kv-b", wait=False, extra_args=extra)
        swarm.wait_all_ready(timeout_s=300)
        with SwarmClient(
            swarm.initial_peers, model=model, spot_check_rate=0.0, step_timeout_s=300.0
        ) as client:
            client.run(ttft(client.aclient, ids(system_tokens + question_tokens)))  # warm up connections
            times: list[tuple[float, float]] = []
            for r in range(3):
                print(f"prefix round {r + 1}/3", file=sys.stderr)
                system = ids(system_tokens)
                first = client.run(ttft(client.aclient, system + ids(question_tokens)))
                second = client.run(ttft(client.aclient, system + ids(question_tokens)))
                times.append((first, second))
                ratios.append(first / second)
            rates = client.run(hit_rates(client.aclient, [p.peer_id for p in swarm.peers]))
    return {
        "prefix_ttft_ratio": round(statistics.median(ratios), 3),
        "prefix_ttft_s": [[round(a, 4), round(b, 4)] for a, b in times],
        "prefix_hit_rate": [round(r, 4) for r in rates],
    }


def prefix_ttft(model: str, system_tokens: int = 400, question_tokens: int = 37) -> dict[str, Any]:
    """First session's prefill time over a second's with the same system prompt (sharing its blocks)."""
    import torch

    from swarm.models import Step
    from swarm.models.loading import resolve_model

    torch.set_num_threads(1)
    source = resolve_model(model)
    layers, hidden = source.spec.num_layers, source.spec.hidden_size
    blocks = source.load_blocks(0, layers, cache_tokens=4096)
    blocks.cache.share_prefixes = True
    ratios = []
    for r in range(3):
        system = torch.randn(system_tokens, hidden) * 0.1
        times = []
        for sid in (f"first{r}", f"second{r}"):
            prompt = torch.cat([system, torch.randn(question_tokens, hidden) * 0.1])
            blocks.open_session(sid, 1024)
            started = time.perf_counter()
            blocks.forward([Step(sid, prompt, 0, layers, 0)])
            times.append(time.perf_counter() - started)
        ratios.append(times[0] / times[1])
        for sid in (f"first{r}", f"second{r}"):
            blocks.close_session(sid)
    cache = blocks.cache
    return {
        "prefix_ttft_ratio_in_process": round(statistics.median(ratios), 3),
        "prefix_hit_rate_in_process": round(
            cache.prefix_tokens_shared / max(1, cache.prefix_tokens_looked_up), 4
        ),
    }


def sessions_fit() -> dict[str, int]:
    """How many 500-token chats open and fill in 16384 cache tokens: paged, and reserved up front."""
    from swarm.errors import CapacityError
    from swarm.models.kv_cache import KVCache
    from swarm.types import LayerRange

    budget, max_length, used = 8 * 2048, 2048, 400 + 100
    clock = [0.0]
    cache = KVCache(LayerRange(0, 1), budget, clock=lambda: clock[0])
    fitted = 0
    while True:
        clock[0] += 1.0
        sid = f"chat{fitted}"
        try:
            cache.open(sid, max_length)
            cache.prepare({sid: used})
        except CapacityError:
            break
        if cache.evictions:  # it fit only by taking another's blocks
            break
        fitted += 1
    return {"paged": fitted, "reserved": budget // max_length}


async def _sybil(step_timeout_s: float) -> dict[str, Any]:
    import torch

    from swarm.errors import SessionEvicted
    from swarm.models.loading import resolve_model
    from swarm.peer.config import SessionConfig
    from swarm.peer.executor import Executor
    from swarm.peer.handlers import PeerHandlers
    from swarm.peer.state import Identity, Peer
    from swarm.wire import StepRequest

    torch.set_num_threads(1)
    source = resolve_model("tiny")
    config = SessionConfig(idle_timeout_s=60.0)
    peer = Peer(Identity("QmSelf", "bench", (), 1 << 30, 6), source.spec, Executor(), config)
    peer.serve(source.load_blocks(0, 2, cache_tokens=512))
    handlers = PeerHandlers(peer, p2p=None, config=config)  # type: ignore[arg-type]
    size, weights = source.spec.hidden_size, source.spec.weights_hash

    def step(sid: str, position: int, tokens: int) -> StepRequest:
        return StepRequest(
            sid, position, torch.randn(tokens, size), 0, 2, 256, weights, timeout_s=step_timeout_s
        )

    squatters = [(f"QmSybil{i:02d}", f"s{j}") for i in range(16) for j in range(2)]
    runner = asyncio.create_task(peer.executor.run())
    evicted: set[tuple[str, str]] = set()

    async def keep_alive() -> None:
        while True:
            await asyncio.sleep(2.0)
            for remote, sid in squatters:
                if (remote, sid) not in evicted:
                    try:
                        await handlers.rpc_step(step(sid, 1, 1), remote)
                    except SessionEvicted:
                        evicted.add((remote, sid))

    try:
        for remote, sid in squatters:
            await handlers.rpc_step(step(sid, 0, 1), remote)
        full = peer.current is not None and peer.current.blocks.cache.free_tokens == 0
        keeper = asyncio.create_task(keep_alive())
        await asyncio.sleep(2.5)  # a keep-alive round has passed
        latencies, failures, position = [], 0, 0
        for tokens in [9] + [1] * 40:
            started = time.perf_counter()
            try:
                await asyncio.wait_for(
                    handlers.rpc_step(step("honest", position, tokens), "QmHonest"), step_timeout_s
                )
            except Exception as error:  # noqa: BLE001 - any failure counts against the honest client
                failures += 1
                print(f"honest step failed: {error!r}", file=sys.stderr)
                break
            latencies.append(time.perf_counter() - started)
            position += tokens
            await asyncio.sleep(0.05)  # a client's head and round trip between steps
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
    return {
        "sybil_honest_ok": full and failures == 0 and position == 49,
        "sybil": {
            "identities": 16,
            "squatting_sessions": len(squatters),
            "cache_full_before": full,
            "honest_tokens": position,
            "honest_step_max_s": round(max(latencies, default=0.0), 4),
            "step_timeout_s": step_timeout_s,
            "squatters_told_evicted": len(evicted),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", metavar="OUT", help="also write the JSON object to this file")
    parser.add_argument("--quick", action="store_true", help="tiny model, small sizes (the CI smoke run)")
    parser.add_argument("--model", default=None, help="default | tiny[:SEED] | checkpoint dir")
    parser.add_argument("--sessions", type=int, nargs="+", default=None, help="decode session counts (1 8)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="cached tokens per session (512)")
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps (64)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating decode rounds (4)")
    parser.add_argument(
        "--contiguous-tree", default="", help="a checkout from before paging, as the reference"
    )
    parser.add_argument("--step-timeout-s", type=float, default=5.0, help="the honest client's step timeout")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--block-tokens", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    quick = args.quick
    args.model = args.model or ("tiny" if quick else "default")
    args.sessions = args.sessions or ([1, 2] if quick else [1, 8])
    args.prompt_tokens = args.prompt_tokens or (40 if quick else 512)
    args.steps = args.steps or (4 if quick else 64)
    args.rounds = args.rounds or (2 if quick else 4)
    if args.worker:
        print(
            json.dumps(
                _decode_worker(args.model, args.sessions, args.prompt_tokens, args.steps, args.block_tokens)
            )
        )
        return
    result: dict[str, Any] = {"model": args.model, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    result.update(asyncio.run(_sybil(args.step_timeout_s)))
    result["sessions_fit"] = sessions_fit()
    result.update(prefix_ttft(args.model))
    result.update(prefix_ttft_swarm(args.model))
    result.update(decode_ratio(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
