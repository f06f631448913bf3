"""Interleaved weighted round-robin over float weights (a plan's edge flows).

How it works (stride scheduling with virtual time). Candidate i with weight w_i has a stride 1/w_i and a
"pass": the virtual time of its next turn. A pick takes the candidate with the smallest pass (ties go to the
lower index, so the order is deterministic) and advances its pass by one stride. Over n picks candidate i is
chosen n * w_i / sum(w) times, give or take one, and the picks interleave: i can be chosen at most
ceil(w_i / w_j) + 1 times in a row while any other candidate j is available.

Masking. A masked candidate that comes up in a pick is given its turn "virtually": its pass advances as if it
had been picked, and the pick goes to the next candidate. So the others keep their relative proportions, and a
candidate that was masked for a while comes back at its normal share instead of in a catch-up burst.

Passes live in a heap, so a pick costs O(log k) plus O(log k) per masked candidate skipped.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class IWRR(Generic[T]):
    """Deterministic, smooth weighted round-robin over fixed candidates with positive float weights."""

    def __init__(
        self, candidates: Sequence[T], weights: Sequence[float], rng: random.Random | None = None
    ) -> None:
        if len(candidates) != len(weights):
            raise ValueError(f"{len(candidates)} candidates but {len(weights)} weights")
        if len(set(candidates)) != len(candidates):
            raise ValueError("candidates must be distinct")
        for cand, weight in zip(candidates, weights, strict=True):
            if not (weight > 0 and math.isfinite(weight)):
                raise ValueError(f"weight of {cand!r} must be positive and finite, got {weight}")
        self.candidates: tuple[T, ...] = tuple(candidates)
        self.weights: tuple[float, ...] = tuple(float(w) for w in weights)
        # Normalising strides by the total keeps passes near the pick count, whatever the weights' units.
        total = sum(self.weights)
        self._strides = [total / w for w in self.weights]
        # Starting at half a stride spreads the first picks (a small weight does not start with a free turn).
        # With `rng`, each candidate starts at a random point of its first stride instead: clients that each
        # build their own IWRR from the same plan then do not all send their first sessions to the same peer.
        # The long-run shares do not depend on where the passes start.
        phases = [rng.random() if rng is not None else 0.5 for _ in self._strides]
        self._heap: list[tuple[float, int]] = [
            (s * p, i) for i, (s, p) in enumerate(zip(self._strides, phases, strict=True))
        ]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self.candidates)

    def pick(self, masked: Callable[[T], bool] | None = None) -> T | None:
        """The next candidate that is not masked, or None when every candidate is masked."""
        chosen: T | None = None
        set_aside: list[tuple[float, int]] = []
        while self._heap:
            pass_, i = heapq.heappop(self._heap)
            # Either way the candidate's turn is used up: picked, or skipped because it is masked.
            entry = (pass_ + self._strides[i], i)
            candidate = self.candidates[i]
            if masked is None or not masked(candidate):
                heapq.heappush(self._heap, entry)
                chosen = candidate
                break
            set_aside.append(entry)
        for entry in set_aside:
            heapq.heappush(self._heap, entry)
        # None means every candidate was masked; each was given one virtual turn, which treats them all alike.
        return chosen
