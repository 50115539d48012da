"""The largest model of the paper's family that fits a 32 GB V100, per ZeRO-DP stage.

The paper's Table 2 has two kinds of columns. The *theory* columns count model states only
(memory_model.table2_theory_rows reproduces them exactly). The *measured* columns (1.3B ... 20B
for the baseline, 6.2B ... 100B for Pos, at MP 1 ... 16 with Nd = 64) are what really trained,
so they also paid for activations, buffers and the framework. This module predicts those
measured columns by adding up everything a GPU holds and searching the paper's model family for
the largest model that still fits. Every assumption is a field of ``Assumptions`` and is written
into the report.

Per GPU, for a GPT-2-like model of L layers × hidden h (vocab V, seq s, batch b per GPU), with
model parallelism of degree Nm (Megatron-style: each rank holds ``ModelShape.params_per_mp_rank``)
and data parallelism of degree Nd:

* model states: ``model_state_bytes(Ψ_mp, stage, Nd)`` (2 + 2 + 12 bytes per parameter, sharded
  as the stage says). The engine at scale confirms this term for every shape found.
* the gradient buffer without CB: the baseline systems the paper measured (PyTorch DDP /
  Megatron-LM with apex's FP16_Optimizer, 2019) keep an fp32 copy of all gradients for the fp32
  master weights: 4Ψ_mp bytes (the paper's "flattened fp32 buffer", Sec 3.2). ZeRO converts
  gradients per constant-size bucket (CB, Sec 6.2) instead: ``cb_buffers`` buffers of
  ``cb_numel`` fp32 elements.
* activations with checkpointing (Sec 3.2): one checkpoint per layer, b·s·h·L fp16 values,
  replicated on every MP rank (no Pa); plus (``activation_extras``, our choice: the paper shows no
  accounting, see experiments/activation_study.py) the recomputed layer in backward (the paper's
  footnote count for one layer, 12·b·s·h values) and the logits, b·s·V/Nm values in fp16 and
  again in fp32 for the loss.
* the framework: ``context_bytes`` (CUDA context, cuBLAS/NCCL workspaces: memory PyTorch's
  allocator never sees), and a ``fragmentation`` share of the rest that the caching allocator
  cannot hand out (the paper saw OOM with over 30% free in extreme cases, Sec 3.2).

None of ``Assumptions`` is stated by the paper for these runs: each is chosen, and the
fragmentation share (15%) was chosen in the same change that compared the result with Table 2,
so it is in effect one parameter fitted to twelve points until it is measured
(experiments/fragmentation_study.py measures it). ``sensitivity_rows`` redoes the
search with each chosen number changed in turn; the reports show how much each one moves.

The family: the hidden sizes and head counts of the paper's runs (Table 4 / appendix), any
number of layers no shallower than the paper's shallowest shape (hidden / layers <= 164, from
50 × 8192), hidden and heads divisible by Nm. Memory grows with L, so for each width the deepest
fitting L is found by bisection and the largest model over all widths wins.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from zero_ref.analysis import memory_model as mm
from experiments.paper_values import NO_MP_B, TABLE2_MEASURED_B, TABLE2_THEORY_B
from zero_ref.analysis.at_scale import ModelShape

FAMILY = ((1536, 16), (1600, 16), (1920, 16), (2304, 24), (3072, 24), (4096, 32), (6144, 64), (8192, 64))
"""(hidden, heads) of the paper's GPT-2-like runs (SC20 Table IV and the artifact appendix)."""

MAX_WIDTH_PER_LAYER = 164
"""The shallowest paper model, 50 layers × 8192 (Fig 6, C1): hidden / layers <= 8192 / 50."""


