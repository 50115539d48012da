"""The allocation trace of one rank's training steps at the paper's scale, on meta tensors.

One rank of an Nd x Nm grid (a fake process group of Nd * Nm ranks, at_scale.fake_world, with
its model-parallel and data-parallel subgroups) builds its slice of a GPT-2-like model
(at_scale.GPTLike) on the meta device, checkpoints every block (plain, Pa or Pa+cpu; with or
without MD's arena, activations.py), initialises the real engine over the data-parallel group and
runs `steps` training steps (fp16 activations, the fp32 loss), all under
alloc_trace.record_allocations. No memory is used and no value computed, but every storage the
rank would allocate, and when it would free it, is in the trace: the input the caching-allocator
model (zero_ref.analysis.caching_allocator) replays to measure fragmentation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn import functional as F

from zero_ref.analysis import caching_allocator as ca
from zero_ref.core.activations import checkpoint_blocks
from zero_ref.analysis.alloc_trace import AllocationTrace, record_allocations
from zero_ref.analysis.at_scale import ModelShape, fake_world
from zero_ref.config import ZeroConfig
from zero_ref.engine import initialize


@dataclass(frozen=True)
class TraceCase:
    """One rank's run: `shape` at ZeRO `stage`, Nd x Nm ranks, `batch` sequences per rank,
    checkpoints `checkpoints` ("plain", "pa", "pa_cpu") in an MD arena when `md`."""

    shape: ModelShape
    stage: int
    nd: int
    nm: int
    batch: int
    checkpoints: str = "plain"
    md: bool = False
    bucket_numel: int = 2**22

    def label(self) -> str:
        return (f"{self.shape.label()} stage {self.stage} Nd {self.nd} Nm {self.nm} b {self.batch} "
                f"{self.checkpoints}{' +MD' if self.md else ''}")


def trace_steps(case: TraceCase, steps: int = 2) -> AllocationTrace:
    """Record model construction, initialize and `steps` steps; the trace marks where each
    step starts ("step 0", "step 1", ...)."""
    config = ZeroConfig(stage=case.stage, dtype="fp16", kernels="torch", bucket_numel=case.bucket_numel)
    with fake_world(case.nd * case.nm):
        mp_group = dist.new_group(list(range(case.nm)))
        dp_group = dist.new_group(list(range(0, case.nd * case.nm, case.nm)))
        with record_allocations({"meta"}) as trace:     # device memory only (Pa+cpu's slices are on the host)
            model = case.shape.build("meta", mp=case.nm)
            checkpoint_blocks(model.blocks, case.checkpoints, mp_group, contiguous=case.md)
            engine = initialize(model, config, dp_group)
            tokens = torch.zeros(case.batch, case.shape.seq, dtype=torch.long, device="meta")
            for step in range(steps):
                trace.mark(f"step {step}")
                logits = engine(tokens)
                loss = F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
                del logits
                engine.backward(loss)
                del loss
                engine.step()
                engine.zero_grad()
            engine.close()
            del engine, model
    return trace


def measure(case: TraceCase, steps: int = 2) -> dict:
    """Trace `case` and replay it through the caching-allocator model, the steps under a device of
    the smallest sufficient capacity (construction and initialize before them run without a limit:
    they are not the steady state, and a large model would be built sharded). Bytes in GB (1e9)."""
    start = time.perf_counter()
    trace = trace_steps(case, steps)
    first_step = trace.marks["step 0"]
    unlimited = ca.replay(trace, None, first_step)
    capacity = ca.min_capacity(trace, first_step)
    return {"trace": case.label(), "layers": case.shape.layers, "hidden": case.shape.hidden,
            "psi_b": case.shape.params / 1e9, "stage": case.stage, "nd": case.nd, "nm": case.nm,
            "batch": case.batch, "checkpoints": case.checkpoints, "md": case.md, "events": len(trace.events),
            "peak_requested_gb": unlimited.peak_requested / 1e9, "peak_reserved_gb": unlimited.peak_reserved / 1e9,
            "min_capacity_gb": capacity / 1e9, "fragmentation": 1 - unlimited.peak_requested / capacity,
            "seconds": time.perf_counter() - start}
