"""What one timed run is (``RunSpec``) and the engine it trains (``build_engine``).

Shared by the timed runs (throughput.py, which spawns or joins the ranks and times their steps) and
the batch search (batch_search.py, which runs the same engine on meta tensors as one rank of a fake
process group): neither imports the other's machinery to get at them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from zero_ref.analysis import perf_model

DTYPES = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class RunSpec:
    """One timed configuration. ``batch`` is sequences per data-parallel rank (the paper's "batch
    per GPU"; every MP rank of a replica sees the same sequences)."""

    layers: int = 4
    hidden: int = 256
    heads: int = 8
    seq: int = 128
    vocab: int = 4096
    batch: int = 4
    stage: int = 2
    mp: int = 1
    checkpoints: str = "plain"
    md: bool = False
    dtype: str = "fp32"
    bucket_numel: int = 0              # 0: 12 x hidden^2, about one block
    steps: int = 8
    warmup: int = 2
    profile_steps: int = 2
    seed: int = 0
    threads: int = 0                   # torch threads per rank; 0: the launcher's choice
    budget_gb: float = 0.0             # CUDA: cap each rank's device memory at this (0: no cap)

    def check(self, world_size: int | None = None) -> "RunSpec":
        """Raise ValueError naming the field and what is allowed; return self."""
        positive = ("layers", "hidden", "heads", "seq", "vocab", "batch", "mp", "steps")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)} must be >= 1")
        for name in ("warmup", "profile_steps", "bucket_numel", "threads", "budget_gb"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} = {getattr(self, name)} must be >= 0")
        if self.stage not in range(4):
            raise ValueError(f"stage = {self.stage} is not allowed: expected 0, 1, 2 or 3")
        if self.checkpoints not in perf_model.CHECKPOINT_MODES:
            raise ValueError(f"checkpoints = {self.checkpoints!r} is not allowed: expected one of "
                             f"{perf_model.CHECKPOINT_MODES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype = {self.dtype!r} is not allowed: expected one of {DTYPES}")
        if self.hidden % self.heads or self.heads % self.mp:
            raise ValueError(f"hidden = {self.hidden} must be divisible by heads = {self.heads}, and heads by "
                             f"mp = {self.mp}")
        if self.md and self.checkpoints == "none":
            raise ValueError("md = True needs checkpointed blocks: checkpoints must be 'plain', 'pa' or 'pa_cpu'")
        if world_size is not None and world_size % self.mp:
            raise ValueError(f"the world size {world_size} is not a multiple of mp = {self.mp}")
        return self

    def flops(self) -> dict[str, float]:
        return perf_model.training_flops(self.layers, self.hidden, self.seq, self.vocab, self.batch,
                                         recompute=self.checkpoints != "none")


def build_engine(spec: RunSpec, device: torch.device):
    """The mesh, the engine of ``spec`` (the model built on meta, materialised by initialize) and
    the parameter count of this rank's model-parallel slice."""
    import zero_ref
    from torch.distributed.device_mesh import init_device_mesh
    from zero_ref.core.activations import checkpoint_blocks
    from zero_ref.models import ParallelGPT

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu" if device.type == "meta" else device.type, (world // spec.mp, spec.mp),
                            mesh_dim_names=("dp", "mp"))
    mp_group = mesh.get_group("mp") if spec.mp > 1 else None
    with torch.device("meta"):
        model = ParallelGPT(spec.layers, spec.hidden, spec.heads, spec.vocab, spec.seq, group=mp_group, seed=spec.seed)
    local_params = sum(p.numel() for p in model.parameters())
    if spec.checkpoints != "none":
        checkpoint_blocks(model.blocks, spec.checkpoints, mp_group, contiguous=spec.md)
    config = zero_ref.ZeroConfig(stage=spec.stage, dtype=spec.dtype,
                                 bucket_numel=spec.bucket_numel or 12 * spec.hidden**2)
    # on meta (a fake process group, batch_search.py) the engine runs on the meta tensors themselves
    engine = zero_ref.initialize(model, config, mesh=mesh, device=None if device.type == "meta" else device)
    return mesh, engine, local_params
