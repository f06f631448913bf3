"""OS names for the threads that do a process's work, so per-thread CPU says which work it is.

Python names its threads for itself only: in ``top -H`` and ``/proc/<pid>/task/<tid>/comm`` every thread of a
peer or client is "python". Named, a peer's decode and prefill lanes and a client's head and event loop show
apart (scripts/bench_e2e.py reports CPU per token by them), which is what tells where a swarm's CPU goes.

    name_os_thread("swarm-decode")    # in the thread itself; at most 15 bytes stay (the kernel's limit)
"""

from __future__ import annotations

import ctypes
import logging
import sys

logger = logging.getLogger(__name__)

_PR_SET_NAME = 15  # prctl option, <linux/prctl.h>
MAX_NAME_BYTES = 15  # TASK_COMM_LEN - 1


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` in the OS (cut to MAX_NAME_BYTES); nothing where the OS has no such call."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:MAX_NAME_BYTES], 0, 0, 0)
    except (OSError, AttributeError) as e:  # no prctl in this libc: the thread keeps its name
        logger.debug("could not name thread %s: %s", name, e)
