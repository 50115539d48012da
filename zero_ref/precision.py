"""Mixed precision: fp32 master weights beside bf16/fp16 model copies, and fp16 loss scaling.

The model's parameters and gradients live in `ZeroConfig.dtype`; the optimizer updates fp32
master weights and writes the rounded result back into the parameters. In fp32 training the
"master" is the parameter storage itself (no second copy), so fp32 runs hold 4 + 4 + 8 bytes per
parameter before sharding and mixed-precision runs 2 + 2 + 12, as in the paper.

fp16 has too few exponent bits for small gradients, so the loss is multiplied by a scale before
backward and the gradients divided by it in the optimizer step. When any rank sees a non-finite
gradient the step is skipped on every rank alike and the scale halves; after
`growth_interval` clean steps it doubles (dynamic loss scaling, Micikevicius et al. 2018).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def make_fp32_master(views: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 master copies of `views` (the parameter shards a rank updates).

    fp32 views are returned as they are: the master *is* the parameter. Otherwise one contiguous
    fp32 buffer is allocated and each view's values are copied into its slice.
    """
    if all(v.dtype == torch.float32 for v in views):
        return list(views)
    total = sum(v.numel() for v in views)
    device = views[0].device if views else torch.device("cpu")
    flat = torch.empty(total, dtype=torch.float32, device=device)
    masters, start = [], 0
    for view in views:
        master = flat[start:start + view.numel()]
        master.copy_(view)
        masters.append(master)
        start += view.numel()
    return masters


@dataclass
class LossScaler:
    """Dynamic loss scale for fp16 (enabled) or a constant 1.0 (disabled: fp32, bf16)."""

    enabled: bool
    scale: float = 2.0**16
    growth_interval: int = 2000
    min_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    clean_steps: int = 0

    def __post_init__(self) -> None:
        if not self.enabled:
            self.scale = 1.0

    def update(self, found_overflow: bool) -> None:
        """After each optimizer step: back off on overflow, grow after a run of clean steps."""
        if not self.enabled:
            return
        if found_overflow:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
