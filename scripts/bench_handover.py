"""Hand-over cost on the default model: a session of N tokens moved between two in-process peers.

Every chunk goes through the real wire encoding into the receiver's rpc_handover (no network: the figure is
the freeze + read + encode + decode + install time, the part a link's bandwidth does not set). Prints JSON.

    python scripts/bench_handover.py --tokens 128 512 1024
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import torch

from swarm.models.loading import resolve_model
from swarm.peer import handover as handover_module
from swarm.peer.config import SessionConfig
from swarm.peer.executor import Executor
from swarm.peer.handlers import PeerHandlers
from swarm.peer.state import Identity, Peer, session_key
from swarm.wire import HandoverRequest, StepRequest, decode_request, encode_request


def _handlers(name: str, model: str, cache_tokens: int) -> PeerHandlers:
    source = resolve_model(model)
    identity = Identity(name, name, (), 1 << 34, source.spec.num_layers)
    peer = Peer(identity, source.spec, Executor(), SessionConfig(max_remote_cache_fraction=1.0))
    peer.serve(source.load_blocks(0, source.spec.num_layers, cache_tokens=cache_tokens))
    return PeerHandlers(peer, p2p=None)  # type: ignore[arg-type]


async def _measure(a: PeerHandlers, b: PeerHandlers, tokens: int) -> dict[str, float | int]:
    sent: list[int] = []

    async def call(p2p: object, peer_id: str, request: HandoverRequest, **_: object) -> bool:
        data = encode_request(request)
        sent.append(len(data))
        decoded = decode_request(data)
        assert isinstance(decoded, HandoverRequest)
        return (await b.rpc_handover(decoded, "QmSender")).installed

    handover_module.call_handover = call  # type: ignore[assignment]
    spec, sid = a.peer.spec, f"s{tokens}"
    hidden = torch.randn(tokens, spec.hidden_size)
    end = spec.num_layers
    await a.rpc_step(StepRequest(sid, 0, hidden, 0, end, tokens + 1, spec.weights_hash), "QmClient")
    served = a.peer.find(session_key("QmClient", sid))
    assert served is not None
    began = time.perf_counter()
    moved = await a.handover.hand_over_all([served], {"QmB": b.peer.record()})
    elapsed = time.perf_counter() - began
    await b.peer.close(session_key("QmClient", sid))
    return {
        "tokens": tokens,
        "moved": moved,
        "seconds": round(elapsed, 4),
        "chunks": len(sent),
        "bytes": sum(sent),
    }


async def main(model: str, token_counts: list[int]) -> None:
    torch.set_num_threads(1)
    cache = max(token_counts) + 1
    a, b = _handlers("QmA", model, cache), _handlers("QmB", model, cache)
    tasks = [asyncio.create_task(h.peer.executor.run()) for h in (a, b)]
    try:
        for tokens in token_counts:
            print(json.dumps({"model": a.peer.spec.name, **await _measure(a, b, tokens)}))
    finally:
        for task in tasks:
            task.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 1024])
    args = parser.parse_args()
    asyncio.run(main(args.model, args.tokens))
