"""What the paper's largest models held that our per-GPU accounting does not: named, measured, or stated.

At the fragmentation the fragmentation study measures (0.1-2.8%), the search of
experiments/max_model_size.py finds models 10-64% larger than the paper trained (Table 2's measured
columns, Fig 4's sizes, Fig 6's C1-C5), so the paper's runs held memory our accounting does not name.
This study sizes that memory and names what it can:

1. **The gap, per paper point**: the paper's model (its Ψ, at the width our search chose) under our
   accounting at the measured share: model states, the gradient buffers (the 2019 baseline's fp32
   copy, CB for ZeRO), one checkpoint per layer, the recomputed layer's activations (the paper's
   footnote, 12·b·s·h values) and the logits, the CUDA context (1 GB, chosen), the measured
   fragmentation. What is left of the 32 GiB is the **gap**: memory the paper's run held beyond it.
2. **A term measured here**: the working set of one recomputed layer as 2019's Megatron-LM ran it
   (no fused kernels: attention scores, their softmax, dropout's mask and output, each b·a·s²
   values; dropout after the projection and the MLP), measured with torch's MemTracker on this CPU
   in bf16 (2 bytes, as fp16) at several (b, s, h, a, Nm) and fitted as
   ``bytes = α·b·s·h + α_mp·b·s·h/Nm + β·b·(a/Nm)·s²``. Our accounting counts the footnote's
   12·b·s·h values; the measured layer minus that is the first named term.
3. **What the batch would have to be**: the paper does not give Table 2's batch per GPU (we chose 1);
   the activations of one more sequence per GPU (checkpoints, the layer, the logits) are the
   second named term, so the gap reads as "N more sequences per GPU".
4. What is left after the measured term is stated as **unexplained**, in GB and as a share of the
   device; NCCL's buffers, cuBLAS/cuDNN workspaces beyond the context and 2019 apex's optimizer
   temporaries are named there, with no size (nothing here can measure them).
5. **The CUDA share beside the CPU one**: the one fragmentation measured with CUDA's own allocator
   (results/gpu/engine_check.csv, a small engine on the lent H200) replaces the CPU trace model's
   share in a second column of the remainder: a sensitivity, since that engine is not at paper scale.

Writes ``layer_fit.csv`` (every measured layer and the fit), ``gap.csv`` (per paper point),
``REPORT.md`` and ``meta.json`` into ``results/memory_gap/``; reads ``results/fragmentation`` and
``results/gpu``.

    python -m experiments.memory_gap
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F

from experiments import markdown
from experiments.fragmentation_study import search_cases
from experiments.max_model_size import Assumptions, Case, per_gpu_bytes
from experiments.provenance import ROOT, provenance
from zero_ref.analysis import memory_model as mm
from zero_ref.analysis.at_scale import ModelShape

GRID = [(b, s, h, a, nm) for b in (1, 2) for s in (128, 256, 512) for h in (64, 128) for a in (4, 8) for nm in (1, 2)]
"""(batch, seq, hidden, heads, Nm) of the layers measured: small enough for seconds on a CPU."""

QUICK_GRID = [(1, 128, 64, 4, 1), (1, 256, 64, 4, 1), (1, 128, 128, 4, 1), (1, 128, 64, 8, 1), (2, 128, 64, 4, 1),
              (1, 128, 64, 4, 2), (1, 256, 128, 8, 2)]


class Block2019(nn.Module):
    """One GPT-2 layer as this rank of Nm holds it in 2019's Megatron-LM: attention computed as
    matrices (scores, masked softmax, dropout, no fused kernel), dropout 0.1 after the attention's
    projection and after the MLP; the qkv and MLP widths split over the Nm ranks."""

    def __init__(self, hidden: int, heads: int, nm: int = 1):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden // nm), nn.Linear(hidden // nm, hidden)
        self.fc, self.out = nn.Linear(hidden, 4 * hidden // nm), nn.Linear(4 * hidden // nm, hidden)
        self.heads, self.head_dim = heads // nm, hidden // heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, self.heads, self.head_dim).transpose(1, 2)
                   for t in self.qkv(self.ln1(x)).split(self.heads * self.head_dim, -1))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = F.dropout(scores.masked_fill(causal, float("-inf")).softmax(-1), 0.1, training=True)
        x = x + F.dropout(self.proj((probs @ v).transpose(1, 2).reshape(b, s, -1)), 0.1, training=True)
        return x + F.dropout(self.out(F.gelu(self.fc(self.ln2(x)))), 0.1, training=True)


def layer_working_set(b: int, s: int, h: int, a: int, nm: int) -> int:
    """Peak bytes of one layer's forward and backward (the recompute of a checkpointed layer),
    beyond its parameters and their gradients: MemTracker's peak, in bf16 on this CPU."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    block = Block2019(h, a, nm).to(torch.bfloat16)
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(b, s, h, dtype=torch.bfloat16)
    tracker = MemTracker()
    tracker.track_external(block)
    with tracker:
        block(x).backward(grad)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    states = {k: v for k, v in peak.items() if str(k).endswith(("PARAM", "GRAD"))}
    return int(peak["Total"] - sum(states.values()))


