"""What peers sharing one device do for each other's decode steps, on only while another peer shares it.

Several peers on one machine (a demo, a CPU host, a GPU shared by two peers) each run their own prefill thread.
A pipelined long prompt keeps every peer of its route prefilling at once, and each hop of a decode round (its
forward call, its hand-offs between threads and processes, the client's head) slows at once. ``SharedDevice``
is the one component for that case, and a lone peer has it off: no lock per decode call, no turns, its prefill
thread at its normal priority. It is on while another peer holds the same device (``DevicePeers``: each peer
holds a lock on a file of its own in the device's folder for its life), or always / never by a flag
(ExecutorConfig.shared_device). While on:

- the prefill thread runs nicer than the decode thread, under the idle scheduling policy (Linux SCHED_IDLE), so a
  waking decode thread of any peer gets a core at once (``lower_thread_priority``);
- prefill chunks take turns across the device while sessions decode on it (``DeviceTurns``): a long prompt's
  chunk alone, short prefills (a spot-check's window, a chat's next message) shared with each other;
- a long prompt's chunk waits between two layers for the decode calls of the other peers (``DecodeCalls``),
  at most ``DEVICE_DECODE_WAIT_S`` a layer.

Taking a turn alone has the priority: shared turns overlapping one another would otherwise keep a long prompt's
chunk from its turn for good (a ``flock`` waiting to be held alone does not hold up new shared holders). So a turn
goes through a gate first, a second ``flock`` taken alone by a turn that will be alone and shared by a shared one,
and let go once the turn is had.

Every lock is a ``flock`` on a file per device in the cache directory: the kernel drops it with the process, so
a peer that dies never holds it. A peer that hangs holding a turn would hold up every other peer's prefills: a
turn not had within ``wait_s`` is gone without, and so is every turn for ``skip_s`` after that. Peers of other
users, or of another cache directory, do not see the files. Measured effects are in docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import torch

from swarm.config import cache_dir
from swarm.peer.config import SHARED_DEVICE_MODES

try:
    import fcntl
except ImportError:  # not POSIX (Windows): peers go without turns
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)
TURNS_SUPPORTED = fcntl is not None
DEVICE_DECODE_WAIT_S = 0.02  # most a long prompt's chunk waits, per layer, for other peers' decode calls
PREFILL_NICE = 10  # how much nicer than the decode thread a prefill thread runs on a shared device
SHARED_CHECK_S = 5.0  # how often a peer looks whether another peer holds its device


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


def peers_folder(turns: Path) -> Path:
    """The folder of a device's peers (``DevicePeers``), beside its turns' file (``turns_path``)."""
    return turns.with_name(turns.name.replace("prefill-turns-", "device-peers-", 1).removesuffix(".lock"))


class DevicePeers:
    """This peer's file in its device's folder, locked for the peer's life, and a count of the other live ones.

    A file is named ``*.peer`` only once it is locked (created under another name, then renamed), so a file of
    that name that nobody holds is one whose peer has gone: it is removed when seen."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        name = f"{os.getpid()}-{secrets.token_hex(4)}"
        joining = folder / f".{name}.joining"
        self._own: IO[bytes] | None = open(joining, "a+b")  # noqa: SIM115 (held for the peer's life)
        fcntl.flock(self._own, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.path = folder / f"{name}.peer"
        joining.rename(self.path)

    def others(self) -> int:
        """How many other peers hold this device now."""
        count = 0
        for path in self.folder.glob("*.peer"):
            if path == self.path:
                continue
            try:
                file = open(path, "rb")  # noqa: SIM115 (closed below)
            except OSError:  # removed meanwhile
                continue
            with file:
                try:
                    fcntl.flock(file, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    count += 1
                    continue
                except OSError:
                    continue
                fcntl.flock(file, fcntl.LOCK_UN)
            path.unlink(missing_ok=True)  # nobody holds it: its peer has gone
        return count

    def close(self) -> None:
        if self._own is not None:
            self.path.unlink(missing_ok=True)
            self._own.close()
            self._own = None


def lower_thread_priority(nice: int = PREFILL_NICE, idle: bool = True) -> None:
    """Run the calling thread ``nice`` steps nicer (Linux sets niceness per thread) and, with ``idle``, under the
    idle scheduling policy. Not undone: the OS lets a thread lower its priority, not raise it back."""
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + nice))
    except (AttributeError, OSError) as e:  # not Linux, or not allowed: prefill just competes as an equal
        logger.info("prefill thread keeps its priority (%s)", e)
    if idle:
        try:
            os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError) as e:  # not Linux: its niceness alone
            logger.info("prefill thread keeps the normal scheduling policy (%s)", e)


class SharedDevice:
    """The mechanisms for peers sharing one device (see the module doc), on while ``active``.

    ``mode`` "on" and "off" fix it; "auto" looks every ``SHARED_CHECK_S`` (``run``) whether another peer holds
    the device. The executor reads ``active`` once per forward call and does nothing more while it is off."""

    def __init__(
        self,
        mode: str,
        turns: DeviceTurns | None = None,
        decode_calls: DecodeCalls | None = None,
        peers: DevicePeers | None = None,
        check_s: float = SHARED_CHECK_S,
    ) -> None:
        if mode not in SHARED_DEVICE_MODES:
            raise ValueError(f"shared device mode must be one of {SHARED_DEVICE_MODES}, got {mode!r}")
        self.mode = mode
        self.turns = turns
        self.decode_calls = decode_calls
        self.peers = peers
        self.check_s = check_s
        self.active = mode == "on"
        self.refresh()

    @classmethod
    def for_device(cls, device: str, mode: str, directory: Path | None = None) -> SharedDevice:
        """The component of a peer on ``device`` ("cpu", "cuda:1", ...): its files in the cache directory."""
        if mode == "off" or not TURNS_SUPPORTED:
            return cls("off")
        path = turns_path(device, directory)
        try:  # "on" joins the device's peers too, so that "auto" peers beside it see it
            peers = DevicePeers(peers_folder(path))
        except OSError as e:
            logger.warning("cannot tell whether another peer shares %s (%s): taken as alone", device, e)
            return cls("off") if mode == "auto" else cls(mode)
        return cls(mode, DeviceTurns(path), DecodeCalls(decode_calls_path(path), DEVICE_DECODE_WAIT_S), peers)

    def refresh(self) -> bool:
        """Look again whether another peer holds the device ("auto"); whether the component is on now."""
        if self.mode == "auto" and self.peers is not None:
            try:
                active = self.peers.others() > 0
            except OSError as e:
                logger.warning("cannot list the peers of this device (%s): taken as alone", e)
                active = False
            if active != self.active:
                logger.info("device %s by another peer", "shared" if active else "no longer shared")
            self.active = active
        return self.active

    async def run(self) -> None:
        """Look again every ``check_s`` until cancelled; then let this peer's files go."""
        try:
            while True:
                await asyncio.sleep(self.check_s)
                self.refresh()
        finally:
            self.close()

    def close(self) -> None:
        if self.peers is not None:
            self.peers.close()
        if self.decode_calls is not None:
            self.decode_calls.close()