@dataclass(frozen=True)
class Assumptions:
    """Everything the search assumes that the paper does not state for these runs."""

    device_bytes: float = 32 * 2**30     # V100-SXM3-32GB: 32 GiB of HBM2
    context_bytes: float = 1e9           # CUDA context + cuBLAS/cuDNN/NCCL workspaces
    fragmentation: float = 0.15          # share of the rest the caching allocator cannot use
    seq: int = 1024                      # the paper's sequence length (Sec 6.1 example)
    vocab: int = 50257                   # GPT-2's vocabulary
    baseline_fp32_grads: bool = True     # 2019 baselines: fp32 copy of all gradients, 4Ψ bytes
    cb_numel: int = 2**22                # elements per constant-size buffer (ZeroConfig default)
    cb_buffers: int = 3                  # buffers alive at once (2 in flight + 1 filling)
    activation_extras: bool = True       # + one recomputed layer and the logits beside the checkpoints

    def usable_bytes(self) -> float:
        return (self.device_bytes - self.context_bytes) * (1 - self.fragmentation)


@dataclass(frozen=True)
class Case:
    """One search: a stage at Nd data-parallel ranks, Nm model-parallel ranks, batch b per GPU."""

    name: str
    stage: int
    nd: int
    nm: int
    batch: int
    checkpoints: str = "plain"   # "plain" (replicated on the MP ranks), "pa" (1/Nm each), "pa_cpu" (on the host)


def per_gpu_bytes(shape: ModelShape, case: Case, a: Assumptions) -> dict[str, float]:
    """What one GPU holds for ``shape`` under ``case``, by term (bytes)."""
    local = shape.params_per_mp_rank(case.nm)
    states = mm.model_state_bytes(local, case.stage, case.nd).total
    if case.stage == 0:
        buffers = 4 * local if a.baseline_fp32_grads else 0.0
    else:
        buffers = a.cb_buffers * a.cb_numel * 4
    checkpoints = 0 if case.checkpoints == "pa_cpu" else 2 * mm.activation_values(
        shape.hidden, case.batch, a.seq, shape.layers, checkpointing=True, nm=case.nm, pa=case.checkpoints == "pa")
    recompute = 2 * mm.activation_values(shape.hidden, case.batch, a.seq, 1) if a.activation_extras else 0
    logits = 6 * case.batch * a.seq * shape.vocab / case.nm if a.activation_extras else 0
    terms = {"states": states, "buffers": buffers, "activations": checkpoints + recompute + logits}
    terms["total"] = sum(terms.values())
    return terms


