"""Scaling curves, not points: bytes and elements per rank against Nd and Ψ, beside the paper.

Two sources, one set of plots:

1. **The engine at scale** (measured here). For each model of ``MODELS`` (three Hugging Face
   GPT-2 sizes), each stage 0-3 and Nd = 1, 2, 4, ..., 1024, the real engine runs as rank 0 of a
   fake process group of Nd ranks (``zero_ref.at_scale.fake_world``) on a model built under
   ``torch.device("meta")``: tensors with shapes and no data, so any Nd costs the same fraction
   of a second. Two training steps are run (forward on ``BATCH_PER_RANK`` x seq tokens,
   ``lm_loss``, ``engine.backward``, ``engine.step``); the second is counted with
   ``CountCollectives`` (the first also agrees on the bucket order), and ``engine.memory_report()``
   is read after it, in the steady state: stages 2 and 3 allocate their constant-size gradient
   buckets (the paper's CB, ``comm_buffers``) in the first backward, so a report read right after
   ``initialize`` would miss them. HF GPT-2 builds and trains on meta tensors without a change.
2. **Real runs** (read, not measured here): the pytest-benchmark JSON of the scaling suite, gloo
   ranks on CPU at Nd 1-4, with step times, DDP's step times and the same byte and element counts.

Beside each measurement, the paper's formulas (``zero_ref.memory_model``):

* bytes: ``model_state_bytes(Ψ, stage, Nd, k=8, param_bytes=4, grad_bytes=4)``. In fp32 the
  engine keeps no master copy (the fp32 parameters *are* the master weights, precision.py), so its
  optimizer holds Adam's two moments only: K = 8 bytes per parameter, 16Ψ in all at stage 0, not
  the paper's mixed-precision 2 + 2 + 12. The engine may exceed the formula by padding alone:
  every flat group is padded to a multiple of Nd (``at_scale.padding_bound``).
* elements moved per rank per step: ``comm_volume_elements`` = 2Ψ at stages 0-2, 3Ψ at stage 3,
  counted the paper's way (a reduce-scatter or all-gather of n: n; an all-reduce of n: 2n). The
  engine adds padding and one small all-reduce of the step's statistics (gradient norm, overflow
  flag) when Nd > 1. At Nd = 1 it still issues every collective, on a group of one, so the count is
  the paper's 2Ψ / 3Ψ although a ring moves (Nd-1)/Nd of it over wires: nothing at Nd = 1.

The paper gives no formula for step time: its plot shows the real runs alone.

    python -m experiments.scaling_curves [--bench-json PATH] [--out results/scaling_curves] [--quiet]
"""

from __future__ import annotations

import argparse
import json
import numbers
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from experiments.markdown import table
from experiments.provenance import ROOT, provenance
from zero_ref import memory_model as mm
from zero_ref.at_scale import fake_world, padding_bound
from zero_ref.collective_count import CountCollectives
from zero_ref.config import ZeroConfig
from zero_ref.engine import initialize
from zero_ref.models import lm_loss, tiny_gpt2

NDS = tuple(2**i for i in range(11))
"""Data-parallel degrees of the at-scale sweep: 1, 2, 4, ..., 1024."""
PSI_ND = 64
"""The Nd at which the *_vs_psi plots compare the three models (the largest swept Nd if not swept)."""
BATCH_PER_RANK = 4
K_FP32 = 8
"""Optimizer bytes per parameter in fp32: Adam's momentum and variance, no master copy."""
CATEGORIES = ("params", "grads", "optimizer_states", "buffers", "comm_buffers")
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


@dataclass(frozen=True)
class GPT2Size:
    """One GPT-2 of the benchmark suite: a Hugging Face ``GPT2LMHeadModel`` (tied head), fp32."""

    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int = 4096
    seq: int = 128

    def build(self, seed: int = 0):
        """The model (on the current default device: wrap in ``torch.device("meta")`` for shapes only)."""
        return tiny_gpt2(self.layers, self.hidden, self.heads, self.vocab, self.seq, seed)

    @property
    def bucket_numel(self) -> int:
        """The engine's bucket size in the suite: 12 h², about one transformer block per bucket."""
        return 12 * self.hidden ** 2

    def config(self, stage: int) -> ZeroConfig:
        """The engine's configuration in the suite and in the sweep (fp32, torch kernels)."""
        return ZeroConfig(stage=stage, dtype="fp32", kernels="torch", bucket_numel=self.bucket_numel)


