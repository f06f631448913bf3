"""IWRR: proportions, smoothness, determinism and masking."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from swarm.routing import IWRR

pytestmark = pytest.mark.timeout(30)


def longest_runs(picks: list[str]) -> dict[str, int]:
    runs: dict[str, int] = {}
    run = 0
    for i, p in enumerate(picks):
        run = run + 1 if i and picks[i - 1] == p else 1
        runs[p] = max(runs.get(p, 0), run)
    return runs


@pytest.mark.parametrize(
    "weights",
    [{"a": 1.0, "b": 1.0}, {"a": 5.0, "b": 3.0, "c": 1.5}, {"a": 123.4, "b": 0.7, "c": 40.0, "d": 9.9}],
)
def test_proportions_and_no_bursts(weights: dict[str, float]) -> None:
    iwrr = IWRR(list(weights), list(weights.values()))
    picks = [iwrr.pick() for _ in range(10_000)]
    counts = Counter(picks)
    total = sum(weights.values())
    for name, w in weights.items():
        assert abs(counts[name] - 10_000 * w / total) <= 1, (name, counts)
    for name, run in longest_runs([p for p in picks if p]).items():
        biggest_other = max(w for n, w in weights.items() if n != name)
        assert run <= math.ceil(weights[name] / biggest_other) + 1, (name, run)


def test_interleaves_equal_weights() -> None:
    iwrr = IWRR(["a", "b", "c"], [2.0, 2.0, 2.0])
    assert [iwrr.pick() for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_deterministic() -> None:
    a = IWRR(["x", "y", "z"], [0.3, 0.5, 0.2])
    b = IWRR(["x", "y", "z"], [0.3, 0.5, 0.2])
    assert [a.pick() for _ in range(500)] == [b.pick() for _ in range(500)]


def test_masked_never_chosen_and_others_keep_proportions() -> None:
    iwrr = IWRR(["a", "b", "c"], [6.0, 3.0, 1.0])
    picks = [iwrr.pick(lambda c: c == "a") for _ in range(4000)]
    counts = Counter(picks)
    assert counts["a"] == 0
    assert abs(counts["b"] / counts["c"] - 3.0) < 0.01


def test_unmasked_candidate_returns_without_catch_up_burst() -> None:
    iwrr = IWRR(["a", "b"], [1.0, 1.0])
    for _ in range(1000):
        iwrr.pick(lambda c: c == "a")
    picks = [iwrr.pick() for _ in range(10)]
    assert longest_runs(picks)["a"] <= 1


def test_all_masked_gives_none_and_big_weight_masked_does_not_starve_small() -> None:
    iwrr = IWRR(["a", "b"], [100.0, 1.0])
    assert iwrr.pick(lambda c: True) is None
    assert iwrr.pick(lambda c: c == "a") == "b"


@pytest.mark.parametrize(
    ("cands", "weights"), [(["a"], [0.0]), (["a", "b"], [1.0]), (["a", "a"], [1.0, 1.0]), (["a"], [math.nan])]
)
def test_bad_input_is_a_clear_error(cands: list[str], weights: list[float]) -> None:
    with pytest.raises(ValueError):
        IWRR(cands, weights)
