"""Plots and REPORT.md of the memory study (see memory_study.py for what the numbers are).

Every number written here comes from the data frames memory_study computed in the same run; the
paper's numbers come from paper_values.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments import markdown
from experiments import max_model_size as mms
from experiments import memory_real_runs as real
from experiments.paper_values import NO_MP_B, TABLE1_GB, TRILLION_AT_1024_GB
from zero_ref.analysis import memory_model as mm

STAGE_ORDER = list(mm.PAPER_NAMES)


# ------------------------------------------------------------------------------------- plots
def plots(out: Path, at_scale: pd.DataFrame, versus_nd: pd.DataFrame, t2: pd.DataFrame, runs: pd.DataFrame,
          fig1: pd.DataFrame | None = None) -> None:
    """memory_vs_nd.png, figure1.png, max_model_vs_nd.png and real_runs.png. The paper's markers are
    drawn above ours (filled X with a dark edge inside our hollow circles), every line and marker
    kind has a legend entry, and where ours and the paper differ by a few percent a ratio panel
    shows the difference that bars of the same height would hide."""
    import matplotlib

    matplotlib.use("Agg")
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="notebook")
    palette = dict(zip(STAGE_ORDER, sns.color_palette("deep", 4)))
    _memory_vs_nd(out, at_scale, palette)
    _figure1(out, fig1 if fig1 is not None else _figure1_rows(at_scale), palette)
    _max_model(out, versus_nd, t2, palette)
    _real_runs(out, runs, palette)


def _stage_legend(palette: dict, extra: list) -> list:
    """Legend handles: one coloured line per scheme, then ``extra`` (handles for the marker kinds)."""
    from matplotlib.lines import Line2D

    return [Line2D([], [], color=palette[name], lw=2, label=name) for name in STAGE_ORDER] + extra


def _memory_vs_nd(out: Path, at_scale: pd.DataFrame, palette: dict) -> None:
    """Figure 1 / Table 1: memory per device against Nd, one panel per model."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    models = list(dict.fromkeys(at_scale.model))
    fig, axes = plt.subplots(1, len(models), figsize=(4.4 * len(models), 4.4), sharex=True, squeeze=False)
    for ax, model in zip(axes[0], models):
        data = at_scale[at_scale.model == model]
        for name in STAGE_ORDER:
            rows = data[data.scheme == name].sort_values("nd")
            ax.plot(rows.nd, rows.analysis_gb, color=palette[name], lw=1.5, zorder=2)
            ax.scatter(rows.nd, rows.engine_gb, s=90, facecolors="none", edgecolors=palette[name], linewidths=1.5,
                       zorder=3)
        paper = [(nd, TABLE1_GB[(model, nd)][s - 1], mm.PAPER_NAMES[s]) for nd in mm.TABLE1_ND for s in (1, 2, 3)
                 if (model, nd) in TABLE1_GB]
        ax.scatter([p[0] for p in paper], [p[1] for p in paper], c=[palette[p[2]] for p in paper], marker="X",
                   s=45, edgecolors="black", linewidths=0.6, zorder=5)
        ax.axhline(32, color="grey", ls=":", lw=1.2, zorder=1)
        ax.set(xscale="log", yscale="log", title=f"{model}: model states per device", xlabel="Nd (data-parallel ranks)",
               ylabel="GB (1e9 bytes)")
        ax.set_xticks(mm.TABLE1_ND, [str(n) for n in mm.TABLE1_ND])
    kinds = [Line2D([], [], color="black", lw=1.5, label="analysis (formula)"),
             Line2D([], [], color="black", marker="o", mfc="none", ls="", ms=9, label="engine at scale"),
             Line2D([], [], color="grey", marker="X", mec="black", ls="", ms=7, label="paper, Table 1"),
             Line2D([], [], color="grey", ls=":", lw=1.2, label="32 GB (a V100's memory)")]
    axes[0][0].legend(handles=_stage_legend(palette, kinds), fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(out / "memory_vs_nd.png", dpi=120)
    plt.close(fig)


def _figure1_rows(at_scale: pd.DataFrame) -> pd.DataFrame:
    from experiments.paper_values import FIGURE1_GB

    rows = at_scale[(at_scale.model == "7.5B") & (at_scale.nd == 64)].copy()
    rows["paper_gb"] = rows.stage.map(FIGURE1_GB)
    return rows


def _figure1(out: Path, fig1: pd.DataFrame, palette: dict) -> None:
    """Figure 1 (7.5B, Nd = 64): the paper's bars beside ours, and ours / paper below."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig1 = fig1.sort_values("stage")
    x = np.arange(len(fig1))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.6), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]})
    colors = [palette[name] for name in fig1.scheme]
    top.bar(x - 0.2, fig1.paper_gb, 0.38, color=colors, alpha=0.45, edgecolor="black", hatch="//", label="paper (Figure 1)")
    top.bar(x + 0.2, fig1.engine_gb, 0.38, color=colors, edgecolor="black", label="ours: engine at scale")
    for xi, paper, ours in zip(x, fig1.paper_gb, fig1.engine_gb):
        top.annotate(f"{paper:g}", (xi - 0.2, paper), ha="center", va="bottom", fontsize=8)
        top.annotate(f"{ours:.3g}", (xi + 0.2, ours), ha="center", va="bottom", fontsize=8)
    top.set(yscale="log", ylabel="GB per device (log)", title="Figure 1: 7.5B parameters, Nd = 64, K = 12")
    top.legend(fontsize=8)
    ratio = fig1.engine_gb / fig1.paper_gb
    bottom.axhline(1, color="grey", lw=1, label="equal")
    bottom.scatter(x, ratio, c=colors, edgecolors="black", s=50, zorder=3, label="ours / paper")
    for xi, r in zip(x, ratio):
        bottom.annotate(f"{r:.3f}", (xi, r), textcoords="offset points", xytext=(12, -3), fontsize=8)
    bottom.set(ylabel="ours / paper", ylim=(min(0.95, ratio.min() - 0.01), max(1.05, ratio.max() + 0.01)))
    bottom.set_xticks(x, list(fig1.scheme))
    bottom.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "figure1.png", dpi=120)
    plt.close(fig)


def _max_model(out: Path, versus_nd: pd.DataFrame, t2: pd.DataFrame, palette: dict) -> None:
    """Max model size: against Nd (no MP) with Fig 4's two runs, and Table 2's measured columns."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    for name in STAGE_ORDER:
        rows = versus_nd[versus_nd.scheme == name].sort_values("nd")
        left.plot(rows.nd, rows.ours_b, "o-", color=palette[name], ms=4, zorder=2)
        left.plot(rows.nd, rows.theory_b, "--", color=palette[name], lw=1, zorder=2)
    fig4 = t2[t2.study != "Table 2"]
    for r in fig4.itertuples():   # our search for Fig 4's own runs (their batch), and the paper's sizes
        left.scatter([r.nd], [r.ours_b], s=90, facecolors="none", edgecolors=palette[r.scheme], linewidths=1.5, zorder=4)
        left.scatter([r.nd], [NO_MP_B[r.stage]], marker="X", s=55, c=[palette[r.scheme]], edgecolors="black",
                     linewidths=0.6, zorder=5)
    left.set(xscale="log", yscale="log", xlabel="Nd (no MP)", ylabel="largest model (B parameters)",
             title="largest model without MP (batch 1 per GPU)")
    nds = sorted(set(versus_nd.nd))
    left.set_xticks(nds, [str(n) for n in nds])
    kinds = [Line2D([], [], color="black", marker="o", ms=4, label="our search (states + buffers + activations)"),
             Line2D([], [], color="black", ls="--", lw=1, label="model states only, whole 32 GB (theory)"),
             Line2D([], [], color="black", marker="o", mfc="none", ls="", ms=9, label="our search, Fig 4's runs (Nd 128)"),
             Line2D([], [], color="grey", marker="X", mec="black", ls="", ms=7, label="paper, Sec 10.4 / Fig 4")]
    left.legend(handles=_stage_legend(palette, kinds), fontsize=7, loc="upper left")
    measured = t2[t2.study == "Table 2"]
    for stage in (0, 1):
        rows = measured[measured.stage == stage]
        name = mm.PAPER_NAMES[stage]
        right.plot(rows.nm, rows.ours_b, "o-", color=palette[name], label=f"{name}: our search", zorder=2)
        right.plot(rows.nm, rows.formula_theory_b, "--", color=palette[name], lw=1, label=f"{name}: theory", zorder=2)
        right.scatter(rows.nm, rows.paper_measured_b, marker="X", s=55, c=[palette[name]], edgecolors="black",
                      linewidths=0.6, label=f"{name}: paper measured", zorder=5)
    right.set(xscale="log", yscale="log", xlabel="MP degree (Nd = 64)", ylabel="largest model (B parameters)",
              title=f"Table 2, measured columns (at {mms.Assumptions().fragmentation:.0%} fragmentation, chosen)")
    right.set_xticks([1, 2, 4, 8, 16], ["1", "2", "4", "8", "16"])
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "max_model_vs_nd.png", dpi=120)
    plt.close(fig)


