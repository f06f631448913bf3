"""The int8 screens: each one's bound holds, so the greedy token is that of the exact float32 logits
(argmax.exact_logits: one fixed order of the sums, the same bits on every x86 CPU and for any subset of rows)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from client.config import ClientConfig
from client.local import in_process_client
from swarm.models import SamplingParams
from swarm.models.backends.cpu import argmax
from swarm.models.backends.cpu.argmax import (
    LOUD,
    ROWS_TIMED,
    SCREENS,
    ArgmaxScreen,
    Int8InputScreen,
    Int8WeightScreen,
    calibrated_screen,
    exact_logits,
    pick_screen,
)
from swarm.models.loading import ModelSource

pytestmark = pytest.mark.timeout(120)


class InputScreenFinishedInTorch(Int8InputScreen):
    """Int8InputScreen as it runs where screen.c cannot be built: every step after the int8 product in torch."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        self.finish = None


FINISHED_IN_C = Int8InputScreen.available(96) and argmax._finish() is not None
# every kind of screen this torch can run (each test also runs with a tiny weight of 96 dimensions)
KINDS = [
    pytest.param(kind, id=kind.__name__)
    for kind in SCREENS
    if kind.available(96) and argmax.exact_available()
]
needs_exact = pytest.mark.skipif(not argmax.exact_available(), reason="screen.c does not build here")
if FINISHED_IN_C:
    KINDS.append(pytest.param(InputScreenFinishedInTorch, id="Int8InputScreen-in-torch"))


