"""Announced speed against observed speed: a peer that delivers less than it announces loses its share.

Peers announce their own speeds, and the plan's flows follow them, so a peer announcing 10x what it delivers
would draw 10x its share of traffic. A client times every hop (compute seconds per hop of each step); these
pure functions turn such observations into a speed ratio per peer and scale the plan's flows into a slow
peer by it, so IWRR sends it only what it actually carries. The client keeps the state (an average ratio per
peer, client/routes.py SwarmRoutes.observe); nothing here reads a clock.

    ratio = speed_ratio(announced_layer_tokens_s=400.0, layers=4, tokens=1, compute_s=0.1)   # 40/400 = 0.1
    factors = {peer: flow_factor(ratio)}                                                  # 0.1: lost 90%
    router = Router(discount_plan(plan, factors), bans=...)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

from swarm.types import EdgeFlow, NodeID, Plan

TOLERANCE = 0.5  # a peer delivering at least half its announced speed keeps its whole share (load, noise)
MIN_FACTOR = 1e-3  # a slow peer keeps a sliver of flow, so it can still be observed and recover


def observed_layer_tokens_s(layers: int, tokens: int, compute_s: float) -> float | None:
    """Tokens/s through one layer seen in one hop that ran `layers` layers on `tokens` tokens in
    `compute_s` seconds (None when the observation says nothing)."""
    if layers <= 0 or tokens <= 0 or not math.isfinite(compute_s) or compute_s <= 0:
        return None
    return layers * tokens / compute_s


def speed_ratio(announced_layer_tokens_s: float, layers: int, tokens: int, compute_s: float) -> float | None:
    """Observed / announced per-layer speed, in [0, 1] (faster than announced counts as 1)."""
    observed = observed_layer_tokens_s(layers, tokens, compute_s)
    if observed is None or announced_layer_tokens_s <= 0:
        return None
    return min(1.0, observed / announced_layer_tokens_s)


def flow_factor(ratio: float) -> float:
    """How much of its planned flow a peer keeps at an (averaged) speed ratio."""
    return 1.0 if ratio >= TOLERANCE else max(MIN_FACTOR, ratio)


def discount_plan(plan: Plan, factors: Mapping[NodeID, float]) -> Plan:
    """`plan` with every flow into a peer scaled by its factor (peers not in `factors` keep theirs).

    Routing weighs the next hop by the flow into it, so a peer at factor 0.1 gets a tenth of its share;
    max_flow_tokens_s is left as planned (it describes the plan, not this client's view)."""
    if not any(f < 1.0 for f in factors.values()):
        return plan

    def scaled(flows: tuple[EdgeFlow, ...]) -> tuple[EdgeFlow, ...]:
        return tuple(
            EdgeFlow(f.src, f.dst, f.tokens_s * factors.get(f.dst, 1.0)) if f.dst in factors else f
            for f in flows
        )

    return replace(plan, flows=scaled(plan.flows), decode_flows=scaled(plan.decode_flows))


def announced_layer_tokens_s(decode_b1: float, prefill: float, tokens: int, cap: float) -> float:
    """What a peer announced for a hop of `tokens` tokens (decode speed for one token, prefill for more),
    clamped to the plausible cap."""
    return min(decode_b1 if tokens == 1 else prefill, cap)
