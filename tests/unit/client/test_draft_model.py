"""Model drafters (client.draft_model): a whole draft model or the served model's first layers, drafting on
the client. Greedy answers with either equal plain decoding and transformers; a drafter's cache follows the
session's accepted tokens through rejections without running the history again; bad settings fail clearly."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from client.config import ClientConfig
from client.draft_model import DraftModel, ModelDrafter, check_same_vocab, load_draft_model
from client.drafting import DraftLength, Speculation, make_speculation
from client.generation import GenerationRequest, generate_ids
from client.local import in_process_client
from swarm.models.checkpoints import write_tiny_checkpoint
from swarm.models.head import Sampler, SamplingParams
from swarm.models.loading import ModelSource, resolve_model
from swarm.testing.reference import greedy_reference, greedy_tokens

pytestmark = pytest.mark.timeout(120)

SPLIT = {"a": (0, 3), "b": (3, 6)}
PROMPT_IDS = [5, 17, 42, 99, 7, 3, 250, 11, 64, 2]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def reference(tiny_source: ModelSource) -> list[int]:
    return greedy_reference(tiny_source, PROMPT_IDS, NEW_TOKENS)


def _client(source: ModelSource, **settings: Any) -> Any:
    """An in-process client over SPLIT with the draft model its settings ask for."""
    config = ClientConfig(retry_delay_s=0.0, spot_check_rate=0.0, **settings)
    blocks = {p: source.load_blocks(a, b, cache_tokens=4096) for p, (a, b) in SPLIT.items()}
    head = source.load_head()
    draft = load_draft_model(config, source, head)
    return in_process_client(head, blocks, None, config, draft=draft)


# --- greedy answers: those of plain decoding ------------------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        {"speculate": "model", "draft_model": "tiny:0"},  # the served model itself: every draft right
        {"speculate": "model", "draft_model": "tiny:1"},  # another model of the same vocabulary: most wrong
        {"speculate": "self", "draft_layers": 2},
        {"speculate": "self", "draft_layers": 5},
    ],
    ids=["model-same", "model-other", "self-2", "self-5"],
)
def test_model_drafts_give_the_plain_greedy_tokens(
    tiny_source: ModelSource, reference: list[int], settings: dict[str, Any]
) -> None:
    client = _client(tiny_source, draft_tokens=4, **settings)
    plain = _client(tiny_source, speculate="off")
    got = asyncio.run(client.generate_ids(PROMPT_IDS, NEW_TOKENS, SamplingParams()))
    assert got == reference == asyncio.run(plain.generate_ids(PROMPT_IDS, NEW_TOKENS, SamplingParams()))
    spec = client.last_session.speculation
    assert isinstance(spec.drafter, ModelDrafter) and spec.drafted > 0
    if settings.get("draft_model") == "tiny:0":
        assert spec.accepted == spec.drafted  # the same model guesses every token
    assert not client.draft.blocks.active_sessions  # the drafter's cache was freed with the answer


def test_fixed_length_model_drafts_keep_the_greedy_tokens_through_many_rejections(
    tiny_source: ModelSource, reference: list[int]
) -> None:
    """Every step carries 4 drafts of a different model (no adaptive switch-off): most steps reject some."""
    client = _client(tiny_source, speculate="model", draft_model="tiny:1")
    spec = Speculation(client.draft.drafter(), 4)
    request = GenerationRequest(tuple(PROMPT_IDS), NEW_TOKENS, frozenset())

    async def run() -> list[int]:
        session = client.new_session(len(PROMPT_IDS) + NEW_TOKENS)
        try:
            return [
                t async for t in generate_ids(session, request, Sampler(SamplingParams()).sample, True, spec)
            ]
        finally:
            await session.close()

    assert asyncio.run(run()) == reference
    assert spec.steps > 5 and spec.accepted < spec.drafted


def test_sampling_with_a_model_drafter_runs_and_ends_on_time(tiny_source: ModelSource) -> None:
    """Sampled answers verify greedy drafts by speculative sampling (client.drafting.sampled_accept, whose
    distribution test covers any drafter); here: the answer has its length and the drafter's cache is freed."""
    client = _client(tiny_source, speculate="self", draft_layers=3)
    got = asyncio.run(client.generate_ids(PROMPT_IDS, NEW_TOKENS, SamplingParams(temperature=0.7, seed=3)))
    assert len(got) == NEW_TOKENS and client.last_session.speculation.drafted > 0
    assert not client.draft.blocks.active_sessions


# --- the drafter's cache -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def draft_source() -> ModelSource:
    return resolve_model("tiny:1")


@pytest.fixture(scope="module")
def draft(draft_source: ModelSource) -> DraftModel:
    return DraftModel(draft_source.load_blocks(0, 6, cache_tokens=512), draft_source.load_head())


