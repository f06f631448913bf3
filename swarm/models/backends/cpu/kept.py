"""Facts of this machine measured once and kept in the cache directory, so a process starting again on the
same machine does not spend seconds timing them again (swarm.models.backends.cpu.matmul's forms, swarm.models.backends.cpu.argmax's
screen). Each file maps a key (the machine, the torch build and the shapes timed) to what was measured; a
damaged or unreadable file only means measuring again. The processes of one machine measure one at a time
(``one_at_a_time``): peers and clients started together would otherwise time each other's memory traffic, and
keep for good what none of them would have measured alone."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from swarm.models.checkpoints import write_json_atomic

logger = logging.getLogger(__name__)


def machine(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU and torch build a measurement holds for: the CPU's name, family and model, and a digest of the
    instruction sets it offers. A VM may name CPUs of different generations alike ("AMD EPYC" for a Zen 3 with
    AVX2 only and a Zen 5 with AVX-512), and what runs fastest on them differs."""
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo) as lines:
            for line in lines:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model", "flags", "Features"):
                    fields.setdefault(key, value.strip())
                elif not line.strip() and fields:
                    break  # the first CPU's block is enough: the others are alike
    except OSError:
        pass
    flags = fields.get("flags") or fields.get("Features") or ""
    digest = hashlib.sha256(flags.encode()).hexdigest()[:12] if flags else "unknown"
    return (
        f"{fields.get('model name') or 'unknown CPU'} (family {fields.get('cpu family', '?')}, model "
        f"{fields.get('model', '?')}, flags {digest}), {os.cpu_count()} CPUs, torch {torch.__version__}"
    )


@contextlib.contextmanager
def one_at_a_time(path: Path) -> Iterator[None]:
    """Held by one process of the machine at a time while it measures what it keeps in ``path``: an exclusive
    ``flock`` on a file beside it, which the kernel drops with the process. A caller that waited reads ``path``
    again inside, since the one before it may have kept the answer. Where no lock can be had (an unwritable
    directory) it measures anyway."""
    try:
        lock = open(path.with_name(f".{path.name}.lock"), "a")  # noqa: SIM115 (closed below, after the lock)
    except OSError as e:
        logger.info("measuring without a lock on %s: %s", path.name, e)
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_kept(path: Path, key: str) -> object | None:
    """What is kept in ``path`` under ``key``, or None (nothing kept, or the file unreadable or not a map)."""
    try:
        kept = json.loads(path.read_text())
        return kept.get(key) if isinstance(kept, dict) else None
    except (OSError, ValueError) as e:
        if not isinstance(e, FileNotFoundError):
            logger.info("ignoring %s: %s", path.name, e)
        return None


def keep(path: Path, key: str, value: object) -> None:
    """Keep ``value`` in ``path`` under ``key`` beside the rest."""
    try:
        try:
            kept = json.loads(path.read_text())
        except (OSError, ValueError):
            kept = {}
        kept = kept if isinstance(kept, dict) else {}
        kept[key] = value
        write_json_atomic(path, kept)
    except OSError as e:
        logger.info("could not keep %s: %s", path.name, e)
