"""The paper's ZeRO-100B configurations C1-C5 (Table 3): a ZeRO-DP stage and an activation-checkpoint mode.

    C1  Pos    CB + MD                 checkpoints replicated on the MP ranks ("plain")
    C2  Pos    CB + MD + Pa            checkpoints partitioned across MP ranks ("pa")
    C3  Pos+g  CB + MD                 "plain"
    C4  Pos+g  CB + MD + Pa            "pa"
    C5  Pos+g  CB + MD + Pa+cpu        "pa_cpu": the partitions live in host memory

CB (constant-size buffers) is how the engine always works (`ZeroConfig.bucket_numel`). MD (memory
defragmentation) is the checkpoint arena (`checkpoint_blocks(..., contiguous=True)`); gradients
live in flat preallocated buffers at every stage already.

    preset = PAPER_CONFIGS["C4"]
    checkpoint_blocks(model.blocks, preset.checkpoints, mesh.get_group("mp"), contiguous=preset.md)
    engine = zero_ref.initialize(model, preset.zero_config(dtype="bf16"), mesh=mesh)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ZeroConfig


@dataclass(frozen=True)
class PaperConfig:
    """One of the paper's C1-C5: `stage` (1 = Pos, 2 = Pos+g), `checkpoints` ("plain", "pa",
    "pa_cpu") and `md` (the contiguous checkpoint arena), for activations.checkpoint_blocks."""

    name: str
    stage: int
    checkpoints: str
    md: bool = True

    def zero_config(self, **fields) -> ZeroConfig:
        """The ZeroConfig of this configuration, with any other fields given."""
        return ZeroConfig(stage=self.stage, **fields)


PAPER_CONFIGS = {
    "C1": PaperConfig("C1", 1, "plain"),
    "C2": PaperConfig("C2", 1, "pa"),
    "C3": PaperConfig("C3", 2, "plain"),
    "C4": PaperConfig("C4", 2, "pa"),
    "C5": PaperConfig("C5", 2, "pa_cpu"),
}
"""The paper's Table 3, by name."""