MODELS = {size.name: size for size in (GPT2Size("S", 2, 128, 4), GPT2Size("M", 4, 256, 4), GPT2Size("L", 6, 384, 6))}


# ------------------------------------------------------------------------------ Part 1: at scale
def measure_case(size: GPT2Size, stage: int, nd: int) -> dict:
    """One (model, stage, Nd) row: rank 0's bytes by category and elements by kind in a steady-state
    step, each beside the paper's formula (see the module docstring)."""
    with fake_world(nd):
        with torch.device("meta"):
            model = size.build()
        tensors = len(list(model.parameters()))              # parameters() lists a tied weight once
        psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
        engine = initialize(model, size.config(stage))
        tokens = torch.zeros(BATCH_PER_RANK, size.seq, dtype=torch.long, device="meta")
        for _ in range(2):
            with CountCollectives() as counter:
                engine.backward(lm_loss(engine(tokens).logits, tokens))
                engine.step()
        report = engine.memory_report()
        engine.close()
    formula = mm.model_state_bytes(psi, stage, nd, k=K_FP32, param_bytes=4, grad_bytes=4)
    states = report["params"] + report["grads"] + report["optimizer_states"]
    moved = {f"elements_{kind}": counter.moved.get(kind, 0) for kind in KINDS}
    elements = sum(moved.values())
    return {"model": size.name, "psi": psi, "stage": stage, "nd": nd,
            **{c: report[c] for c in CATEGORIES}, "report_total": report["total"], "engine_total": states,
            "formula_params": formula.params, "formula_grads": formula.grads,
            "formula_optimizer_states": formula.optimizer_states, "formula_total": formula.total,
            "padding": states - formula.total, "padding_bound": padding_bound(tensors, nd), **moved,
            "other_calls": counter.moved.get("other", 0), "elements_total": elements,
            "elements_over_psi": elements / psi, "formula_elements_over_psi": mm.comm_volume_elements(psi, stage) / psi}


def sweep(cases: list[tuple[str, int, int]], quiet: bool = False) -> pd.DataFrame:
    """``measure_case`` for every (model name, stage, Nd), with a progress bar unless ``quiet``."""
    rows = [measure_case(MODELS[name], stage, nd)
            for name, stage, nd in tqdm(cases, desc="engine at scale", disable=quiet)]
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------ Part 2: real runs
REQUIRED = ("model", "layers", "hidden", "heads", "vocab", "seq", "dtype", "psi", "stage", "world_size", "step_s",
            "ddp_step_s", "ratio_to_ddp", "bytes_per_rank", "elements_total", "elements_over_psi")


def _model_order(column: pd.Series) -> pd.Series:
    """A sort key: models in the order of ``MODELS`` (S, M, L), other columns as they are."""
    return column.map(list(MODELS).index) if column.name == "model" else column


def newest_bench_json(root: Path = ROOT / "results" / "benchmarks") -> Path | None:
    """The suite's last run (``run.json``, written by ``zero-ref bench``), else its newest saved
    run (``*/NNNN_name.json``, by counter), or None."""
    if (root / "run.json").is_file():
        return root / "run.json"
    found = sorted(root.glob("*/*.json"), key=lambda p: p.name)
    return found[-1] if found else None


