"""A device's prefill turns: one lock file per device, and a wait for a turn that a hung peer holds ends."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from swarm.peer import turns as turns_module
from swarm.peer.turns import (
    DecodeCalls,
    DevicePeers,
    DeviceTurns,
    SharedDevice,
    decode_calls_path,
    turns_path,
)


def test_each_device_has_its_own_turns_file_and_cuda_is_gpu_0(tmp_path: Path) -> None:
    def no_uuid(index: int) -> None:
        return None

    devices = ("cpu", "cuda", "cuda:0", "cuda:1")
    names = {device: turns_path(device, tmp_path, no_uuid).name for device in devices}
    assert names["cuda"] == names["cuda:0"]
    assert len({names["cpu"], names["cuda:0"], names["cuda:1"]}) == 3
    assert all(turns_path(device, tmp_path, no_uuid).parent == tmp_path for device in names)


def test_a_gpu_is_named_by_its_uuid_whatever_index_a_peer_sees_it_at(tmp_path: Path) -> None:
    """Two peers with other CUDA_VISIBLE_DEVICES see different GPUs as cuda:0, and one GPU at other indices."""
    first_peer = {
        0: "GPU-1b2c3d4e-0000-1111-2222-333344445555",
        1: "GPU-99990000-aaaa-bbbb-cccc-ddddeeeeffff",
    }
    second_peer = {0: first_peer[1], 1: first_peer[0]}  # CUDA_VISIBLE_DEVICES=1,0
    assert turns_path("cuda:0", tmp_path, first_peer.get) != turns_path("cuda:0", tmp_path, second_peer.get)
    assert turns_path("cuda:0", tmp_path, first_peer.get) == turns_path("cuda:1", tmp_path, second_peer.get)
    assert turns_path("cuda:1", tmp_path, first_peer.get).name.startswith("prefill-turns-cudagpu99990000")


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_turn_held_by_a_hung_peer_is_gone_without_for_a_while_and_let_go_once_it_comes(
    tmp_path: Path,
) -> None:
    """Another holder keeps the lock past wait_s: the turn is gone without, and so are turns within skip_s even
    once the lock is free; the given-up wait lets the lock go as soon as it has it; after skip_s, turns are had."""
    path, clock = tmp_path / "turns.lock", _Clock()
    turns = DeviceTurns(path, wait_s=0.05, skip_s=30.0, clock=clock)
    with open(path, "a+b") as hung:
        fcntl.flock(hung, fcntl.LOCK_EX)
        with turns.turn(alone=False) as had:
            assert not had
        fcntl.flock(hung, fcntl.LOCK_UN)
    assert turns.waiting is not None
    turns.waiting.join(30)  # the given-up wait has had the lock and let it go
    with open(path, "a+b") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if the lock was kept
        fcntl.flock(other, fcntl.LOCK_UN)
    clock.now += 29.0
    with turns.turn(alone=True) as had:
        assert not had, "turns are skipped for skip_s"
    clock.now += 2.0
    with turns.turn(alone=True) as had:
        assert had
        with open(path, "a+b") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_SH | fcntl.LOCK_NB)
                raise AssertionError("the turn is held alone: a shared lock must not be had beside it")
            except BlockingIOError:
                pass


def _gate_taken(path: Path) -> bool:
    with open(path.with_suffix(".gate"), "a+b") as gate:
        try:
            fcntl.flock(gate, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(gate, fcntl.LOCK_UN)
        return False


def test_a_turn_alone_waiting_goes_before_shared_turns_asked_for_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shared turn is held; a turn alone waits for it; a shared turn asked for meanwhile is not free, and waits
    behind the one alone instead of joining the held one (which would keep a long prompt's chunks from their turn
    for good)."""
    path = tmp_path / "turns.lock"
    alone, shared = DeviceTurns(path, wait_s=60.0), DeviceTurns(path, wait_s=60.0)
    entered: list[str] = []
    shared_free_now: list[bool] = []
    shared_tried = threading.Event()
    real_now = turns_module._Wait.now

    def tried(wait: turns_module._Wait, mode: int) -> bool:
        free = real_now(wait, mode)
        if mode == fcntl.LOCK_SH:
            shared_free_now.append(free)
            shared_tried.set()
        return free

    monkeypatch.setattr(turns_module._Wait, "now", tried)

    def take(turns: DeviceTurns, name: str, alone_turn: bool) -> None:
        with turns.turn(alone=alone_turn) as had:
            assert had
            entered.append(name)

    with open(path, "a+b") as holder:
        fcntl.flock(holder, fcntl.LOCK_SH)  # a shared turn, running
        waiting_alone = threading.Thread(target=take, args=(alone, "alone", True))
        waiting_alone.start()
        deadline = time.monotonic() + 30
        while not _gate_taken(path):  # the turn alone now waits at the lock, holding the gate
            assert time.monotonic() < deadline, "the turn alone never reached the gate"
            time.sleep(0.01)
        later_shared = threading.Thread(target=take, args=(shared, "shared", False))
        later_shared.start()
        assert shared_tried.wait(30)
        assert shared_free_now == [False], "a shared turn was let in beside the held one, past the one alone"
        fcntl.flock(holder, fcntl.LOCK_UN)
    waiting_alone.join(30)
    later_shared.join(30)
    assert entered == ["alone", "shared"]


