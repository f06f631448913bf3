"""Speculative decoding on the client: the prompt-lookup drafter, greedy acceptance, and generation with drafts
over the in-process chain, which must give exactly the tokens of plain greedy decoding."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy.stats import chisquare

from client.config import ClientConfig
from client.drafting import DraftLength, PromptLookup, Speculation, accept, make_speculation
from client.generation import GenerationRequest, generate_ids
from client.local import LocalChain, in_process_client
from swarm.models.head import Sampler, SamplingParams
from swarm.models.loading import ModelSource
from swarm.testing.reference import greedy_reference

pytestmark = pytest.mark.timeout(120)

SPLIT = {"a": (0, 3), "b": (3, 6)}
PROMPT_IDS = [5, 17, 42, 99, 7, 3, 250, 11] * 3  # repeats itself: lookup has something to propose


# --- the drafter and acceptance -------------------------------------------------------------------------


def test_lookup_proposes_what_followed_the_latest_match_of_the_longest_tail() -> None:
    drafter = PromptLookup(max_ngram=3)
    assert drafter.propose([1, 2, 3, 4, 9, 2, 3, 5, 2, 3], 2) == [5, 2]  # latest match of [2, 3]
    assert drafter.propose([7, 1, 2, 8, 3, 1, 2], 4) == [8, 3, 1, 2]  # [1, 2] beats the [2] at its own tail
    assert drafter.propose([1, 2, 3], 4) == []  # nothing repeats
    assert drafter.propose([4], 4) == []


@given(st.lists(st.integers(0, 5), max_size=40), st.integers(1, 6), st.integers(1, 4))
def test_a_lookup_proposal_continues_an_earlier_copy_of_the_tail(history: list[int], k: int, n: int) -> None:
    proposal = PromptLookup(max_ngram=n).propose(history, k)
    assert len(proposal) <= k
    copies = [
        start
        for size in range(1, n + 1)
        for start in range(len(history) - size)
        if len(history) > size and history[start : start + size] == history[-size:]
    ]
    if not proposal:
        assert not copies  # any earlier copy of the last token has something after it
        return
    assert any(
        history[start : start + len(proposal)] == proposal
        for size in range(1, n + 1)
        for start in range(size, len(history))
        if history[start - size : start] == history[-size:]
    )


@given(st.lists(st.integers(0, 3), max_size=8), st.data())
def test_accept_keeps_the_agreeing_prefix_and_the_targets_next_pick(drafts: list[int], data: Any) -> None:
    picks = data.draw(st.lists(st.integers(0, 3), min_size=len(drafts) + 1, max_size=len(drafts) + 1))
    kept = accept(drafts, picks)
    agree = next((i for i, (d, p) in enumerate(zip(drafts, picks, strict=False)) if d != p), len(drafts))
    assert kept == picks[: agree + 1]


def test_speculation_is_on_by_default_with_a_length_that_adapts() -> None:
    assert ClientConfig().speculate == "lookup" and make_speculation("off", 4) is None
    spec = make_speculation("lookup", 3)
    assert spec is not None and spec.draft_tokens == 3 and spec.length is not None
    with pytest.raises(ValueError):
        ClientConfig(speculate="tree")
    with pytest.raises(ValueError):
        ClientConfig(draft_tokens=0)


# --- generation with drafts over the in-process chain ---------------------------------------------------


@pytest.fixture(scope="module")
def reference(tiny_source: ModelSource) -> list[int]:
    """Greedy decoding of PROMPT_IDS for 24 tokens by full forward passes of the transformers model."""
    return greedy_reference(tiny_source, PROMPT_IDS, 24)


class Scripted:
    """Drafts from a known answer: its true continuation (``right``) or a token off by one at each place."""

    def __init__(self, answer: Sequence[int], right: bool) -> None:
        self.answer, self.right = list(answer), right

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        done = len(history) - len(PROMPT_IDS)
        guess = self.answer[done : done + k]
        return guess if self.right else [t + 1 for t in guess]


def _client(source: ModelSource, **settings: Any) -> tuple[Any, LocalChain]:
    blocks = {p: source.load_blocks(a, b, cache_tokens=4096) for p, (a, b) in SPLIT.items()}
    config = ClientConfig(retry_delay_s=0.0, spot_check_rate=0.0, **settings)
    client = in_process_client(source.load_head(), blocks, None, config)
    assert isinstance(client.chain, LocalChain)
    return client, client.chain


def _generate(source: ModelSource, spec: Speculation, request: GenerationRequest) -> list[int]:
    """The tokens of generating `request` with `spec`; checks that each trip but the prompt's gave one token
    the target picked, plus the accepted drafts before it."""
    client, chain = _client(source)

    async def run() -> list[int]:
        session = client.new_session(len(request.prompt_ids) + request.max_new_tokens)
        try:
            return [
                t async for t in generate_ids(session, request, Sampler(SamplingParams()).sample, True, spec)
            ]
        finally:
            await session.close()

    tokens = asyncio.run(run())
    trips = len([c for c in chain.calls if c[0] == "a"])
    if not request.eos_ids:
        assert trips == len(tokens) - spec.accepted
    return tokens


def test_lookup_drafts_give_the_plain_greedy_tokens_in_fewer_steps(
    tiny_source: ModelSource, reference: list[int]
) -> None:
    client, chain = _client(tiny_source, speculate="lookup", draft_tokens=4)
    got = asyncio.run(client.generate_ids(PROMPT_IDS, 24, SamplingParams()))
    assert got == reference
    spec = client.last_session.speculation
    assert spec is not None and spec.accepted > 0 and spec.drafted >= spec.accepted
    first_hop = [c for c in chain.calls if c[0] == "a"]
    # the prefill, then one step per token that came from the target rather than an accepted draft
    assert len(first_hop) == 1 + 23 - spec.accepted
    assert all(not block.active_sessions for block in chain.blocks.values())


def test_drafts_that_are_always_wrong_still_give_the_plain_greedy_tokens(
    tiny_source: ModelSource, reference: list[int]
) -> None:
    spec = Speculation(Scripted(reference, right=False), 4)
    request = GenerationRequest(tuple(PROMPT_IDS), 24, frozenset())
    assert _generate(tiny_source, spec, request) == reference
    # every decode step carried drafts but the last, which has room for no more tokens
    assert spec.steps == 22 and spec.drafted > 0 and spec.accepted == 0


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 24])
def test_right_drafts_stop_exactly_at_max_new_tokens(
    tiny_source: ModelSource, reference: list[int], max_new_tokens: int
) -> None:
    spec = Speculation(Scripted(reference, right=True), 4)
    request = GenerationRequest(tuple(PROMPT_IDS), max_new_tokens, frozenset())
    assert _generate(tiny_source, spec, request) == reference[:max_new_tokens]
    # each trip with drafts takes all it carries; the last trip goes without: no room for more tokens
    assert spec.accepted == spec.drafted and (spec.accepted > 0) == (max_new_tokens > 2)


@pytest.mark.parametrize("yield_eos", [False, True])
def test_an_accepted_draft_that_is_eos_ends_generation_there(
    tiny_source: ModelSource, reference: list[int], yield_eos: bool
) -> None:
    eos = reference[6]
    end = reference.index(eos)
    spec = Speculation(Scripted(reference, right=True), 8)
    request = GenerationRequest(tuple(PROMPT_IDS), 24, frozenset({eos}), yield_eos=yield_eos)
    assert _generate(tiny_source, spec, request) == reference[: end + 1 if yield_eos else end]


def test_a_peer_killed_mid_speculation_fails_over_and_replays_only_accepted_tokens(
    tiny_source: ModelSource, reference: list[int]
) -> None:
    """The second hop dies after a few steps with drafts; the failover replays the session's tokens on its
    replica. Rejected drafts are no part of them: the answer is still the greedy one."""
    client, chain = _client(tiny_source, speculate="lookup", draft_tokens=4)
    blocks = {"b2": tiny_source.load_blocks(3, 6, cache_tokens=4096)}
    chain.blocks.update(blocks)
    positions: list[int] = []

    def kill_second_hop(step: int) -> None:
        session = client.last_session
        if step == 5 and session is not None:
            positions.append(session.position)
            chain.dead.add(session.stages[1].peer_id)

    chain.on_step = kill_second_hop
    assert asyncio.run(client.generate_ids(PROMPT_IDS, 24, SamplingParams())) == reference
    session = client.last_session
    assert session is not None and session.failovers == 1 and session.speculation is not None
    assert session.speculation.accepted > 0
    # the replay carried the tokens the session held when the step failed: accepted ones only
    assert [r.tokens for r in session.replays] == positions


def test_concurrent_generations_with_drafts_give_each_its_greedy_tokens(
    tiny_source: ModelSource, reference: list[int]
) -> None:
    """Sessions whose decode steps go batched in rounds, each leaving its round for a step with drafts."""
    client, _ = _client(tiny_source, speculate="lookup", draft_tokens=3)
    rows = [PROMPT_IDS, PROMPT_IDS[:8], PROMPT_IDS]
    got = asyncio.run(client.generate_ids_batch(rows, 24, SamplingParams()))
    plain, _ = _client(tiny_source)
    assert got[0] == got[2] == reference
    assert got[1] == asyncio.run(plain.generate_ids(PROMPT_IDS[:8], 24, SamplingParams()))


# --- sampling with drafts: the plain distribution, exactly ---------------------------------------------

SAMPLED = SamplingParams(temperature=0.8, top_k=3, seed=7)
SAMPLES = 600


def _exact_joint(source: ModelSource, n: int) -> dict[tuple[int, ...], float]:
    """P(first n tokens) under plain sampling with SAMPLED, from full forward passes of transformers."""
    model, sampler = source.load_reference_model(), Sampler(SAMPLED)
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    with torch.inference_mode():
        for _ in range(n):
            grown: dict[tuple[int, ...], float] = {}
            for prefix, mass in joint.items():
                history = [*PROMPT_IDS, *prefix]
                probs = sampler.distribution(model(torch.tensor([history])).logits[0, -1], history)
                for token in probs.nonzero().flatten().tolist():
                    grown[(*prefix, token)] = mass * float(probs[token])
            joint = grown
    return joint


class AlwaysKeeps:
    """A broken verifier for the control: every draft kept, whatever its probability."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def distribution(self, logits: torch.Tensor, previous: Sequence[int]) -> torch.Tensor:
        return self.sampler.distribution(logits, previous)

    def draw(self, probs: torch.Tensor) -> int:
        return self.sampler.draw(probs)

    def uniform(self) -> float:
        return 0.0


