"""zero-ref: a compact, exact reference implementation of ZeRO (Rajbhandari et al., SC20).

    import torch.distributed as dist, zero_ref
    dist.init_process_group("gloo")
    engine = zero_ref.initialize(model, zero_ref.ZeroConfig(stage=2, dtype="bf16"))
    loss = loss_fn(engine(batch)); engine.backward(loss); engine.step()
"""

from .config import ZeroConfig
from .engine import ZeroEngine, initialize
from .analysis.presets import PAPER_CONFIGS, PaperConfig
from .guard.sharded_param import FreedParameterError

__all__ = ["FreedParameterError", "PAPER_CONFIGS", "PaperConfig", "ZeroConfig", "ZeroEngine", "initialize"]
__version__ = "0.1.0"
