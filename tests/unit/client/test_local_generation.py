"""The client's session, failover and generation logic over in-process BlockRanges, against transformers.

The same AsyncSwarmClient that talks to peers runs here over client.local's in-process chain (BlockRanges
behind the remote chain's interface), so these tests check the client's own logic exactly, without any network.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from client.chunks import prefill_chunks
from client.client import AsyncSwarmClient
from client.config import ClientConfig
from client.generation import GenerationRequest, generate_ids
from client.local import LocalChain, LocalRoutes, in_process_client
from client.retry import Action
from swarm.errors import CapacityError, NoRouteError, ProtocolError, SwarmError
from swarm.models.head import Sampler, SamplingParams
from swarm.models.loading import ModelSource
from swarm.routing.route import Stage
from swarm.testing.reference import greedy_tokens
from swarm.types import LayerRange, NodeID

pytestmark = pytest.mark.timeout(120)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def make_client(
    source: ModelSource,
    ranges: dict[str, tuple[int, int]],
    clock: Callable[[], float] = time.monotonic,
    **settings: Any,
) -> tuple[AsyncSwarmClient, LocalChain]:
    blocks = {p: source.load_blocks(a, b, cache_tokens=4096) for p, (a, b) in ranges.items()}
    # No spot-checks and no drafts here: these tests count the calls each step makes (test_spot.py checks
    # spot-checks, test_drafting.py drafts).
    settings.setdefault("prefill_chunk_tokens", 256)
    settings.setdefault("speculate", "off")
    config = ClientConfig(retry_delay_s=0.0, spot_check_rate=0.0, **settings)
    client = in_process_client(source.load_head(), blocks, source.tokenizer(), config, clock=clock)
    assert isinstance(client.chain, LocalChain)
    return client, client.chain


def greedy_reference(model: Any, ids: list[int], steps: int) -> list[int]:
    """Greedy decoding by full forward passes of the plain transformers model (no cache at all)."""
    return greedy_tokens(model, ids, steps)


# --- tiny random model: token ids -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_source: ModelSource) -> ModelSource:
    return tiny_source


@pytest.fixture(scope="module")
def tiny_reference(tiny: ModelSource) -> Any:
    return tiny.load_reference_model()


TINY_SPLIT = {"a": (0, 2), "b": (2, 4), "c": (4, 6)}
PROMPT_IDS = [5, 17, 42, 99, 7, 3, 250, 11]


def test_greedy_ids_equal_transformers(tiny: ModelSource, tiny_reference: Any) -> None:
    client, chain = make_client(tiny, TINY_SPLIT)
    got = asyncio.run(client.generate_ids(PROMPT_IDS, 12, SamplingParams()))
    assert got == greedy_reference(tiny_reference, PROMPT_IDS, 12)
    # one prefill of 8 tokens, then 11 decode steps of one token, each through the three stages
    assert [c for c in chain.calls if c[0] == "a"] == [("a", 0, 8)] + [("a", 8 + i, 1) for i in range(11)]
    # the session was closed on every peer
    assert all(not block.active_sessions for block in chain.blocks.values())


def test_a_prompt_pipelined_in_chunks_equals_transformers(tiny: ModelSource, tiny_reference: Any) -> None:
    client, chain = make_client(tiny, TINY_SPLIT, prefill_chunk_tokens=3)
    got = asyncio.run(client.generate_ids(PROMPT_IDS, 6, SamplingParams()))
    assert got == greedy_reference(tiny_reference, PROMPT_IDS, 6)
    sizes = prefill_chunks(len(PROMPT_IDS), 0, 3)
    assert len(sizes) == 3 and sum(sizes) == len(PROMPT_IDS)
    starts = [0, sizes[0], sizes[0] + sizes[1]]
    # the prompt went as three steps, each through the three stages; then one-token decode steps
    assert [c for c in chain.calls if c[0] == "a"][:4] == [
        ("a", p, n) for p, n in zip(starts, sizes, strict=True)
    ] + [("a", 8, 1)]


def test_a_failed_chunk_fails_over_and_replays_the_prompt_in_chunks(
    tiny: ModelSource, tiny_reference: Any
) -> None:
    """The middle peer dies on the prompt's second chunk: the step fails over like any other (ban, re-route,
    replay from position 0, in chunks again) and the answer is the same."""
    client, chain = make_client(tiny, {**TINY_SPLIT, "b2": (2, 4)}, prefill_chunk_tokens=3)

    def kill_middle_at_second_chunk(step: int) -> None:
        if step == 2:
            assert client.last_session is not None
            chain.dead.add(client.last_session.stages[1].peer_id)

    chain.on_step = kill_middle_at_second_chunk
    got = asyncio.run(client.generate_ids(PROMPT_IDS, 6, SamplingParams()))
    assert got == greedy_reference(tiny_reference, PROMPT_IDS, 6)
    session = client.last_session
    assert session is not None and session.failovers == 1
    sizes = prefill_chunks(len(PROMPT_IDS), 0, 3)
    chunks = [("a", 0, sizes[0]), ("a", sizes[0], sizes[1]), ("a", sizes[0] + sizes[1], sizes[2])]
    # all three chunks ran on the first hop (two of them then failed further on), then the replay, in chunks
    assert [c for c in chain.calls if c[0] == "a"][:7] == [*chunks, *chunks, ("a", 8, 1)]


def test_seeded_sampling_equals_the_same_sampler_over_transformers(
    tiny: ModelSource, tiny_reference: Any
) -> None:
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.2, seed=1234)
    client, _ = make_client(tiny, TINY_SPLIT)
    got = asyncio.run(client.generate_ids(PROMPT_IDS, 10, params))
    sampler, history = Sampler(params), list(PROMPT_IDS)
    with torch.inference_mode():
        for _ in range(10):
            history.append(sampler.sample(tiny_reference(torch.tensor([history])).logits[0, -1], history))
    assert got == history[len(PROMPT_IDS) :]


def test_killed_middle_peer_fails_over_to_replica_with_identical_output(
    tiny: ModelSource, tiny_reference: Any
) -> None:
    client, chain = make_client(tiny, {**TINY_SPLIT, "b2": (2, 4)})
    expected = greedy_reference(tiny_reference, PROMPT_IDS, 12)
    state: dict[str, NodeID] = {}

    def kill_middle_at_step_5(step: int) -> None:
        if step == 5:
            assert client.last_session is not None
            state["victim"] = client.last_session.stages[1].peer_id
            chain.dead.add(state["victim"])

    chain.on_step = kill_middle_at_step_5
    got = asyncio.run(client.generate_ids(PROMPT_IDS, 12, SamplingParams()))
    assert got == expected
    session = client.last_session
    assert session is not None and session.failovers == 1
    survivor = "b2" if state["victim"] == "b" else "b"
    assert [s.peer_id for s in session.stages] == ["a", survivor, "c"]
    # Only the replaced stage replayed: "a" resent what it had sent on for the 11 tokens before the failed step,
    # without computing them again, and "c" kept its cache (it took the failed step again from the survivor).
    assert chain.resends == [("a", 0, 11)]
    assert (survivor, 0, 11) in chain.calls
    assert [c for c in chain.calls if c[0] in ("a", "c") and c[1] == 0] == [("a", 0, 8), ("c", 0, 8)]
    assert session.replayed_tokens == 11
    assert [(r.stages, r.tokens, r.resent_by) for r in session.replays] == [
        ((Stage(NodeID(survivor), LayerRange(2, 4)),), 11, "a")
    ]
    assert client.routes.bans.is_banned(state["victim"])  # type: ignore[attr-defined]


def test_a_peer_that_lost_the_session_gets_a_replay_not_a_ban(tiny: ModelSource, tiny_reference: Any) -> None:
    client, chain = make_client(tiny, TINY_SPLIT)

    def drop_session_on_b_at_step_4(step: int) -> None:
        if step == 4:  # as a peer does after a restart or after moving to other layers
            assert client.last_session is not None
            chain.blocks[NodeID("b")].close_session(client.last_session.session_id)

    chain.on_step = drop_session_on_b_at_step_4
    got = asyncio.run(client.generate_ids(PROMPT_IDS, 8, SamplingParams()))
    assert got == greedy_reference(tiny_reference, PROMPT_IDS, 8)
    session = client.last_session
    assert session is not None and session.failovers == 1
    assert [s.peer_id for s in session.stages] == ["a", "b", "c"]  # same route, nobody banned
    assert not client.routes.bans.is_banned(NodeID("b"))  # type: ignore[attr-defined]
    # only "b" replayed the 10 tokens before the failed step, from what "a" had sent it; "c" kept its cache
    assert chain.resends == [("a", 0, 10)] and ("b", 0, 10) in chain.calls
    assert [c for c in chain.calls if c[0] in ("a", "c") and c[1] == 0] == [("a", 0, 8), ("c", 0, 8)]


def _refuse_middle_at_step(
    client: AsyncSwarmClient, chain: LocalChain, step: int, error: SwarmError, state: dict[str, NodeID]
) -> Callable[[int], None]:
    def hook(n: int) -> None:
        if n == step:
            assert client.last_session is not None
            state["victim"] = client.last_session.stages[1].peer_id
            chain.refusing[state["victim"]] = error

    return hook


def test_a_full_or_leaving_peer_is_routed_around_without_a_ban(
    tiny: ModelSource, tiny_reference: Any
) -> None:
    """CapacityError is the honest "not me, not now": the session avoids the peer, other sessions still may not."""
    client, chain = make_client(tiny, {**TINY_SPLIT, "b2": (2, 4)})
    state: dict[str, NodeID] = {}
    chain.on_step = _refuse_middle_at_step(client, chain, 4, CapacityError("draining: leaving"), state)
    got = asyncio.run(client.generate_ids(PROMPT_IDS, 10, SamplingParams()))
    assert got == greedy_reference(tiny_reference, PROMPT_IDS, 10)
    session = client.last_session
    assert session is not None and session.failovers == 1
    survivor = "b2" if state["victim"] == "b" else "b"
    assert [s.peer_id for s in session.stages] == ["a", survivor, "c"]
    assert session.avoided == {state["victim"]}
    assert isinstance(client.routes, LocalRoutes)
    assert not client.routes.bans.is_banned(state["victim"])
    assert client.routes.bans.failures(state["victim"]) == 0


def test_a_peer_sending_garbage_first_hand_is_banned_and_routed_around(
    tiny: ModelSource, tiny_reference: Any
) -> None:
    client, chain = make_client(tiny, {**TINY_SPLIT, "a2": (0, 2)})
    state: dict[str, NodeID] = {}

    def refuse_first_at_step_4(n: int) -> None:
        if n == 4:
            assert client.last_session is not None
            state["victim"] = client.last_session.stages[0].peer_id
            chain.refusing[state["victim"]] = ProtocolError("hidden size 65")

    chain.on_step = refuse_first_at_step_4
    got = asyncio.run(client.generate_ids(PROMPT_IDS, 10, SamplingParams()))
    assert got == greedy_reference(tiny_reference, PROMPT_IDS, 10)
    session = client.last_session
    assert session is not None and session.failovers == 1 and not session.avoided
    assert state["victim"] not in {s.peer_id for s in session.stages}
    assert isinstance(client.routes, LocalRoutes)
    assert client.routes.bans.is_banned(state["victim"])


def test_a_later_hop_said_to_send_garbage_is_routed_around_but_not_banned(
    tiny: ModelSource, tiny_reference: Any
) -> None:
    """Only the first hop talks to us first hand: "b sent garbage" is a's word, which nothing can check, so b
    is avoided for this session and nobody is banned (a lying hop could get any honest peer banned)."""
    client, chain = make_client(tiny, {**TINY_SPLIT, "b2": (2, 4)})
    state: dict[str, NodeID] = {}
    chain.on_step = _refuse_middle_at_step(client, chain, 4, ProtocolError("hidden size 65"), state)
    got = asyncio.run(client.generate_ids(PROMPT_IDS, 10, SamplingParams()))
    assert got == greedy_reference(tiny_reference, PROMPT_IDS, 10)
    session = client.last_session
    assert session is not None and session.failovers == 1 and session.avoided == {state["victim"]}
    assert state["victim"] not in {s.peer_id for s in session.stages}
    assert isinstance(client.routes, LocalRoutes)
    assert not any(client.routes.bans.is_banned(NodeID(p)) for p in chain.blocks)


def test_a_good_step_forgets_the_past_failures_of_the_route_peers(tiny: ModelSource) -> None:
    now = [0.0]
    client, _ = make_client(tiny, TINY_SPLIT, clock=lambda: now[0])
    assert isinstance(client.routes, LocalRoutes)
    bans = client.routes.bans
    bans.ban(NodeID("b"))
    now[0] += 61.0  # the ban is over, but b's failure is remembered: the next would double its ban
    assert not bans.is_banned(NodeID("b")) and bans.failures(NodeID("b")) == 1
    asyncio.run(client.generate_ids(PROMPT_IDS, 2, SamplingParams()))
    assert bans.failures(NodeID("b")) == 0


def test_missing_layers_give_no_route_error_naming_them(tiny: ModelSource) -> None:
    client, _ = make_client(tiny, {"a": (0, 2), "b": (2, 4)}, route_wait_s=0.0)
    with pytest.raises(NoRouteError) as info:
        asyncio.run(client.generate_ids(PROMPT_IDS, 3, SamplingParams()))
    assert info.value.missing_layers == [4, 5]
    assert "4:6" in str(info.value)


def test_failover_gives_up_with_no_route_when_the_only_holder_dies(tiny: ModelSource) -> None:
    """...once the wait for a route is over (route_wait_s; 0 here): a dead peer is not routed to again."""
    client, chain = make_client(tiny, TINY_SPLIT, route_wait_s=0.0)
    chain.on_step = lambda step: chain.dead.add(NodeID("c")) if step == 3 else None
    with pytest.raises(NoRouteError) as info:
        asyncio.run(client.generate_ids(PROMPT_IDS, 10, SamplingParams()))
    assert info.value.missing_layers == [4, 5]


def test_a_hung_middle_peer_is_found_by_a_probe_and_withdrawn_long_before_the_step_timeout(
    tiny: ModelSource, tiny_reference: Any
) -> None:
    """The middle peer stops answering at step 5 (its machine lost power: no error ever comes back). With an
    hour's step timeout, only the probe can end that step: the failover says it was the probe, the peer is
    withdrawn from routing, and the answer equals transformers'."""
    client, chain = make_client(tiny, {**TINY_SPLIT, "b2": (2, 4)}, step_timeout_s=3600.0, probe_after_s=0.01)
    state: dict[str, NodeID] = {}

    def hang_middle_at_step_5(step: int) -> None:
        if step == 5:
            assert client.last_session is not None
            state["victim"] = client.last_session.stages[1].peer_id
            chain.hung.add(state["victim"])

    chain.on_step = hang_middle_at_step_5
    got = asyncio.run(client.generate_ids(PROMPT_IDS, 12, SamplingParams()))
    assert got == greedy_reference(tiny_reference, PROMPT_IDS, 12)
    session = client.last_session
    assert session is not None and session.failovers == 1
    [failover] = session.failover_log
    assert (failover.error, failover.detected_by, failover.action) == ("PeerSilent", "probe", Action.WITHDRAW)
    assert failover.peer == state["victim"] and client.watch.silent_found == 1
    assert isinstance(client.routes, LocalRoutes) and state["victim"] in client.routes.withdrawn
    assert state["victim"] not in {s.peer_id for s in session.stages}