def fit_layer(grid) -> tuple[pd.DataFrame, dict]:
    """Measure every layer of ``grid`` and fit bytes = α·bsh + α_mp·bsh/Nm + β·b(a/Nm)s² (least squares)."""
    rows = [{"batch": b, "seq": s, "hidden": h, "heads": a, "nm": nm, "bytes": layer_working_set(b, s, h, a, nm)}
            for b, s, h, a, nm in grid]
    frame = pd.DataFrame(rows)
    bsh = frame.batch * frame.seq * frame.hidden
    design = np.stack([bsh, bsh / frame.nm, frame.batch * frame.heads / frame.nm * frame.seq ** 2], axis=1)
    coef, *_ = np.linalg.lstsq(design.astype(float), frame.bytes.to_numpy(float), rcond=None)
    fit = dict(zip(("alpha", "alpha_mp", "beta"), (float(c) for c in coef)))
    frame["fitted"] = design @ coef
    frame["fit_error_pct"] = 100 * (frame.fitted - frame.bytes) / frame.bytes
    return frame, fit


def layer_bytes(fit: dict, b: int, s: int, h: int, a: int, nm: int) -> float:
    """The fitted working set of one recomputed layer at a paper shape."""
    return fit["alpha"] * b * s * h + fit["alpha_mp"] * b * s * h / nm + fit["beta"] * b * a / nm * s * s


def paper_shape(paper_b: float, traced: str, family: tuple, vocab: int, seq: int) -> tuple[ModelShape, float]:
    """The paper's model at the width our search chose (``traced``, "LxH"): whole layers nearest
    the paper's Ψ, and the fraction of a layer by which that misses it (memory is linear in L)."""
    hidden = int(traced.split("x")[1])
    heads = dict(family)[hidden]
    one, two = (mm.gpt2_like_params(layers, hidden, vocab=vocab, seq=seq) for layers in (1, 2))
    per_layer = two - one
    rest = paper_b * 1e9 - (one - per_layer)   # less the embeddings and the final layer norm
    layers = max(1, round(rest / per_layer))
    return ModelShape(layers, hidden, heads, vocab, seq), rest / per_layer - layers


