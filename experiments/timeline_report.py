"""The walkthrough study: traces a step per stage with experiments/timeline.py and writes results/walkthrough
(CSVs, a figure per stage, REPORT.md).

    python -m experiments.timeline_report --out results/walkthrough

Per stage N: `timeline_stage{N}.csv` (the rows of `timeline.rows_of`, both ranks), `memory_stage{N}.csv`
(bytes alive on each rank at every allocation and free of the step), `timeline_stage{N}.png`;
`summary.csv` (per stage and rank: `engine.memory_report()` at the step's four points beside the
paper's model-state formula, elements moved, the checks); REPORT.md and meta.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd

from experiments.provenance import provenance
from experiments.timeline import BLOCK_NUMEL, HIDDEN, ROWS_PER_RANK, UNITS, check, rows_of, trace
from zero_ref.config import STAGE_NAMES
from zero_ref.analysis.memory_model import comm_volume_elements, model_state_bytes

MB = 1e6
FORMULA = {0: "(2+2+K)Ψ", 1: "2Ψ+2Ψ+KΨ/Nd", 2: "2Ψ+(2+K)Ψ/Nd", 3: "(2+2+K)Ψ/Nd"}
MOVED = {0: "2Ψ", 1: "2Ψ", 2: "2Ψ", 3: "3Ψ"}
STATES = ("params", "grads", "optimizer_states")


def facts(raws: list[dict]) -> dict:
    """What one stage's traces measured (every rank), beside the paper's formulas."""
    first = raws[0]
    stage, psi, world = first["stage"], first["psi"], first["world"]
    rows = {raw["rank"]: rows_of(raw) for raw in raws}
    r0 = rows[0]
    backward_end = max(r["end_us"] for r in r0 if r["what"].startswith("backward "))
    reductions = [r for r in r0 if r["what"] == "reduce bucket"]
    after = {raw["rank"]: next(p for p in raw["reports"] if p["when"] == "after step") for raw in raws}
    return {
        "stage": stage, "psi": psi, "world": world, "rows": rows,
        "formula_bytes": model_state_bytes(psi, stage, world).total,
        "states_bytes": {r: sum(a[k] for k in STATES) for r, a in after.items()},
        "cb_bytes": {r: a["comm_buffers"] for r, a in after.items()},
        "alive_start": {raw["rank"]: raw["memory"][0][1] for raw in raws},
        "alive_peak": {raw["rank"]: max(live for _, live in raw["memory"]) for raw in raws},
        "moved": first["comm"], "paper_moved": comm_volume_elements(psi, stage),
        "reductions": len(reductions), "step_ms": first["step_us"] / 1e3,
        "issued_in_backward": sum(r["start_us"] < backward_end for r in reductions),
        "done_in_backward": sum(r["done_us"] is not None and r["done_us"] < backward_end for r in reductions),
        "gathers": sum(r["what"] == "gather unit" for r in r0), "frees": sum(r["what"] == "free unit" for r in r0),
        "regathers": sum(r["what"] == "regather bucket" for r in r0),
        "problems": {rank: check(rs, stage) for rank, rs in rows.items()},
    }


def write(out: Path, traces: list[list[dict]], quick: bool, seconds: float, quiet: bool = True) -> dict:
    """Write everything for `traces` (timeline.trace's result) into `out`; the reproduce headline."""
    out.mkdir(parents=True, exist_ok=True)
    found = [facts(raws) for raws in traces]
    summary = []
    for f, raws in zip(found, traces):
        n = f["stage"]
        pd.DataFrame([row for rank in sorted(f["rows"]) for row in f["rows"][rank]]).to_csv(
            out / f"timeline_stage{n}.csv", index=False)
        pd.DataFrame([{"rank": raw["rank"], "t_us": t, "bytes_alive": live} for raw in raws for t, live in raw["memory"]]
                     ).to_csv(out / f"memory_stage{n}.csv", index=False)
        for raw in raws:
            for point in raw["reports"]:
                summary.append({"stage": n, "rank": raw["rank"], "when": point["when"], "t_us": round(point["t_us"], 1),
                                **{k: point[k] for k in (*STATES, "buffers", "comm_buffers", "total")},
                                "model_states": sum(point[k] for k in STATES), "formula_model_states": f["formula_bytes"],
                                "elements_moved": raw["comm"]["total"], "paper_elements": f["paper_moved"],
                                "checks": "; ".join(f["problems"][raw["rank"]]) or "hold"})
        plot(out / f"timeline_stage{n}.png", f, raws)
    pd.DataFrame(summary).to_csv(out / "summary.csv", index=False)
    meta = provenance() | {"quick": quick, "seconds": round(seconds, 1), "world": traces[0][0]["world"],
                           "model": f"TinyBlocks: {UNITS} blocks x (Linear {HIDDEN}->{4 * HIDDEN}, GELU, "
                                    f"Linear {4 * HIDDEN}->{HIDDEN}), residual", "psi": found[0]["psi"],
                           "bucket_numel": BLOCK_NUMEL, "rows_per_rank": ROWS_PER_RANK, "dtype": "bf16",
                           "backend": "gloo (CPU)"}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    (out / "REPORT.md").write_text(report(found, meta, out))
    if not quiet:
        print(f"wrote {out} in {seconds:.0f} s")
    return {"headline": headline(found), "meta": meta}


def headline(found: list[dict]) -> list[dict]:
    """The reproduce rows: model states and elements moved per stage, and what the timelines show."""
    how = "real run, traced (world 2, gloo)"
    rows = []
    for f in found:
        n, psi = f["stage"], f["psi"]
        ours = f["states_bytes"][0]
        rows.append({"item": f"stage {n} ({STAGE_NAMES[n]}): model states per rank after the traced step (memory_report), Nd 2, bf16",
                     "paper": f"{FORMULA[n]} = {f['formula_bytes'] / MB:.3f} MB",
                     "ours": f"{ours / MB:.3f} MB (+ {f['cb_bytes'][0] / MB:.3f} MB CB)",
                     "error": f"{ours / f['formula_bytes'] - 1:+.2%}", "how": how})
        moved = f["moved"]["total"]
        rows.append({"item": f"stage {n}: elements moved per rank in the traced step", "paper": MOVED[n],
                     "ours": f"{moved / psi:.4f}Ψ", "error": f"{moved / f['paper_moved'] - 1:+.2%}", "how": how})
    overlap = ", ".join(f"stage {f['stage']}: {f['issued_in_backward']}/{f['reductions']}" for f in found)
    rows.append({"item": "gradient reductions issued while backward still computes", "paper": "overlap (Sec 7, CB)",
                 "ours": overlap, "error": _verdict(found, (0, 1, 2, 3)), "how": how})
    s3 = next((f for f in found if f["stage"] == 3), None)
    if s3:
        computes = sum(r["what"].split()[0] in ("forward", "backward") for r in s3["rows"][0] if r["lane"] == "compute")
        rows.append({"item": "stage 3: each unit gathered before its forward and backward, freed after",
                     "paper": "Sec 5.3 / 7.2.2", "ours": f"{s3['gathers']} gathers, {s3['frees']} frees around "
                     f"{computes} block computations (rank 0)", "error": _verdict(found, (3,)), "how": how})
    rows.append({"item": "stages 1-2: each bucket's parameters all-gathered after its shard's update",
                 "paper": "Sec 7.2.1", "ours": ", ".join(f"stage {f['stage']}: {f['regathers']} all-gathers"
                                                         for f in found if f["stage"] in (1, 2)),
                 "error": _verdict(found, (1, 2)), "how": how})
    return rows


def _verdict(found: list[dict], stages: tuple[int, ...]) -> str:
    broken = [f"stage {f['stage']} rank {rank}: {p[0]}" for f in found if f["stage"] in stages
              for rank, p in f["problems"].items() if p]
    return "holds on every rank" if not broken else "VIOLATED: " + "; ".join(broken)


def plot(path: Path, f: dict, raws: list[dict]) -> None:
    """Lanes of rank 0's step (phases, compute per block, collectives issue -> done with the host's
    wait, buffer events) above every rank's bytes alive, the formula and memory_report's points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = f["rows"][0]
    blocks = sorted({r["name"] for r in rows if r["name"]} | {r["what"].split()[1] for r in rows if r["lane"] == "compute"
                                                             and r["what"].split()[0] in ("forward", "backward")})
    color = {b: plt.get_cmap("tab10")(k) for k, b in enumerate(blocks)}
    lanes = ["compute", "all-gather", "reduction", "control", "buffers"]
    if not any(r["kind"] == "control" for r in rows):
        lanes.remove("control")
    y = {name: len(lanes) - k for k, name in enumerate(lanes)}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(15, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    ms = lambda us: us / 1e3   # noqa: E731
    phases = 0
    for r in rows:
        c = color.get(r["name"] or (r["what"].split() + [""])[1], "0.6")
        if r["lane"] == "phase":
            for ax in (top, bottom):
                ax.axvspan(ms(r["start_us"]), ms(r["end_us"]), color="0.93" if r["what"] in ("forward", "optimizer")
                           else "0.97", zorder=0)
            late = r["start_us"] > 0.85 * raws[0]["step_us"]   # near the right edge: the label ends there
            top.text(ms(r["end_us"] if late else r["start_us"]), len(lanes) + (0.72 if phases % 2 == 0 else 0.5),
                     r["what"].replace("_", " "), fontsize=9, va="center", ha="right" if late else "left")
            phases += 1
        elif r["lane"] == "compute":
            top.barh(y["compute"], ms(r["end_us"] - r["start_us"]), left=ms(r["start_us"]), height=0.5, color=c,
                     hatch="///" if r["what"].startswith("backward") else None, edgecolor="white")
        elif r["lane"] == "collective":
            lane = "all-gather" if r["kind"] == "all_gather" else "control" if r["kind"] == "control" else "reduction"
            done = r["done_us"] if r["done_us"] is not None else r["end_us"]
            shift = 0.3 - 0.12 * (max(r["group"], 0) % 3)   # concurrent collectives side by side
            top.barh(y[lane] + shift, ms(done - r["start_us"]), left=ms(r["start_us"]), height=0.12, color=c, alpha=0.6)
            if r["wait_start_us"] is not None:
                top.barh(y[lane] - 0.2, ms(r["end_us"] - r["wait_start_us"]), left=ms(r["wait_start_us"]),
                         height=0.12, color="black")
        elif r["lane"] == "buffers":
            marker = {"free unit": "v", "take bucket": "^", "reduced bucket": "s"}[r["what"]]
            top.plot(ms(r["start_us"]), y["buffers"], marker=marker, color=c, markersize=9, linestyle="none")
    top.set_yticks([y[name] for name in lanes], [{"reduction": "reduce-scatter /\nall-reduce",
                                                   "buffers": "free ▼ take ▲\nreturn ■"}.get(n, n) for n in lanes])
    top.set_ylim(0.4, len(lanes) + 0.9)
    handles = [Patch(color=color[b], label=b) for b in blocks]
    handles += [Patch(facecolor="white", edgecolor="0.3", hatch="///", label="backward (hatched)"),
                Patch(color="0.5", alpha=0.6, label="collective: issue → gloo done"),
                Patch(color="black", label="host waits for it")]
    top.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1), fontsize=8)
    top.set_title(f"Stage {f['stage']} ({STAGE_NAMES[f['stage']]}): one traced step, rank 0 of {f['world']} "
                  f"(gloo, CPU), Ψ = {f['psi']:,}, bf16")
    for raw in raws:
        t, live = zip(*raw["memory"])
        bottom.step([ms(v) for v in t], [v / MB for v in live], where="post", label=f"bytes alive, rank {raw['rank']}",
                    linestyle="-" if raw["rank"] == 0 else "--", color="C0" if raw["rank"] == 0 else "C1")
    bottom.axhline(f["formula_bytes"] / MB, color="C3", linestyle=":",
                   label=f"paper: model states {FORMULA[f['stage']]} = {f['formula_bytes'] / MB:.2f} MB")
    points = raws[0]["reports"]
    bottom.plot([ms(p["t_us"]) for p in points], [sum(p[k] for k in STATES) / MB for p in points], "o", color="C3",
                label="memory_report(): model states, rank 0")
    bottom.plot([ms(p["t_us"]) for p in points], [(sum(p[k] for k in STATES) + p["comm_buffers"]) / MB for p in points],
                "s", color="C2", label="memory_report(): + constant-size buckets (CB)")
    bottom.set_ylabel("MB on the rank")
    bottom.set_xlabel("ms since the step began (each rank's own clock)")
    bottom.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.005, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def report(found: list[dict], meta: dict, out: Path) -> str:
    """REPORT.md: per stage, the figure, the formula beside the measurement, and what the trace shows."""
    lines = ["# The walkthrough's timelines: one traced ZeRO step per stage", "",
             f"Generated by `{meta['command']}` at git `{meta['git_revision']}` on {meta['date_utc']} in "
             f"{meta['seconds']:.0f} s ({meta['hardware']['cores']} cores, torch {meta['hardware']['torch']}). "
             f"Model: {meta['model']}, Ψ = {meta['psi']:,} parameters, bf16 parameters and gradients, fp32 AdamW "
             f"(K = 12), world {meta['world']} on gloo, {meta['rows_per_rank']} rows per rank, one bucket (stages 0-2) "
             "or unit (stage 3) per block. One warm-up step, then one step under torch.profiler "
             "(experiments/timeline.py says what is read from the trace). The story of each stage, told through "
             "the code, is in [docs/](../../docs/README.md).", "",
             "Bytes alive: every allocation and free of the rank's CPU allocator since the model was built; the paper's "
             "formula counts model states only (parameters, gradients, optimizer states), so the curve sits above it "
             "by the constant-size buckets (CB), activations, gloo's staging copies of collectives in flight (made on "
             "its worker threads), at stage 3 the gathered units, and during the update the fp32 temporaries of "
             "AdamW's torch twin (one chunk at a time). Times are those of "
             "Python-driven CPU ranks on a shared machine and vary from run to run; the order of events and the "
             "overlap are what the figures show.", "",
             "| stage | paper formula | formula | memory_report, rank 0 | CB | alive at start | peak alive | elements "
             "moved | paper | reductions issued during backward | checks |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for f in found:
        lines.append(f"| {f['stage']} | {FORMULA[f['stage']]} | {f['formula_bytes']:,.0f} | {f['states_bytes'][0]:,} | "
                     f"{f['cb_bytes'][0]:,} | {f['alive_start'][0]:,} | {f['alive_peak'][0]:,} | "
                     f"{f['moved']['total']:,} ({f['moved']['total'] / f['psi']:.4f}Ψ) | {MOVED[f['stage']]} | "
                     f"{f['issued_in_backward']} of {f['reductions']} | "
                     f"{'hold' if not any(f['problems'].values()) else 'VIOLATED'} |")
    stats = {r["elements"] for f in found for r in f["rows"][0] if r["what"] == "step statistics"}
    lines += ["", "Elements moved: the engine's ledger, counted as the paper counts (an all-reduce of n moves 2n); "
              f"beyond 2Ψ/3Ψ it holds the step's statistics all-reduce of {', '.join(map(str, sorted(stats)))} "
              "elements (engine.step: sum of squares, non-finite flag, which parameters got a gradient, the "
              "hyper-parameters' agreement fingerprint and the micro-batch at which a backward raised, whether "
              "the parameters were written from outside the engine, how many parameters left the engine's "
              "buffers).", ""]
    for f in found:
        n = f["stage"]
        lines += [f"## Stage {n} ({STAGE_NAMES[n]})", "", f"![stage {n}](timeline_stage{n}.png)", "",
                  f"Rows: [timeline_stage{n}.csv](timeline_stage{n}.csv); bytes alive: [memory_stage{n}.csv]"
                  f"(memory_stage{n}.csv). Step {f['step_ms']:.1f} ms on rank 0; model states "
                  f"{f['states_bytes'][0]:,} B against the formula's {f['formula_bytes']:,.0f} B; peak alive "
                  f"{f['alive_peak'][0]:,} B ({f['alive_peak'][0] - f['alive_start'][0]:+,} B over the step's start).", ""]
        lines += [f"- {line}" for line in _shown(f)]
        lines.append("")
    lines.append(f"Checks (`experiments.timeline.check`, run on every rank's rows; tests/test_timeline.py also shows "
                 f"that they fail on reordered rows). Files: {', '.join(sorted(p.name for p in out.glob('*.csv')))}.")
    return "\n".join(lines) + "\n"


def _shown(f: dict) -> list[str]:
    n = f["stage"]
    said = [f"{f['issued_in_backward']} of {f['reductions']} gradient reductions are issued before backward's last "
            f"computation ends, and gloo has finished {f['done_in_backward']} of them by then: the reductions of the "
            "blocks backward reaches first run while earlier blocks still compute."]
    if n == 3:
        said.append(f"{f['gathers']} unit all-gathers ({f['world']} ranks: each a 1/{f['world']} shard from every rank) "
                    f"and {f['frees']} frees: every unit is gathered before its forward and again before its backward, "
                    "the next unit's gather is issued before the current one computes (prefetch 1), and each is freed "
                    "right after it computes; nothing is gathered after the update.")
    if n in (1, 2):
        said.append(f"{f['regathers']} all-gathers of updated parameters, each issued right after its bucket's shard "
                    "is updated, while the next bucket updates; the host waits for them in `after_update`.")
    if n == 0:
        said.append("Each bucket is all-reduced (averaged) as soon as its gradients are complete; every rank then "
                    "runs the same full update; nothing is gathered.")
    problems = [f"rank {rank}: {p}" for rank, ps in f["problems"].items() for p in ps]
    said.append("Checks: " + ("all hold on every rank." if not problems else "VIOLATED: " + "; ".join(problems)))
    return said


def run_study(out: Path, quick: bool = False, quiet: bool = False) -> dict:
    """The reproduce entry: trace stages 0-3 and write ``out``. ``quick`` changes nothing: the study
    is short (its time is in meta.json)."""
    start = time.perf_counter()
    traces = trace()
    return write(Path(out), traces, quick, time.perf_counter() - start, quiet)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/walkthrough")
    args = parser.parse_args(argv)
    run_study(Path(args.out))


if __name__ == "__main__":
    main()
