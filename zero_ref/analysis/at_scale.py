"""The real engine at the paper's scale, without the memory.

How much memory a ZeRO rank holds is a function of shapes alone: how many elements each flat
buffer has and which dtype it is. So the engine can be *measured* at the paper's scale (Ψ up to
1T, Nd up to 1024) on a laptop, by running the real ``zero_ref.initialize`` with two stand-ins:

* **tensors on the meta device**: they have shapes, dtypes and storages of a size, but no data.
  Every allocation, view, copy and ``storage.resize_`` the engine makes works on them and costs
  no memory, so a 1T-parameter model is built and partitioned in seconds and a few hundred MB.
* **a fake process group** (``torch.testing._internal.distributed.fake_pg``: ``FakeStore`` and
  backend ``"fake"``): this process *is* rank 0 of Nd ranks. Collectives return at once without
  moving data, so the engine sees ``world_size == Nd`` and builds exactly the padded shards, flat
  buffers and optimizer segments that rank 0 of a real Nd-rank job would build.

What this process then holds is read twice, independently:

1. ``engine.memory_report()``: the engine's own account, by category (params, grads, optimizer
   states), each storage counted once;
2. ``torch.distributed._tools.mem_tracker.MemTracker``: torch's dispatch-level tracker. It sees
   every tensor created by any op while it is active (here: building the model *and*
   initialising the engine) and follows storage resizes and frees through weak references, so it
   knows nothing of the engine's categories; its current total must equal the engine's.

Both are compared with ``memory_model.model_state_bytes`` (the paper's formula). They may exceed it
only by padding: every flat group is padded to a multiple of Nd, fewer than Nd elements per group.

The models are GPT-2-shaped (``GPTLike``), with exactly ``memory_model.gpt2_like_params``
parameters. ``ModelShape(..., mp=Nm)`` builds what one rank of a Megatron-style model-parallel
group of Nm ranks holds (attention and MLP weights split by columns/rows, embedding split by
vocabulary, layer norms and row-parallel biases replicated), for the studies that combine MP with
ZeRO-DP. At ``mp=1`` the model is also a real, trainable language model (used by the real runs).

Command line (the benchmark of the memory study runs it in a fresh process to measure RSS)::

    python -m zero_ref.analysis.at_scale --psi 1e12 --hidden 25600 --heads 200 --nd 1024 --stage 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from . import memory_model as mm
from ..config import ZeroConfig
from ..engine import initialize


# --------------------------------------------------------------------------------------- the model
class Block(nn.Module):
    """One GPT-2 transformer layer: 12h² + 13h parameters at ``mp=1``.

    Under model parallelism of degree ``mp`` (Megatron-LM's split) a rank holds a column slice of
    ``qkv`` and ``fc`` (their outputs are split), a row slice of ``proj`` and ``fc2`` (their inputs
    are split; their biases and both layer norms are replicated): 12h²/mp + 7h/mp + 6h parameters.
    """

    def __init__(self, hidden: int, heads: int, mp: int = 1):
        super().__init__()
        self.local_heads, self.head_dim = heads // mp, hidden // heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden // mp)
        self.proj = nn.Linear(hidden // mp, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden // mp)
        self.fc2 = nn.Linear(4 * hidden // mp, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.local_heads, self.head_dim).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPTLike(nn.Module):
    """A GPT-2-like language model: token and position embeddings, ``layers`` blocks, a final
    layer norm and an output layer tied to the token embedding (as in GPT-2, so it adds no
    parameters). ``checkpointing`` keeps only each block's input during forward and recomputes the
    block in backward (the paper's activation checkpointing, one checkpoint per layer).

    ``forward(tokens)`` returns logits (this rank's vocabulary slice). For ``mp > 1`` it runs on
    the meta device only, for allocation traces (alloc_trace.py): it leaves out Megatron's
    all-reduces, which work in place and allocate nothing, so its values would be wrong but its
    allocations are those of one rank of the model-parallel group.
    """

    def __init__(self, layers: int, hidden: int, heads: int, vocab: int, seq: int, mp: int = 1,
                 checkpointing: bool = False):
        super().__init__()
        if hidden % heads or hidden % mp or heads % mp:
            raise ValueError(f"hidden={hidden} must divide by heads={heads} and by mp={mp}, and heads by mp")
        self.mp, self.checkpointing = mp, checkpointing
        local_vocab = -(-vocab // mp)                      # vocabulary-parallel under MP, padded up
        self.wte = nn.Embedding(local_vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, mp) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, local_vocab, bias=False)
        self.lm_head.weight = self.wte.weight              # tied: one parameter, two users
        for module in self.modules():                      # GPT-2's initialisation
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.mp != 1 and tokens.device.type != "meta":
            raise NotImplementedError("a model-parallel slice (mp > 1) runs forward on the meta device only "
                                      "(allocation traces): its values would need the tensor-parallel all-reduces")
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing and x.requires_grad else block(x)
        return self.lm_head(self.ln_f(x))


@dataclass(frozen=True)
class ModelShape:
    """A member of the paper's GPT-2-like family: ``layers`` × ``hidden`` with ``heads`` heads,
    vocabulary ``vocab`` and ``seq`` positions. ``params`` is memory_model.gpt2_like_params."""

    layers: int
    hidden: int
    heads: int
    vocab: int = 50257
    seq: int = 1024

    @property
    def params(self) -> int:
        return mm.gpt2_like_params(self.layers, self.hidden, vocab=self.vocab, seq=self.seq)

    def params_per_mp_rank(self, mp: int) -> int:
        """Parameters one rank of a model-parallel group of ``mp`` ranks holds (see ``Block``; the
        vocabulary is split over the ranks, padded up to a multiple of ``mp`` as Megatron does)."""
        h = self.hidden
        per_layer = 12 * h * h // mp + 7 * h // mp + 6 * h
        return self.layers * per_layer + -(-self.vocab // mp) * h + self.seq * h + 2 * h

    def build(self, device: str | torch.device = "meta", mp: int = 1, checkpointing: bool = False) -> GPTLike:
        with torch.device(device):
            return GPTLike(self.layers, self.hidden, self.heads, self.vocab, self.seq, mp, checkpointing)

    def label(self) -> str:
        return f"{self.layers}x{self.hidden}"


def exact_shape(psi: int, hidden: int, heads: int, *, seq: int = 1024, vocab_near: int = 50257) -> ModelShape:
    """A GPT-2-like shape with exactly ``psi`` parameters at the given hidden size.

    The paper's Table 1 sizes (7.5B, 128B, 1T) are bare parameter counts with no shape. We pick
    the number of layers that leaves a vocabulary closest to GPT-2's, and let the vocabulary
    absorb the rest: Ψ = L(12h² + 13h) + (V + seq + 2)h, so Ψ must be a multiple of h.
    """
    psi = int(psi)
    if psi % hidden:
        raise ValueError(f"psi={psi} is not a multiple of hidden={hidden}: no GPT-2-like shape has exactly psi "
                         f"parameters at this hidden size")
    per_layer = 12 * hidden + 13                        # per layer, in units of h
    rest = psi // hidden - seq - 2                       # L * per_layer + V
    layers = max(1, round((rest - vocab_near) / per_layer))
    while layers > 1 and rest - layers * per_layer < 1:     # rounding up left no vocabulary
        layers -= 1
    vocab = rest - layers * per_layer
    if vocab < 1:
        raise ValueError(f"psi={psi} is too small for hidden={hidden}")
    shape = ModelShape(layers, hidden, heads, vocab, seq)
    assert shape.params == psi
    return shape


# ------------------------------------------------------------------------------ the fake world
@contextmanager
def fake_world(nd: int, rank: int = 0):
    """Make this process rank ``rank`` of a fake default process group of ``nd`` ranks.

    Collectives complete immediately and move nothing (values are meaningless, shapes are right).
    The group is destroyed on exit, so calls can be made one after another at different Nd.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers backend "fake"

    if dist.is_initialized():
        raise RuntimeError("fake_world needs a process without a default process group (it creates one)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=nd)
    try:
        yield
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- measuring one case
@dataclass(frozen=True)
class AtScale:
    """What one rank of Nd holds after ``initialize`` for one (shape, stage, Nd, MP) case.

    ``psi`` is the whole model's parameter count, ``local_params`` this model-parallel rank's.
    Bytes: ``engine`` (memory_report by category), ``engine_total`` (params + grads + optimizer
    states), ``tracker_total`` (MemTracker's live bytes at the end; None when not tracked), ``tracker_peak`` (its peak
    while building the model and initialising the engine), ``analysis`` (the paper's formula for
    ``local_params``) and ``padding_bound`` (the most padding can add; see ``padding_bound``).
    """

    label: str
    stage: int
    nd: int
    mp: int
    psi: int
    local_params: int
    engine: dict
    engine_total: int
    tracker_total: int | None
    tracker_peak: int | None
    analysis: float
    padding_bound: int
    seconds: float

    @property
    def padding(self) -> float:
        """Engine bytes beyond the formula: the padding of the flat groups."""
        return self.engine_total - self.analysis

    @property
    def within_padding(self) -> bool:
        """The engine holds the formula's bytes plus at most padding."""
        return 0 <= self.padding <= self.padding_bound

    @property
    def tracker_agrees(self) -> bool | None:
        """torch's MemTracker sees exactly the bytes the engine reports (None: not tracked)."""
        return None if self.tracker_total is None else self.tracker_total == self.engine["total"]


def padding_bound(param_tensors: int, nd: int, bytes_per_param: int = 16) -> int:
    """The most padding can add to a rank's model states, without looking inside the engine.

    Each flat group is padded by fewer than ``nd`` elements, there are at most as many groups as
    parameter tensors, and a padded element costs at most ``bytes_per_param`` over all states.
    """
    return param_tensors * nd * bytes_per_param


def measure_at_scale(shape: ModelShape, stage: int, nd: int, *, mp: int = 1, dtype: str = "fp16",
                     bucket_numel: int = 2**22, track: bool = True) -> AtScale:
    """Build ``shape`` (this rank's MP slice) on the meta device and ``initialize`` it as rank 0 of
    a fake group of ``nd`` ranks; return both accounts of its bytes beside the formula
    (``track=False``: the engine's only, about three times faster: MemTracker sees every operation)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    config = ZeroConfig(stage=stage, dtype=dtype, bucket_numel=bucket_numel, kernels="torch")
    meta = torch.device("meta")
    start = time.perf_counter()
    with fake_world(nd):
        tracker = MemTracker() if track else None
        with tracker or contextlib.nullcontext():
            model = shape.build("meta", mp=mp)
            tensors = len(list(model.parameters()))
            local = sum(p.numel() for p in model.parameters())
            engine = initialize(model, config)
            report = engine.memory_report()
            tracked, peak = ((tracker.get_tracker_snapshot(when).get(meta, {}).get("Total", 0)
                              for when in ("current", "peak")) if track else (None, None))
        del engine, model
    seconds = time.perf_counter() - start
    elem = ZeroConfig(dtype=dtype).torch_dtype.itemsize
    analysis = mm.model_state_bytes(local, stage, nd, param_bytes=elem, grad_bytes=elem).total
    states = report["params"] + report["grads"] + report["optimizer_states"]
    return AtScale(shape.label(), stage, nd, mp, shape.params, local, report, states, tracked, peak, analysis,
                   padding_bound(tensors, nd), seconds)


# ---------------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> dict:
    """Measure one case and print it as JSON, with wall time and this process's peak RSS."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--psi", type=float, default=1e12, help="parameters (exact; a multiple of --hidden)")
    parser.add_argument("--hidden", type=int, default=25600)
    parser.add_argument("--heads", type=int, default=200)
    parser.add_argument("--nd", type=int, default=1024)
    parser.add_argument("--stage", type=int, default=3, choices=range(4))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    result = measure_at_scale(exact_shape(int(args.psi), args.hidden, args.heads), args.stage, args.nd)
    out = asdict(result) | {
        "wall_seconds": time.perf_counter() - start,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
        "within_padding": result.within_padding,
        "tracker_agrees": result.tracker_agrees,
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
