"""The shared vocabulary's one computation: per-layer coverage of half-open ranges."""

from __future__ import annotations

import random

from swarm.types import LayerRange, coverage


def test_coverage_counts_ranges_per_layer():
    ranges = [LayerRange(0, 4), LayerRange(2, 8), LayerRange(3, 4)]
    assert coverage(ranges, 8) == [1, 1, 2, 3, 1, 1, 1, 1]


def test_coverage_ignores_layers_past_the_end_and_reports_holes():
    assert coverage([LayerRange(1, 3), LayerRange(5, 12), LayerRange(9, 10)], 6) == [0, 1, 1, 0, 0, 1]
    assert coverage([], 3) == [0, 0, 0]


def test_coverage_matches_counting_layer_by_layer():
    rng = random.Random(7)
    for _ in range(200):
        num_layers = rng.randint(1, 12)
        ranges = []
        for _ in range(rng.randint(0, 6)):
            start = rng.randrange(num_layers + 2)
            ranges.append(LayerRange(start, start + rng.randint(1, 6)))
        expected = [sum(layer in r for r in ranges) for layer in range(num_layers)]
        assert coverage(ranges, num_layers) == expected, (ranges, num_layers)
