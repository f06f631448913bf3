"""The LM head on a CPU in float32: its product in the form this CPU runs fastest (matmul.py), and greedy
steps through an int8 screen whose candidates are settled by exact logits (argmax.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from swarm.models.backends.base import HeadKernels
from swarm.models.backends.cpu.argmax import ArgmaxScreen, calibrated_screen
from swarm.models.backends.cpu.matmul import Forms, calibrate, linear, taken


class CpuHead(HeadKernels):
    """An LM head weight [V, H] (float32, CPU)."""

    def __init__(self, weight: torch.Tensor, sample: Callable[[], torch.Tensor]) -> None:
        self.weight = weight
        # a packed copy where it pays, as large as the LM head (the head is the embeddings, so it stays float32)
        self.use_forms(calibrate([weight], packing=True))
        self.screen: ArgmaxScreen | None = None
        self.screened_rows = 0
        self.use_screen(*calibrated_screen(self.logits, weight, sample()))

    def use_forms(self, forms: Forms) -> None:
        """Take ``forms`` for the LM head from now on, keeping a packed copy of it only if they use one."""
        self.forms, copies = taken(forms, [self.weight])
        self._packed = copies.get(id(self.weight))

    def use_screen(self, screen: ArgmaxScreen | None, rows: int) -> None:
        """Screen greedy inputs of 1 to ``rows`` rows through ``screen`` (None or 0: never)."""
        self.screen, self.screened_rows = (screen, rows) if screen is not None and rows > 0 else (None, 0)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return linear(normed, self.weight, None, self.forms, self._packed).float()

    def greedy_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Screened, for 1 to screened_rows rows: each row's argmax is that of argmax.exact_logits (the exact
        float32 logits, the same bits on every CPU); past those rows, the argmax of ``logits``."""
        if self.screen is not None and 0 < normed.shape[0] <= self.screened_rows:
            return self.screen.logits(normed, self.logits)
        return self.logits(normed)