def test_the_only_holder_of_a_range_refusing_one_step_is_deprioritised_not_fatal(
    tiny: ModelSource, tiny_reference: Any
) -> None:
    """a, the only holder of 0:2 and the first hop (first hand: banned), refuses step 4 once. The ban used to
    leave no route for 0:2, and the request failed with NoRouteError; now a is routed through anyway."""
    client, chain = make_client(tiny, TINY_SPLIT)

    def refuse_a_once(step: int) -> None:
        if step == 4:
            chain.refusing[NodeID("a")] = ProtocolError("hidden size 65")
        else:
            chain.refusing.pop(NodeID("a"), None)

    chain.on_step = refuse_a_once
    got = asyncio.run(client.generate_ids(PROMPT_IDS, 10, SamplingParams()))
    assert got == greedy_reference(tiny_reference, PROMPT_IDS, 10)
    session = client.last_session
    assert session is not None and session.failovers == 1 and session.route_waits == 0
    assert [f.action for f in session.failover_log] == [Action.BAN_AND_REROUTE]
    assert [s.peer_id for s in session.stages] == ["a", "b", "c"]
    assert isinstance(client.routes, LocalRoutes)
    assert client.routes.bans.failures(NodeID("a")) == 0  # the good steps since forgot the failure


def test_the_only_holder_of_a_range_saying_it_is_full_is_tried_again_not_fatal(
    tiny: ModelSource, tiny_reference: Any
) -> None:
    """b, the only holder of 2:4, answers one step with CapacityError: the session avoids it, finds nobody else
    for 2:4, and tries it again (avoiding is only a preference) instead of failing with NoRouteError."""
    client, chain = make_client(tiny, TINY_SPLIT, route_wait_s=0.0)

    def refuse_b_once(step: int) -> None:
        if step == 4:
            chain.refusing[NodeID("b")] = CapacityError("40 sessions open, the limit")
        else:
            chain.refusing.pop(NodeID("b"), None)

    chain.on_step = refuse_b_once
    got = asyncio.run(client.generate_ids(PROMPT_IDS, 10, SamplingParams()))
    assert got == greedy_reference(tiny_reference, PROMPT_IDS, 10)
    session = client.last_session
    assert session is not None and session.failovers == 1 and session.route_waits == 0
    assert [s.peer_id for s in session.stages] == ["a", "b", "c"] and not session.avoided