def gap_row(study: str, case: Case, paper_b: float, family: tuple, search: pd.Series, fit: dict) -> dict:
    """Our accounting of the paper's model at the measured share, the gap to the device, and the
    gap after the measured layer term, in GB; the sequences per GPU that would fill it."""
    a = Assumptions(fragmentation=float(search.fragmentation))
    shape, missed_layers = paper_shape(paper_b, search.ours_shape, family, a.vocab, a.seq)
    terms = per_gpu_bytes(shape, case, a)
    one_more = per_gpu_bytes(ModelShape(shape.layers + 1, shape.hidden, shape.heads, a.vocab, a.seq), case, a)
    accounted = terms["total"] + missed_layers * (one_more["total"] - terms["total"])
    usable = a.usable_bytes()
    gap = usable - accounted
    footnote = 2 * mm.activation_values(shape.hidden, case.batch, a.seq, 1)
    layer = layer_bytes(fit, case.batch, a.seq, shape.hidden, shape.heads, case.nm) - footnote
    bigger = Case(case.name, case.stage, case.nd, case.nm, case.batch + 1, case.checkpoints)
    per_sequence = per_gpu_bytes(shape, bigger, a)["activations"] - terms["activations"] + (
        layer_bytes(fit, 1, a.seq, shape.hidden, shape.heads, case.nm) - 2 * mm.activation_values(shape.hidden, 1,
                                                                                                  a.seq, 1))
    left = gap - layer
    return {"study": study, "case": case.name, "paper_b": paper_b, "shape": shape.label(), "batch": case.batch,
            "fragmentation": a.fragmentation, "states_gb": terms["states"] / 1e9, "buffers_gb": terms["buffers"] / 1e9,
            "activations_gb": terms["activations"] / 1e9, "context_gb": a.context_bytes / 1e9,
            "fragmentation_gb": (a.device_bytes - a.context_bytes) * a.fragmentation / 1e9,
            "device_gb": a.device_bytes / 1e9, "gap_gb": gap / 1e9, "layer_measured_extra_gb": layer / 1e9,
            "unexplained_gb": left / 1e9, "unexplained_pct_of_device": 100 * left / a.device_bytes,
            "sequence_gb": per_sequence / 1e9, "sequences_to_fill": left / per_sequence if per_sequence else None,
            "search_error_pct": float(search.error_pct)}


def cuda_fragmentation(results: Path) -> float | None:
    """The largest fragmentation CUDA's caching allocator showed in the GPU check (the
    "caching-allocator model" rows of results/gpu/engine_check.csv), or None where none was recorded."""
    path = results / "gpu" / "engine_check.csv"
    if not path.exists():
        return None
    shares = [float(m.group(1)) for check in pd.read_csv(path).check
              if (m := re.search(r"caching-allocator model.*fragmentation ([0-9.]+)", check))]
    return max(shares) if shares else None


def run(out: Path, quick: bool, results: Path) -> dict:
    frame, fit = fit_layer(QUICK_GRID if quick else GRID)
    frame.to_csv(out / "layer_fit.csv", index=False)
    searches = pd.read_csv(results / "fragmentation" / "searches.csv").set_index("case")
    rows = [gap_row(study, case, paper_b, family, searches.loc[case.name], fit)
            for study, case, paper_b, family in search_cases(quick=False) if case.name in searches.index]
    gap = pd.DataFrame(rows)
    cuda = cuda_fragmentation(results)
    if cuda is not None:   # the same remainder with CUDA's share in place of the CPU model's
        usable = Assumptions().device_bytes - Assumptions().context_bytes
        gap["cuda_fragmentation"] = cuda
        gap["unexplained_gb_at_cuda_share"] = gap.unexplained_gb - (cuda - gap.fragmentation) * usable / 1e9
    gap.to_csv(out / "gap.csv", index=False)
    return {"fit": fit, "layers": frame, "gap": gap, "cuda_fragmentation": cuda}


