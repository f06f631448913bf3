"""Start real ``swarm-peer join`` processes on 127.0.0.1 for integration tests, and always reap them.

    from swarm.testing import LocalSwarm, swarm_client

    def test_something(tmp_path):
        with LocalSwarm(tmp_path, model="tiny") as swarm:
            first = swarm.start_peer(layers="0:2")           # starts a new swarm
            swarm.start_peer(layers="2:4"); swarm.start_peer(layers="4:6")
            swarm.wait_all_ready(timeout_s=60)               # every peer serving and announced
            asyncio.run(my_check(swarm.initial_peers))      # e.g. with swarm_client(...) below
        # leaving the block: SIGTERM, then SIGKILL after a grace, then the whole process group (p2pd too)

Every peer runs in its own session/process group (so its hivemind DHT child and p2pd daemon can be killed with
it even after a SIGKILL of the peer), with FLOWSWARM_THREADS=1 and logs in ``tmp_path/<name>.log``. A peer is
ready when it wrote its ``--maddr-file``, which ``swarm-peer`` does only once it is serving and announced.
On timeout or early exit the error message carries the tail of the peer's log.

With ``net=EmulatedNet(...)`` (swarm/testing/wan) a peer started with ``host="p1"`` runs inside that host's
network namespace and listens on its address, started fresh with ``ip netns exec`` (never forked by the zygote,
which lives in the root namespace); ``popen(host, argv)`` runs a client process there the same way:

    with EmulatedNet("fsn", ["p1", "p2", "c"], LinkSpec(0.025, 100e6)) as net, LocalSwarm(tmp_path, net=net) as swarm:
        swarm.start_peer("0:3", host="p1"); swarm.start_peer("3:6", host="p2")
        client = swarm.popen("c", [sys.executable, "my_client.py", *swarm.initial_peers], stdout=subprocess.PIPE)

``swarm_client`` is an async context manager giving a client-mode SwarmDHT, its Directory (for snapshots) and a
P2P instance to pass to ``swarm.transport.call_*``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from swarm.config import fork_peers
from swarm.testing.wan import EmulatedNet
from swarm.testing.zygote import ForkedProcess, zygote

REPO = Path(__file__).resolve().parents[2]
SWARM_PEER = [sys.executable, "-m", "swarm.peer.cli"]
Process = subprocess.Popen[bytes] | ForkedProcess  # a fresh peer process, or one forked by the zygote


@dataclass
class PeerProcess:
    """One running ``swarm-peer join``."""

    name: str
    proc: Process
    maddr_file: Path
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)
    maddrs: list[str] = field(default_factory=list)
    ready_after_s: float | None = None  # seconds from process start to serving (set by wait_ready)

    @property
    def peer_id(self) -> str:
        if not self.maddrs:
            raise RuntimeError(f"peer {self.name} is not ready yet")
        return self.maddrs[0].rsplit("/p2p/", 1)[1]

    def log_tail(self, chars: int = 3000) -> str:
        return log_tail(self.log_path, chars)

    def is_ready(self) -> bool:
        if self.maddrs:
            return True
        if self.maddr_file.exists():
            lines = [m for m in self.maddr_file.read_text().split() if m]
            if lines:
                self.maddrs = lines
                self.ready_after_s = time.monotonic() - self.started_at
                return True
        return False

    def wait_ready(self, timeout_s: float = 60.0) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while not self.is_ready():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"peer {self.name} exited with {self.proc.returncode} before serving:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"peer {self.name} not serving after {timeout_s:.0f} s:\n{self.log_tail()}"
                )
            time.sleep(0.1)
        return self.maddrs

    def kill(self) -> None:
        """SIGKILL the peer and everything in its process group (a crash, for failure tests)."""
        _killpg(self.proc, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self, grace_s: float = 20.0) -> int:
        """SIGTERM, wait up to grace_s for a clean exit, then SIGKILL; always reaps the whole group."""
        return stop_process_group(self.proc, grace_s)


def stop_process_group(proc: Process, grace_s: float) -> int:
    """SIGTERM ``proc`` (the leader of its own process group), SIGKILL its group after ``grace_s``, and at
    the end SIGKILL the group anyway: a hivemind DHT child or p2pd that outlived its parent goes too."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _killpg(proc, signal.SIGKILL)
            proc.wait(timeout=10)
    _killpg(proc, signal.SIGKILL)
    return proc.wait(timeout=10)


