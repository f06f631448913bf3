"""Request traces: prompt and output lengths like the Azure LLM conversation trace, Poisson arrivals.

The Azure conversation trace (2023) averages about 763 prompt and 232 output tokens, with long tails. We draw
lengths from seeded log-normal distributions clipped to the limits (prompts <= 2048, outputs <= 1024) and
rescaled so the clipped means hit the targets; no trace file is needed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class TraceConfig:
    """Shape of the synthetic trace."""

    mean_prompt_tokens: float = 763.0
    mean_output_tokens: float = 232.0
    max_prompt_tokens: int = 2048
    max_output_tokens: int = 1024
    sigma: float = 0.9  # log-normal shape: larger means a longer tail


@dataclass(frozen=True)
class Request:
    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def _lengths(rng: random.Random, n: int, mean: float, cap: int, sigma: float) -> list[int]:
    # Draw with mu set for the target mean, then scale once so the clipped sample mean lands on it.
    mu = math.log(mean) - sigma * sigma / 2
    raw = [rng.lognormvariate(mu, sigma) for _ in range(n)]
    scale = 1.0
    for _ in range(20):  # clipping lowers the mean; a few fixed-point steps on the scale fix that
        clipped = [min(max(x * scale, 1.0), cap) for x in raw]
        got = sum(clipped) / n
        if abs(got - mean) < 0.5:
            break
        scale *= mean / got
    return [max(1, min(cap, round(x * scale))) for x in raw]


def make_trace(
    n: int, rate_per_s: float | None, seed: int, config: TraceConfig | None = None
) -> list[Request]:
    """n requests; Poisson arrivals at `rate_per_s`, or all at time 0 when rate_per_s is None (offline)."""
    if n < 1:
        raise ValueError(f"need at least one request, got {n}")
    if rate_per_s is not None and not rate_per_s > 0:
        raise ValueError(f"arrival rate must be positive, got {rate_per_s}")
    cfg = config or TraceConfig()
    rng = random.Random(seed)
    prompts = _lengths(rng, n, cfg.mean_prompt_tokens, cfg.max_prompt_tokens, cfg.sigma)
    outputs = _lengths(rng, n, cfg.mean_output_tokens, cfg.max_output_tokens, cfg.sigma)
    t = 0.0
    out: list[Request] = []
    for i in range(n):
        if rate_per_s is not None:
            t += rng.expovariate(rate_per_s)
        out.append(Request(i, t, prompts[i], outputs[i]))
    return out
