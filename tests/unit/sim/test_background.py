"""The paper model of an idle peer's background traffic: the mean peer and the busiest."""

from __future__ import annotations

from swarm.sim.background import Rates, busiest_bytes_s, holder_bytes_s, model_bytes_s, search_calls
from swarm.types import summary_copies


def test_a_search_asks_the_beam_per_round_and_a_round_more_per_bucket_factor() -> None:
    assert search_calls(1, 3, 20) == 0
    assert search_calls(3, 3, 20) == 2  # only the others
    assert search_calls(20, 3, 20) == 3
    assert search_calls(1000, 3, 20) == 9  # 50 buckets' worth: two more rounds
    assert search_calls(10_000, 3, 20) == 12


def test_an_idle_peer_stays_within_the_targets_and_churn_costs_full_reads() -> None:
    idle = {n: model_bytes_s(n)["total"] for n in (100, 1000, 10_000)}
    assert idle[1000] <= 20 * 1024
    assert idle[10_000] < 2 * idle[100]  # grows with the search depth only
    busy = model_bytes_s(1000, rates=Rates(churn_per_s=1 / 60))
    assert busy["churn_reads"] > idle[1000]  # every change is a full read by everyone
    causes = model_bytes_s(12)
    assert abs(sum(v for k, v in causes.items() if k != "total") - causes["total"]) < 1e-6


def test_the_busiest_node_stays_within_the_target_at_a_thousand_peers() -> None:
    assert busiest_bytes_s(1000) <= 20 * 1024
    assert busiest_bytes_s(12) <= 8 * 1024
    for n in (4, 12, 100, 1000, 10_000):
        assert busiest_bytes_s(n) > model_bytes_s(n)["total"]


def test_summary_copies_keep_the_readers_of_each_copy_few() -> None:
    """One key for everyone would make its nodes answer every peer's polls: 10x the peers, 10x the bytes."""
    one_copy = holder_bytes_s(1000, rates=Rates())["summary_holder"] * summary_copies(1000)
    assert holder_bytes_s(1000)["summary_holder"] <= holder_bytes_s(100)["summary_holder"] * 1.01
    assert one_copy > 9 * holder_bytes_s(100)["summary_holder"]


def test_more_shards_spread_the_planners_reads() -> None:
    few, many = Rates(shards=1), Rates(shards=16)
    assert (
        holder_bytes_s(1000, rates=many)["shard_holder"]
        < holder_bytes_s(1000, rates=few)["shard_holder"] / 10
    )