def test_with_no_live_holder_the_session_waits_and_completes_once_one_serves(
    tiny: ModelSource, tiny_reference: Any
) -> None:
    """c, the only holder of 4:6, dies at step 3 and is withdrawn: nobody serves 4:6. The session waits (its
    pauses are injected: the first one brings c back, as a restart would) instead of failing at once."""
    client, chain = make_client(tiny, TINY_SPLIT, route_wait_s=3600.0)
    chain.on_step = lambda step: chain.dead.add(NodeID("c")) if step == 3 else None
    request = GenerationRequest(tuple(PROMPT_IDS), 10, frozenset())
    session = client.new_session(len(PROMPT_IDS) + 10)
    pauses: list[float] = []

    async def pause(seconds: float) -> None:
        pauses.append(seconds)
        if session.route_waits and NodeID("c") in chain.dead:  # waiting for a route: the holder comes back
            assert isinstance(client.routes, LocalRoutes)
            assert NodeID("c") in client.routes.withdrawn  # it was not routed to while dead
            chain.dead.discard(NodeID("c"))

    session.sleep = pause

    async def generate() -> list[int]:
        return [t async for t in generate_ids(session, request, Sampler(SamplingParams()).sample)]

    assert asyncio.run(generate()) == greedy_reference(tiny_reference, PROMPT_IDS, 10)
    assert session.route_waits == 1 and session.failovers == 1
    assert pauses == [client.config.route_poll_s, 0.0]  # one poll of the swarm, then the retry's own pause
    assert [s.peer_id for s in session.stages] == ["a", "b", "c"]


