"""Two real ``swarm-peer join --quant nf4`` processes (tiny model): their records say nf4, size their layers by
the quantized bytes, and a client's greedy tokens through them equal transformers with the same config."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from client import SwarmClient
from swarm.dht.schemas import PeerRecord
from swarm.models import SamplingParams
from swarm.models.loading import ModelSource
from swarm.models.quant import reference_config
from swarm.testing import LocalSwarm, swarm_client
from swarm.testing.reference import greedy_tokens

try:
    import bitsandbytes  # noqa: F401
except Exception as e:  # not installed, or its native library does not load here
    MISSING = f"bitsandbytes cannot be imported here: {e!r}"
else:
    MISSING = ""

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(240),
    pytest.mark.skipif(bool(MISSING), reason=MISSING or "bitsandbytes present"),
]

PROMPT_IDS = [5, 17, 42, 99, 7, 3, 250, 11]
NEW_TOKENS = 10
CACHE_TOKENS = 64
WAIT_S = 120.0


def budget_gb(source: ModelSource) -> float:
    """A memory budget of two float32 layers with their caches: nf4 layers fit all six in it."""
    kv = CACHE_TOKENS * source.spec.kv_bytes_per_token("float32")
    return 2.5 * (source.held_layer_bytes("cpu", "float32") + kv) / 1024**3


@pytest.fixture
def nf4_swarm(tmp_path: Path, tiny_source: ModelSource) -> Iterator[LocalSwarm]:
    args = ["--no-follow-plan", "--quant", "nf4", "--cache-tokens", str(CACHE_TOKENS)]
    args += ["--max-memory-gb", f"{budget_gb(tiny_source):.9f}"]
    with LocalSwarm(tmp_path, model="tiny:0") as local:
        local.start_peer("0:3", name="first", extra_args=args)
        local.start_peer("3:6", name="last", extra_args=args)
        yield local


async def _records(swarm: LocalSwarm, model_hash: str) -> list[PeerRecord]:
    async with swarm_client(swarm.initial_peers, model_hash) as (_dht, directory, _p2p):
        deadline = time.monotonic() + WAIT_S
        while True:
            records = list((await directory.snapshot()).serving().values())
            if len(records) == 2 or time.monotonic() > deadline:
                return records
            await asyncio.sleep(0.5)


def test_nf4_peers_announce_it_fit_more_layers_and_answer_as_transformers(
    nf4_swarm: LocalSwarm, tiny_source: ModelSource
) -> None:
    records = asyncio.run(_records(nf4_swarm, tiny_source.spec.weights_hash))
    assert len(records) == 2
    assert all(r.quant == "nf4" for r in records)
    # the budget holds two float32 layers, and every layer of the model as nf4
    assert all(r.max_layers == tiny_source.spec.num_layers for r in records), [r.max_layers for r in records]

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(
        tiny_source.path,
        quantization_config=reference_config("nf4", torch.float32),
        dtype=torch.float32,
        device_map="cpu",
        local_files_only=True,
    ).eval()
    with SwarmClient(nf4_swarm.initial_peers, model="tiny:0", spot_check_rate=0.0, quant="nf4") as client:
        rows = client.generate_ids_batch([PROMPT_IDS], NEW_TOKENS, SamplingParams())
    assert rows == [greedy_tokens(reference, PROMPT_IDS, NEW_TOKENS)]
