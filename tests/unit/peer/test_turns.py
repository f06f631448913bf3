"""The lock file of a device's prefill turns: one per device, the same for two names of one device."""

from __future__ import annotations

from pathlib import Path

from swarm.peer.turns import turns_path


def test_each_device_has_its_own_turns_file_and_cuda_is_gpu_0(tmp_path: Path) -> None:
    names = {device: turns_path(device, tmp_path).name for device in ("cpu", "cuda", "cuda:0", "cuda:1")}
    assert names["cuda"] == names["cuda:0"]
    assert len({names["cpu"], names["cuda:0"], names["cuda:1"]}) == 3
    assert all(turns_path(device, tmp_path).parent == tmp_path for device in names)
