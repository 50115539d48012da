"""bench_step.py's outputs: its tables (written by the run), and its report step (``render``): the
bar plot, REPORT.md and the headline rows, drawn from the tables, with every run kept in history/.

    zero-ref reproduce --redraw bench_step   # draw again from the tables, measuring nothing
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd

from experiments.run_history import described, keep, spread


def write_outputs(args, rows, step_rows, results, meta) -> None:
    """The run's tables: bench_step.csv (a row per system), bench_step_steps.csv (every timed step),
    meta.json and the profiles, in ``args.out``."""
    os.makedirs(args.out, exist_ok=True)
    columns = ["system", "stage", "dtype", "reduce_dtype", "world_size", "steps", "median_s", "q1_s", "q3_s",
               "iqr_s", "ratio_to_ddp", "ratio_to_same_stage", "goal", "pass", "paired_ratio", "min_s", "min_ratio", "cpu_median_s",
               "cpu_ratio", "quiet_steps", "quiet_median_s", "quiet_ratio", "forward_median_s",
               "backward_median_s", "optimizer_median_s", "max_loss_diff_vs_ddp", "final_loss"]
    pd.DataFrame(rows)[columns].to_csv(os.path.join(args.out, "bench_step.csv"), index=False)
    pd.DataFrame(step_rows).to_csv(os.path.join(args.out, "bench_step_steps.csv"), index=False)
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    for name, text in results[0]["profiles"].items():
        if text:
            with open(os.path.join(args.out, f"profile_{name}.txt"), "w") as f:
                f.write(text)


def _rows(folder: Path) -> list[dict]:
    frame = pd.read_csv(folder / "bench_step.csv").fillna({"pass": ""})
    return frame.to_dict("records")


def draw(folder: Path) -> list[dict]:
    """The plot and REPORT.md of one run's folder (fp32 or bf16), from its tables; returns its rows."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    meta = json.loads((folder / "meta.json").read_text())
    rows, steps = _rows(folder), pd.read_csv(folder / "bench_step_steps.csv")
    history = spread(keep(folder, "bench_step.csv", meta), ["system"], "ratio_to_ddp")
    profiled = sorted(p.stem.removeprefix("profile_") for p in folder.glob("profile_*.txt"))
    (folder / "REPORT.md").write_text(report_markdown(rows, meta, profiled, history))

    fig, ax = plt.subplots(figsize=(7, 3.8))
    order = [r["system"] for r in rows]
    sns.barplot(data=steps, x="system", y="step_s", order=order, estimator="median",
                errorbar=("pi", 50), color="#4c72b0", ax=ax)
    ddp = next(r["median_s"] for r in rows if r["system"] == "ddp")
    for i, r in enumerate(rows):
        if r["pass"]:
            ax.hlines(ddp * r["goal"], i - 0.4, i + 0.4, color="#c44e52", linestyle="--", linewidth=1.5)
        ax.annotate(f"{r['ratio_to_ddp']:.2f}x", (i, 0), xytext=(0, 3), textcoords="offset points",
                    ha="center", va="bottom", fontsize=8, color="white", fontweight="bold")
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    ax.set_ylabel("step time, s (median, bar: IQR)")
    ax.set_xlabel("")
    ax.set_title(f"world {meta['args']['world_size']}, {meta['args']['dtype']}; white: ratio to DDP; "
                 "dashed: goal", fontsize=10)
    fig.tight_layout()
    fig.savefig(folder / "bench_step.png", dpi=120)
    plt.close(fig)
    return rows


def headline(rows: list[dict], dtype: str) -> list[dict]:
    """One row per system of one run: its ratio to DDP against the project's goal; for a
    ``-r32`` system, the cost of fp32 reductions over the same stage."""
    ddp = next(r for r in rows if r["system"] == "ddp")
    out = []
    for r in rows:
        if r["system"] == "ddp":
            continue
        if r["system"].endswith("-r32"):
            out.append({"item": f"step time, stage {int(r['stage'])} with reduce_dtype='fp32', bf16, world 2",
                        "paper": "(not in the paper)", "ours": f"{r['ratio_to_same_stage']:.3f}x the bf16 reduction",
                        "error": "cost measured, no goal", "how": "real run"})
            continue
        out.append({
            "item": f"step time, stage {int(r['stage'])} vs DDP + AdamW(foreach), {dtype}, world 2",
            "paper": "2Ψ comm. for stages 0-2, 3Ψ for stage 3 (no step time given)",
            "ours": f"{r['ratio_to_ddp']:.3f}x DDP ({r['median_s'] * 1e3:.0f} vs {ddp['median_s'] * 1e3:.0f} ms)",
            "error": f"project goal <= {r['goal']:.2f}x: {r['pass']}", "how": "real run"})
    return out


def render(out: Path) -> list[dict]:
    """The report step `zero-ref reproduce` runs: ``out`` (fp32) and ``out``/bf16 when a run left
    one, drawn from their tables; the headline rows of both."""
    rows = []
    for folder in (out, out / "bf16"):
        if (folder / "bench_step.csv").exists():
            dtype = json.loads((folder / "meta.json").read_text())["args"]["dtype"]
            rows += headline(draw(folder), dtype)
    return rows


