"""The directory on a real hivemind DHT over 127.0.0.1: visibility, forgery, expiry, plans.

Announcing peers run as separate processes (`python -m tests.integration.test_dht ...`) started in their own
process group, so a SIGKILL takes their DHT child and p2pd daemon with them and nothing is left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import hivemind
import psutil
import pytest

from swarm.dht import (
    P2PD_THREADS,
    Announcer,
    DHTConfig,
    Directory,
    DirectoryConfig,
    Election,
    ElectionConfig,
    LeaseRecord,
    PlanRecord,
    SwarmDHT,
    SwarmSnapshot,
    coverage,
)
from swarm.dht.schemas import record_key
from swarm.errors import TransportError
from swarm.types import LayerRange, NodeID, Plan
from tests.unit.dht.records import MODEL_HASH, peer_record

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")
TTL_S = 4.0  # short for fast tests, long enough that a loaded 2-core machine still refreshes in time


# ---- child process: one announcing (and optionally election-running) peer --------------------------------


async def _child_main(initial_peers: list[str], start: int, end: int, ttl_s: float, elect: bool) -> None:
    dht = await SwarmDHT.create(DHTConfig(initial_peers=tuple(initial_peers)), MODEL_HASH)
    try:
        directory = Directory(dht, DirectoryConfig(ttl_s=ttl_s))
        print(json.dumps({"peer_id": dht.peer_id, "maddrs": dht.visible_maddrs()}), flush=True)
        record = peer_record(dht.peer_id, start, end)
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(Announcer(directory, lambda: record).run())
            if elect:
                tasks.create_task(Election(directory, ElectionConfig(lease_s=ttl_s)).run())
    finally:
        await dht.aclose()


def _child_entry() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--range", default="0:4")
    parser.add_argument("--ttl-s", type=float, default=TTL_S)
    parser.add_argument("--elect", action="store_true")
    args = parser.parse_args()
    layers = LayerRange.parse(args.range)

    async def main() -> None:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await _child_main(args.initial_peers, layers.start, layers.end, args.ttl_s, args.elect)

    asyncio.run(main())


class Child:
    """A peer process in its own process group; `kill()` takes its DHT child and p2pd with it."""

    def __init__(self, initial_peers: list[str], layers: str, elect: bool = False) -> None:
        cmd = [sys.executable, "-m", "tests.integration.test_dht", "--range", layers, "--ttl-s", str(TTL_S)]
        cmd += ["--initial-peers", *initial_peers] + (["--elect"] if elect else [])
        env = dict(os.environ, FLOWSWARM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, start_new_session=True)
        self.layers = layers
        self.peer_id = ""

    def wait_joined(self) -> None:
        """Block until the child printed its peer id (it joined the DHT) or died."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"child for {self.layers} exited with {self.proc.wait()}")
        self.peer_id = json.loads(line)["peer_id"]

    def kill(self) -> None:
        """SIGKILL the whole group: no withdraw, no shutdown, the record must expire on its own."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        """Graceful stop, then a hard kill of whatever is left of the group."""
        if self.proc.poll() is None:
            # SIGTERM to the peer only: its DHT child and p2pd must live on while it withdraws and shuts down.
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        self.kill()


@contextlib.contextmanager
def children(*specs: tuple[list[str], str, bool]) -> Iterator[list[Child]]:
    started: list[Child] = []
    try:
        for initial_peers, layers, elect in specs:  # all start at once: imports take seconds each
            started.append(Child(initial_peers, layers, elect))
        for child in started:
            child.wait_joined()
        yield started
    finally:
        for child in started:
            child.stop()


@contextlib.asynccontextmanager
async def observer(**config: object) -> AsyncIterator[SwarmDHT]:
    """A DHT node in the test process that bootstraps the swarm and reads it."""
    dht = await SwarmDHT.create(DHTConfig(**config), MODEL_HASH)  # type: ignore[arg-type]
    try:
        yield dht
    finally:
        await dht.aclose()


async def wait_for(
    read: Callable[[], Awaitable[SwarmSnapshot]], ok: Callable[[SwarmSnapshot], bool], timeout_s: float
) -> tuple[SwarmSnapshot, float]:
    """Poll until ok(snapshot); return it and the seconds it took."""
    started = time.monotonic()
    while True:
        snapshot = await read()
        if ok(snapshot):
            return snapshot, time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"not reached within {timeout_s} s: peers={sorted(snapshot.peers)}")
        await asyncio.sleep(0.2)


async def read_until(
    read: Callable[[], Awaitable[SwarmSnapshot]],
    done: Callable[[SwarmSnapshot], bool],
    every: Callable[[SwarmSnapshot], bool],
    timeout_s: float,
) -> SwarmSnapshot:
    """Poll until done(snapshot), asserting every(snapshot) of each read on the way (the first included).

    The deadline only stops a test that would hang; what is judged is the snapshots, not how long they took."""
    started = time.monotonic()
    while True:
        snapshot = await read()
        assert every(snapshot), f"a read broke the invariant: peers={dict(snapshot.peers)}"
        if done(snapshot):
            return snapshot
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"not reached within {timeout_s} s: peers={sorted(snapshot.peers)}")
        await asyncio.sleep(0.2)


# ---- tests --------------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_three_nodes_see_each_others_records() -> None:
    asyncio.run(_test_three_nodes_see_each_others_records())


async def _test_three_nodes_see_each_others_records() -> None:
    # Three hivemind DHTs in this process: each runs its node and p2pd in its own child process anyway.
    async with observer() as boot:
        peers = tuple(boot.visible_maddrs())
        async with observer(initial_peers=peers) as second, observer(initial_peers=peers) as third:
            nodes = [boot, second, third]
            directories = [Directory(d, DirectoryConfig(ttl_s=TTL_S)) for d in nodes]
            for directory, (start, end) in zip(directories, [(2, 6), (0, 4), (4, 8)], strict=True):
                assert await directory.announce(peer_record(directory.peer_id, start, end))
            expected = {d.peer_id for d in nodes}
            for reader in directories:
                snapshot, took_s = await wait_for(reader.snapshot, lambda s: set(s.peers) == expected, 15.0)
                assert coverage(snapshot, 8) == [1, 1, 2, 2, 2, 2, 1, 1]
                assert (
                    snapshot.peers[third.peer_id].range_start,
                    snapshot.peers[third.peer_id].range_end,
                ) == (4, 8)
                print(f"{reader.peer_id[-6:]} sees all 3 records after {took_s:.2f} s")


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_forged_unsigned_and_invalid_records_are_rejected() -> None:
    asyncio.run(_test_forged_unsigned_and_invalid_records_are_rejected())


async def _test_forged_unsigned_and_invalid_records_are_rejected() -> None:
    async with observer() as boot:
        async with observer(initial_peers=tuple(boot.visible_maddrs())) as evil:
            honest = Directory(boot, DirectoryConfig(ttl_s=30.0))
            assert await honest.announce(peer_record(boot.peer_id, 0, 4))
            raw, key = evil.hivemind_dht, record_key(MODEL_HASH, evil.peer_id)
            expiration = evil.now() + 60
            forged = peer_record(boot.peer_id, 0, 8).to_dht()  # claims to be boot, with more layers
            # Into the honest peer's subkey: evil cannot sign for that key.
            assert not raw.store(key, forged, expiration, subkey=boot.own_subkey())
            # Unprotected subkey: the schema demands an owner marker.
            assert not raw.store(key, forged, expiration, subkey=b"anonymous")
            # Its own subkey but schema-invalid: signed, still refused.
            bad = peer_record(evil.peer_id, 0, 4).to_dht() | {"range_end": 99}
            assert not raw.store(key, bad, expiration, subkey=evil.own_subkey())
            # Its own subkey, valid shape, but naming the honest peer: stored, yet dropped on read.
            assert raw.store(key, forged, expiration, subkey=evil.own_subkey())
            for reader in (Directory(boot), Directory(evil)):
                snapshot = await reader.snapshot()
                assert set(snapshot.peers) == {boot.peer_id}
                assert snapshot.peers[boot.peer_id].range_end == 4
            with pytest.raises(ValueError, match="this node is"):
                await Directory(evil).announce(peer_record(boot.peer_id))


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_record_expires_after_its_writer_is_killed() -> None:
    asyncio.run(_test_record_expires_after_its_writer_is_killed())


async def _test_record_expires_after_its_writer_is_killed() -> None:
    async with observer() as boot:
        directory = Directory(boot)
        peers = boot.visible_maddrs()
        with children((peers, "0:8", False), (peers, "0:4", False)) as (victim, quitter):
            both = {victim.peer_id, quitter.peer_id}
            first, _ = await wait_for(directory.snapshot, lambda s: both <= set(s.serving()), 15.0)
            # Heartbeats keep live records past one TTL: read until both were re-stamped a whole TTL after the
            # record first seen (so that one has expired). The stamps seen on the way must come less than a TTL
            # apart (each refresh lands before the previous value expires) and never say "leaving".
            stamped = {pid: first.peers[pid].updated_at for pid in both}
            stamps: dict[str, set[float]] = {pid: {stamped[pid]} for pid in both}

            def still_serving(snapshot: SwarmSnapshot) -> bool:
                # A read may miss a record: judge the ones it shows.
                present = [snapshot.peers[pid] for pid in both if pid in snapshot.peers]
                for record in present:
                    stamps[record.peer_id].add(record.updated_at)
                return all(record.state == "serving" for record in present)

            await read_until(
                directory.snapshot,
                lambda s: all(
                    pid in s.peers and s.peers[pid].updated_at >= stamped[pid] + TTL_S for pid in both
                ),
                every=still_serving,
                timeout_s=10 * TTL_S,
            )
            for pid in both:
                seen = sorted(stamps[pid])
                assert len(seen) >= 3 and max(b - a for a, b in itertools.pairwise(seen)) < TTL_S, seen

            quitter.stop()  # graceful: the Announcer marks its record leaving on the way out
            # The mark may reach the node we read from a moment after the quitter exits, or not at all; its last
            # "serving" record then expires on its own. Either way it is soon no longer served.
            await wait_for(
                directory.snapshot,
                lambda s: quitter.peer_id not in s.peers or s.peers[quitter.peer_id].state == "leaving",
                10 * TTL_S,
            )

            victim.kill()  # no withdraw: only the record's expiry removes it
            await wait_for(directory.snapshot, lambda s: victim.peer_id not in s.peers, 10 * TTL_S)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_withdraw_marks_the_record_leaving() -> None:
    asyncio.run(_test_withdraw_marks_the_record_leaving())


async def _test_withdraw_marks_the_record_leaving() -> None:
    async with observer() as boot:
        directory = Directory(boot, DirectoryConfig(ttl_s=TTL_S))
        assert await directory.announce(peer_record(boot.peer_id))
        await directory.withdraw()
        snapshot = await directory.snapshot()
        assert snapshot.peers[boot.peer_id].state == "leaving"
        assert snapshot.serving() == {}


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_plan_round_trip() -> None:
    asyncio.run(_test_plan_round_trip())


async def _test_plan_round_trip() -> None:
    async with observer() as boot:
        async with observer(initial_peers=tuple(boot.visible_maddrs()), client_mode=True) as client:
            plan = Plan(
                method="milp",
                placement={NodeID(boot.peer_id): LayerRange(0, 8)},
                max_flow_tokens_s=123.5,
                epoch=4,
            )
            record = PlanRecord(
                epoch=4, planner_peer_id=boot.peer_id, plan=plan.to_json(), created_at=boot.now()
            )
            writer = Directory(boot)
            assert await writer.publish_plan(record)
            # Readers use only the lease holder's plan, placing peers they know: claim, then announce.
            now = boot.now()
            lease = LeaseRecord(peer_id=boot.peer_id, candidate_since=now, held_since=now, updated_at=now)
            assert await writer.write_lease(lease, now + 30)
            assert await writer.announce(peer_record(boot.peer_id, 0, 8))
            snapshot, _ = await wait_for(Directory(client).snapshot, lambda s: s.plan is not None, 15.0)
            assert snapshot.plan == record
            assert Plan.from_json(snapshot.plan.plan) == plan
            with pytest.raises(ValueError, match="names planner"):
                await Directory(client).publish_plan(record)


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_identity_file_keeps_the_peer_id(tmp_path: Path) -> None:
    asyncio.run(_test_identity_file_keeps_the_peer_id(tmp_path))


async def _test_identity_file_keeps_the_peer_id(tmp_path: Path) -> None:
    path = tmp_path / "peer.key"
    ids = []
    for _ in range(2):
        async with observer(identity_path=str(path)) as dht:
            ids.append(dht.peer_id)
            assert dht.visible_maddrs()[0].endswith(f"/p2p/{dht.peer_id}")
            assert "/ip4/127.0.0.1/" in dht.visible_maddrs()[0]
    assert ids[0] == ids[1]
    assert path.exists()


class BlockingCall:
    """Wraps a blocking hivemind.DHT method to record whether the event loop ran while it was in progress."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        self.in_progress = False
        self.loop_ran_meanwhile = False
        original = getattr(hivemind.DHT, name)

        def wrapped(dht: hivemind.DHT, *args: object, **kwargs: object) -> object:
            self.in_progress = True
            try:
                return original(dht, *args, **kwargs)
            finally:
                self.in_progress = False

        monkeypatch.setattr(hivemind.DHT, name, wrapped)

    async def watch(self, awaitable: Awaitable[T]) -> T:
        """Await `awaitable` while checking, at every turn of the loop, whether the call is in progress."""
        task = asyncio.ensure_future(awaitable)
        while not task.done():
            await asyncio.sleep(0.001)
            self.loop_ran_meanwhile |= self.in_progress
        return task.result()


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_joining_and_leaving_leave_the_event_loop_running(monkeypatch: pytest.MonkeyPatch) -> None:
    asyncio.run(_test_joining_and_leaving_leave_the_event_loop_running(monkeypatch))