def log_tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def _killpg(proc: Process, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


class LocalSwarm:
    """Peers of one test, all on 127.0.0.1; use as a context manager so they are always reaped."""

    # A test's peers may leave with sessions still open (the test is over): 10 s of drain each is wasted CI time.
    # Options given to one peer come after these and win (argparse keeps the last value).
    DEFAULT_PEER_ARGS = ("--shutdown-grace-s", "2")

    def __init__(
        self,
        tmp_path: Path,
        model: str = "tiny",
        env: dict[str, str] | None = None,
        net: EmulatedNet | None = None,
    ) -> None:
        self.dir = tmp_path
        self.model = model
        self.env = {**os.environ, "FLOWSWARM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.net = net  # peers and processes given a host run in its namespace
        self.peers: list[PeerProcess] = []
        self.others: list[subprocess.Popen[bytes]] = []  # processes started by popen, reaped at close

    @property
    def initial_peers(self) -> list[str]:
        """Multiaddrs of the first ready peer (what later peers and clients join with)."""
        for peer in self.peers:
            if peer.is_ready():
                return peer.maddrs[:1]
        raise RuntimeError("no peer is ready yet: start one and wait_ready() first")

    def start_peer(
        self,
        layers: str = "auto",
        *,
        name: str | None = None,
        initial_peers: Sequence[str] | None = None,
        extra_args: Sequence[str] = (),
        wait: bool = True,
        timeout_s: float = 90.0,
        host: str | None = None,
    ) -> PeerProcess:
        """Start ``swarm-peer join``; joins the first ready peer unless ``initial_peers`` is given.

        With ``wait`` (default) returns once the peer is serving; otherwise call ``wait_ready`` yourself.
        With ``host`` it runs in that host's namespace of ``net``, listening on the host's address.
        """
        name = name or f"peer{len(self.peers)}"
        if initial_peers is None:
            initial_peers = self.initial_peers if self.peers else []
        maddr_file = self.dir / f"{name}.maddrs"
        maddr_file.unlink(missing_ok=True)
        log_path = self.dir / f"{name}.log"
        args = [*SWARM_PEER, "join", "--model", self.model, "--layers", layers, "--name", name]
        address = "127.0.0.1" if host is None else self._net().address(host)
        args += ["--maddr-file", str(maddr_file), "--host", address]
        if initial_peers:
            args += ["--initial-peers", *initial_peers]
        args += [*self.DEFAULT_PEER_ARGS, *extra_args]
        proc: Process
        if host is not None:
            with open(log_path, "wb") as log:
                proc = self.popen(host, args, stdout=log, stderr=subprocess.STDOUT, track=False)
        elif fork_peers():  # tests: the imports are done once (swarm/testing/zygote.py)
            proc = zygote().start(args[len(SWARM_PEER) :], self.env, REPO, log_path)
        else:
            with open(log_path, "wb") as log:
                # a session of its own: on Linux its own scheduling group, which keeps the peers' share of the
                # machine beside the clients' threads (docs/benchmarks.md has what one session cost)
                proc = subprocess.Popen(
                    args, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=REPO, start_new_session=True
                )
        peer = PeerProcess(name, proc, maddr_file, log_path)
        self.peers.append(peer)
        if wait:
            peer.wait_ready(timeout_s)
        return peer

    def popen(
        self, host: str, argv: Sequence[str], track: bool = True, **kwargs: Any
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside ``host``'s namespace of ``net`` (e.g. a client), with the peers' environment and
        working directory and a session of its own; unless ``track`` is False it is stopped at ``close``."""
        kwargs = {"env": self.env, "cwd": REPO, "start_new_session": True, **kwargs}
        proc: subprocess.Popen[bytes] = subprocess.Popen(self._net().exec_argv(host, argv), **kwargs)
        if track:
            self.others.append(proc)
        return proc

    def _net(self) -> EmulatedNet:
        if self.net is None:
            raise ValueError(
                "a host was given but this LocalSwarm has no net: LocalSwarm(..., net=EmulatedNet(...))"
            )
        return self.net

    def wait_all_ready(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        for peer in self.peers:
            peer.wait_ready(max(1.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Stop every peer (in parallel: SIGTERM all, then wait), reaping their process groups."""
        for peer in self.peers:
            if peer.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    peer.proc.send_signal(signal.SIGTERM)
        for peer in self.peers:
            peer.stop(grace_s=20.0)
        for other in self.others:
            stop_process_group(other, grace_s=5.0)

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@contextlib.asynccontextmanager
async def swarm_client(initial_peers: Sequence[str], model_hash: str) -> AsyncIterator[tuple]:  # type: ignore[type-arg]
    """(SwarmDHT, Directory, P2P) of a client-mode DHT node joined to ``initial_peers``; shut down on exit."""
    from swarm.dht import DHTConfig, Directory, SwarmDHT

    dht = await SwarmDHT.create(DHTConfig(initial_peers=tuple(initial_peers), client_mode=True), model_hash)
    try:
        p2p = await dht.replicate_p2p()
        yield dht, Directory(dht), p2p
    finally:
        await dht.aclose()
