"""The hivemind DHT child process, made to die with its parent.

hivemind runs the DHT in a forked child, which starts the ``p2pd`` daemon as its own child. When the peer is
SIGKILLed (or crashes) neither learns of it: both were seen running minutes later, and the orphaned DHT child
ignored SIGTERM. So the child watches its parent: once the parent is gone it kills its own descendants (p2pd)
and exits. (PR_SET_PDEATHSIG alone would kill the DHT child at once but leave p2pd behind.)
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import hivemind
import psutil
from hivemind.p2p import P2P

WATCH_INTERVAL_S = 0.5


class ParentBoundDHT(hivemind.DHT):
    """A hivemind.DHT whose child process, and everything it started, ends when the process that forked it ends.
    ``p2pd_threads`` > 0 runs its p2pd daemon with that many Go threads (GOMAXPROCS; swarm.dht.node);
    ``p2pd_flags`` are added to its command line (``{"relayService": "0"}`` -> ``-relayService=0``)."""

    def __init__(
        self, *args: Any, p2pd_threads: int = 0, p2pd_flags: dict[str, str] | None = None, **kwargs: Any
    ) -> None:
        # before hivemind's __init__, which may fork the child already
        self._p2pd_threads = p2pd_threads
        self._p2pd_flags = dict(p2pd_flags or {})
        super().__init__(*args, **kwargs)

    def run(self) -> None:  # runs in the child
        start_parent_watch(os.getppid(), before_exit=lambda: reap_descendants(os.getpid()))
        if self._p2pd_threads > 0:  # hivemind starts p2pd with this process's environment
            os.environ["GOMAXPROCS"] = str(self._p2pd_threads)
        if self._p2pd_flags:
            add_daemon_flags(self._p2pd_flags)
        super().run()


def add_daemon_flags(flags: dict[str, str]) -> None:
    """Make every p2pd this process starts get ``flags`` too. hivemind's P2P.create has no option for p2pd's
    relay settings (limits, static relays), but builds the command line in one static method: this wraps it.
    Only in the DHT's own child process, where every P2P started is the one this DHT runs on."""
    build = P2P._make_process_args

    def with_flags(*args: Any, **kwargs: Any) -> list[str]:
        return [*build(*args, **kwargs), *(f"-{name}={value}" for name, value in flags.items())]

    P2P._make_process_args = staticmethod(with_flags)


def start_parent_watch(parent_pid: int, before_exit: Callable[[], None] = lambda: None) -> None:
    """In a child process: once ``parent_pid`` is gone, call ``before_exit`` and exit (a daemon thread polls)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCH_INTERVAL_S)
        before_exit()
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def reap_descendants(pid: int) -> None:
    """SIGKILL every descendant of ``pid`` (not ``pid`` itself)."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(children, timeout=5)