def _real_runs(out: Path, runs: pd.DataFrame, palette: dict) -> None:
    """Real runs: per-rank bytes (top) and measured / predicted (bottom: differences of 1-2% show)."""
    import matplotlib.pyplot as plt
    import numpy as np

    runs = runs.assign(run=runs.collectives + " world " + runs.world.astype(str) + " on " + runs.device)
    names = list(dict.fromkeys(runs.run))
    fig, axes = plt.subplots(2, len(names), figsize=(5.2 * len(names), 6.2), squeeze=False,
                             gridspec_kw={"height_ratios": [2, 1.4]}, sharey="row")
    what = [("states_predicted", "states predicted", "//", 0.45), ("states_engine", "states, memory_report()", "", 0.75),
            ("peak_predicted", "peak predicted", "//", 0.45), ("peak_measured", "peak measured (MemTracker)", "", 1.0)]
    for col, name in enumerate(names):
        first = runs[(runs.run == name) & (runs["rank"] == 0)].set_index("scheme").reindex(STAGE_ORDER).dropna(how="all")
        x = np.arange(len(first))
        top, bottom = axes[0][col], axes[1][col]
        for i, (column, label, hatch, alpha) in enumerate(what):
            top.bar(x + (i - 1.5) * 0.2, first[column] / 1e6, 0.19, color=[palette[s] for s in first.index],
                    alpha=alpha, hatch=hatch, edgecolor="black", linewidth=0.5, label=label)
        top.set(title=f"{name}, rank 0", ylabel="MB per rank")
        top.set_xticks(x, list(first.index))
        every = runs[runs.run == name]   # every rank: the worst rank shows
        for scheme, rows in every.groupby("scheme"):
            xi = STAGE_ORDER.index(scheme) - STAGE_ORDER.index(first.index[0])
            bottom.scatter([xi - 0.12] * len(rows), rows.peak_measured / rows.peak_predicted, marker="o", s=40,
                           color=palette[scheme], edgecolors="black", zorder=3)
            bottom.scatter([xi + 0.12] * len(rows), rows.states_engine / rows.states_predicted, marker="s", s=30,
                           color=palette[scheme], edgecolors="black", zorder=3)
        bottom.axhline(1, color="grey", lw=1)
        bottom.axhspan(0.98, 1.02, color="grey", alpha=0.15, lw=0)
        bottom.set(ylabel="measured / predicted", xlabel="scheme")
        bottom.set_xticks(x, list(first.index))
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    axes[0][0].legend(fontsize=7, loc="upper right")
    axes[1][0].legend(handles=[Line2D([], [], marker="o", color="grey", mec="black", ls="", label="peak, every rank"),
                               Line2D([], [], marker="s", color="grey", mec="black", ls="", label="states, every rank"),
                               Line2D([], [], color="grey", lw=1, label="equal"),
                               Patch(color="grey", alpha=0.15, label="within 2%")], fontsize=7, loc="upper left")
    fig.suptitle("real runs: per-rank memory, predicted vs measured", y=1.0)
    fig.tight_layout()
    fig.savefig(out / "real_runs.png", dpi=110, bbox_inches="tight")
    plt.close(fig)


