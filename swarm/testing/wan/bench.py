"""The end every namespace benchmark shares: stop cleanly on SIGTERM, refuse without namespaces, print one JSON
object (and write it to ``--json``)."""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from swarm.testing.wan.net import namespaces_unavailable


def bench_main(name: str, run: Callable[[], dict[str, Any]], json_path: str | None) -> None:
    """Run the benchmark ``name``: ``run()`` gives its figures."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the `with` blocks stop peers and router
    reason = namespaces_unavailable()
    if reason:
        sys.exit(f"{name} needs network namespaces: {reason}")
    text = json.dumps(run())
    if json_path:
        Path(json_path).write_text(text + "\n")
    print(text)
