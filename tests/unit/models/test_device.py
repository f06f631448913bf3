"""parse_device: a GPU this process cannot use is refused in one line that names the fix."""

from __future__ import annotations

import pytest
import torch

from swarm.models.device import parse_device


def test_cpu_and_bad_names() -> None:
    assert parse_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device"):
        parse_device("tpu")
    with pytest.raises(ValueError, match="integer N"):
        parse_device("cuda:x")


def test_a_cpu_build_of_torch_names_the_setup_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ValueError, match=r"CPU build.*FLOWSWARM_TORCH=cuda \./scripts/setup") as error:
        parse_device("cuda")
    assert "\n" not in str(error.value)


def test_a_cuda_build_without_a_driver_names_the_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no usable GPU: is the NVIDIA driver installed"):
        parse_device("cuda:0")


def test_a_gpu_index_past_the_last(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert parse_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ValueError, match="has 2 GPU"):
        parse_device("cuda:2")
