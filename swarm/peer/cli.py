"""``swarm-peer``: join the swarm as a peer, or print the live swarm.

    swarm-peer join [--initial-peers MADDR ...] [--model default|tiny|PATH] [--layers auto|A:B] ...
    swarm-peer status --initial-peers MADDR ... [--model default] [--json]

uvloop is installed here, at the entry point, and nowhere else.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from swarm import config as swarm_config
from swarm.peer.config import PeerConfig
from swarm.settings import add_arguments, from_arguments

if TYPE_CHECKING:  # hivemind and torch load only when a command runs, so argument errors come back fast
    from swarm.dht import SwarmSnapshot

logger = logging.getLogger("swarm.peer")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarm-peer", description="A peer of a FlowSwarm LLM serving swarm."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    join = commands.add_parser("join", help="load layers and serve them to the swarm")
    add_arguments(join, PeerConfig)  # every option comes from a PeerConfig field: written once, there

    status = commands.add_parser("status", help="print the live swarm")
    status.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR")
    status.add_argument("--model", default="default", help="which model's swarm to read")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def peer_config(args: argparse.Namespace) -> PeerConfig:
    return from_arguments(PeerConfig, args)


def check_before_join(config: PeerConfig) -> None:
    """What the machine lacks for this config, as a ValueError naming the fix, before the DHT, p2p or any
    weight load starts (a CUDA device without a CUDA build of torch or a driver; --quant without bitsandbytes)."""
    from swarm.models.device import parse_device

    device = parse_device(config.device)
    if config.quant != "none":
        import torch

        from swarm.models.quant import check_runs

        check_runs(config.quant, device, getattr(torch, config.torch_dtype_name))


async def _join(config: PeerConfig) -> None:
    from swarm.peer.server import run  # torch and the model code load only for `join`

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await run(config, stop)


def snapshot_json(
    snapshot: SwarmSnapshot,
    num_layers: int,
    background: Mapping[str, tuple[tuple[str, int, int], ...]] | None = None,
) -> dict[str, object]:
    """The ``status --json`` document; ``background``: each peer's background traffic as its rpc_info said
    (InfoReply.background_bytes), where it answered."""
    background = background or {}
    from swarm.dht import coverage

    peers = [
        {
            "peer_id": r.peer_id,
            "name": r.name,
            "state": r.state,
            "quant": r.quant,
            "range": [r.range_start, r.range_end],
            "older_ranges": [[o.start, o.end, o.sessions] for o in r.older_ranges],  # [start, end, sessions]
            "decode_tokens_s": r.decode_layer_tokens_s_b1,
            "decode_tokens_s_b8": r.decode_layer_tokens_s_b8,
            "prefill_tokens_s": r.prefill_layer_tokens_s,
            "free_cache_tokens": r.free_cache_tokens,
            "active_sessions": r.active_sessions,
            "reachable": r.reachable,
            "links": {
                p: {"rtt_s": m.rtt_s, "bandwidth_bytes_s": m.bandwidth_bytes_s} for p, m in r.links.items()
            },
            # {cause: {"sent": bytes, "received": bytes}} so far; {} when the peer did not answer
            "background_bytes": {
                c: {"sent": s, "received": rx} for c, s, rx in background.get(r.peer_id, ())
            },
        }
        for r in sorted(snapshot.peers.values(), key=lambda r: (r.range_start, r.peer_id))
    ]
    plan = None
    if snapshot.plan is not None:
        body = snapshot.plan.plan
        plan = {
            "epoch": snapshot.plan.epoch,
            "max_flow_tokens_s": body.get("max_flow_tokens_s"),
            "placement": body.get("placement"),
        }
    return {
        "peers": peers,
        "coverage": coverage(snapshot, num_layers),
        "planner": snapshot.planner_peer_id,
        "plan": plan,
    }


def _print_status(data: dict[str, object]) -> None:
    peers = data["peers"]
    assert isinstance(peers, list)
    print(f"{len(peers)} peers; coverage per layer: {data['coverage']}; planner: {data['planner']}")
    for p in peers:
        quant = "" if p["quant"] == "none" else f"{p['quant']} "
        print(
            f"  {p['name']:>12} {p['peer_id'][-10:]} layers {p['range'][0]}:{p['range'][1]} {p['state']:<8} "
            f"{quant}decode {p['decode_tokens_s']:.0f} tok/s/layer, free cache {p['free_cache_tokens']}, "
            f"sessions {p['active_sessions']}"
        )
    if data["plan"]:
        print(f"plan: {data['plan']}")


async def _status(args: argparse.Namespace) -> None:
    from swarm.dht import DHTConfig, Directory, SwarmDHT
    from swarm.models.loading import resolve_model

    spec = (await asyncio.to_thread(resolve_model, args.model)).spec
    dht = await SwarmDHT.create(
        DHTConfig(initial_peers=tuple(args.initial_peers), client_mode=True), spec.weights_hash
    )
    try:
        snapshot = await Directory(dht).snapshot()
        background = await _background_bytes(await dht.replicate_p2p(), snapshot)
    finally:
        await dht.aclose()
    data = snapshot_json(snapshot, spec.num_layers, background)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        _print_status(data)


async def _background_bytes(p2p: Any, snapshot: SwarmSnapshot) -> dict[str, tuple[tuple[str, int, int], ...]]:
    """Each serving peer's background traffic by cause, asked of all at once (rpc_info); silent ones left out."""
    from swarm.transport import call_info

    async def ask(record: Any) -> tuple[str, tuple[tuple[str, int, int], ...]]:
        try:
            info = await call_info(
                p2p, record.peer_id, maddrs=list(record.maddrs), timeout_s=STATUS_INFO_TIMEOUT_S
            )
        except Exception as e:  # a peer that does not answer just has no traffic figures
            logging.getLogger(__name__).debug("peer %s did not answer info: %r", record.peer_id[-8:], e)
            return record.peer_id, ()
        return record.peer_id, info.background_bytes

    answers = await asyncio.gather(*(ask(r) for r in snapshot.serving().values()))
    return {pid: triples for pid, triples in answers if triples}


STATUS_INFO_TIMEOUT_S = 5.0
GIL_SWITCH_INTERVAL_S = 0.0005


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The executor thread (torch) and the event loop (RPCs) share the GIL. A step arriving while another
    # session's step computes waits for the executor to give the GIL up: up to the switch interval, 5 ms by
    # default, per hop; a shorter interval lets it in sooner (docs/benchmarks.md: the GIL switch interval).
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    logging.basicConfig(
        level=swarm_config.log_level(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("hivemind", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        if args.command == "join":
            config = peer_config(args)
            check_before_join(config)
            coro = _join(config)
        else:
            coro = _status(args)
        import uvloop

        uvloop.run(coro)
    except ValueError as e:
        print(f"swarm-peer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        _reap_children()
    return 0


def _reap_children() -> None:
    """hivemind's DHT runs in a child process; if its shutdown hung, do not let it keep us from exiting."""
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(3)
        if child.is_alive():
            child.kill()
            child.join(3)


if __name__ == "__main__":
    sys.exit(main())