def _flatten(value: dict, prefix: str = "") -> dict:
    """Nested dicts to "outer.inner" columns; lists (per-round values) to JSON strings."""
    flat = {}
    for key, item in value.items():
        if isinstance(item, dict):
            flat |= _flatten(item, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = json.dumps(item) if isinstance(item, list) else item
    return flat


def load_real(path: Path) -> tuple[pd.DataFrame, dict]:
    """The benchmark JSON's entries as one flat row each (extra_info, plus the entry's name and
    pytest-benchmark's median), and its commit_info. Raises ValueError on a missing key, or where
    a model's shape is not the one of ``MODELS`` with its name (its bytes would not be comparable)."""
    data = json.loads(Path(path).read_text())
    rows = []
    for entry in data["benchmarks"]:
        info = entry.get("extra_info", {})
        missing = [key for key in REQUIRED if key not in info]
        if missing:
            raise ValueError(f"{path}: benchmark {entry['name']!r} lacks extra_info keys {missing}")
        size = MODELS.get(info["model"])
        shape = tuple(info[k] for k in ("layers", "hidden", "heads", "vocab", "seq", "dtype"))
        if size is None or shape != (size.layers, size.hidden, size.heads, size.vocab, size.seq, "fp32"):
            raise ValueError(f"{path}: benchmark {entry['name']!r} is model {info['model']!r} of shape {shape} "
                             f"(layers, hidden, heads, vocab, seq, dtype); the sweep measures fp32 "
                             f"{MODELS.get(info['model'])}: its bytes would not be comparable")
        rows.append({"name": entry["name"], "bench_median_s": entry["stats"]["median"], **_flatten(info)})
    frame = pd.DataFrame(rows).sort_values(["model", "stage", "world_size"], ignore_index=True, key=_model_order)
    frame["real_states"] = sum(frame[f"bytes_per_rank.{c}"] for c in CATEGORIES[:3])
    return frame, data.get("commit_info", {})


def compare_real(real: pd.DataFrame, at_scale: pd.DataFrame) -> pd.DataFrame:
    """Each real run beside the at-scale case of the same (model, stage, Nd): bytes by category
    (and memory_report's total), Ψ and elements per step must be equal exactly: the same engine on
    the same shapes, meta tensors only drop the values."""
    merged = real.merge(at_scale, left_on=["model", "stage", "world_size"], right_on=["model", "stage", "nd"],
                        suffixes=("_real", ""), validate="many_to_one")
    rows = []
    for row in merged.to_dict("records"):
        pairs = {c: (row[f"bytes_per_rank.{c}"], row[c]) for c in CATEGORIES}
        pairs["total"] = (row["bytes_per_rank.total"], row["report_total"])
        pairs["Ψ"] = (row["psi_real"], row["psi"])
        bad = [f"{c}: {a:,.0f} real vs {b:,.0f} at scale" for c, (a, b) in pairs.items() if a != b]
        rows.append({"model": row["model"], "stage": row["stage"], "world": row["world_size"],
                     "real_states": row["real_states"],
                     "at_scale_states": row["engine_total"], "bytes_equal": not bad,
                     "elements_real": row["elements_total_real"], "elements_at_scale": row["elements_total"],
                     "elements_equal": row["elements_total_real"] == row["elements_total"],
                     "mismatches": "; ".join(bad)})
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------------------ plots
def _stage(s: int) -> str:
    return f"stage {s} ({mm.PAPER_NAMES[s]})"


def _finish(plt, fig, axes, path: Path, title: str) -> None:
    """One legend for the figure (every label once, from every panel), a title, save, close."""
    labelled = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            labelled.setdefault(label, handle)
    fig.suptitle(title, fontsize=9)
    columns = 3 if axes.shape[1] > 1 else 2
    fig.legend(labelled.values(), labelled.keys(), loc="lower center", ncol=columns, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.025 * (len(labelled) + columns - 1) / columns + 0.02, 1, 0.93))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plots(out: Path, at_scale: pd.DataFrame, real: pd.DataFrame | None, psi_nd: int) -> list[str]:
    """Write the plots (see the module docstring); paper lines and real points are drawn above ours."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns
    from matplotlib.ticker import FuncFormatter

    colour = dict(enumerate(sns.color_palette("deep", 4)))
    models = [m for m in MODELS if m in set(at_scale.model)]
    real = real if real is not None else pd.DataFrame(columns=["model", "stage", "world_size"])
    real_models = [m for m in MODELS if m in set(real.model)]
    written = []

    ours = {"lw": 3.5, "alpha": 0.45, "zorder": 2}           # wide and pale, so the paper's thin line shows on top
    paper = {"lw": 1.3, "ls": "--", "zorder": 3}

    def nd_axis(ax, nds, label="Nd (data-parallel ranks)"):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(set(nds)) if len(set(nds)) <= 6 else [4**i for i in range(6)])
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel(label)

    with sns.axes_style("whitegrid"):
        fig, axes = plt.subplots(1, len(models), figsize=(4.6 * len(models), 5), squeeze=False)
        for ax, model in zip(axes[0], models):
            data = at_scale[at_scale.model == model]
            for s, rows in data.groupby("stage"):
                ax.plot(rows.nd, rows.engine_total / 1e6, color=colour[s], label=f"{_stage(s)}: engine at scale", **ours)
                ax.plot(rows.nd, rows.formula_total / 1e6, color=colour[s], label=f"{_stage(s)}: paper formula, K = 8",
                        **paper)
                if rows.comm_buffers.any():
                    ax.plot(rows.nd, (rows.engine_total + rows.comm_buffers) / 1e6, ":", color=colour[s], lw=1.3,
                            label=f"{_stage(s)}: engine + gradient buckets (CB)")
            for s, rows in real[real.model == model].groupby("stage"):
                ax.scatter(rows.world_size, rows.real_states / 1e6, marker="X", s=70, color=colour[s],
                           edgecolors="black", zorder=4, label=f"{_stage(s)}: real run")
            nd_axis(ax, data.nd)
            ax.set(yscale="log", ylabel="MB per rank", title=model)
        _finish(plt, fig, axes, out / "bytes_vs_nd.png", "Model-state bytes per rank (params + grads + optimizer "
                "states) against Nd, fp32 AdamW: 16Ψ at stage 0.\nThe engine exceeds the formula by padding only; "
                "the dotted lines add the constant-size gradient buckets (CB), outside the formula")
        written.append("bytes_vs_nd.png")

        fig, axes = plt.subplots(2, len(models), figsize=(4.6 * len(models), 7), squeeze=False)
        for top, bottom, model in zip(axes[0], axes[1], models):
            data = at_scale[at_scale.model == model]
            for s, rows in data.groupby("stage"):
                top.plot(rows.nd, rows.elements_over_psi, color=colour[s], label=f"{_stage(s)}: engine at scale", **ours)
                top.plot(rows.nd, rows.formula_elements_over_psi, color=colour[s],
                         label=f"{_stage(s)}: paper, {rows.formula_elements_over_psi.iloc[0]:.0f}Ψ", **paper)
                bottom.plot(rows.nd, rows.elements_over_psi - rows.formula_elements_over_psi, "o-", ms=3,
                            color=colour[s])
            for s, rows in real[real.model == model].groupby("stage"):
                excess = rows.elements_over_psi - mm.comm_volume_elements(1, s)
                for ax, y in ((top, rows.elements_over_psi), (bottom, excess)):
                    ax.scatter(rows.world_size, y, marker="X", s=70, color=colour[s], edgecolors="black", zorder=4,
                               label=f"{_stage(s)}: real run")
            top.set(ylim=(1.8, 3.2), ylabel="elements per rank per step / Ψ", title=model)
            bottom.set_yscale("symlog", linthresh=1e-6)
            bottom.set(ylabel="excess / Ψ over the paper")
            nd_axis(top, data.nd), nd_axis(bottom, data.nd)
        _finish(plt, fig, axes, out / "elements_vs_nd.png", "Elements moved per rank in one step / Ψ (the paper's "
                "count); below: the excess, padding plus the step's statistics all-reduce.\nAt Nd = 1 the engine still "
                "issues every collective, on a group of one: the paper's count (its large-Nd limit) is met, though a "
                "ring moves (Nd-1)/Nd of it over wires, nothing at Nd = 1")
        written.append("elements_vs_nd.png")

        if real_models:
            fig, axes = plt.subplots(2, len(real_models), figsize=(4.6 * len(real_models), 7), squeeze=False)
            for top, bottom, model in zip(axes[0], axes[1], real_models):
                runs = real[real.model == model]
                for s, rows in runs.groupby("stage"):
                    top.plot(rows.world_size, rows["step_s.median"] * 1e3, "o-", color=colour[s], label=_stage(s))
                    bottom.errorbar(rows.world_size, rows["ratio_to_ddp.median"], capsize=3, fmt="o-", color=colour[s],
                                    yerr=[rows["ratio_to_ddp.median"] - rows["ratio_to_ddp.ci_low"],
                                          rows["ratio_to_ddp.ci_high"] - rows["ratio_to_ddp.median"]])
                ddp = runs.groupby("world_size")["ddp_step_s.median"].median()
                top.plot(ddp.index, ddp.values * 1e3, "s-", color="black", zorder=3, label="DDP (torch), median over entries")
                bottom.axhline(1.0, color="black", lw=1, ls=":", label="DDP = 1")
                top.set(ylabel="step time (ms, median)", title=model)
                bottom.set(ylabel="step time / DDP's (median, CI)")
                nd_axis(top, runs.world_size, "world size (gloo ranks)")
                nd_axis(bottom, runs.world_size, "world size (gloo ranks)")
            _finish(plt, fig, axes, out / "step_time_vs_nd.png", "Real step time against world size (gloo on CPU). "
                    "The paper gives no formula for step time: no paper line is drawn")
            written.append("step_time_vs_nd.png")

        fixed = at_scale[at_scale.nd == psi_nd].sort_values("psi")
        for name, measured, formula, ylabel in (
                ("bytes_vs_psi.png", "engine_total", "formula_total", "MB per rank (model states)"),
                ("elements_vs_psi.png", "elements_total", "formula_elements", "elements per rank per step (M)")):
            fig, axes = plt.subplots(1, 1, figsize=(6.5, 6.5), squeeze=False)
            ax = axes[0, 0]
            for s, rows in fixed.assign(formula_elements=fixed.formula_elements_over_psi * fixed.psi).groupby("stage"):
                ax.plot(rows.psi, rows[measured] / 1e6, "o-", color=colour[s], label=f"{_stage(s)}: engine at scale",
                        **ours)
                ax.plot(rows.psi, rows[formula] / 1e6, color=colour[s], label=f"{_stage(s)}: paper formula", **paper)
                for row in rows.itertuples():
                    ax.annotate(row.model, (row.psi, getattr(row, measured) / 1e6), fontsize=7, xytext=(3, -9),
                                textcoords="offset points")
            ax.set(xscale="log", yscale="log", xlabel="Ψ (trainable parameters)", ylabel=ylabel)
            _finish(plt, fig, axes, out / name, f"Against Ψ at Nd = {psi_nd} (GPT-2 {', '.join(dict.fromkeys(fixed.model))})")
            written.append(name)
    return written


# --------------------------------------------------------------------------------------- report
def _number(value) -> str:
    """A table cell: counts with thousands separators, everything else as it is."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return f"{value:,.0f}"
    return str(value)