def report_markdown(rows, meta, profiled: list[str], history: pd.DataFrame) -> str:
    a = meta["args"]
    share = meta.get("other_processes_cpu_fraction_timed")
    lines = [
        "# Step time: zero_ref stages vs DDP (generated by experiments/bench_step.py; do not edit)", "",
        f"- command: `{meta['command']}`", f"- git revision: {meta['git_revision']}",
        f"- hardware: {meta['hardware']['cpu']}, {meta['hardware']['cores']} cores; "
        f"{meta['threads_per_rank']} torch thread(s) per rank; torch {meta['torch']}; {meta['date']}",
        f"- model: tiny_gpt2, {a['layers']} layers, hidden {a['hidden']}, {a['heads']} heads, vocab {a['vocab']}, "
        f"seq {a['seq']}: {meta['parameters']:,} parameters; global batch {a['batch']}; world size "
        f"{a['world_size']}; {a['dtype']}; bucket_numel {a['bucket_numel']:,}",
        f"- baseline: {meta['baseline']}",
        f"- timing: {meta['timing']}; {a['warmup']} warm-up and {a['steps']} timed steps per system in "
        f"{a['rounds']} rounds",
        "- disturbance: other processes took "
        + ("(unknown)" if share is None else f"{share:.0%} of the machine's CPU during the timed steps")
        + ("; **the timings are disturbed**" if share is not None and share > 0.1 else ""), "",
        "| system | median s | IQR s | ratio to DDP | goal | result | paired | min | cpu | quiet (n) "
        "| fwd s | bwd s | opt s | max abs loss diff |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        goal = "" if r["pass"] == "" else f"{r['goal']:.2f}"
        lines.append(
            f"| {r['system']} | {r['median_s']:.4f} | {r['iqr_s']:.4f} | {r['ratio_to_ddp']:.3f} | {goal} | "
            f"{r['pass']} | {r['paired_ratio']:.3f} | {r['min_ratio']:.3f} | {r['cpu_ratio']:.3f} | "
            f"{r['quiet_ratio']:.3f} ({r['quiet_steps']}) | {r['forward_median_s']:.4f} | "
            f"{r['backward_median_s']:.4f} | {r['optimizer_median_s']:.4f} | {r['max_loss_diff_vs_ddp']:.2e} |")
    lines += [
        "", "ratio: median step over DDP's median step (the goal's measure); paired: per round, this "
        "system's step over DDP's, median over rounds; min: fastest step over DDP's fastest; cpu: median "
        "CPU seconds per step of the busiest rank (all threads) over DDP's; quiet: ratio of medians over "
        f"the steps during which other processes took < {a['quiet_threshold']:.0%} of the machine (n: how "
        "many). Phase columns (fwd incl. loss, bwd, opt incl. clearing gradients) are medians of the "
        "slowest rank's phase.", "",
        "Files: bench_step.csv (this table), bench_step_steps.csv (every timed step), meta.json, "
        "bench_step.png" + ("".join(f", profile_{name}.txt" for name in profiled)) + ".",
    ]
    lines += ["", "## Every run kept", "", "The ratio to DDP of each run kept in `history/bench_step.csv` "
              "(one row set per run, by `run_id`): median across runs (lowest-highest, how many runs).", "",
              "| system | ratio to DDP across runs |", "|---|---|"]
    lines += [f"| {r['system']} | {described(r)} |" for _, r in history.iterrows()]
    fp32_reduce = [r for r in rows if r["system"].endswith("-r32")]
    if fp32_reduce:
        lines += ["", "The cost of `reduce_dtype=\"fp32\"` (gradients accumulated and reduced in fp32, twice the "
                  "gradient bytes and traffic): " + "; ".join(
                      f"{r['system']} {r['ratio_to_same_stage']:.3f}x zero-{r['stage']}" for r in fp32_reduce) + "."]
    return "\n".join(lines) + "\n"


def print_table(rows) -> None:
    print(f"\n{'system':<10} {'median s':>9} {'IQR s':>8} {'fwd s':>7} {'bwd s':>7} {'opt s':>7} "
          f"{'ratio':>6} {'goal':>5}  result  {'paired':>6} {'min':>6} {'cpu':>6} {'quiet':>6}  max|dloss|")
    for r in rows:
        goal = "" if r["pass"] == "" else f"{r['goal']:.2f}"
        print(f"{r['system']:<10} {r['median_s']:9.4f} {r['iqr_s']:8.4f} {r['forward_median_s']:7.4f} "
              f"{r['backward_median_s']:7.4f} {r['optimizer_median_s']:7.4f} {r['ratio_to_ddp']:6.3f} "
              f"{goal:>5}  {r['pass']:<6}  {r['paired_ratio']:6.3f} {r['min_ratio']:6.3f} {r['cpu_ratio']:6.3f} "
              f"{r['quiet_ratio']:6.3f}  "
              f"{r['max_loss_diff_vs_ddp']:.2e}")
    print("ratio: median step over DDP's median step (the goal's measure); paired: median over rounds of "
          "the per-round ratio;\nmin: fastest step over DDP's fastest; cpu: median CPU seconds per step of the "
          "busiest rank (all its threads) over DDP's;\nquiet: median over the steps during which other "
          "processes took < --quiet-threshold of the machine, over DDP's (n quiet steps: "
          + ", ".join(f"{r['system']} {r['quiet_steps']}" for r in rows) + ")")
