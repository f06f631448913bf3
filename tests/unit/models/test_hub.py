"""--model ORG/NAME: a hub id is fetched once into the model cache, read from there after, and where it can be
neither (offline, no such model) the error says why and what to do."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from swarm.models import checkpoints, hub
from swarm.models.loading import resolve_model
from swarm.testing import REPO

pytestmark = pytest.mark.timeout(120)


def test_what_reads_as_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert hub.is_hub_id("HuggingFaceTB/SmolLM2-360M-Instruct")
    assert not any(hub.is_hub_id(m) for m in ("tiny", "default", "/abs/dir", "a/b/c", "~/models", "org/"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "mine").mkdir(parents=True)
    assert not hub.is_hub_id("models/mine")  # a local dir of that shape stays a local dir


def test_a_cached_hub_model_loads_without_the_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOWSWARM_CACHE", str(tmp_path))
    checkpoints.write_tiny_checkpoint(hub.cached_dir("someone/tiny-llama"), seed=3)

    def no_hub(*args: object, **kwargs: object) -> None:
        raise AssertionError("the hub was asked for a model in the cache")

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    source = resolve_model("someone/tiny-llama")
    assert source.path == tmp_path / "models" / "hub" / "someone--tiny-llama"
    assert source.spec.name == "someone--tiny-llama"
    assert source.spec.weights_hash == resolve_model("tiny:3").spec.weights_hash


def test_an_uncached_hub_model_offline_fails_saying_why(tmp_path: Path) -> None:
    # huggingface_hub reads HF_HUB_OFFLINE when imported: a fresh interpreter, as a peer starting offline
    code = "from swarm.models import resolve_model; resolve_model('nobody-here/no-such-model')"
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "FLOWSWARM_CACHE": str(tmp_path), "PYTHONPATH": str(REPO)},
        cwd=tmp_path,
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: model 'nobody-here/no-such-model' is not in the cache"), last
    assert "could not be downloaded" in last and "HF_HUB_OFFLINE" in last, last
    assert list((tmp_path / "models" / "hub").iterdir()) == []  # no half-written model left behind


def test_two_processes_fetching_one_model_at_once_both_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two peers on one machine (one per GPU) start together: the second to finish takes the first's copy."""
    monkeypatch.setenv("FLOWSWARM_CACHE", str(tmp_path))
    import huggingface_hub

    both_started = threading.Barrier(2)
    asked: list[dict[str, object]] = []

    def fake_download(repo_id: str, local_dir: Path, **options: object) -> None:
        asked.append(options)
        both_started.wait()  # both saw no copy in the cache
        (Path(local_dir) / "config.json").write_text("{}")
        (Path(local_dir) / "model.safetensors").write_bytes(b"x")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    results: list[object] = []

    def fetch() -> None:
        try:
            results.append(hub.fetch("org/model"))
        except BaseException as e:  # noqa: BLE001 - the test reports whatever a thread raised
            results.append(e)

    threads = [threading.Thread(target=fetch) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [hub.cached_dir("org/model")] * 2
    assert all(
        o["ignore_patterns"] == ["consolidated*"] for o in asked
    )  # no second copy of Mistral's weights
