"""Prefill chunks of the peers that share one device take turns while sessions decode on it.

Several peers on one machine (a demo, a CPU host, a GPU shared by two peers) each run their own prefill thread.
A pipelined long prompt (HPipe) keeps every peer of its route prefilling at once: on the 2-core benchmark
machine three chunks then ran beside every decode step, and each hop of a decode round, its forward call, its
hand-offs between threads and processes, and the client's head, slowed at once (decode p99 while a 2048-token
prompt was prefilled: 85-96 ms, 2.0-2.2x the p50 alone; taking turns: 67-73 ms, 1.5-1.7x, with the prompt's
prefill 12-30 % slower; scripts/bench_e2e.py). Turns are taken only while sessions decode on the peer: a prompt
on an idle swarm keeps its pipeline's peers computing together. A chunk of a long prefill takes its turn alone;
short prefills (a spot-check's window, a chat's next message: one call each) share theirs, so they wait for a
long prompt's chunk but not for each other (see Executor._prefill_forward).

Taking a turn alone has the priority: shared turns overlapping one another (spot-checks of many clients, the
next messages of many chats) would otherwise keep a long prompt's chunk from its turn for good (a ``flock``
waiting to be held alone does not hold up new shared holders). So a turn goes through a gate first, a second
``flock`` taken alone by a turn that will be alone and shared by a shared one, and let go once the turn is had:
a chunk waiting for its turn holds the gate, and shared turns asked for meanwhile wait behind it.

A turn is a ``flock`` on a file per device in the cache directory: the kernel drops it with the process, so a
peer that dies never holds it. A peer that hangs holding it (stopped, or its device stuck) would hold up every
other peer's prefills: a turn not had within ``wait_s`` (a chunk takes well under a second) is gone without,
and so is every turn for ``skip_s`` after that. Peers of other users, or of another cache directory, do not see
the file.

Decode calls are seen across the device too (``DecodeCalls``, ``device_decode_wait_s``; its figures are in
swarm/peer/config.py): a chunk waits between two layers for the decode call of its own peer running
beside it (swarm/peer/executor.py), and a long prompt's chunk then for those of the other peers on the device,
which share its cores (traced on 2 cores: decode calls waited 10-70 ms in the run queue while another peer's
chunk ran). Each decode call holds a shared ``flock`` on a second file per device; a chunk between two
layers looks whether it could take that file alone, and if not looks again after a millisecond, for at most
``wait_s``: a chunk behind back-to-back decode calls of three peers still runs a layer per ``wait_s``.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import torch

from swarm.config import cache_dir

try:
    import fcntl
except ImportError:  # not POSIX (Windows): peers go without turns
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)
TURNS_SUPPORTED = fcntl is not None


def _gpu_uuid(index: int) -> str | None:
    try:
        return str(torch.cuda.get_device_properties(index).uuid)
    except (AssertionError, RuntimeError, AttributeError):  # no CUDA here, or a torch without uuid
        return None


def turns_path(
    device: str, directory: Path | None = None, gpu_uuid: Callable[[int], str | None] = _gpu_uuid
) -> Path:
    """The lock file of ``device`` ("cpu", "cuda", "cuda:1", ...). A GPU is named by its UUID where torch gives
    one: "cuda:0" is whichever GPU a peer's CUDA_VISIBLE_DEVICES puts first, so two peers on different GPUs
    would take turns for nothing. Otherwise by its index ("cuda" is GPU 0, as torch takes it)."""
    parsed = torch.device(device)
    index = parsed.index or 0
    uuid = gpu_uuid(index) if parsed.type == "cuda" else None
    name = re.sub(r"[^a-z0-9]", "", f"{parsed.type}{uuid.lower() if uuid else index}")
    return (directory or cache_dir()) / f"prefill-turns-{name}.lock"


def decode_calls_path(turns: Path) -> Path:
    """The file of a device's decode calls, beside its turns' file (``turns_path``)."""
    return turns.with_name(turns.name.replace("prefill-turns-", "decode-calls-", 1))


class DecodeCalls:
    """This peer's side of its device's decode calls (see the module doc): ``running`` on the decode thread,
    ``wait`` on the prefill thread, each with a file of its own (two holders of one file cannot tell each other
    apart). Where locks fail (an unwritable directory, a file system without them), neither does anything."""

    def __init__(
        self,
        path: Path,
        wait_s: float,
        poll_s: float = 0.001,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.wait_s = wait_s
        self.poll_s = poll_s
        self.clock = clock
        self.sleep = sleep
        self.waited = 0  # how many waits found a decode call running (for tests)
        try:
            self._decoding: IO[bytes] | None = open(path, "a+b")  # noqa: SIM115 (held for the peer's life)
            self._looking: IO[bytes] | None = open(path, "a+b")  # noqa: SIM115
        except OSError as e:
            logger.warning("no decode calls file %s (%s): chunks wait only for this peer's calls", path, e)
            self._decoding = self._looking = None

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Held by a decode call for its length. It never waits: the file is only ever held alone for the
        instant a chunk looks, and a call that meets that instant goes unseen."""
        held = self._decoding
        if held is not None:
            try:
                fcntl.flock(held, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                held = None
        try:
            yield
        finally:
            if held is not None:
                fcntl.flock(held, fcntl.LOCK_UN)

    def wait(self) -> None:
        """Return once no decode call runs on the device, or after ``wait_s``."""
        if self._looking is None or self.wait_s <= 0:
            return
        deadline = None
        while True:
            try:
                fcntl.flock(self._looking, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                now = self.clock()
                if deadline is None:
                    deadline = now + self.wait_s
                    self.waited += 1
                if now >= deadline:
                    return
                self.sleep(self.poll_s)
                continue
            except OSError:
                return
            fcntl.flock(self._looking, fcntl.LOCK_UN)
            return

    def close(self) -> None:
        for file in (self._decoding, self._looking):
            if file is not None:
                file.close()
        self._decoding = self._looking = None


class DeviceTurns:
    """This peer's side of its device's turns, used from one thread (the prefill thread).

    A lock not free at once is waited for on a daemon thread of its own, so that the wait can end: a wait given
    up on leaves that thread blocked until the lock comes, and it lets the lock go at once then. While such a
    wait is still pending, no other is started (each holds its files open). A turn that fails for another reason
    (the cache directory unwritable, a file system without locks) is gone without, and so are all after it."""

    def __init__(
        self,
        path: Path,
        wait_s: float = 2.0,
        skip_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.wait_s = wait_s
        self.skip_s = skip_s
        self.clock = clock
        self._skip_until = -float("inf")
        self.waiting: threading.Thread | None = None  # a wait given up on, until the lock has come and gone
        self._broken = False

    @contextlib.contextmanager
    def turn(self, alone: bool) -> Iterator[bool]:
        """Hold the turn for the ``with`` body, ``alone`` or shared with other shared holders; yields whether it
        was had (False: gone without, see the module doc)."""
        if self._broken or self.clock() < self._skip_until or (self.waiting and self.waiting.is_alive()):
            yield False
            return
        mode = fcntl.LOCK_EX if alone else fcntl.LOCK_SH
        try:
            # closed by whoever lets the locks go
            wait = _Wait(open(self.path.with_suffix(".gate"), "a+b"), open(self.path, "a+b"))
            free = wait.now(mode)  # most turns are: no other thread then
        except OSError as e:
            self._broken = True
            logger.warning("prefill turns on %s failed (%s); this peer goes without them", self.path, e)
            yield False
            return
        locker = None
        if not free:
            locker = threading.Thread(target=wait.lock, args=(mode,), name="prefill-turn", daemon=True)
            locker.start()
        if not wait.had(self.wait_s):
            self.waiting = locker
            self._skip_until = self.clock() + self.skip_s
            logger.warning(
                "no prefill turn on %s within %.1f s (a peer holds it); prefilling without turns for %.0f s",
                self.path.name,
                self.wait_s,
                self.skip_s,
            )
            yield False
            return
        try:
            yield True
        finally:
            wait.unlock()


class _Wait:
    """One wait for the lock (through the gate, see the module doc) on the locker thread, which the prefill
    thread may give up on."""

    def __init__(self, gate: IO[bytes], file: IO[bytes]) -> None:
        self.gate = gate
        self.file = file
        self._state = threading.Lock()
        self._locked = threading.Event()
        self._given_up = False

    def _through_gate(self, flags: int) -> None:
        fcntl.flock(self.gate, flags)
        try:
            fcntl.flock(self.file, flags)
        finally:
            fcntl.flock(self.gate, fcntl.LOCK_UN)

    def now(self, mode: int) -> bool:
        """Take the lock if the gate and the lock are free now."""
        try:
            self._through_gate(mode | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError:
            self._close()
            raise
        self._locked.set()
        return True

    def lock(self, mode: int) -> None:
        try:
            self._through_gate(mode)
        except OSError:
            logger.warning("waiting for a prefill turn failed", exc_info=True)
            self._close()
            return  # the prefill thread's wait times out
        with self._state:
            if not self._given_up:
                self._locked.set()
                return
        self.unlock()  # nobody waits for it any more

    def had(self, timeout_s: float) -> bool:
        """Whether the lock came within ``timeout_s``; if not, it is let go as soon as it comes."""
        if self._locked.wait(timeout_s):
            return True
        with self._state:
            if self._locked.is_set():  # it came just now
                return True
            self._given_up = True
            return False

    def unlock(self) -> None:
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self._close()

    def _close(self) -> None:
        self.gate.close()
        self.file.close()