def test_drafts_are_the_draft_models_own_greedy_tokens(draft_source: ModelSource, draft: DraftModel) -> None:
    drafter = draft.drafter()
    model = draft_source.load_reference_model()
    assert drafter.propose(PROMPT_IDS, 6) == greedy_tokens(model, PROMPT_IDS, 6)
    drafter.close()


def test_the_cache_follows_the_history_through_rejections(
    draft_source: ModelSource, draft: DraftModel
) -> None:
    """A session's histories: drafts partly kept, then a token the drafter did not guess. Each proposal equals
    the draft model's greedy tokens after that history, and runs only the tokens it had not cached."""
    model = draft_source.load_reference_model()
    drafter = draft.drafter()
    drafter.prepare(PROMPT_IDS)
    assert drafter.fed == len(PROMPT_IDS)
    history = list(PROMPT_IDS)
    for step in range(8):
        drafts = drafter.propose(history, 4)
        assert drafts == greedy_tokens(model, history, 4)
        fed = drafter.fed
        kept = step % 4  # 0 to 3 drafts kept, then a token other than the next draft
        wrong = (drafts[kept] + 1 + step) % draft.head.spec.vocab_size
        history += [*drafts[:kept], wrong]
        assert drafter.propose(history, 1) == greedy_tokens(model, history, 1)
        assert drafter.cached == history  # the rejected drafts are out of its cache
        assert drafter.fed - fed <= kept + 1  # the cut-back cache ran the new tokens only
    drafter.close()
    assert not draft.blocks.active_sessions


def test_an_evicted_drafter_starts_again_and_still_drafts_right(
    draft_source: ModelSource, draft: DraftModel
) -> None:
    model = draft_source.load_reference_model()
    drafter = draft.drafter()
    assert drafter.propose(PROMPT_IDS, 2) == greedy_tokens(model, PROMPT_IDS, 2)
    draft.blocks.cache.evict(drafter.session_id)
    fed = drafter.fed
    assert drafter.propose(PROMPT_IDS, 2) == greedy_tokens(model, PROMPT_IDS, 2)
    assert drafter.fed - fed == len(PROMPT_IDS) + 1  # the whole history again, then the second draft
    drafter.close()


def test_a_history_longer_than_the_drafters_cache_gets_no_drafts(draft: DraftModel) -> None:
    drafter = draft.drafter()
    assert drafter.propose(PROMPT_IDS * 60, 4) == []
    assert not draft.blocks.active_sessions


# --- settings ------------------------------------------------------------------------------------------


def test_bad_drafter_settings_fail_clearly(tiny_source: ModelSource) -> None:
    with pytest.raises(ValueError, match="draft_model"):
        ClientConfig(speculate="model")
    with pytest.raises(ValueError, match="draft_layers"):
        ClientConfig(speculate="self")
    with pytest.raises(ValueError, match="draft_layers"):
        ClientConfig(draft_layers=-1)
    with pytest.raises(ValueError, match="draft_cache_tokens"):
        ClientConfig(draft_cache_tokens=0)
    head = tiny_source.load_head()
    with pytest.raises(ValueError, match="draft_layers"):
        load_draft_model(ClientConfig(speculate="self", draft_layers=6), tiny_source, head)
    with pytest.raises(ValueError, match="neither"):
        load_draft_model(ClientConfig(speculate="model", draft_model="/nowhere"), tiny_source, head)
    with pytest.raises(ValueError, match="needs a draft model"):
        make_speculation("model", 4)
    with pytest.raises(ValueError, match="needs a draft model"):
        in_process_client(head, {}, None, ClientConfig(speculate="self", draft_layers=2))
    assert load_draft_model(ClientConfig(), tiny_source, head) is None  # lookup: no model to load


def _tokenizer_dir(path: Path, words: list[str], vocab_size: int = 320) -> ModelSource:
    """A tiny checkpoint with a word-level tokenizer of ``words`` (and a vocabulary of ``vocab_size``)."""
    write_tiny_checkpoint(path, seed=0)
    if vocab_size != 320:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(config | {"vocab_size": vocab_size}))
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return ModelSource(path)


