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
from zero_ref import memory_model as mm

STAGE_ORDER = list(mm.PAPER_NAMES)


# ------------------------------------------------------------------------------------- plots
def plots(out: Path, at_scale: pd.DataFrame, versus_nd: pd.DataFrame, t2: pd.DataFrame, runs: pd.DataFrame) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="notebook")
    palette = dict(zip(STAGE_ORDER, sns.color_palette("deep", 4)))

    # Figure 1 / Table 1: memory per device against Nd, one panel per model.
    models = list(dict.fromkeys(at_scale.model))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4.2), sharex=True)
    for ax, model in zip(axes, models):
        data = at_scale[at_scale.model == model]
        sns.lineplot(data=data, x="nd", y="analysis_gb", hue="scheme", hue_order=STAGE_ORDER, palette=palette,
                     ax=ax, legend=ax is axes[0])
        sns.scatterplot(data=data, x="nd", y="engine_gb", hue="scheme", hue_order=STAGE_ORDER, palette=palette,
                        ax=ax, legend=False, s=45, marker="o")
        paper = [(nd, TABLE1_GB[(model, nd)][s - 1], mm.PAPER_NAMES[s]) for nd in mm.TABLE1_ND for s in (1, 2, 3)]
        ax.scatter([p[0] for p in paper], [p[1] for p in paper], c=[palette[p[2]] for p in paper], marker="x",
                   s=60, zorder=3)
        ax.axhline(32, color="grey", ls=":", lw=1)
        ax.set(xscale="log", yscale="log", title=f"{model}: model states per device", xlabel="Nd (data-parallel ranks)",
               ylabel="GB (1e9 bytes)")
        ax.set_xticks(mm.TABLE1_ND, [str(n) for n in mm.TABLE1_ND])
    axes[0].legend(title="line: analysis, o: engine at scale, x: paper", fontsize=8, title_fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "memory_vs_nd.png", dpi=120)
    plt.close(fig)

    # Max model size: against Nd (no MP), and Table 2's measured columns against MP.
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    sns.lineplot(data=versus_nd, x="nd", y="ours_b", hue="scheme", hue_order=STAGE_ORDER, palette=palette,
                 marker="o", ax=left)
    sns.lineplot(data=versus_nd, x="nd", y="theory_b", hue="scheme", hue_order=STAGE_ORDER, palette=palette,
                 ax=left, legend=False, ls="--")
    left.scatter([128, 128], [NO_MP_B[0], NO_MP_B[2]], c=[palette["baseline"], palette["Pos+g"]], marker="x", s=70,
                 zorder=3)
    left.set(xscale="log", yscale="log", xlabel="Nd (no MP)", ylabel="largest model (B parameters)",
             title="solid: our search, dashed: states only, x: paper (Sec 10.4)")
    left.set_xticks(mm.TABLE1_ND, [str(n) for n in mm.TABLE1_ND])
    measured = t2[t2.study == "Table 2"]
    for stage in (0, 1):
        rows = measured[measured.stage == stage]
        name = mm.PAPER_NAMES[stage]
        right.plot(rows.nm, rows.ours_b, "o-", color=palette[name], label=f"{name}: our search")
        right.plot(rows.nm, rows.paper_measured_b, "x", color=palette[name], ms=9, mew=2, label=f"{name}: paper measured")
        right.plot(rows.nm, rows.formula_theory_b, "--", color=palette[name], lw=1, label=f"{name}: theory")
    right.set(xscale="log", yscale="log", xlabel="MP degree (Nd = 64)", ylabel="largest model (B parameters)",
              title="Table 2: measured columns")
    right.set_xticks([1, 2, 4, 8, 16], ["1", "2", "4", "8", "16"])
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "max_model_vs_nd.png", dpi=120)
    plt.close(fig)

    # Real runs: predicted against measured peak per rank.
    first = runs[runs["rank"] == 0].assign(run=lambda d: d.collectives + " world " + d.world.astype(str) + " on "
                                           + d.device + ", rank 0")
    data = first.melt(id_vars=["run", "scheme"], value_vars=["peak_predicted", "peak_measured", "states_predicted",
                      "states_engine"], var_name="what", value_name="bytes")
    data["MB"] = data.bytes / 1e6
    grid = sns.catplot(data=data, x="scheme", y="MB", hue="what", col="run", kind="bar", order=STAGE_ORDER,
                       height=3.6, aspect=1.2)
    grid.set_titles("{col_name}")
    grid.figure.suptitle("real runs: per-rank peak, predicted vs measured (MemTracker)", y=1.03)
    grid.savefig(out / "real_runs.png", dpi=110)
    plt.close(grid.figure)


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
        "How each number was obtained: **analysis** = `zero_ref.memory_model` (the paper's formulas); "
        "**engine at scale** = the real `zero_ref.initialize()` on meta tensors as rank 0 of a fake process "
        "group of Nd ranks (`zero_ref.at_scale`), bytes from `engine.memory_report()` and, independently, "
        "torch's `MemTracker`; **search** = the largest model of the paper's GPT-2 family whose per-GPU "
        "memory fits (`experiments/max_model_size.py`); **real run** = gloo ranks on this CPU.", "",
        "## Table 1: model states per device (GB), engine at scale", "",
        f"{t1_ok} of {len(table1)} cells within 1 GB of the paper (largest difference {t1_err.max():.3f} GB; "
        "the paper truncates some cells). Engine = analysis up to padding in "
        f"{int(table1.within_padding.sum())} of {len(table1)} cells (largest padding "
        f"{int(table1.padding_bytes.max()):,} bytes); MemTracker's live bytes = the engine's report in "
        f"{int(table1.tracker_equals_engine.sum())} of {len(table1)}. Shapes (exactly Ψ parameters): "
        + ", ".join(f"{m} = {s}" for m, s in table1.groupby("model", sort=False)["shape"].first().items()) + ".", "",
        "| model | Nd | Pos paper | Pos ours | Pos+g paper | Pos+g ours | Pos+g+p paper | Pos+g+p ours |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (model, nd), cell in table1.groupby(["model", "nd"], sort=False):
        vals = []
        for stage in (1, 2, 3):
            r = cell[cell.stage == stage].iloc[0]
            vals += [_fmt(r.paper_gb, 3).rstrip("0").rstrip("."), _fmt(r.engine_gb, 3)]
        lines.append(f"| {model} | {nd} | " + " | ".join(vals) + " |")
    lines += ["", "## Figure 1: 7.5B parameters, Nd = 64 (engine at scale)", "",
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
              "ranks, no Pa), plus one recomputed layer (12·b·s·h) and the logits (fp16 + fp32, split over MP);",
              "- baseline (PyTorch DDP / Megatron with apex, 2019): an fp32 copy of all gradients, 4Ψ bytes per MP "
              f"rank (the paper's flattened fp32 buffer, Sec 3.2); ZeRO stages: {a.cb_buffers} constant buffers "
              f"of {a.cb_numel:,} fp32 elements (CB);",
              "- the family: hidden/heads of the paper's runs "
              + ", ".join(f"{h}/{n}" for h, n in mms.FAMILY)
              + f"; hidden/layers ≤ {mms.MAX_WIDTH_PER_LAYER}; Megatron-style MP slices.", "",
              f"Mean |error| over the {len(measured)} measured values: {measured.error_pct.abs().mean():.1f}% "
              f"(max {measured.error_pct.abs().max():.1f}%). The fragmentation share is the assumption the result "
              "depends on most:", "",
              _markdown(sensitivity.pivot(index="case", columns="fragmentation", values="error_pct")
                        .rename(columns=lambda f: f"error % at {f:.0%} fragmentation")), "",
              "## Real runs: predicted vs measured per-rank memory", "",
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
    for _, r in t2[t2.paper_measured_b.notna()].iterrows():
        rows.append({"item": f"{r.case}: measured (B)", "paper": r.paper_measured_b, "ours": round(r.ours_b, 2),
                     "error": f"{r.error_pct:+.1f}%", "how": "search (analysis + stated allowances; states by engine at scale)"})
    worst = runs.loc[runs.groupby(["collectives", "device", "world", "stage"]).peak_error_pct.apply(
        lambda e: e.abs().idxmax())]
    for _, r in worst.iterrows():
        rows.append({"item": f"real run, {r.collectives} world {r.world} on {r.device}, {r.scheme}: peak per rank (MB)",
                     "paper": "–", "ours": f"{r.peak_measured / 1e6:.1f} measured vs {r.peak_predicted / 1e6:.1f} predicted",
                     "error": f"{r.peak_error_pct:+.1f}%", "how": "real run, MemTracker (worst rank)"})
    return rows
