"""Prefill chunks of the peers that share one device take turns while sessions decode on it.

Several peers on one machine (a demo, a CPU host, a GPU shared by two peers) each run their own prefill thread.
A pipelined long prompt (HPipe) keeps every peer of its route prefilling at once: on the 2-core benchmark
machine three chunks then ran beside every decode step, and each hop of a decode round, its forward call, its
hand-offs between threads and processes, and the client's head, slowed at once (decode p99 while a 2048-token
prompt was prefilled: 85-96 ms, 2.0-2.2x the p50 alone; taking turns: 67-71 ms, 1.5-1.6x, with the prompt's
prefill 12-30 % slower; scripts/bench_e2e.py). Turns are taken only while sessions decode on the peer: a prompt
on an idle swarm keeps its pipeline's peers computing together. A chunk of a long prefill takes its turn alone;
short prefills (a spot-check's window, a chat's next message: one call each) share theirs, so they wait for a
long prompt's chunk but not for each other (see Executor._prefill_forward).

A turn is an exclusive ``flock`` on a file per device in the cache directory: the kernel drops it with the
process, so a peer that dies never holds it. Peers of other users, or of another cache directory, do not see it.
"""

from __future__ import annotations

import contextlib
import fcntl
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from swarm.config import cache_dir


def turns_path(device: str, directory: Path | None = None) -> Path:
    """The lock file of ``device`` ("cpu", "cuda", "cuda:1", ...): "cuda" is GPU 0, as torch takes it."""
    parsed = torch.device(device)
    name = re.sub(r"[^a-z0-9]", "", f"{parsed.type}{parsed.index or 0}")
    return (directory or cache_dir()) / f"prefill-turns-{name}.lock"


@contextlib.contextmanager
def turn(path: Path, alone: bool) -> Iterator[None]:
    """Hold ``path``'s turn, ``alone`` or shared with other shared holders: wait while another peer holds it
    alone, or, to hold it alone, while anyone holds it (call it on a worker thread, never on the event loop)."""
    with open(path, "a+b") as file:
        fcntl.flock(file, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)
