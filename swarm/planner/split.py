"""Whether and where to split prefill and decode: the plan of two flows (swarm.planner.phases has the model).

split_plan scores candidate placements with the split linear program (phases.phase_flows): today's plan's,
the three heuristics', and, given time (SplitConfig.milp_time_limit_s), the two-phase placement MILP's
(split_milp.py) warm-started from the best of those. A handful of small LPs, so without the MILP the time this
adds is small next to today's solve. The plan is today's unless the best split serves min_gain more
requests/s than single routes on today's placement.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from swarm.planner.cluster import Cluster
from swarm.planner.graph import max_flow
from swarm.planner.heuristics import petals_greedy, separate_pipelines, swarm_stages
from swarm.planner.phases import (
    KV_KEY,
    PREFILL_KEY,
    PhaseFlows,
    SplitConfig,
    can_split,
    phase_flows,
)
from swarm.planner.placement import Placement, placement_problems
from swarm.planner.split_milp import solve_split_milp
from swarm.types import Plan

__all__ = ["KV_KEY", "PREFILL_KEY", "SplitConfig", "phase_flows", "split_plan"]

logger = logging.getLogger(__name__)

_EPS = 1e-6
_GAIN_TOL = 1e-6  # a gain this small is the LP's rounding: no reason to split


def split_plan(
    cluster: Cluster, today: Plan, config: SplitConfig | None = None, other_placements: bool = True
) -> Plan:
    """`today`'s plan, or a plan of two flows over one placement where splitting pays (module docstring).

    other_placements: also try the heuristics' placements (False: today's placement only, as the live
    planner does, whose placement moves are priced by swarm.planner.replan). The plan's max_flow_tokens_s
    stays the placement's max flow of one kind, the figure every plan carries (so plans compare as before);
    extra holds the split's figures."""
    config = config or SplitConfig()
    started = time.perf_counter()
    if not today.placement or not can_split(cluster):
        return today
    single = phase_flows(cluster, today.placement, config, split=False)
    best: tuple[float, Placement, PhaseFlows] | None = None
    for candidate in _candidates(cluster, today.placement) if other_placements else [today.placement]:
        flows = phase_flows(cluster, candidate, config, split=True)
        if best is None or flows.decode_tokens_s > best[0] + _EPS:
            best = (flows.decode_tokens_s, candidate, flows)
    assert best is not None  # today's placement is always a candidate
    if other_placements and config.milp_time_limit_s > 0:
        found = solve_split_milp(cluster, config, best[1], config.milp_time_limit_s)
        if found is not None and not placement_problems(cluster, found):
            flows = phase_flows(cluster, found, config, split=True)
            if flows.decode_tokens_s > best[0] + _EPS:
                best = (flows.decode_tokens_s, found, flows)
    _, placement, split = best
    gain = split.decode_tokens_s / single.decode_tokens_s - 1.0 if single.decode_tokens_s > 0 else 0.0
    logger.info(
        "split phases: %.2f requests/s split vs %.2f single routes (%+.0f%%)",
        split.requests_s(config),
        single.requests_s(config),
        100.0 * gain,
    )
    if single.decode_tokens_s > 0 and (gain < config.min_gain or gain <= _GAIN_TOL):
        return today
    extra = dict(today.extra)
    extra |= {
        "split_decode_tokens_s": split.decode_tokens_s,
        "split_requests_s": split.requests_s(config),
        "single_requests_s": single.requests_s(config),
        "split_gain": gain,
    }
    one_kind = today.max_flow_tokens_s
    if placement != today.placement:
        one_kind = max_flow(cluster, placement, least_delay=False).max_flow_tokens_s
    return replace(
        today,
        placement=dict(placement),
        max_flow_tokens_s=one_kind,
        flows=split.prefill,
        decode_flows=split.decode,
        solve_s=today.solve_s + time.perf_counter() - started,
        extra=extra,
    )


def _candidates(cluster: Cluster, today: Placement) -> list[Placement]:
    """Today's placement first, then the heuristics' (valid ones, each once)."""
    out = [dict(today)]
    for heuristic in (petals_greedy, swarm_stages, separate_pipelines):
        placement = heuristic(cluster)
        if placement not in out and not placement_problems(cluster, placement):
            out.append(placement)
    return out