def deepest_fitting(hidden: int, heads: int, case: Case, a: Assumptions) -> ModelShape | None:
    """The most layers at this width whose total fits ``a.usable_bytes()``, or None."""
    fits = lambda layers: per_gpu_bytes(ModelShape(layers, hidden, heads, a.vocab, a.seq), case, a)["total"] \
        <= a.usable_bytes()
    low = -(-hidden // MAX_WIDTH_PER_LAYER)            # the shallowest allowed
    if not fits(low):
        return None
    high = low
    while fits(high * 2):
        high *= 2
    high *= 2                                          # fits(low) and not fits(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return ModelShape(low, hidden, heads, a.vocab, a.seq)


def largest_model(case: Case, a: Assumptions, family=FAMILY) -> tuple[ModelShape, dict[str, float]] | None:
    """The largest model of the family that fits, and its per-GPU terms."""
    best = None
    for hidden, heads in family:
        if hidden % case.nm or heads % case.nm:
            continue
        shape = deepest_fitting(hidden, heads, case, a)
        if shape is not None and (best is None or shape.params > best.params):
            best = shape
    return (best, per_gpu_bytes(best, case, a)) if best is not None else None


def continuous_bound(case: Case, a: Assumptions, hidden: int, heads: int) -> float:
    """Ψ at which the memory of a (fractional-depth) model of width ``hidden`` reaches the limit:
    how much the whole-layer steps of the family cost. Memory is linear in L: two points suffice."""
    shape = lambda layers: ModelShape(layers, hidden, heads, a.vocab, a.seq)
    m1, m2 = (per_gpu_bytes(shape(L), case, a)["total"] for L in (1, 2))
    layers = 1 + (a.usable_bytes() - m1) / (m2 - m1)
    p1, p2 = shape(1).params, shape(2).params
    return p1 + (layers - 1) * (p2 - p1)


# ------------------------------------------------------------------------- the paper's cases
TABLE2_BATCH = 1
"""Table 2 gives no batch size for its measured runs: we assume 1 sequence per GPU."""

NO_MP_CASES = (Case("Fig 4 baseline DDP (1.4B)", 0, 128, 1, 1), Case("Fig 4 ZeRO-100B Pos+g (13B)", 2, 128, 1, 2))
"""Sec 10.4 / Fig 4 on 128 GPUs without MP: PyTorch DDP's largest model, 1.4B, ran at batch 1
(its 1.38B run, appendix); ZeRO-100B (Pos+g with ZeRO-R) reached 13B at batch 2 (its 13B run)."""


def table2_cases(batch: int = TABLE2_BATCH) -> list[tuple[Case, float | None]]:
    """(case, the paper's measured size in B or None) for every stage and MP degree of Table 2."""
    cases = []
    for nm, (baseline, pos) in TABLE2_MEASURED_B.items():
        for stage in range(4):
            measured = {0: baseline, 1: pos}.get(stage)
            cases.append((Case(f"Table 2 MP {nm} {mm.PAPER_NAMES[stage]}", stage, 64, nm, batch), measured))
    return cases


def search_rows(a: Assumptions | None = None, table2_batch: int = TABLE2_BATCH) -> list[dict]:
    """One row per case of Table 2 and of the no-MP study: our largest model beside the paper's."""
    a = a or Assumptions()
    theory = {(r["nm"], r["stage"]): r for r in mm.table2_theory_rows()}
    rows = []
    cases = [(c, m, "Table 2") for c, m in table2_cases(table2_batch)]
    cases += [(c, NO_MP_B[c.stage], "Fig 4 / Sec 10.4") for c in NO_MP_CASES]
    for case, paper_b, study in cases:
        found = largest_model(case, a)
        shape, terms = found if found else (None, {"states": 0, "buffers": 0, "activations": 0, "total": 0})
        ours_b = shape.params / 1e9 if shape else 0.0
        t = theory.get((case.nm, case.stage)) if study == "Table 2" else None
        rows.append({
            "study": study, "case": case.name, "stage": case.stage, "scheme": mm.PAPER_NAMES[case.stage],
            "nd": case.nd, "nm": case.nm, "gpus": case.nd * case.nm, "batch_per_gpu": case.batch,
            "paper_theory_b": TABLE2_THEORY_B[case.nm][case.stage] if t else None,
            "formula_theory_b": t["psi_b"] if t else None,
            "paper_measured_b": paper_b,
            "ours_b": ours_b, "ours_shape": shape.label() if shape else "",
            "ours_continuous_b": continuous_bound(case, a, shape.hidden, shape.heads) / 1e9 if shape else 0.0,
            "error_pct": 100 * (ours_b - paper_b) / paper_b if paper_b else None,
            "states_gb": terms["states"] / mm.GB, "buffers_gb": terms["buffers"] / mm.GB,
            "activations_gb": terms["activations"] / mm.GB, "total_gb": terms["total"] / mm.GB,
            "usable_gb": a.usable_bytes() / mm.GB,
        })
    return rows


FIG6_GPUS, FIG6_NM, FIG6_BATCH = 400, 16, 16
"""Fig 6's setting: 400 GPUs at MP 16 (Nd = 25), batch 16 per model-parallel group (appendix)."""

FIG6_FAMILY = ((6144, 64), (8192, 64))
"""Fig 6's runs are 50/62/175/187 x 8192 and 132 x 6144 (appendix): the search keeps those widths
(wider choices would let C5, with no checkpoints on the GPU, pick thousands of narrow layers)."""


def fig6_rows(a: Assumptions | None = None) -> list[dict]:
    """The largest model per configuration C1-C5 (Fig 6), our search beside the paper's."""
    from experiments.paper_values import FIG6_B
    from zero_ref.analysis.presets import PAPER_CONFIGS

    a = a or Assumptions()
    rows = []
    for name, preset in PAPER_CONFIGS.items():
        case = Case(f"Fig 6 {name}", preset.stage, FIG6_GPUS // FIG6_NM, FIG6_NM, FIG6_BATCH, preset.checkpoints)
        shape, terms = largest_model(case, a, FIG6_FAMILY)
        rows.append({"config": name, "stage": preset.stage, "checkpoints": preset.checkpoints,
                     "paper_b": FIG6_B[name], "ours_b": shape.params / 1e9, "ours_shape": shape.label(),
                     "layers": shape.layers, "hidden": shape.hidden, "heads": shape.heads,
                     "error_pct": 100 * (shape.params / 1e9 - FIG6_B[name]) / FIG6_B[name],
                     "states_gb": terms["states"] / mm.GB, "activations_gb": terms["activations"] / mm.GB,
                     "total_gb": terms["total"] / mm.GB, "fragmentation": a.fragmentation})
    return rows


def versus_nd_rows(nds=(1, 4, 16, 64, 128, 256, 1024), batch: int = 1, a: Assumptions | None = None) -> list[dict]:
    """Largest model per stage against Nd without MP (for the plot): our search, and the theory
    (model states only, the whole 32 GB) beside it."""
    a = a or Assumptions()
    rows = []
    for stage in range(4):
        for nd in nds:
            found = largest_model(Case(f"MP 1 Nd {nd}", stage, nd, 1, batch), a)
            rows.append({"stage": stage, "scheme": mm.PAPER_NAMES[stage], "nd": nd, "batch_per_gpu": batch,
                         "ours_b": found[0].params / 1e9 if found else 0.0,
                         "ours_shape": found[0].label() if found else "",
                         "theory_b": mm.max_params_fitting(stage, nd, 32 * mm.GB) / 1e9})
    return rows


VARIANTS = (
    ("fragmentation", "share of the rest lost to the caching allocator", [0.0, 0.1, 0.15, 0.2, 0.3]),
    ("context_bytes", "CUDA context and workspaces (bytes)", [0.0, 0.5e9, 1e9, 2e9]),
    ("baseline_fp32_grads", "baseline keeps an fp32 copy of all gradients (4Ψ)", [True, False]),
    ("activation_extras", "a recomputed layer and the logits beside the checkpoints", [True, False]),
    ("table2_batch", "sequences per GPU in Table 2's runs", [1, 2]),
)
"""The chosen numbers of the search, each with the values tried: (field of Assumptions, or
``table2_batch``; what it is; values). The first value equal to the default is the chosen one."""


def sensitivity_rows() -> list[dict]:
    """How the 12 measured-column predictions move when one chosen number changes and the others keep
    their chosen values: one row per (assumption, value, case)."""
    chosen = asdict(Assumptions()) | {"table2_batch": TABLE2_BATCH}
    rows = []
    for name, what, values in VARIANTS:
        for value in values:
            a = Assumptions(**{name: value}) if name != "table2_batch" else Assumptions()
            batch = value if name == "table2_batch" else TABLE2_BATCH
            for row in search_rows(a, batch):
                if row["paper_measured_b"]:
                    rows.append({"assumption": name, "what": what, "value": _label(name, value),
                                 "chosen": value == chosen[name],
                                 "case": row["case"], "paper_measured_b": row["paper_measured_b"],
                                 "ours_b": row["ours_b"], "error_pct": row["error_pct"]})
    return rows


def _label(name: str, value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if name == "fragmentation":
        return f"{value:.0%}"
    if name.endswith("_bytes"):
        return f"{value / 1e9:g} GB"
    return str(value)


def assumptions_table(a: Assumptions | None = None) -> dict:
    return asdict(a or Assumptions()) | {"usable_bytes": (a or Assumptions()).usable_bytes(),
                                          "table2_batch_per_gpu": TABLE2_BATCH}