async def _test_joining_and_leaving_leave_the_event_loop_running(monkeypatch: pytest.MonkeyPatch) -> None:
    joining = BlockingCall(monkeypatch, "wait_until_ready")
    leaving = BlockingCall(monkeypatch, "shutdown")
    dht = await joining.watch(SwarmDHT.create(DHTConfig(), MODEL_HASH))
    try:
        assert joining.loop_ran_meanwhile, (
            "SwarmDHT.create blocked the event loop while hivemind bootstrapped"
        )
    finally:
        await leaving.watch(dht.aclose())
    assert leaving.loop_ran_meanwhile, "SwarmDHT.aclose blocked the event loop while hivemind shut down"


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_cancelling_a_join_leaves_nothing_running(monkeypatch: pytest.MonkeyPatch) -> None:
    asyncio.run(_test_cancelling_a_join_leaves_nothing_running(monkeypatch))


async def _test_cancelling_a_join_leaves_nothing_running(monkeypatch: pytest.MonkeyPatch) -> None:
    joining = BlockingCall(monkeypatch, "wait_until_ready")
    task = asyncio.create_task(SwarmDHT.create(DHTConfig(), MODEL_HASH))
    while not joining.in_progress:  # cancel while the worker thread waits for hivemind's bootstrap
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert multiprocessing.active_children() == []  # the DHT child was started, then stopped and reaped


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_unreachable_initial_peer_is_a_clear_transport_error() -> None:
    dead = "/ip4/127.0.0.1/tcp/9/p2p/QmZ2NCKo2bzPZMEQv9j43xtgmUURH25tZAdFzz8QC2EBy8"  # nothing listens on 9
    with pytest.raises(TransportError, match="could not join the DHT via /ip4/127.0.0.1/tcp/9"):
        asyncio.run(SwarmDHT.create(DHTConfig(initial_peers=(dead,), start_timeout_s=30.0), MODEL_HASH))