def _sampled_counts(
    source: ModelSource, n: int, drafts: Sequence[int] | None, broken: bool = False
) -> Counter[tuple[int, ...]]:
    """How often each first-n-tokens answer came in SAMPLES generations, with ``drafts`` proposed (the same
    guesses at each place) or without speculation. With drafts, some must have been kept and some refused."""
    client, _ = _client(source)
    sampler = Sampler(SAMPLED)
    target: Any = AlwaysKeeps(sampler) if broken else sampler
    request = GenerationRequest(tuple(PROMPT_IDS), n, frozenset())

    kept = drafted = 0

    async def run() -> Counter[tuple[int, ...]]:
        nonlocal kept, drafted
        counts: Counter[tuple[int, ...]] = Counter()
        for _ in range(SAMPLES):
            spec = None if drafts is None else Speculation(Scripted(drafts, right=True), 2)
            session = client.new_session(len(PROMPT_IDS) + n)
            try:
                got = generate_ids(session, request, sampler.sample, False, spec, target)
                counts[tuple([t async for t in got])] += 1
            finally:
                await session.close()
            if spec is not None:
                kept, drafted = kept + spec.accepted, drafted + spec.drafted
        return counts

    counts = asyncio.run(run())
    assert drafts is None or 0 < kept < drafted
    return counts


