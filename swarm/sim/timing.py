"""Per-node compute models: seconds for a prefill or a decode iteration, given the batch and layers run.

A node may carry measured tables in CLUSTER.json (seconds per layer, interpolated linearly in the batch):

    "prefill_s_per_layer": [[tokens in batch, seconds per layer], ...]
    "decode_s_per_layer":  [[decode tokens in batch, seconds per layer], ...]

Without them the model is derived from tokens_s_by_layers: holding k layers the node serves T = t(k)
decode tokens/s at a full batch of F tokens (the planner's figure; F is the simulator's batch cap), and a batch of B tokens costs a fixed
part worth `knee` tokens plus B tokens: (knee + B) / (knee + F) * F / (T * k) seconds per layer. Small
batches cost almost the same as a batch of `knee` tokens (loading the weights dominates); a full batch runs
at exactly T. A prompt token costs `prefill_token_cost` of a decode token at full batch.

"forward_s": seconds a node spends handing one session's step on to the next peer (serialising, the RPC),
added to its iteration for each session it forwards; 0 when absent (a GPU peer overlaps it with compute).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TimingDefaults:
    """How compute time is derived when a node has no measured tables."""

    decode_knee_tokens: float = 8.0  # the fixed cost of an iteration, in decode tokens
    prefill_token_cost: float = 0.1  # seconds of a prompt token relative to a decode token at full batch


class Table:
    """A piecewise-linear function from (x, y) points, extended by the end segments' slopes."""

    def __init__(self, points: Sequence[Sequence[float]], name: str) -> None:
        pts = sorted((float(p[0]), float(p[1])) for p in points)
        if not pts or any(len(p) != 2 for p in points):
            raise ValueError(f"{name}: need a list of [batch tokens, seconds per layer] pairs")
        if any(y < 0 or x < 0 for x, y in pts) or len({x for x, _ in pts}) != len(pts):
            raise ValueError(f"{name}: batch sizes must be distinct and values >= 0")
        self.xs = [x for x, _ in pts]
        self.ys = [y for _, y in pts]

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1:
            return ys[0] * max(x, 1.0) / max(xs[0], 1.0)  # one point: time proportional to the batch
        i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 0.0)


class NodeTiming:
    """Seconds per iteration on one node holding `held_layers` layers."""

    def __init__(
        self,
        node_id: str,
        tokens_s: float,
        held_layers: int,
        extra: dict[str, Any],
        defaults: TimingDefaults,
        full_batch_tokens: int,
    ) -> None:
        self.held_layers = held_layers
        self._prefill = (
            Table(extra["prefill_s_per_layer"], f"{node_id} prefill")
            if "prefill_s_per_layer" in extra
            else None
        )
        self._decode = (
            Table(extra["decode_s_per_layer"], f"{node_id} decode") if "decode_s_per_layer" in extra else None
        )
        if (self._prefill is None or self._decode is None) and tokens_s <= 0:
            raise ValueError(
                f"node {node_id}: zero throughput holding {held_layers} layers and no timing tables"
            )
        # Seconds per token through all held layers when the node runs at tokens_s (at a full batch).
        token_s = 1.0 / tokens_s if tokens_s > 0 else 0.0
        full, knee = full_batch_tokens, defaults.decode_knee_tokens
        self._fixed_s = knee * full / (knee + full) * token_s  # the part of an iteration that is per batch
        self._decode_token_s = full / (knee + full) * token_s
        self._prefill_token_s = defaults.prefill_token_cost * token_s
        self.forward_s = float(extra.get("forward_s", 0.0))
        if self.forward_s < 0:
            raise ValueError(f"node {node_id}: forward_s must be >= 0, got {self.forward_s}")

    def decode_s(self, batch_tokens: int) -> float:
        """One decode iteration over all held layers for `batch_tokens` sessions."""
        if self._decode is not None:
            return self._decode(batch_tokens) * self.held_layers
        return self._fixed_s + batch_tokens * self._decode_token_s

    def prefill_s(self, prompt_tokens: int) -> float:
        """Prefill of `prompt_tokens` tokens (one or several prompts batched) over all held layers."""
        if self._prefill is not None:
            return self._prefill(prompt_tokens) * self.held_layers
        return self._fixed_s + prompt_tokens * self._prefill_token_s

    def peak_decode_tokens_s(self, batch_tokens: int) -> float:
        return batch_tokens / self.decode_s(batch_tokens)