if __name__ == "__main__":
    _child_entry()


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_temporary_identity_key_is_gone_once_joined(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh key lives on disk only while p2pd starts: a peer killed later leaves no key file behind."""
    # A temporary directory of this test's own: other test workers create keys in the shared one meanwhile.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    async def body() -> None:
        async with observer() as dht:
            assert dht.peer_id
            assert dht._identity_path.parent == tmp_path, "the key was not made in the temporary directory"
            left = list(tmp_path.glob("flowswarm-identity-*.key"))
            assert not left, f"temporary keys still on disk while serving: {left}"

    asyncio.run(body())


def _p2pd_environment(dht: SwarmDHT) -> dict[str, str]:
    """The environment the p2pd daemon of ``dht`` runs with (the daemon is its DHT child's child)."""
    (daemon,) = psutil.Process(dht.hivemind_dht.pid).children()
    return daemon.environ()


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_the_p2pd_daemon_runs_with_the_go_threads_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    """One Go thread by default (swarm.dht.node.P2PD_THREADS); 0 leaves the daemon Go's own choice."""
    monkeypatch.delenv("GOMAXPROCS", raising=False)

    async def body() -> None:
        async with observer() as default, observer(p2pd_threads=3) as three, observer(p2pd_threads=0) as left:
            assert _p2pd_environment(default).get("GOMAXPROCS") == str(P2PD_THREADS) == "1"
            assert _p2pd_environment(three).get("GOMAXPROCS") == "3"
            assert "GOMAXPROCS" not in _p2pd_environment(left)
        assert "GOMAXPROCS" not in os.environ  # set in the DHT child only

    asyncio.run(body())