def _fit_p_value(counts: Counter[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    """Chi-square goodness of fit of ``counts`` to ``exact``; answers expected fewer than 5 times pooled."""
    total = sum(counts.values())
    assert set(counts) <= set(exact)  # nothing plain sampling could not give
    cells = [a for a in exact if exact[a] * total >= 5]
    observed = [counts[a] for a in cells] + [total - sum(counts[a] for a in cells)]
    expected = [exact[a] * total for a in cells] + [total - sum(exact[a] * total for a in cells)]
    if expected[-1] < 1e-9:
        observed, expected = observed[:-1], expected[:-1]
    scale = total / sum(expected)  # the float sums of the exact masses stop a hair short of 1
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


@pytest.fixture(scope="module")
def exact_three(tiny_source: ModelSource) -> dict[tuple[int, ...], float]:
    return _exact_joint(tiny_source, 3)


@pytest.fixture(scope="module")
def guesses(exact_three: dict[tuple[int, ...], float]) -> list[int]:
    """The likeliest answer, as Scripted drafts it: its second token is drafted after any first one (kept
    at times, refused at others), and the step that checks it draws the third."""
    likeliest: tuple[int, ...] = max(exact_three, key=exact_three.__getitem__)
    return list(likeliest)


def test_sampling_with_drafts_draws_the_plain_distribution(
    tiny_source: ModelSource, exact_three: dict[tuple[int, ...], float], guesses: list[int]
) -> None:
    """Three tokens: the first from the prompt's step, the next two from one step with a draft. Their
    joint distribution over SAMPLES answers fits the exact one of plain sampling, as plain sampling does."""
    assert _fit_p_value(_sampled_counts(tiny_source, 3, None), exact_three) > 1e-3
    assert _fit_p_value(_sampled_counts(tiny_source, 3, guesses), exact_three) > 1e-3


def test_the_fit_sees_a_verifier_that_keeps_every_draft(
    tiny_source: ModelSource, exact_three: dict[tuple[int, ...], float], guesses: list[int]
) -> None:
    """The control: keeping drafts regardless of their probability skews the answers, and the test says so."""
    assert _fit_p_value(_sampled_counts(tiny_source, 3, guesses, broken=True), exact_three) < 1e-6


# --- the draft length: from measured acceptance and step times -----------------------------------------


def _drive(
    length: DraftLength, steps: int, alpha: float, trip_s: float, token_s: float, seed: int
) -> list[int]:
    """Run ``steps`` steps on a route whose step of n tokens takes trip_s + n token_s and whose drafts are
    each kept with chance ``alpha``: the number of drafts each step carried."""
    rng = random.Random(seed)
    carried = []
    for _ in range(steps):
        k = length.choose(4)
        kept = 0
        while kept < k and rng.random() < alpha:
            kept += 1
        length.observe(k + 1, trip_s + (k + 1) * token_s, k, kept)
        carried.append(k)
    return carried


@pytest.mark.parametrize("seed", range(3))
def test_a_long_trip_and_a_good_drafter_draft_the_most(seed: int) -> None:
    carried = _drive(DraftLength(4), 200, alpha=0.7, trip_s=0.100, token_s=0.002, seed=seed)
    assert sum(k == 4 for k in carried[10:]) >= 0.9 * len(carried[10:])


@pytest.mark.parametrize("seed", range(3))
def test_drafts_that_do_not_pay_are_switched_off_but_for_rare_probes(seed: int) -> None:
    # Loopback on a CPU: every token costs as much as the trip, and the drafter is weak.
    carried = _drive(DraftLength(4), 400, alpha=0.1, trip_s=0.005, token_s=0.010, seed=seed)
    with_drafts = [i for i, k in enumerate(carried) if k > 0]
    assert len(with_drafts) <= 0.06 * len(carried)
    assert with_drafts[-1] >= len(carried) - 64 - 1  # still probing now and then


def test_a_drafter_that_starts_to_pay_is_taken_back_within_a_probe() -> None:
    length = DraftLength(4)
    assert sum(_drive(length, 300, alpha=0.05, trip_s=0.005, token_s=0.010, seed=0)[-50:]) <= 8
    carried = _drive(length, 100, alpha=0.9, trip_s=0.100, token_s=0.002, seed=1)
    first = next(i for i, k in enumerate(carried) if k > 0)
    # the step times of the old route fade as the new ones come: long drafts again within a few dozen steps
    assert first <= 64 and all(k >= 3 for k in carried[first + 30 :])


def test_bad_draft_length_settings_are_refused() -> None:
    for bad in ({"max_k": 0}, {"max_k": 4, "decay": 1.0}, {"max_k": 4, "probe_every": 0}):
        with pytest.raises(ValueError):
            DraftLength(**bad)  # type: ignore[arg-type]