def write_report(out: Path, found: dict, meta: dict) -> list[dict]:
    """REPORT.md and the headline rows: the gap per group of paper points."""
    fit, layers, gap = found["fit"], found["layers"], found["gap"]
    fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else str(v)
    lines = [
        "# The memory the paper's largest models held that our accounting does not name", "",
        f"Made by `{meta['command']}` at git `{meta['git_revision']}` on {meta['date_utc']} "
        "(experiments/memory_gap.py; its docstring gives the method). Fragmentation: the share the fragmentation "
        "study measured for each case (results/fragmentation/searches.csv). GB = 1e9 bytes; the device is "
        "32 GiB.", "",
        "## One recomputed layer, measured (2019 Megatron-LM's attention: scores, softmax, dropout)", "",
        f"{len(layers)} layers measured with MemTracker (bf16, this CPU); fit: bytes = {fit['alpha']:.1f}·b·s·h "
        f"+ {fit['alpha_mp']:.1f}·b·s·h/Nm + {fit['beta']:.2f}·b·(a/Nm)·s², largest fit error "
        f"{layers.fit_error_pct.abs().max():.1f}%. Our accounting counts the footnote's 12·b·s·h values "
        "(24 bytes per b·s·h) for this layer; the difference at each paper shape is `layer_measured_extra_gb`.", "",
        "## The gap per paper point", "",
        "The paper's model under our accounting (`states`, `buffers`, `activations`: checkpoints, the footnote's "
        "recomputed layer and the logits; `context`: chosen 1 GB; `fragmentation`: measured), and what is left of "
        "the device: `gap_gb`. `unexplained_gb`: the gap less the measured layer term; `sequences_to_fill`: how "
        "many more sequences per GPU would fill it (Table 2's batch is not in the paper: we chose 1).", "",
        markdown.table(gap[["case", "paper_b", "shape", "batch", "fragmentation", "states_gb", "buffers_gb",
                            "activations_gb", "gap_gb", "layer_measured_extra_gb", "unexplained_gb",
                            "unexplained_pct_of_device", "sequences_to_fill", "search_error_pct"]], cell=fmt), "",
        "Named but not measurable here, so left in `unexplained_gb`: NCCL's buffers, cuBLAS/cuDNN workspaces beyond "
        "the chosen context, the temporaries of 2019 apex's optimizer, and a batch per GPU larger than the one "
        "chosen.", ""]
    cuda = found["cuda_fragmentation"]
    if cuda is not None:
        lines += ["## At CUDA's measured share instead", "",
                  f"The GPU check measured {cuda:.1%} fragmentation with CUDA's own caching allocator "
                  "(results/gpu/engine_check.csv: a small engine on the lent H200, not a paper-scale model), against "
                  "the CPU trace model's share per case above. At that share the remainder is:", "",
                  markdown.table(gap[["case", "fragmentation", "cuda_fragmentation", "unexplained_gb",
                                      "unexplained_gb_at_cuda_share"]].assign(
                      fragmentation=gap.fragmentation.map("{:.2%}".format),
                      cuda_fragmentation=gap.cuda_fragmentation.map("{:.2%}".format)), cell=fmt), ""]
    (out / "REPORT.md").write_text("\n".join(lines))
    headline = []
    for study, rows in gap.groupby("study", sort=False):
        headline.append({
            "item": f"{study}: memory the paper's runs held beyond our accounting (measured fragmentation)",
            "paper": f"{len(rows)} points", "ours": f"gap {rows.gap_gb.min():.1f} to {rows.gap_gb.max():.1f} GB; "
            f"after the measured layer term {rows.unexplained_gb.min():.1f} to {rows.unexplained_gb.max():.1f} GB",
            "error": f"unexplained {rows.unexplained_pct_of_device.min():.0f}% to "
                     f"{rows.unexplained_pct_of_device.max():.0f}% of the device"
                     + (f"; at CUDA's {cuda:.1%}: {rows.unexplained_gb_at_cuda_share.min():.1f} to "
                        f"{rows.unexplained_gb_at_cuda_share.max():.1f} GB" if cuda is not None else ""),
            "how": "analysis at the paper's Ψ + layer measured (MemTracker)"})
    return headline


def run_study(out: Path, quick: bool = False, quiet: bool = False) -> dict:
    """The reproduce entry: measure, size the gap, write ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    found = run(out, quick, out.parent)
    meta = provenance() | {"quick": quick, "seconds": round(time.perf_counter() - start, 1), "fit": found["fit"]}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return {"headline": write_report(out, found, meta), "meta": meta}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "memory_gap")
    parser.add_argument("--quick", action="store_true", help="fewer layers measured for the fit")
    args = parser.parse_args(argv)
    return run_study(args.out, args.quick)


if __name__ == "__main__":
    main()