def write_report(out: Path, at_scale: pd.DataFrame, real: pd.DataFrame | None, check: pd.DataFrame | None,
                 psi_nd: int, meta: dict) -> list[dict]:
    """REPORT.md, and the headline rows of `zero-ref reproduce` (item, paper, ours, error, how)."""
    within = (at_scale.padding >= 0) & (at_scale.padding <= at_scale.padding_bound)
    worst = at_scale.loc[at_scale.padding.abs().idxmax()]
    nd_max = at_scale.nd.max()
    groups = at_scale.assign(within=within).groupby(["model", "stage"], sort=False)
    bytes_table = (at_scale.loc[groups.padding.idxmax(), ["model", "stage", "psi", "padding", "nd", "padding_bound"]]
                   .assign(within=groups.within.all().to_numpy())
                   .set_axis(["model", "stage", "Ψ", "max padding (bytes)", "at Nd", "bound there",
                              "all Nd within bound"], axis=1))
    shown = sorted({1, 2, psi_nd, nd_max} & set(at_scale.nd))
    ratios = at_scale[at_scale.nd.isin(shown)].pivot_table(index=["model", "stage"], columns="nd",
                                                          values="elements_over_psi", sort=False)
    ratios.columns = [f"Nd {nd}" for nd in ratios.columns]
    ratios["paper"] = at_scale.groupby(["model", "stage"], sort=False).formula_elements_over_psi.first()
    lines = ["# Scaling curves: bytes and elements per rank against Nd and Ψ", "",
             f"Generated by `{meta['command']}` at git `{meta['git_revision']}` on {meta['date_utc']} in "
             f"{meta['seconds']:.0f} s (at-scale sweep {meta['sweep_seconds']:.0f} s, {len(at_scale)} cases).", "",
             "**Engine at scale**: our real `initialize()` and two training steps (batch "
             f"{BATCH_PER_RANK} x seq per rank, fp32) for Hugging Face GPT-2 models built on the meta device, as "
             "rank 0 of a fake process group of Nd ranks; bytes from `engine.memory_report()` after the second "
             "step, elements of the second step from `CountCollectives`. **Paper**: `model_state_bytes(Ψ, stage, "
             "Nd, k=8, param_bytes=4, grad_bytes=4)` (fp32 keeps no master copy: K = 8, Adam's two moments) and "
             "`comm_volume_elements` (2Ψ, 3Ψ at stage 3). Ψ counts the tied embedding once.", "",
             "## Bytes per rank: engine against the formula", "",
             f"Largest |engine - formula| over the sweep: **{abs(worst.padding):,.0f} bytes** ({worst.model}, stage "
             f"{worst.stage}, Nd {worst.nd}; {worst.padding / worst.formula_total:.2e} of the formula). "
             f"{int(within.sum())} of {len(at_scale)} cases hold the formula's bytes plus padding within "
             "`at_scale.padding_bound` (each flat group padded by under Nd elements, at most 16 bytes each). "
             "`comm_buffers` (stages 2-3: the constant-size gradient buckets, the paper's CB) are outside "
             "the formula and the plotted totals (dotted lines add them); they are in `scaling_at_scale.csv`. "
             f"For models this small the buckets hold the whole model: at stage 3, Nd {nd_max}, they are "
             + ", ".join(f"{r.model} {r.comm_buffers / 4 / r.psi:.2f}Ψ elements ({r.comm_buffers / r.engine_total:.3g}x "
                         "the model states)" for r in at_scale[(at_scale.stage == 3) & (at_scale.nd == nd_max)].itertuples())
             + ".", "",
             table(bytes_table, cell=_number), "",
             "## Elements per rank per step / Ψ", "",
             "The excess over 2 / 3 is padding plus one all-reduce of the step's statistics (norm, overflow "
             "flag; skipped at Nd = 1). At Nd = 1 every collective is still issued, on a group of one, and "
             "counted the paper's way; a ring moves (Nd-1)/Nd of it over wires, i.e. nothing.", "",
             table(ratios.reset_index(), cell=lambda v: f"{v:.6f}" if isinstance(v, float) else str(v)), ""]
    headline = [{"item": f"model-state bytes per rank, Nd {at_scale.nd.min()}-{nd_max}, stages 0-3, GPT-2 "
                         f"{'/'.join(dict.fromkeys(at_scale.model))}, fp32",
                 "paper": "(4 + 4 + 8)Ψ split by stage (Sec 5, K = 8 in fp32)",
                 "ours": f"max engine - formula {abs(worst.padding):,.0f} bytes ({worst.model} stage {worst.stage} Nd {worst.nd})",
                 "error": f"{int(within.sum())}/{len(at_scale)} within the padding bound", "how": "engine at scale"}]
    for s, rows in at_scale[at_scale.nd == nd_max].groupby("stage"):
        excess = rows.elements_over_psi - rows.formula_elements_over_psi
        headline.append({"item": f"elements per rank per step / Ψ, stage {s}, Nd {nd_max}",
                         "paper": f"{rows.formula_elements_over_psi.iloc[0]:.0f} (Sec 7)",
                         "ours": ", ".join(f"{r.model} {r.elements_over_psi:.5f}" for r in rows.itertuples()),
                         "error": f"max +{excess.max():.1e} (padding, statistics)", "how": "engine at scale"})
    if real is None:
        lines += ["## Real runs", "", f"Skipped: {meta['part2']}.", ""]
    else:
        equal, n = int(check.bytes_equal.sum()), len(check)
        bad = check[~check.bytes_equal]
        lines += ["## Real runs (Nd 1-4) against the engine at scale", "",
                  f"From `{meta['bench_json']}` (commit {meta['bench_commit_info'].get('id', 'unknown')}). Check: "
                  f"real bytes per rank equal the at-scale bytes of the same model, stage and Nd in every category "
                  f"in **{equal} of {n}** runs; elements per step equal in {int(check.elements_equal.sum())} of {n}.",
                  "", table(check, cell=_number), "",
                  "Step time (the paper has no formula for it):", "",
                  table(real[["model", "stage", "world_size", "step_s.median", "ddp_step_s.median",
                              "ratio_to_ddp.median", "ratio_to_ddp.ci_low", "ratio_to_ddp.ci_high"]],
                        cell=lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)), ""]
        headline.append({"item": "real-run bytes per rank (Nd 1-4) = engine at scale, same model and stage",
                         "paper": "(a check of the measurement)", "ours": f"{equal}/{n} equal in every category (elements per step: "
                                 f"{int(check.elements_equal.sum())}/{n})",
                         "error": "; ".join(f"{r.model} stage {r.stage} Nd {r.world}: {r.mismatches}"
                                            for r in bad.head(2).itertuples())
                                  + (f"; {len(bad) - 2} more in REPORT.md" if len(bad) > 2 else "") or "none",
                         "how": "real run vs engine at scale"})
        for s, rows in real.groupby("stage"):
            top = rows.loc[rows.groupby("model", sort=False).world_size.idxmax()]
            headline.append({"item": f"step time against DDP, stage {s}, largest real world",
                             "paper": "(no step-time formula in the paper)",
                             "ours": ", ".join(f"{r['model']} Nd {r['world_size']}: {r['ratio_to_ddp.median']:.2f}x"
                                               for r in top.to_dict("records")),
                             "error": "no paper value", "how": "real run"})
    lines += ["## Files", "", "`scaling_at_scale.csv`, `scaling_real.csv`, `meta.json`, "
              + ", ".join(f"`{name}`" for name in meta["plots"]) + f" (the *_vs_psi plots at Nd = {psi_nd}).", ""]
    (out / "REPORT.md").write_text("\n".join(lines))
    return headline