# --- default model: text ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default(default_source: ModelSource) -> ModelSource:
    return default_source


@pytest.fixture(scope="module")
def default_client(default: ModelSource) -> AsyncSwarmClient:
    return make_client(default, {"a": (0, 10), "b": (10, 20), "c": (20, 30)})[0]


@pytest.fixture(scope="module")
def transformers_answer(default: ModelSource) -> str:
    tokenizer, model = default.tokenizer(), default.load_reference_model()
    text = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=24, do_sample=False)
    return str(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))


@pytest.mark.slow
def test_chat_generate_and_stream_equal_transformers_greedy(
    default_client: AsyncSwarmClient, transformers_answer: str
) -> None:
    async def run() -> tuple[str, list[str]]:
        text = await default_client.generate(messages=QUESTION, max_new_tokens=24)
        pieces = [p async for p in default_client.stream(messages=QUESTION, max_new_tokens=24)]
        return text, pieces

    text, pieces = asyncio.run(run())
    assert "Paris" in transformers_answer
    assert text == transformers_answer
    assert "".join(pieces) == transformers_answer and len(pieces) > 3


@pytest.mark.slow
def test_stop_string_ends_the_answer_before_it(
    default_client: AsyncSwarmClient, transformers_answer: str
) -> None:
    stop = "Paris"
    text = asyncio.run(default_client.generate(messages=QUESTION, max_new_tokens=24, stop=stop))
    assert text == transformers_answer[: transformers_answer.index(stop)]


