"""Planner solves in a process of their own, at lower priority, so a solve never stalls serving.

A MILP solve holds the CPU (and, through the solver's Python bindings, the GIL) for seconds. Run in a thread of
the serving process, it delayed every RPC of that peer: clients saw 3-4 s gaps between tokens while the planner
peer re-solved. Here the solve runs in one long-lived child process (spawned, not forked: the serving process
has torch and hivemind threads), niced so the OS prefers the serving process when both want the same core.
The child exits when its parent dies.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

from swarm.dht.process import start_parent_watch

logger = logging.getLogger(__name__)
T = TypeVar("T")
NICENESS = 10


class SolverProcess:
    """Runs picklable functions in one niced child process; ``close()`` ends it."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._pool is None:
            context = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(
                1, mp_context=context, initializer=_init, initargs=(os.getpid(),)
            )
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, _call, fn, args, kwargs)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


class InThread:
    """The same interface on a thread of this process (tests, and the comparison in the benchmark)."""

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.to_thread(fn, *args, **kwargs)

    def close(self) -> None:
        pass


def _call(fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
    return fn(*args, **kwargs)


def _init(parent_pid: int) -> None:
    try:
        os.nice(NICENESS)
    except OSError:  # not allowed here: still off the serving process
        pass
    start_parent_watch(parent_pid)