# ------------------------------------------------------------------------------------ report
def _fmt(x, digits=2) -> str:
    if x is None or (isinstance(x, float) and pd.isna(x)):
        return "–"
    return f"{x:,.{digits}f}"


def _markdown(frame: pd.DataFrame, digits: int = 1) -> str:
    """A pandas frame as a markdown table (index first)."""
    return markdown.table(frame, lambda v: _fmt(v, digits), index=True)


def write_report(out: Path, table1: pd.DataFrame, fig1: pd.DataFrame, bench: dict, t2: pd.DataFrame,
                 sensitivity: pd.DataFrame, runs: pd.DataFrame, run: real.RealRun, meta: dict) -> list[dict]:
    """Write out/REPORT.md; return the headline rows for results/REPORT.md."""
    t1_err = (table1.engine_gb - table1.paper_gb).abs()
    t1_ok = int((t1_err <= 1.0).sum())
    measured = t2[t2.paper_measured_b.notna()]
    runs_err = runs.peak_error_pct.abs()
    hw = meta["hardware"]
    lines = [
        "# Memory and model-size studies (ZeRO paper Table 1, Figure 1, Table 2, Sec 10.4)", "",
        f"Generated by `{meta['command']}` at git `{meta['git_revision']}` on {meta['date_utc']}; "
        f"{hw['cores']} cores ({hw['cpu']}), {hw.get('memory_gb')} GB, torch {hw['torch']}"
        f"{', GPU ' + hw['gpu'] if 'gpu' in hw else ', no GPU'}; quick={meta['quick']}; "
        f"seconds per part: {meta['seconds']}.", "",
        "How each number was obtained: **analysis** = `zero_ref.analysis.memory_model` (the paper's formulas); "
        "**engine at scale** = the real `zero_ref.initialize()` on meta tensors as rank 0 of a fake process "
        "group of Nd ranks (`zero_ref.analysis.at_scale`), bytes from `engine.memory_report()` and, independently, "
        "torch's `MemTracker`; **search** = the largest model of the paper's GPT-2 family whose per-GPU "
        "memory fits (`experiments/max_model_size.py`); **real run** = gloo ranks on this CPU.", "",
        "## Table 1: model states per device (GB), engine at scale", "",
        f"{t1_ok} of {len(table1)} cells within 1 GB of the paper (largest difference {t1_err.max():.3f} GB; "
        "the paper truncates some cells). Engine = analysis up to padding in "
        f"{int(table1.within_padding.sum())} of {len(table1)} cells (largest padding "
        f"{int(table1.padding_bytes.max()):,} bytes); MemTracker's live bytes = the engine's report in "
        f"{int(table1.tracker_equals_engine.eq(True).sum())} of {int(table1.tracker_equals_engine.notna().sum())} "
        "cells tracked. Shapes (exactly Ψ parameters): "
        + ", ".join(f"{m} = {s}" for m, s in table1.groupby("model", sort=False)["shape"].first().items()) + ".", "",
        "| model | Nd | Pos paper | Pos ours | Pos+g paper | Pos+g ours | Pos+g+p paper | Pos+g+p ours |",
        "|---|---|---|---|---|---|---|---|",
    ]
    figure = ["", "![Table 1: model states per device against Nd; lines: analysis, hollow circles: the engine at "
              "scale, X: the paper](memory_vs_nd.png)"]
    for (model, nd), cell in table1.groupby(["model", "nd"], sort=False):
        vals = []
        for stage in (1, 2, 3):
            r = cell[cell.stage == stage].iloc[0]
            vals += [_fmt(r.paper_gb, 3).rstrip("0").rstrip("."), _fmt(r.engine_gb, 3)]
        lines.append(f"| {model} | {nd} | " + " | ".join(vals) + " |")
    lines += figure
    lines += ["", "## Figure 1: 7.5B parameters, Nd = 64 (engine at scale)", "",
              "![Figure 1: the paper's bars beside ours, and ours / paper](figure1.png)", "",
              "| scheme | paper GB | analysis GB | engine GB | tracker GB | engine − paper |", "|---|---|---|---|---|---|"]
    for _, r in fig1.iterrows():
        lines.append(f"| {r.scheme} | {r.paper_gb} | {_fmt(r.analysis_gb, 3)} | {_fmt(r.engine_gb, 3)} | "
                     f"{_fmt(r.tracker_gb, 3)} | {_fmt(r.error_gb, 3)} |")
    lines += ["", "## 1T parameters at Nd = 1024, Pos+g+p (engine at scale, fresh process)", "",
              f"Shape {bench['label']} (Ψ = {bench['psi']:,}): {bench['engine_total'] / mm.GB:.3f} GB per rank "
              f"(paper {TRILLION_AT_1024_GB} GB); MemTracker {bench['tracker_total'] / mm.GB:.3f} GB; "
              f"`initialize` {bench['seconds']:.1f} s, whole process {bench['process_seconds']:.1f} s; "
              f"peak RSS {bench['max_rss_bytes'] / 1e9:.2f} GB. Command: `{bench['command']}`.", "",
              f"During `initialize` MemTracker saw a peak of {bench['tracker_peak'] / 1e12:,.1f} TB on the meta "
              "device: the engine takes a fully built model on every rank and shards it afterwards, so a real "
              "1T run would need sharded construction (DeepSpeed's `zero.Init`), which this engine does not "
              "have.", "",
              "## Table 2 and Sec 10.4: largest model that fits a 32 GB V100", "",
              "Theory columns: model states only, 32e9 bytes, Nd = 64 (analysis; exact, see formula). "
              "Measured columns: the paper's training runs; ours: the search with every term below. "
              "`engine states` re-measures the states of the shape found with the engine at scale.", "",
              "| case | GPUs | paper theory | formula | paper measured | ours (shape) | error | "
              "states / buffers / activations GB | engine states GB |",
              "|---|---|---|---|---|---|---|---|---|"]
    for _, r in t2.iterrows():
        lines.append(
            f"| {r.case} | {r.gpus} | {_fmt(r.paper_theory_b, 1)} | {_fmt(r.formula_theory_b, 2)} | "
            f"{_fmt(r.paper_measured_b, 1)} | {r.ours_b:.2f} ({r.ours_shape}) | "
            f"{_fmt(r.error_pct, 1) + '%' if pd.notna(r.error_pct) else '–'} | "
            f"{r.states_gb:.1f} / {r.buffers_gb:.1f} / {r.activations_gb:.1f} | {_fmt(r.engine_states_gb, 2)} |")
    a = mms.Assumptions()
    lines += ["", "The paper prints 0.5T, 1T and 2T for the Pos+g+p column (the formula gives 512B, 1,024B and "
              "2,048B) and computes its Pos and Pos+g columns as the MP-1 value rounded to 0.1B times the MP "
              "degree; the formula column is exact.", "",
              "Assumptions (none of these is stated in the paper for these runs):", "",
              f"- device: {a.device_bytes / 2**30:.0f} GiB = {a.device_bytes / 1e9:.2f} GB; minus "
              f"{a.context_bytes / 1e9:.1f} GB for the CUDA context and cuBLAS/NCCL workspaces; of the rest "
              f"{a.fragmentation:.0%} is lost to the caching allocator's fragmentation (the paper saw OOM with "
              f"over 30% free in extreme cases): {a.usable_bytes() / 1e9:.2f} GB usable. This share is chosen; "
              "[../fragmentation/REPORT.md](../fragmentation/REPORT.md) measures it per case and searches again;",
              f"- batch: {mms.TABLE2_BATCH} sequence per GPU for Table 2 (not given); Sec 10.4 uses the appendix's "
              "batch of the named runs (1.38B baseline: 1, 13B: 2); sequence length "
              f"{a.seq}, vocabulary {a.vocab};",
              "- activations with checkpointing, one checkpoint per layer (b·s·h·L fp16, replicated on the MP "
              "ranks, no Pa), plus one recomputed layer (12·b·s·h) and the logits (fp16 + fp32, split over MP): "
              "these two extras are our choice (the paper shows no accounting: "
              "[../activations/REPORT.md](../activations/REPORT.md));",
              "- baseline (PyTorch DDP / Megatron with apex, 2019): an fp32 copy of all gradients, 4Ψ bytes per MP "
              f"rank (the paper's flattened fp32 buffer, Sec 3.2); ZeRO stages: {a.cb_buffers} constant buffers "
              f"of {a.cb_numel:,} fp32 elements (CB);",
              "- the family: hidden/heads of the paper's runs "
              + ", ".join(f"{h}/{n}" for h, n in mms.FAMILY)
              + f"; hidden/layers ≤ {mms.MAX_WIDTH_PER_LAYER}; Megatron-style MP slices.", "",
              f"Mean |error| over the {len(measured)} measured values: {measured.error_pct.abs().mean():.1f}% "
              f"(max {measured.error_pct.abs().max():.1f}%). **This match rests on chosen numbers**: the "
              f"{a.fragmentation:.0%} fragmentation share, the {a.context_bytes / 1e9:g} GB context and the baseline's "
              "fp32 gradient copy were chosen in the same change that made this comparison, so with twelve measured "
              "values the fragmentation share is in effect one parameter fitted to them, until fragmentation is "
              "measured ([../fragmentation/REPORT.md](../fragmentation/REPORT.md) measures it on a trace and "
              "searches again). The search redone with one chosen number changed at a time "
              "(`table2_sensitivity.csv`; the chosen value in bold):", "",
              markdown.table(sensitivity_summary(sensitivity).assign(
                  value=lambda d: [f"**{v}**" if c else v for v, c in zip(d.value, d.chosen)]).drop(columns="chosen"),
                  lambda v: _fmt(v, 1) if isinstance(v, float) else str(v)), "",
              "Per case, against the fragmentation share:", "",
              _markdown(sensitivity[sensitivity.assumption == "fragmentation"]
                        .pivot(index="case", columns="value", values="error_pct")
                        .rename(columns=lambda f: f"error % at {f} fragmentation")), "",
              "![Largest model: against Nd without MP (with Fig 4's two runs) and Table 2's measured columns]"
              "(max_model_vs_nd.png)", "",
              "## Real runs: predicted vs measured per-rank memory", "",
              "![Real runs: bytes per rank, and measured / predicted for every rank](real_runs.png)", "",
              f"Model {run.shape.label()} (Ψ = {run.shape.params:,}), vocab {run.vocab}, seq {run.seq}, batch "
              f"{run.batch} per rank, bf16, {run.steps} step(s), bucket {run.bucket_numel:,}, torch AdamW twin. "
              "States: `memory_report()` after the step (params + grads + optimizer states; CB: its comm_buffers), "
              "and MemTracker's live bytes (states and CB). Peak: MemTracker's peak "
              "during forward+backward and during the step, against the prediction of "
              "`experiments/memory_real_runs.py` (states + the largest phase: activations and gathered units at "
              "the start of backward, reductions in flight, optimizer temporaries).", "",
              f"Largest |peak error| {runs_err.max():.1f}% over {len(runs)} rank-runs; states exact within "
              f"{runs.states_error_pct.abs().max():.3f}%.", "",
              "| collectives, device | world | rank | scheme | states predicted MB | engine MB | CB MB | tracker MB | "
              "peak predicted MB | peak measured MB | error | max RSS MB | cuda max allocated MB |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for _, r in runs.sort_values(["collectives", "world", "stage", "rank"]).iterrows():
        cuda = _fmt(r.cuda_peak / 1e6 if pd.notna(r.cuda_peak) else None)
        lines.append(f"| {r.collectives}, {r.device} | {r.world} | {r['rank']} | {r.scheme} | "
                     f"{r.states_predicted / 1e6:.2f} | {r.states_engine / 1e6:.2f} | {r.comm_buffers_engine / 1e6:.2f} | "
                     f"{r.states_live_tracker / 1e6:.2f} | "
                     f"{r.peak_predicted / 1e6:.2f} | {r.peak_measured / 1e6:.2f} | {r.peak_error_pct:+.1f}% | "
                     f"{r.max_rss / 1e6:.0f} | {cuda} |")
    lines += ["", "Allowances in the prediction, each a property of this implementation on CPU: the torch twin of "
              "the fused AdamW allocates three fp32 temporaries per chunk of at most `bucket_numel` elements; "
              "gloo's reduce-scatter copies its input while in flight (at most two in flight); stages 2-3 keep "
              "their constant-size gradient buckets (CB) for reuse, reported by the engine as `comm_buffers` "
              "and counted in the tracker's live bytes; max RSS also counts the interpreter, torch and gloo and "
              "never falls, so it is shown but not compared.", ""]
    (out / "REPORT.md").write_text("\n".join(lines))
    return _headline(table1, fig1, bench, t2, runs)


def sensitivity_summary(sensitivity: pd.DataFrame) -> pd.DataFrame:
    """Per (assumption, value): mean and max |error| of the 12 measured-column predictions."""
    rows = []
    for (name, value), at in sensitivity.groupby(["assumption", "value"], sort=False):
        rows.append({"assumption": name, "what": at.what.iloc[0], "value": value, "chosen": bool(at.chosen.iloc[0]),
                     "mean abs error %": at.error_pct.abs().mean(), "max abs error %": at.error_pct.abs().max()})
    return pd.DataFrame(rows)


def _headline(table1, fig1, bench, t2, runs) -> list[dict]:
    """One row per paper claim for results/REPORT.md: paper, ours, error, how."""
    rows = [{"item": "Table 1 (54 cells, GB per device)", "paper": "as printed",
             "ours": f"{int(((table1.engine_gb - table1.paper_gb).abs() <= 1).sum())}/54 within 1 GB",
             "error": f"max {(table1.engine_gb - table1.paper_gb).abs().max():.3f} GB", "how": "engine at scale + analysis"}]
    for _, r in fig1.iterrows():
        rows.append({"item": f"Figure 1, 7.5B Nd=64, {r.scheme} (GB)", "paper": r.paper_gb, "ours": round(r.engine_gb, 2),
                     "error": f"{r.error_gb:+.2f} GB", "how": "engine at scale"})
    rows.append({"item": "1T at Nd=1024, Pos+g+p (GB per rank)", "paper": TRILLION_AT_1024_GB,
                 "ours": round(bench["engine_total"] / mm.GB, 3),
                 "error": f"{bench['engine_total'] / mm.GB - TRILLION_AT_1024_GB:+.3f} GB",
                 "how": f"engine at scale: initialize {bench['seconds']:.1f} s (process {bench['process_seconds']:.1f} s), "
                        f"peak RSS {bench['max_rss_bytes'] / 1e9:.2f} GB"})
    for _, r in t2[t2.study == "Table 2"].iterrows():
        error = f"{r.formula_theory_b - r.paper_theory_b:+.2f} B"
        printed = r.paper_theory_b
        if r.paper_theory_b >= 500:                     # printed as 0.5T, 1T, 2T: 512B, 1,024B, 2,048B rounded
            printed = f"{r.paper_theory_b / 1000:g}T"
            error = f"0 ({printed} is {r.formula_theory_b:,.0f}B rounded)"
        rows.append({"item": f"Table 2 theory, MP {r.nm}, {r.scheme} (B)", "paper": printed,
                     "ours": round(r.formula_theory_b, 2), "error": error, "how": "analysis"})
    frag = mms.Assumptions().fragmentation
    for _, r in t2[t2.paper_measured_b.notna()].iterrows():
        rows.append({"item": f"{r.case}: measured (B)", "paper": r.paper_measured_b, "ours": round(r.ours_b, 2),
                     "error": f"{r.error_pct:+.1f}% (at the chosen {frag:.0%} fragmentation)",
                     "how": "search (analysis + chosen allowances, see their sensitivity; states by engine at scale)"})
    worst = runs.loc[runs.groupby(["collectives", "device", "world", "stage"]).peak_error_pct.apply(
        lambda e: e.abs().idxmax())]
    for _, r in worst.iterrows():
        rows.append({"item": f"real run, {r.collectives} world {r.world} on {r.device}, {r.scheme}: peak per rank (MB)",
                     "paper": "–", "ours": f"{r.peak_measured / 1e6:.1f} measured vs {r.peak_predicted / 1e6:.1f} predicted",
                     "error": f"{r.peak_error_pct:+.1f}%", "how": "real run, MemTracker (worst rank)"})
    return rows