def test_multibyte_characters_are_never_split(default: ModelSource) -> None:
    from client.generation import IncrementalDetokenizer

    tokenizer = default.tokenizer()
    text = "Café 東京 🚀 naïve — ok"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_bad_prompts_get_clear_errors(default_client: AsyncSwarmClient) -> None:
    with pytest.raises(ValueError, match="exactly one of prompt= or messages="):
        default_client.encode()
    with pytest.raises(ValueError, match="role"):
        default_client.encode(messages=[{"text": "hi"}])
    with pytest.raises(ValueError, match="prompt must be a string"):
        default_client.encode(prompt=123)  # type: ignore[arg-type]


class _SyncIds:
    """The blocking generate_ids_batch that SwarmModelForCausalLM calls, over an in-process AsyncSwarmClient."""

    def __init__(self, client: AsyncSwarmClient) -> None:
        self.client = client
        self.tokenizer = client.tokenizer
        self.closed = False

    def generate_ids_batch(
        self,
        rows: Sequence[Sequence[int]],
        max_new_tokens: int,
        params: SamplingParams,
        yield_eos: bool = False,
    ) -> list[list[int]]:
        return asyncio.run(self.client.generate_ids_batch(rows, max_new_tokens, params, yield_eos))

    def close(self) -> None:
        self.closed = True


def test_hf_style_generate_returns_input_plus_new_ids_like_transformers(
    tiny: ModelSource, tiny_reference: Any
) -> None:
    from client.hf import SwarmModelForCausalLM

    client = _SyncIds(make_client(tiny, TINY_SPLIT)[0])
    with SwarmModelForCausalLM(client) as model:
        ids = torch.tensor([PROMPT_IDS])
        out = model.generate(ids, max_new_tokens=7)
        with torch.inference_mode():
            expected = tiny_reference.generate(ids, max_new_tokens=7, do_sample=False, eos_token_id=None)
        assert out.dtype == torch.long and torch.equal(out, expected)
        # left-padded batch: each row is generated from its unpadded ids
        batch = torch.tensor([[0, 0, *PROMPT_IDS[:6]], PROMPT_IDS])
        mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8])
        out = model.generate(batch, attention_mask=mask, max_new_tokens=5)
        assert out[0, 8:].tolist() == greedy_reference(tiny_reference, PROMPT_IDS[:6], 5)
        assert out[1, 8:].tolist() == greedy_reference(tiny_reference, PROMPT_IDS, 5)
        with pytest.raises(ValueError, match="LongTensor"):
            model.generate(torch.tensor([[1.0, 2.0]]))
    assert client.closed
