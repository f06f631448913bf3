"""`swarm-chat --initial-peers MADDR...`: serve the web chat, the OpenAI API, /status and /metrics."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from client.web.config import WebConfig, parse_config
from client.web.server import serve
from swarm import config as swarm_config


def _ready(url: str) -> None:
    print(
        f"swarm-chat: serving {url} (chat), {url}status (status), {url}v1 (OpenAI API), {url}metrics",
        flush=True,
    )


async def _main(config: WebConfig) -> None:
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        await serve(config, _ready)
    except asyncio.CancelledError:
        logging.getLogger(__name__).info("stopped")


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    logging.basicConfig(
        level=swarm_config.log_level(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("hivemind", "transformers", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    import uvloop

    try:
        uvloop.run(_main(config))
    except KeyboardInterrupt:
        return 130
    except ValueError as error:
        print(f"swarm-chat: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