class _Ticks:
    """A clock that moves only when slept on, and the sleeps it saw; ``at_sleep`` runs once at the n-th."""

    def __init__(self, at_sleep: int = -1, then: Callable[[], None] = lambda: None) -> None:
        self.now = 0.0
        self.sleeps = 0
        self.at_sleep, self.then = at_sleep, then

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds
        if self.sleeps == self.at_sleep:
            self.then()


def test_a_chunk_waits_for_another_peers_decode_call_until_it_ends(tmp_path: Path) -> None:
    path = decode_calls_path(turns_path("cpu", tmp_path))
    other = DecodeCalls(path, wait_s=0.02)  # another peer on the device
    running = other.running()
    running.__enter__()
    ticks = _Ticks(at_sleep=5, then=lambda: running.__exit__(None, None, None))
    ours = DecodeCalls(path, wait_s=0.02, poll_s=0.001, clock=ticks.clock, sleep=ticks.sleep)
    ours.wait()
    assert (ours.waited, ticks.sleeps) == (1, 5)  # looked again each millisecond until the call ended
    ours.wait()
    assert (ours.waited, ticks.sleeps) == (1, 5)  # nobody decodes: no wait at all


def test_a_chunk_waits_at_most_wait_s_behind_decode_calls_that_keep_coming(tmp_path: Path) -> None:
    path = decode_calls_path(turns_path("cpu", tmp_path))
    others = [
        DecodeCalls(path, wait_s=0.02) for _ in range(2)
    ]  # two peers' calls overlap: the file stays held
    with others[0].running(), others[1].running():
        ticks = _Ticks()
        ours = DecodeCalls(path, wait_s=0.02, poll_s=0.001, clock=ticks.clock, sleep=ticks.sleep)
        ours.wait()
        assert ours.waited == 1 and ticks.now == pytest.approx(0.02, abs=0.0011)
        assert DecodeCalls(path, wait_s=0.0).wait() is None  # 0: never waits (it would hang here otherwise)
    for each in [*others, ours]:
        each.close()


def test_decode_calls_go_without_a_file_where_none_can_be_made(tmp_path: Path) -> None:
    (tmp_path / "a file").write_text("")
    calls = DecodeCalls(tmp_path / "a file" / "decode-calls-cpu0.lock", wait_s=0.02)  # parent is a file
    with calls.running():
        calls.wait()
    assert calls.waited == 0


def test_a_peer_sees_the_other_live_peers_of_its_device_and_clears_the_files_of_gone_ones(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "device-peers-cpu0"
    first = DevicePeers(folder)
    assert first.others() == 0
    second = DevicePeers(folder)
    assert (first.others(), second.others()) == (1, 1)
    gone = folder / "12345-dead.peer"  # a peer that died: its file, held by nobody
    gone.touch()
    assert first.others() == 1 and not gone.exists()
    second.close()
    assert first.others() == 0
    first.close()
    assert not list(folder.iterdir())


def test_the_shared_device_component_is_on_only_while_another_peer_holds_the_device(tmp_path: Path) -> None:
    """auto: off for a lone peer, on once a second peer joins the device (at the next look), off once it left;
    on and off are fixed. A lone peer's component takes no decode-call lock: the device's decode-calls file
    stays free for a chunk that looks."""
    lone = SharedDevice.for_device("cpu", "auto", tmp_path)
    try:
        assert not lone.active and lone.turns is not None and lone.decode_calls is not None
        other = SharedDevice.for_device("cpu", "auto", tmp_path)
        assert other.active, "the second peer sees the first at once"
        assert lone.refresh(), "the first sees the second at its next look"
        other.close()
        assert not lone.refresh()
    finally:
        lone.close()
    always = SharedDevice.for_device("cpu", "on", tmp_path)
    watching = SharedDevice.for_device("cpu", "auto", tmp_path)
    assert always.active and watching.active, "a peer with it on counts as a peer of the device"
    watching.close()
    always.close()
    off = SharedDevice.for_device("cpu", "off", tmp_path)
    assert not off.active and off.turns is None and off.decode_calls is None
    with pytest.raises(ValueError, match="shared device mode"):
        SharedDevice("sometimes")


def test_a_device_shared_with_a_peer_that_died_is_alone_again(tmp_path: Path) -> None:
    """A peer process killed holds nothing: its file's lock went with it."""
    folder = turns_module.peers_folder(turns_path("cpu", tmp_path))
    folder.mkdir(parents=True)
    script = (
        "import sys, time; from pathlib import Path; from swarm.peer.turns import DevicePeers; "
        "held = DevicePeers(Path(sys.argv[1])); print('joined', flush=True); time.sleep(600)"
    )
    child = subprocess.Popen([sys.executable, "-c", script, str(folder)], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"joined"
        shared = SharedDevice.for_device("cpu", "auto", tmp_path)
        assert shared.active
        child.kill()
        child.wait(30)
        assert not shared.refresh()
        shared.close()
    finally:
        child.kill()
        child.wait(30)