# ------------------------------------------------------------------------------------------- run
def run(out: Path, bench_json: Path | None = None, quiet: bool = False, *, models: tuple[str, ...] = tuple(MODELS),
        nds: tuple[int, ...] = NDS) -> dict:
    """Measure the at-scale sweep (``models`` x stages 0-3 x ``nds``, plus the real runs' own cases
    of those models), read the benchmark JSON (``bench_json``; None: the newest under results/benchmarks),
    write the CSVs, plots, meta.json and REPORT.md under ``out``; return headline and meta."""
    start = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    bench_json = Path(bench_json) if bench_json is not None else newest_bench_json()
    real, commit, part2 = None, {}, "read"
    if bench_json is None:
        part2 = "no benchmark run under results/benchmarks (run `zero-ref bench`, or pass --bench-json)"
        print(f"scaling_curves: Part 2 (real runs) skipped: {part2}")
    elif not bench_json.is_file():
        raise FileNotFoundError(f"bench_json = {bench_json} is not a file")
    else:
        real, commit = load_real(bench_json)
        real.to_csv(out / "scaling_real.csv", index=False)
    cases = [(m, s, nd) for m in models for s in range(4) for nd in nds]
    if real is not None:
        cases += [case for case in zip(real.model, real.stage, real.world_size) if case[0] in models]
    swept = time.perf_counter()
    at_scale = sweep(list(dict.fromkeys(cases)), quiet)
    swept = time.perf_counter() - swept
    at_scale = at_scale.sort_values(["model", "stage", "nd"], ignore_index=True, key=_model_order)
    at_scale.to_csv(out / "scaling_at_scale.csv", index=False)
    check = compare_real(real, at_scale) if real is not None else None
    psi_nd = PSI_ND if PSI_ND in nds else max(nds)
    written = plots(out, at_scale, real, psi_nd)
    meta = provenance() | {"seconds": round(time.perf_counter() - start, 1), "sweep_seconds": round(swept, 1),
                           "models": {m: asdict(MODELS[m]) for m in models}, "nds": list(nds), "k": K_FP32,
                           "batch_per_rank": BATCH_PER_RANK, "bench_json": str(bench_json) if bench_json else None,
                           "bench_commit_info": commit, "part2": part2, "plots": written}
    headline = write_report(out, at_scale, real, check, psi_nd, meta)
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return {"headline": headline, "meta": meta}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "scaling_curves")
    parser.add_argument("--bench-json", type=Path, default=None,
                        help="pytest-benchmark JSON of the scaling suite (default: results/benchmarks/run.json, else the newest saved run)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    return run(args.out, args.bench_json, args.quiet)


if __name__ == "__main__":
    main()
