"""SwarmClient against real `swarm-peer join` processes on 127.0.0.1, checked against local transformers.

One default-model swarm (layers 0:10, 10:20, 20:30) serves every test: exactness, streaming, concurrency and
the README example first; then a replica of 10:20 joins and the middle peer of a live session is SIGKILLed
mid-answer; then the other holder of 10:20 dies too (NoRouteError naming 10:20), and a client that loaded
other weights is refused with ModelMismatch.
"""

from __future__ import annotations

import asyncio
import gc
import random
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
import torch

from client import AsyncSwarmClient, SwarmClient
from swarm.errors import ModelMismatch, NoRouteError
from swarm.models import ModelSource, SamplingParams
from swarm.testing import REPO, LocalSwarm
from swarm.testing.reference import greedy_tokens

pytestmark = pytest.mark.integration

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_NEW_TOKENS = 24
# Peers keep the layers they are given: the plan still routes, but nobody moves, so "the middle peer" and
# "its replica" stay what the tests say they are.
# Prefill in chunks of 16 tokens (the chat prompts here are longer), so every exactness test below also
# covers chunked prefill.
FIXED = ["--no-follow-plan", "--executor-prefill-chunk-tokens", "16"]


@pytest.fixture(scope="module")
def expected_answer(default_source: ModelSource) -> str:
    """What local transformers answers, greedily."""
    tokenizer, model = default_source.tokenizer(), default_source.load_reference_model()
    text = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    answer = str(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    assert "Paris" in answer
    return answer


@pytest.fixture(scope="module")
def default_swarm(
    tmp_path_factory: pytest.TempPathFactory, default_source: ModelSource
) -> Iterator[LocalSwarm]:
    with LocalSwarm(tmp_path_factory.mktemp("default_swarm"), model="default") as swarm:
        swarm.start_peer(layers="0:10", name="first", extra_args=FIXED)
        swarm.start_peer(layers="10:20", name="middle", wait=False, extra_args=FIXED)
        swarm.start_peer(layers="20:30", name="last", wait=False, extra_args=FIXED)
        swarm.wait_all_ready(timeout_s=180)
        yield swarm


@pytest.fixture(scope="module")
def client(default_swarm: LocalSwarm) -> Iterator[SwarmClient]:
    # route_wait_s: when every holder of 10:20 is gone (the last test but one), wait 5 s for one, not 60;
    # probe_timeout_s: a live peer on a busy machine may take a while to answer a probe
    settings = dict(step_timeout_s=20.0, route_wait_s=5.0, probe_timeout_s=10.0)
    with SwarmClient(default_swarm.initial_peers, model="default", **settings) as swarm_client:
        yield swarm_client


@pytest.mark.timeout(300)
def test_three_peers_answer_exactly_like_transformers(client: SwarmClient, expected_answer: str) -> None:
    assert client.generate(messages=QUESTION, max_new_tokens=MAX_NEW_TOKENS) == expected_answer
    session = client.aclient.last_session
    assert session is not None and len(session.stages) == 3 and session.failovers == 0


@pytest.mark.timeout(300)
def test_a_prompt_pipelined_in_chunks_across_the_peers_answers_exactly_like_transformers(
    default_swarm: LocalSwarm, expected_answer: str
) -> None:
    """The chat prompt (~37 tokens) goes as 5 chunks sent at once, so the three peers compute different
    chunks at the same time and may receive them out of order; the answer is still transformers'."""
    with SwarmClient(default_swarm.initial_peers, model="default", prefill_chunk_tokens=8) as pipelined:
        assert pipelined.generate(messages=QUESTION, max_new_tokens=MAX_NEW_TOKENS) == expected_answer
        session = pipelined.aclient.last_session
        assert session is not None and session.failovers == 0


@pytest.mark.timeout(120)
def test_stream_yields_the_same_text_piece_by_piece(client: SwarmClient, expected_answer: str) -> None:
    pieces = list(client.stream(messages=QUESTION, max_new_tokens=MAX_NEW_TOKENS))
    assert len(pieces) > 3
    assert "".join(pieces) == expected_answer


@pytest.mark.timeout(180)
def test_two_clients_generate_concurrently(
    default_swarm: LocalSwarm, client: SwarmClient, expected_answer: str
) -> None:
    prompts = [QUESTION, [{"role": "user", "content": "What is 2 + 2?"}]]
    with SwarmClient(default_swarm.initial_peers, model="default") as other:
        alone = [client.generate(messages=p, max_new_tokens=MAX_NEW_TOKENS) for p in prompts]
        results: dict[str, str] = {}
        errors: list[BaseException] = []

        def run(name: str, swarm_client: SwarmClient, messages: list[dict[str, str]]) -> None:
            try:
                results[name] = swarm_client.generate(messages=messages, max_new_tokens=MAX_NEW_TOKENS)
            except BaseException as e:  # re-raised below, in the test's thread
                errors.append(e)

        threads = [
            threading.Thread(target=run, args=("one", client, prompts[0])),
            threading.Thread(target=run, args=("two", other, prompts[1])),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=150)
    assert not errors, errors
    assert results == {"one": expected_answer, "two": alone[1]}


async def _lockstep(aclient: AsyncSwarmClient, rows: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy tokens of `rows`, every session's decode step of a token sent in the same tick (EOS ignored)."""
    sessions = [aclient.new_session(len(row) + new_tokens) for row in rows]
    try:
        logits = await asyncio.gather(*(s.forward(row) for s, row in zip(sessions, rows, strict=True)))
        tokens = [[int(each.argmax())] for each in logits]
        for _ in range(new_tokens - 1):
            logits = await asyncio.gather(*(s.forward(t[-1:]) for s, t in zip(sessions, tokens, strict=True)))
            for got, each in zip(tokens, logits, strict=True):
                got.append(int(each.argmax()))
    finally:
        await asyncio.gather(*(s.close() for s in sessions))
    return tokens


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lanes", [1, 2])
def test_one_client_generating_many_at_once_sends_their_steps_together_and_stays_exact(
    default_swarm: LocalSwarm, default_source: ModelSource, lanes: int
) -> None:
    """Five generations at once in one client: each round's decode steps of a lane go out together (the peers
    batch them as one forward call per hop, StepRequest.batch_id); every row is still local transformers'
    answer. With 2 lanes (ClientConfig's default) each lane holds half the sessions, and half the rows a call.

    How many rows a round of generate_ids_batch gets depends on when the prompts' prefills end, so the batching
    is counted on decode steps sent together, with the round's wait for a reply long enough that only a missing
    reply, never a slow one, could split a round: then each token is one head call per lane."""
    rng = random.Random(7)
    rows = [[rng.randrange(1000, 20000) for _ in range(rng.randrange(4, 20))] for _ in range(5)]
    new_tokens = 12
    model = default_source.load_reference_model()
    wanted = [greedy_tokens(model, prompt, new_tokens) for prompt in rows]
    with SwarmClient(default_swarm.initial_peers, model="default", batch_lanes=lanes) as client:
        got = client.generate_ids_batch(rows, new_tokens, SamplingParams())
        head, eos = client.aclient.batcher, client.aclient.eos_ids
        for tokens, want in zip(got, wanted, strict=True):
            assert tokens == want[: len(tokens)] and (len(tokens) == new_tokens or want[len(tokens)] in eos)
        head.round_wait_s = 600.0  # no reply on its way is ever given up on
        lockstep_tokens = 6
        calls, batched_rows, waits = head.calls, head.rows, head.waits_in_vain
        together = client.run(_lockstep(client.aclient, rows, lockstep_tokens))
        lockstep_calls, lockstep_rows = head.calls - calls, head.rows - batched_rows
        assert head.waits_in_vain == waits
    assert together == [want[:lockstep_tokens] for want in wanted]
    # Prefill: one head row per session, in up to 5 calls. Decode: each of the 5 tokens one call per lane.
    prefill_calls = lockstep_calls - (lockstep_tokens - 1) * lanes
    assert lockstep_rows == len(rows) * lockstep_tokens
    assert lanes <= prefill_calls <= len(rows), (lockstep_calls, lockstep_rows)


@pytest.mark.timeout(300)
def test_a_short_prompt_sent_while_another_session_decodes_leaves_both_answers_exact(
    default_swarm: LocalSwarm, client: SwarmClient, default_source: ModelSource, expected_answer: str
) -> None:
    """A second client's 12-token prompt reaches each peer while the first client's session decodes there, where
    it normally rides in that session's next forward call (ExecutorConfig.ride_along_tokens, 16: a decode step
    and a prefill in one call). Both answers are still transformers'. Whether it rides depends on timing here,
    so riding itself is asserted in tests/unit/peer/test_executor.py, with a fake clock."""
    pieces: list[str] = []
    decoding = threading.Event()
    errors: list[BaseException] = []

    def decode() -> None:
        try:
            for piece in client.stream(messages=QUESTION, max_new_tokens=MAX_NEW_TOKENS):
                pieces.append(piece)
                decoding.set()
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)
            decoding.set()

    prompt = [random.Random(11).randrange(1000, 20000) for _ in range(12)]
    new_tokens = 8
    with SwarmClient(default_swarm.initial_peers, model="default") as other:
        thread = threading.Thread(target=decode)
        thread.start()
        assert decoding.wait(150), "the first session never decoded"
        got = other.generate_ids(prompt, new_tokens, SamplingParams())
        thread.join(timeout=150)
    assert not errors, errors
    assert len(pieces) > 1 and "".join(pieces) == expected_answer
    want = greedy_tokens(default_source.load_reference_model(), prompt, new_tokens)
    eos = client.aclient.eos_ids
    assert got == want[: len(got)] and (len(got) == new_tokens or want[len(got)] in eos)


# The README's example, verbatim but for the multiaddr (the lead pastes it into README.md).
README_EXAMPLE = """\
from client import AsyncSwarmClient, SwarmClient

with SwarmClient(initial_peers=["/ip4/127.0.0.1/tcp/PORT/p2p/PEER_ID"]) as swarm:
    for piece in swarm.stream(messages=[{"role": "user", "content": "What is the capital of France?"}]):
        print(piece, end="", flush=True)
"""


def test_connecting_freezes_the_loaded_heap_out_of_full_collections_unless_told_not_to(
    default_swarm: LocalSwarm,
) -> None:
    gc.unfreeze()  # whatever earlier clients of this process froze
    with SwarmClient(default_swarm.initial_peers, model="default", freeze_heap=False):
        assert gc.get_freeze_count() == 0
    with SwarmClient(default_swarm.initial_peers, model="default"):
        # torch, transformers, hivemind and the head: ~400,000 objects (swarm.models.heap)
        assert gc.get_freeze_count() > 100_000


@pytest.mark.timeout(180)
def test_readme_example_streams_the_answer(default_swarm: LocalSwarm, expected_answer: str) -> None:
    code = README_EXAMPLE.replace("/ip4/127.0.0.1/tcp/PORT/p2p/PEER_ID", default_swarm.initial_peers[0])
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=REPO,
        env=default_swarm.env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == expected_answer


@pytest.mark.timeout(300)
def test_killing_the_middle_peer_mid_answer_gives_the_same_text(
    default_swarm: LocalSwarm, client: SwarmClient, expected_answer: str
) -> None:
    default_swarm.start_peer(layers="10:20", name="middle_replica", timeout_s=180, extra_args=FIXED)
    by_id = {p.peer_id: p for p in default_swarm.peers}
    pieces = []
    killed = None
    for piece in client.stream(messages=QUESTION, max_new_tokens=MAX_NEW_TOKENS):
        pieces.append(piece)
        if killed is None:
            session = client.aclient.last_session
            assert session is not None
            killed = by_id[str(session.stages[1].peer_id)]
            killed.kill()  # SIGKILL, with its DHT child and p2pd
    assert "".join(pieces) == expected_answer
    session = client.aclient.last_session
    assert session is not None and session.failovers >= 1
    assert killed is not None and str(session.stages[1].peer_id) != killed.peer_id
    assert [str(s.peer_id) for s in session.stages][0] == default_swarm.peers[0].peer_id  # upstream kept


@pytest.mark.timeout(120)
def test_losing_every_holder_of_a_range_gives_no_route_error_naming_it(
    default_swarm: LocalSwarm, client: SwarmClient
) -> None:
    for peer in default_swarm.peers:
        if peer.name.startswith("middle") and peer.proc.poll() is None:
            peer.kill()
    with pytest.raises(NoRouteError) as info:
        client.generate(messages=QUESTION, max_new_tokens=MAX_NEW_TOKENS)
    assert info.value.missing_layers == list(range(10, 20))
    assert "10:20" in str(info.value)


@pytest.mark.timeout(120)
def test_a_client_with_other_weights_gets_model_mismatch(default_swarm: LocalSwarm) -> None:
    with pytest.raises(ModelMismatch, match="SmolLM2-135M-Instruct"):
        SwarmClient(default_swarm.initial_peers, model="tiny", connect_timeout_s=10.0)