def _head_weight(seed: int, vocab: int = 2048, hidden: int = 96) -> torch.Tensor:
    """Rows of mixed scales, with near-duplicates: rows whose logits tie to within float rounding."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=g) * torch.rand(vocab, 1, generator=g) * 0.2
    weight[: vocab // 8] *= 10  # a few loud rows: per-row scales must not let them swamp the rest
    twins = torch.randperm(vocab, generator=g)[:64]
    weight[twins[32:]] = weight[twins[:32]] + torch.randn(32, hidden, generator=g) * 1e-6
    weight[7, 3] = 40.0  # one outlier weight: its row's int8 step is coarse
    return weight


def _inputs(weight: torch.Tensor, seed: int) -> torch.Tensor:
    """Peaked rows (a scaled weight row plus noise), flat rows, and huge and tiny rows, shuffled."""
    g = torch.Generator().manual_seed(seed)
    hidden = weight.shape[1]
    picked = weight[torch.randint(weight.shape[0], (24,), generator=g)]
    rows = [
        picked * 20 + torch.randn(24, hidden, generator=g),
        torch.randn(8, hidden, generator=g),
        torch.randn(4, hidden, generator=g) * 1e4,
        torch.randn(4, hidden, generator=g) * 1e-4,
    ]
    stacked = torch.cat(rows)
    return stacked[torch.randperm(stacked.shape[0], generator=g)]


def _dense(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda rows: F.linear(rows, weight)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_screened_logit_lies_within_its_bound(kind: type[ArgmaxScreen], seed: int) -> None:
    weight = _head_weight(seed)
    screen = kind(weight)
    x = _inputs(weight, seed)
    screened, bound = screen.bounds(x)
    exact = F.linear(x.double(), weight.double())  # the true dot products
    assert bool(((exact - screened.double()).abs() <= bound.double()).all())


@pytest.mark.parametrize("kind", KINDS)
def test_rows_with_a_few_loud_dimensions_or_none_at_all_stay_within_the_bound(
    kind: type[ArgmaxScreen],
) -> None:
    weight = _head_weight(4)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, weight.shape[1], generator=g)
    x[:3, torch.randperm(weight.shape[1], generator=g)[:5]] *= 300  # massive activations in a few dimensions
    x[3] = 0.0
    x[4] = 0.0
    x[4, 7] = 5.0  # one dimension: nothing left once the loud ones are apart
    x = x[torch.randperm(x.shape[0], generator=g)]
    screened, bound = kind(weight).bounds(x)
    exact = F.linear(x.double(), weight.double())
    assert bool(((exact - screened.double()).abs() <= bound.double()).all())


@pytest.mark.skipif(not Int8InputScreen.available(96), reason="this torch has no fbgemm")
def test_the_input_screens_bound_holds_where_every_rounding_of_the_input_errs_the_same_way() -> None:
    """The worst case of quantising the input: every value just under half a step past a level, against a row
    of equal weights (random inputs err both ways and stay far inside the bound)."""
    hidden, step = 512, 0.01  # wide, so the loud dimensions (exact) are few of the bound's terms
    weight = torch.ones(
        8, hidden
    )  # exact in int8 and in the loud dimensions' 8-bit rows: only x's rounding errs
    levels = torch.randint(0, 120, (hidden,), generator=torch.Generator().manual_seed(6)).float()
    x = (levels + 0.49) * step  # all >= 0: zero point 0, and the step is (largest / 125)
    x[0] = 125 * step  # the largest left once the loud dimensions are apart
    x[-LOUD:] = 1000 * step  # the loud dimensions: taken apart
    screened, bound = Int8InputScreen(weight).bounds(x[None])
    error = (F.linear(x[None].double(), weight.double()) - screened.double()).abs()
    assert float(error[0, 0]) > 0.4 * step * (hidden - LOUD - 1)  # the case built: each rounding errs alike
    assert bool((error <= bound.double()).all())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_screened_argmax_is_the_exact_one_and_kept_logits_are_exact(
    kind: type[ArgmaxScreen], seed: int
) -> None:
    weight = _head_weight(seed)
    screen = kind(weight)
    for rows in (1, 3, 8):
        x = _inputs(weight, seed)[:rows]
        exact = torch.stack([exact_logits(row, weight) for row in x])
        got = screen.logits(x, _dense(weight))
        assert torch.equal(got.argmax(dim=1), exact.argmax(dim=1))
        kept = torch.isfinite(got)
        assert bool(kept.any(dim=1).all())
        assert torch.equal(
            got[kept], exact[kept]
        )  # the re-check computes each kept logit as the reference does


@pytest.mark.parametrize("kind", KINDS)
def test_near_ties_are_both_kept_and_settled_exactly(kind: type[ArgmaxScreen]) -> None:
    weight = _head_weight(3)
    twin_a, twin_b = 5, 6
    weight[twin_b] = weight[twin_a] + 1e-6
    screen = kind(weight)
    x = weight[twin_a : twin_a + 1] * 50
    got = screen.logits(x, _dense(weight))
    assert bool(torch.isfinite(got[0, [twin_a, twin_b]]).all())
    exact = exact_logits(x[0], weight)
    assert torch.equal(got[0, [twin_a, twin_b]], exact[[twin_a, twin_b]])
    assert int(got.argmax()) == int(exact.argmax())


@needs_exact
def test_exact_logits_are_the_same_bits_for_any_rows_and_f_linears_to_rounding() -> None:
    """What makes the screened argmax exact on every CPU: a logit of exact_logits does not depend on which other
    rows are computed with it (F.linear's does, through the kernel it picks for the shape), and it is the dot
    product to float32 rounding."""
    weight = _head_weight(4)
    x = _inputs(weight, 4)[0]
    whole = exact_logits(x, weight)
    for rows in (
        torch.tensor([5]),
        torch.tensor([6, 5]),
        torch.arange(3, 2048, 7),
        torch.arange(2047, -1, -1),
    ):
        assert torch.equal(exact_logits(x, weight, rows), whole[rows])
    true = F.linear(x.double(), weight.double())
    scale = float(x.double().abs() @ weight.double().abs().T.max(dim=1).values) or 1.0
    assert float((whole.double() - true).abs().max()) <= weight.shape[1] * 2.0**-23 * scale
    with pytest.raises(ValueError, match="rows outside"):
        exact_logits(x, weight, torch.tensor([2048]))


@pytest.mark.skipif(not FINISHED_IN_C, reason="no fbgemm, or screen.c cannot be built here")
@pytest.mark.parametrize("vocab", [2048, 2051, 517, 70])
def test_the_input_screens_finish_in_c_is_its_finish_in_torch(vocab: int) -> None:
    """screen.c's finish against the same steps in torch, on vocabularies that end inside a block of 8 and of
    512; a row whose logits overflow keeps nothing in both (the dense head computes it)."""
    weight = _head_weight(vocab, vocab=vocab)
    x = _inputs(weight, vocab)
    in_c, in_torch = Int8InputScreen(weight), InputScreenFinishedInTorch(weight)
    (c_screened, c_bound), (t_screened, t_bound) = in_c.bounds(x), in_torch.bounds(x)
    # the loud dimensions' sums go in another order: float32 roundings, far inside the bound
    assert bool(((c_screened - t_screened).abs() <= 2.0**-10 * t_bound).all())
    torch.testing.assert_close(c_bound, t_bound, rtol=1e-5, atol=0.0)
    c_kept, t_kept = in_c.candidates(x)[1], in_torch.candidates(x)[1]
    assert [r is None for r in c_kept] == [r is None for r in t_kept]
    assert all(a is None or torch.equal(a, b) for a, b in zip(c_kept, t_kept, strict=True))
    overflowing = torch.full((1, weight.shape[1]), 1e37)  # its L1 norm, in the bound, is inf
    assert in_c.candidates(overflowing)[1] == [None] == in_torch.candidates(overflowing)[1]


@pytest.mark.parametrize("kind", KINDS)
def test_rows_that_are_not_finite_get_the_dense_heads_logits_and_the_rest_are_screened(
    kind: type[ArgmaxScreen],
) -> None:
    weight = _head_weight(5)
    x = _inputs(weight, 5)[:4]
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    calls: list[int] = []

    def dense(rows: torch.Tensor) -> torch.Tensor:
        calls.append(rows.shape[0])
        return F.linear(rows, weight)

    got = kind(weight).logits(x, dense)
    assert calls == [2]  # the two rows that are not finite, together
    torch.testing.assert_close(got[1:3], F.linear(x[1:3], weight), equal_nan=True)
    exact = torch.stack([exact_logits(x[r], weight) for r in (0, 3)])
    assert torch.equal(got[[0, 3]].argmax(dim=1), exact.argmax(dim=1))


def test_no_weight_only_screen_for_rows_its_kernel_cannot_read_safely() -> None:
    assert not Int8WeightScreen.available(40) and Int8WeightScreen.available(576) == hasattr(
        torch, "_weight_int8pack_mm"
    )
    with pytest.raises(ValueError, match="no Int8WeightScreen"):
        Int8WeightScreen(torch.randn(64, 40))


@pytest.mark.parametrize("kind", KINDS)
def test_a_flat_row_gets_every_exact_logit(kind: type[ArgmaxScreen]) -> None:
    weight = torch.ones(512, 32)  # every logit ties: nothing can be ruled out
    calls: list[int] = []

    def dense(rows: torch.Tensor) -> torch.Tensor:
        calls.append(rows.shape[0])
        return F.linear(rows, weight)

    got = kind(weight).logits(torch.ones(1, 32), dense)
    assert calls == [] and torch.equal(got[0], exact_logits(torch.ones(32), weight))


def test_a_screen_is_kept_for_the_row_counts_up_to_the_first_not_clearly_faster() -> None:
    now = [0.0]
    cost = {"dense": {1: 3.0, 2: 3.2, 4: 3.6, 8: 5.0}, "screen": {1: 1.5, 2: 1.8, 4: 3.5, 8: 2.0}}

    def dense(rows: torch.Tensor) -> torch.Tensor:
        now[0] += cost["dense"][rows.shape[0]]
        return rows

    class Screen:
        def logits(self, rows: torch.Tensor, dense: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
            now[0] += cost["screen"][rows.shape[0]]
            return rows

    sample = torch.zeros(max(ROWS_TIMED), 4)
    # 4 rows is not clearly faster (3.5 > 0.9 x 3.6): 8 is never reached, whatever it costs
    screen = Screen()
    assert pick_screen(dense, [screen], sample, clock=lambda: now[0]) == (screen, 2)  # type: ignore[list-item]
    cost["screen"][1] = 2.9
    assert pick_screen(dense, [screen], sample, clock=lambda: now[0]) == (None, 0)  # type: ignore[list-item]


def test_pick_screen_keeps_the_screen_that_saves_the_most_time() -> None:
    now = [0.0]
    dense_cost = {1: 3.0, 2: 3.2, 4: 3.6, 8: 5.0}

    def dense(rows: torch.Tensor) -> torch.Tensor:
        now[0] += dense_cost[rows.shape[0]]
        return rows

    class Screen:
        def __init__(self, cost: dict[int, float]) -> None:
            self.cost = cost

        def logits(self, rows: torch.Tensor, dense: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
            now[0] += self.cost[rows.shape[0]]
            return rows

    quick_alone = Screen({1: 1.0, 2: 3.1, 4: 3.6, 8: 5.0})  # saves 2.0, for 1 row only
    steady = Screen({1: 2.0, 2: 2.0, 4: 2.0, 8: 2.0})  # saves 1.0 + 1.2 + 1.6 + 3.0
    slow = Screen({1: 2.9, 2: 3.2, 4: 3.6, 8: 5.0})  # never clearly faster
    sample = torch.zeros(max(ROWS_TIMED), 4)
    screens = [quick_alone, steady, slow]
    random.Random(0).shuffle(screens)  # the order they are offered in must not matter
    picked = pick_screen(dense, screens, sample, clock=lambda: now[0])  # type: ignore[arg-type]
    assert picked == (steady, 8)
    assert pick_screen(dense, [slow], sample, clock=lambda: now[0]) == (None, 0)  # type: ignore[list-item]


def test_the_screen_picked_is_kept_for_the_next_process_and_a_damaged_pick_is_timed_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    picks = tmp_path / "picks.json"
    monkeypatch.setattr(argmax, "_picks_path", lambda: picks)
    weight = _head_weight(0)
    sample = _inputs(weight, 0)[: max(ROWS_TIMED)]
    now = [0.0]

    def dense(rows: torch.Tensor) -> torch.Tensor:
        now[0] += 100.0  # far slower than any screen: one is picked, for every row count
        return F.linear(rows, weight)

    def never_timed() -> float:
        raise AssertionError("the screens were timed again")

    screen, rows = calibrated_screen(dense, weight, sample, clock=lambda: now[0])
    assert screen is not None and rows == max(ROWS_TIMED)
    again, rows_again = calibrated_screen(dense, weight, sample, clock=never_timed)
    assert type(again) is type(screen) and rows_again == rows
    (key,) = json.loads(picks.read_text())
    picks.write_text(json.dumps({key: {"screen": "NoSuchScreen", "rows": 2}}))
    screen, rows = calibrated_screen(dense, weight, sample, clock=lambda: now[0])
    assert screen is not None and rows == max(ROWS_TIMED)


@needs_exact
def test_the_head_screens_only_argmax_only_calls_within_its_rows(tiny_source: ModelSource) -> None:
    head = tiny_source.load_head()
    head.kernels.use_screen(Int8InputScreen(head.lm_head_weight), 2)  # type: ignore[attr-defined]
    hidden = torch.randn(4, head.hidden_size, generator=torch.Generator().manual_seed(0))
    dense = head.logits(hidden)
    assert bool(torch.isfinite(dense).all())
    assert bool(torch.isfinite(head.logits(hidden, argmax_only=True)).all())  # 4 rows: past the screen's 2
    screened = head.logits(hidden[:2], argmax_only=True)
    assert not bool(torch.isfinite(screened).all())
    normed = head.norm(hidden[:2])
    exact = torch.stack([exact_logits(row, head.lm_head_weight) for row in normed])
    assert torch.equal(screened.argmax(-1), exact.argmax(-1))
    head.kernels.use_screen(None, 8)  # type: ignore[attr-defined]
    assert bool(torch.isfinite(head.logits(hidden[:1], argmax_only=True)).all())


@pytest.fixture(scope="module")
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_screened_greedy_generation_of_the_default_model_equals_transformers(
    default_source: ModelSource, _one_thread: None, kind: type[ArgmaxScreen]
) -> None:
    """Three chat prompts, 40 greedy tokens each, every decode step's head screened (even batched rows)."""
    tokenizer, model = default_source.tokenizer(), default_source.load_reference_model()
    head = default_source.load_head()
    head.kernels.use_screen(kind(head.lm_head_weight), max(ROWS_TIMED))  # type: ignore[attr-defined]
    blocks = {
        "a": default_source.load_blocks(0, 15, cache_tokens=4096),
        "b": default_source.load_blocks(15, 30),
    }
    client = in_process_client(head, blocks, tokenizer, ClientConfig(spot_check_rate=0.0))
    prompts = ["What is the capital of France?", "Write a haiku about rain.", "def fibonacci(n):"]
    rows = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True
        )
        for p in prompts
    ]
    rows = [list(r["input_ids"] if isinstance(r, dict) or hasattr(r, "keys") else r) for r in rows]

    async def run() -> list[list[int]]:
        return await client.generate_ids_batch(rows, 40, SamplingParams(), yield_eos=True)

    got = asyncio.run(run())
    for ids, new in zip(rows, got, strict=True):
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)
        expected: Any = out[0, len(ids) :].tolist()
        assert new == expected
