"""A device's prefill turns: one lock file per device, and a wait for a turn that a hung peer holds ends."""

from __future__ import annotations

import fcntl
from pathlib import Path

from swarm.peer.turns import DeviceTurns, turns_path


def test_each_device_has_its_own_turns_file_and_cuda_is_gpu_0(tmp_path: Path) -> None:
    names = {device: turns_path(device, tmp_path).name for device in ("cpu", "cuda", "cuda:0", "cuda:1")}
    assert names["cuda"] == names["cuda:0"]
    assert len({names["cpu"], names["cuda:0"], names["cuda:1"]}) == 3
    assert all(turns_path(device, tmp_path).parent == tmp_path for device in names)


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
