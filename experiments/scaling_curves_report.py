"""The scaling curves' plots and REPORT.md, from the frames and meta.json that experiments/scaling_curves.py
measured and passes in (it calls these; nothing here imports it back). Redraw without measuring:
`zero-ref reproduce --redraw scaling_curves`."""

from __future__ import annotations

import json
import numbers
from pathlib import Path

import pandas as pd

from experiments.markdown import table
from zero_ref.analysis import memory_model as mm


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
    models = list(dict.fromkeys(at_scale.model))          # both frames come sorted in the study's model order
    real = real if real is not None else pd.DataFrame(columns=["model", "stage", "world_size"])
    real_models = list(dict.fromkeys(real.model))
    written = []

    ours = {"lw": 3.5, "alpha": 0.45, "zorder": 2}           # wide and pale, so the paper's thin line shows on top
    paper = {"lw": 1.3, "ls": "--", "zorder": 3}

    def nd_axis(ax, nds, label="Nd (data-parallel ranks)"):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(set(nds)) if len(set(nds)) <= 6 else [4**i for i in range(6)])
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel(label)

    with sns.axes_style("whitegrid"):
        fig, axes = plt.subplots(1, len(models), figsize=(4.3 * len(models), 5), squeeze=False)
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

        fig, axes = plt.subplots(2, len(models), figsize=(4.3 * len(models), 7), squeeze=False)
        for top, bottom, model in zip(axes[0], axes[1], models):
            data = at_scale[at_scale.model == model]
            for s, rows in data[data.nd > 1].groupby("stage"):    # over one rank nothing is issued
                top.plot(rows.nd, rows.elements_over_psi, color=colour[s], label=f"{_stage(s)}: engine at scale", **ours)
                top.plot(rows.nd, rows.formula_elements_over_psi, color=colour[s],
                         label=f"{_stage(s)}: paper, {rows.formula_elements_over_psi.iloc[0]:.0f}Ψ", **paper)
                bottom.plot(rows.nd, rows.elements_over_psi - rows.formula_elements_over_psi, "o-", ms=3,
                            color=colour[s])
            for s, rows in real[(real.model == model) & (real.world_size > 1)].groupby("stage"):
                excess = rows.elements_over_psi - mm.comm_volume_elements(1, s)
                for ax, y in ((top, rows.elements_over_psi), (bottom, excess)):
                    ax.scatter(rows.world_size, y, marker="X", s=70, color=colour[s], edgecolors="black", zorder=4,
                               label=f"{_stage(s)}: real run")
            top.set(ylim=(1.8, 3.2), ylabel="elements per rank per step / Ψ", title=model)
            top.annotate("stages 0, 1 and 2 lie on one line at 2Ψ", (0.03, 0.12), xycoords="axes fraction",
                         fontsize=7, color="dimgrey")
            bottom.set_yscale("symlog", linthresh=1e-6)
            bottom.set(ylabel="excess / Ψ over the paper")
            bottom.annotate("stage 1 lies under stage 0", (0.03, 0.9), xycoords="axes fraction", fontsize=7,
                            color="dimgrey")
            nd_axis(top, data.nd), nd_axis(bottom, data.nd)
        _finish(plt, fig, axes, out / "elements_vs_nd.png", "Elements moved per rank in one step / Ψ (the paper's "
                "count); below: the excess, padding plus the step's statistics all-reduce.\nNot drawn: Nd = 1, where "
                "the engine issues nothing (its collectives over one rank are local copies)")
        written.append("elements_vs_nd.png")

        if real_models:
            fig, axes = plt.subplots(2, len(real_models), figsize=(4.3 * len(real_models), 7), squeeze=False)
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
             f"{meta['batch_per_rank']} x seq per rank, fp32) for Hugging Face GPT-2 models built on the meta device, as "
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
             "flag). At Nd = 1 nothing is issued: over one rank the engine's collectives are local copies that "
             "never reach torch.distributed (as in a real run), so the count is 0; the engine's own ledger "
             "(`engine.comm_stats()`) still counts the paper's 2Ψ / 3Ψ there.", "",
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
                  f"in **{equal} of {n}** runs; elements per step equal in {int(check.elements_equal.sum())} of {n}. "
                  "Not compared: what a run marks timing-dependent (`timing_dependent`: stage 3's gradient buckets "
                  "on gloo, whose reducer never blocks during backward and reuses a bucket once its reduction has "
                  "finished, so how many exist depends on how fast they ran; the engine at scale keeps the blocking "
                  "reducer's two, as on CUDA).",
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


def render(out: Path) -> list[dict]:
    """The report step: the plots and REPORT.md from the tables a run of scaling_curves.py left in
    ``out``; the headline rows."""
    meta = json.loads((out / "meta.json").read_text())
    at_scale = pd.read_csv(out / "scaling_at_scale.csv")
    real = pd.read_csv(out / "scaling_real.csv") if (out / "scaling_real.csv").exists() else None
    check = pd.read_csv(out / "scaling_check.csv", keep_default_na=False) if real is not None else None
    written = plots(out, at_scale, real, meta["psi_nd"])
    return write_report(out, at_scale, real, check, meta["psi_nd"], meta | {"plots": written})