def test_a_draft_model_must_share_the_served_models_tokenizer(
    tmp_path: Path, tiny_source: ModelSource
) -> None:
    served = _tokenizer_dir(tmp_path / "served", ["<unk>", "a", "bike"])
    same = _tokenizer_dir(tmp_path / "same", ["<unk>", "a", "bike"])
    other = _tokenizer_dir(tmp_path / "other", ["<unk>", "a", "bicycle"])
    wider = _tokenizer_dir(tmp_path / "wider", ["<unk>", "a", "bike"], vocab_size=352)
    tokenizer = served.tokenizer()
    check_same_vocab(same, served, tokenizer)
    with pytest.raises(ValueError, match="tokenizer differs"):
        check_same_vocab(other, served, tokenizer)
    with pytest.raises(ValueError, match="vocabulary of 352"):
        check_same_vocab(wider, served, tokenizer)
    with pytest.raises(ValueError, match="only one has a tokenizer"):
        check_same_vocab(tiny_source, served, tokenizer)
    config = ClientConfig(speculate="model", draft_model=str(tmp_path / "other"))
    with pytest.raises(ValueError, match="tokenizer differs"):
        load_draft_model(config, served, served.load_head(), tokenizer)


def test_the_served_model_as_its_own_draft_shares_the_clients_head(tiny_source: ModelSource) -> None:
    head = tiny_source.load_head()
    draft = load_draft_model(ClientConfig(speculate="model", draft_model="tiny:0"), tiny_source, head)
    assert draft is not None and draft.head is head and draft.layers == 6
    other = load_draft_model(ClientConfig(speculate="model", draft_model="tiny:1"), tiny_source, head)
    assert other is not None and other.head is not head
    assert not torch.equal(other.head.embed_weight, head.embed_weight)


def test_concurrent_sessions_draft_from_one_model_each_with_its_own_cache(
    tiny_source: ModelSource, reference: list[int]
) -> None:
    """Sessions whose steps go batched in rounds, their drafters' caches in the one draft range."""
    client = _client(tiny_source, speculate="model", draft_model="tiny:1", draft_tokens=3)
    rows = [PROMPT_IDS, PROMPT_IDS[:6], PROMPT_IDS]
    got = asyncio.run(client.generate_ids_batch(rows, NEW_TOKENS, SamplingParams()))
    plain = _client(tiny_source, speculate="off")
    assert got[0] == got[2] == reference
    assert got[1] == asyncio.run(plain.generate_ids(PROMPT_IDS[:6], NEW_TOKENS, SamplingParams()))
    assert not client.draft.blocks.active_sessions


class SlowDrafter:
    """Proposes nothing useful, and each proposal takes a second of ``clock``."""

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        self.clock[0] += 1.0
        return [0] * k


def test_a_steps_time_counts_its_drafting(tiny_source: ModelSource) -> None:
    """The draft length weighs what drafting costs: a drafter's time is part of its step's."""
    now = [0.0]
    length = DraftLength(2)
    spec = Speculation(SlowDrafter(now), 2, length, clock=lambda: now[0])
    client = _client(tiny_source, speculate="off")

    def trip(step: int) -> None:  # each trip through the route takes 10 ms of ``clock``
        now[0] += 0.01

    client.chain.on_step = trip
    request = GenerationRequest(tuple(PROMPT_IDS), 6, frozenset())

    async def run() -> list[int]:
        session = client.new_session(len(PROMPT_IDS) + 6)
        try:
            return [
                t async for t in generate_ids(session, request, Sampler(SamplingParams()).sample, True, spec)
            ]
        finally:
            await session.close()

    asyncio.run(run())
    assert spec.drafted > 0 and length.times[3] >= 1.01  # steps of 2 drafts and the token before them
    assert length.times[1] == pytest.approx(0.01)  # plain steps: the trip alone


def test_prepare_catches_up_only_a_drafter_more_than_a_token_behind(draft: DraftModel) -> None:
    """After steps without drafts the drafter catches up before the timed step; one token behind, the
    proposal runs that token with the next (no call of its own)."""
    drafter = draft.drafter()
    drafter.prepare(PROMPT_IDS[:4])
    runs = drafter.runs
    drafter.prepare(PROMPT_IDS[:5])  # one behind: left to the proposal
    assert (drafter.runs, drafter.cached) == (runs, PROMPT_IDS[:4])
    drafter.prepare(PROMPT_IDS[:9])  # five behind: run now
    assert (drafter.runs, drafter.fed, drafter.cached) == (runs + 1, 9, PROMPT_IDS[:9])
    drafter.close()


def test_a_sliding_window_models_self_drafter_drafts_within_its_window(tmp_path: Path) -> None:
    """A Mistral v0.1-style config (a window shorter than the drafter's cache): the drafter's sessions are
    sized to the window, which its blocks accept, rather than refused and never drafting."""
    write_tiny_checkpoint(tmp_path, seed=0)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"sliding_window": 64}))
    source = ModelSource(tmp_path)
    draft = load_draft_model(ClientConfig(speculate="self", draft_layers=3), source, source.load_head())
    assert draft is not None
    assert draft.drafter().propose([5, 17, 42, 99, 7], 4)
