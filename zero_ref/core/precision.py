"""fp16 dynamic loss scaling.

The model's parameters and gradients live in `ZeroConfig.dtype`; the optimizer updates fp32
master weights and writes the rounded result back into the parameters (optim.py). In fp32
training the master *is* the parameter storage (no second copy), so fp32 runs hold 4 + 4 + 8 bytes
per parameter before sharding and mixed-precision runs 2 + 2 + 12, as in the paper.

fp16 has too few exponent bits for small gradients, so the loss is multiplied by a scale before
backward and the gradients divided by it in the optimizer step. When any rank sees a non-finite
gradient the step is skipped on every rank alike and the scale halves; after `growth_interval`
clean steps it doubles (dynamic loss scaling, Micikevicius et al. 2018). An overflow with the scale
already at `min_scale` cannot be cured by scaling: it raises FloatingPointError instead of skipping
every step from then on.
"""

from __future__ import annotations

from dataclasses import dataclass


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

    def update(self, found_overflow: bool, step: int) -> None:
        """After each optimizer step (`step`: its 1-based number, for the error): back off on
        overflow, grow after a run of clean steps."""
        if not self.enabled:
            return
        if found_overflow:
            if self.scale <= self.min_scale:
                raise FloatingPointError(
                    f"fp16 gradients overflowed at step {step} with the loss scale already at "
                    f"min_loss_scale={self.min_scale:g}: the step was skipped, but lowering the scale "
                    "further is not allowed. Lower the learning rate, clip gradients, lower "
                    "ZeroConfig.min_loss_scale, or train in bf16")
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
