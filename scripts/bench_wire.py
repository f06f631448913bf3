#!/usr/bin/env python
"""What one message costs between two hivemind P2P instances on 127.0.0.1, and what encoding it costs. Prints JSON.

    .venv/bin/python scripts/bench_wire.py [--calls 300] [--hidden-size 576]

Round trips of a decode step's size (one token of hidden states) by: a hivemind unary call; a fresh libp2p stream
per message; a stream kept open between messages (what swarm.transport does), and the same with hivemind's
send_raw_data, which writes the length prefix apart. Then encode/decode of a StepRequest and a StepReply of that
size, in float32 and bfloat16. Medians, in microseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from functools import partial

import torch
from hivemind.p2p import P2P

from swarm.dht.node import ReachabilityConfig
from swarm.transport.streams import read_frame, send_frame
from swarm.wire import Hop, StepReply, StepRequest, decode_reply, decode_request, encode_reply, encode_request


async def _timed(calls: int, once: Callable[[], Awaitable[object]]) -> float:
    for _ in range(min(20, calls)):  # warm-up
        await once()
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        await once()
        times.append(time.perf_counter() - began)
    return 1e6 * statistics.median(times)


async def _round_trips(calls: int, payload: bytes) -> dict[str, float]:
    # loopback only, and none of hivemind's reachability defaults (UPnP, AutoNAT, relays: traffic toward the
    # gateway): ReachabilityConfig's defaults, as every FlowSwarm process has them
    options = {"host_maddrs": ["/ip4/127.0.0.1/tcp/0"], **ReachabilityConfig().p2p_kwargs()}
    server = await P2P.create(**options)
    client = await P2P.create(initial_peers=[str(m) for m in await server.get_visible_maddrs()], **options)
    try:

        async def echo_unary(request: bytes, _remote: object) -> bytes:
            return request

        async def echo_stream(
            _info: object, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
        ) -> None:
            try:
                while True:
                    await send_frame(writer, await read_frame(reader))
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        await server._client.add_unary_handler("bench.unary", echo_unary)
        await server.add_binary_stream_handler("bench.stream", echo_stream)
        target = server.peer_id

        async def unary() -> None:
            await client._client.call_unary_handler(target, "bench.unary", payload)

        async def fresh_stream() -> None:
            _, reader, writer = await client.call_binary_stream_handler(target, "bench.stream")
            await send_frame(writer, payload)
            await read_frame(reader)
            writer.close()

        _, reader, writer = await client.call_binary_stream_handler(target, "bench.stream")

        async def open_stream() -> None:
            await send_frame(writer, payload)
            await read_frame(reader)

        # hivemind's send_raw_data, which writes the length prefix apart: a send of its own per frame
        async def open_stream_prefix_apart() -> None:
            await P2P.send_raw_data(payload, writer)
            await read_frame(reader)

        return {
            "unary_call_us": await _timed(calls, unary),
            "fresh_stream_us": await _timed(calls // 3, fresh_stream),
            "open_stream_us": await _timed(calls, open_stream),
            "open_stream_prefix_apart_us": await _timed(calls, open_stream_prefix_apart),
        }
    finally:
        await client.shutdown()
        await server.shutdown()


def _encoding(hidden_size: int, calls: int) -> dict[str, dict[str, float]]:
    route = tuple(
        Hop("Qm" + "x" * 44, ("/ip4/127.0.0.1/tcp/1/p2p/Qm" + "x" * 44,), 10 * i, 10 * i + 10) for i in (1, 2)
    )
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        hidden = torch.randn(1, hidden_size).to(dtype)
        request = StepRequest("s" * 32, 40, hidden, 0, 10, 128, "h" * 64, route, 30.0)
        reply = StepReply(hidden)
        data, reply_data = encode_request(request), encode_reply(reply)
        cases: dict[str, Callable[[], object]] = {
            "encode_request_us": partial(encode_request, request),
            "decode_request_us": partial(decode_request, data),
            "encode_reply_us": partial(encode_reply, reply),
            "decode_reply_us": partial(decode_reply, reply_data),
        }
        row: dict[str, float] = {"request_bytes": len(data)}
        for name, fn in cases.items():
            times = []
            for _ in range(calls):
                began = time.perf_counter()
                fn()
                times.append(time.perf_counter() - began)
            row[name] = 1e6 * statistics.median(times)
        out[str(dtype).removeprefix("torch.")] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--hidden-size", type=int, default=576, help="576: SmolLM2-135M")
    args = parser.parse_args()
    torch.set_num_threads(1)
    payload = bytes(4 * args.hidden_size + 300)  # a float32 decode step and its envelope
    report = {"payload_bytes": len(payload), **asyncio.run(_round_trips(args.calls, payload))}
    report["encoding"] = _encoding(args.hidden_size, 10 * args.calls)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
