"""Peers side by side: DDP, torch's ZeroRedundancyOptimizer, FSDP2, DeepSpeed ZeRO 1-3 and zero-ref
stages 0-3 on one model, one seed and one data stream, each in its own processes.

The question (the peers issue's goal): per stage, is zero-ref's step time no worse than the best
peer of that stage in the same run, with exactly the paper's 2/2/2/3Ψ elements moved per step and
the formula's bytes? Every contender is measured the same way (experiments/peer_systems.py says
how): time relative to DDP, live bytes per parameter beside ``zero_ref.memory_model``'s
``model_state_bytes(Ψ, stage, Nd, k=8, param_bytes=4, grad_bytes=4)`` (fp32: 16 B/Ψ unsharded),
elements moved per parameter beside 2/2/2/3 (counted below every library, at torch's dispatcher),
and the loss of every step against DDP's (fp32, so the comparison is of the same work: equal to
round-off in the first FIRST_STEPS steps, the later drift reported; LOSS_TOLERANCE says why).

How it runs (``zero_ref.launch.RankPool``: each contender's ranks are its own processes and process
group, alive between calls). The contenders are taken one stage at a time: DDP plus that stage's
contenders are alive together, DDP restarted from the initial weights before each stage, so every
contender trains steps 0..N-1 on the same batches. Each runs ``--warmup`` untimed steps (the last
one measured: collectives counted, live bytes read), then ``--steps`` timed steps interleaved in
``--rounds`` rounds (each round every contender of the stage, DDP included, runs its share of
steps, in an order rotated every round). The shared 2-core machine varies by about 20% run to run,
so a ratio to DDP is the median over rounds of (this contender's step / DDP's step in the same
round), with the interquartile range of those per-round ratios. One stage at a time also keeps
memory in bounds: all 14 contenders' ranks at world 4 would be 56 processes of about 0.4 GB.

A contender whose library is missing (``pip install -e ".[peers]"`` installs DeepSpeed) or that
fails is kept in the table with the reason.

Outputs in ``--out``: peers.csv (one row per world size and contender), peers_steps.csv (every
timed step), meta.json (the revision, versions, hardware, each contender's settings), peers.png and
REPORT.md.

    python -m experiments.peers --world-size 2 4 --steps 20 --out results/peers
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from experiments.bench_scaling import FIRST_STEPS, median_ci
from experiments.peer_systems import CONTENDERS, PeerRank, Setup, deepspeed_config, resolved_settings, versions
from experiments.provenance import ROOT, provenance
from zero_ref.launch import RankError, RankPool
from zero_ref.memory_model import model_state_bytes

PAPER_ELEMENTS = {0: 2.0, 1: 2.0, 2: 2.0, 3: 3.0}
"""Elements moved per parameter per step, the paper's Sec 7 (baseline, Pos, Pos+g: 2Ψ; Pos+g+p: 3Ψ)."""
COMM_TOLERANCE = 1e-3
"""|elements/Ψ - formula| allowed for "exact": padding (< Nd elements per group) and the step's small
statistics all-reduce, about 1e-4 Ψ for GPT-2 4x256."""
LOSS_TOLERANCE = 1e-5
"""|loss - DDP's loss| allowed at every rank in each of the first FIRST_STEPS steps (the regression
suite's rule, experiments/bench_scaling.py). In fp32, contenders that sum the gradients in another
order differ in their last bits (about 5e-7 = 1 ulp of a loss near 8), and Adam normalises tiny
gradients (those that are zero but for rounding, e.g. attention key biases) into full-size updates,
so the difference grows over the steps; 1e-5 (about 20 ulp) is far below what a real difference in
the work gives (DeepSpeed's default gradient clipping, left on: 1.4e-4 by the fourth step of the
test model). Later steps are reported (max Δloss), not checked. Measured at 5f48d2f, 22 steps: at
world 2 every contender is bit-exact with DDP; at world 4 all but ZeroRedundancyOptimizer (DDP's own
all-reduce) differ from it, by 2e-7 to 1e-6 in the first 10 steps and by up to 3.4e-5 (DeepSpeed
ZeRO-2; zero-ref 2.2e-5 to 3.0e-5) over all 22."""

CB_ALLOWANCE_BUCKETS = 2
"""Live bytes after backward may exceed the formula (which counts model states only) by this many
constant-size buffers of bucket_numel fp32 elements: the paper's CB (Sec 6.2), constant in Ψ, which
it counts apart from model states (one bucket filling while the previous one is reduced). The
allowance is the same number of bytes for every contender."""


def groups(names: list[str]) -> dict[int, list[str]]:
    """stage -> the chosen contenders of that stage other than DDP, in table order."""
    out: dict[int, list[str]] = {}
    for name, contender in CONTENDERS.items():
        if name in names and name != "ddp":
            out.setdefault(contender.stage, []).append(name)
    return out or {0: []}


def start_pools(names: list[str], world: int, setup: Setup, timeout: float, records: dict) -> dict[str, RankPool]:
    """The contenders' ranks, started side by side (start-up is mostly imports: both cores busy);
    a contender that fails to start gets the reason in its record instead."""

    def start(name: str) -> RankPool | None:
        try:
            return RankPool(world, PeerRank, name, setup, timeout_s=timeout, collective_timeout_s=timeout)
        except (RankError, TimeoutError) as error:
            records[name].update(status="failed", reason=_last_line(error))
            return None

    with ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:
        started = dict(zip(names, pool.map(start, names)))
    return {name: p for name, p in started.items() if p is not None}


def _last_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def run_world(world: int, names: list[str], setup: Setup, args, progress) -> tuple[dict, list[dict]]:
    """Run every chosen contender at one world size; return {name: record} and the timed steps."""
    records = {name: {"status": "ok", "reason": "", "stage": CONTENDERS[name].stage} for name in names}
    for name in names:
        if why := CONTENDERS[name].missing():
            records[name].update(status="skipped", reason=why)
    step_rows: list[dict] = []
    ddp = None
    try:
        for index, (stage, members) in enumerate(groups(names).items()):
            progress.set_postfix_str(f"world {world}: starting stage {stage}")
            members = [n for n in members if records[n]["status"] == "ok"]
            pools = start_pools((["ddp"] if ddp is None else []) + members, world, setup, args.timeout, records)
            if ddp is None:
                if "ddp" not in pools:
                    close_pools(list(pools.values()))
                    raise RuntimeError(f"DDP, the baseline, did not start: {records['ddp']['reason']}")
                ddp = pools["ddp"]
            else:
                ddp.call("restart")
            pools = {"ddp": ddp, **{n: p for n, p in pools.items() if n != "ddp"}}
            ddp_record = records["ddp"] if index == 0 else {"status": "ok", "reason": ""}
            try:
                run_group(world, stage, pools, records, ddp_record, args, progress, step_rows)
            finally:
                close_pools([pool for name, pool in pools.items() if name != "ddp"])
    finally:
        if ddp is not None:
            ddp.close()
    return records, step_rows


def close_pools(pools: list[RankPool]) -> None:
    """Close side by side (each rank takes a second or two to leave its process group and exit)."""
    with ThreadPoolExecutor(max_workers=max(1, len(pools))) as executor:
        list(executor.map(RankPool.close, pools))


def run_group(world, stage, pools, records, ddp_record, args, progress, step_rows) -> None:
    """Warm-up (the last step measured), then the timed rounds, for DDP and one stage's contenders."""
    group_records = {name: (ddp_record if name == "ddp" else records[name]) for name in pools}
    for rec in group_records.values():
        rec.setdefault("losses", {})
    ddp_losses = group_records["ddp"]["losses"]

    def run(name: str, step: int, measure: bool = False, round_index: int = -1) -> None:
        rec = group_records[name]
        try:
            by_rank = pools[name].call("step", step, measure=measure)
            if measure:
                pools[name].call("stop_recording")
        except (RankError, TimeoutError) as error:
            if name == "ddp":
                raise
            rec.update(status="failed", reason=f"step {step}: {_last_line(error)}")
            del pools[name]
            return
        rec["losses"][step] = [r["loss"] for r in by_rank]
        if measure:
            rec["measured"] = by_rank
        elif round_index >= 0:
            slowest = max(by_rank, key=lambda r: r["step_s"])
            step_rows.append({"world_size": world, "group": stage, "contender": name, "round": round_index,
                              "step": step, **{k: slowest[k] for k in ("step_s", "forward_s", "backward_s",
                                                                       "optimizer_s")},
                              "loss": statistics.fmean(r["loss"] for r in by_rank)})

    for name in list(pools):
        for step in range(args.warmup):
            if name in pools:
                run(name, step, measure=step == args.warmup - 1)
    per_round = math.ceil(args.steps / args.rounds)
    for r in range(args.rounds):
        names = list(pools)
        for name in names[r % len(names):] + names[:r % len(names)]:
            first = args.warmup + r * per_round
            for step in range(first, min(first + per_round, args.warmup + args.steps)):
                if name in pools:
                    run(name, step, round_index=r)
        progress.update(1)
        progress.set_postfix_str(f"world {world}, stage {stage}")
    for name, rec in group_records.items():
        if name != "ddp" and rec["status"] == "ok":
            rec["loss_diff_first_steps"], rec["max_loss_diff"] = loss_differences(rec["losses"], ddp_losses)
    records.setdefault("_ddp_losses", []).append(ddp_losses)


def loss_differences(losses: dict[int, list[float]], ddp_losses: dict[int, list[float]]) -> tuple[float, float]:
    """(the largest |loss - DDP's| over ranks in the first FIRST_STEPS steps, the largest over all
    steps) for per-step, per-rank losses {step: [loss of rank 0, rank 1, ...]}."""
    diffs = {s: max(abs(a - b) for a, b in zip(by_rank, ddp_losses[s])) for s, by_rank in losses.items()}
    return max((d for s, d in diffs.items() if s < FIRST_STEPS), default=0.0), max(diffs.values(), default=0.0)


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def summarize(world: int, records: dict, step_rows: list[dict], setup: Setup, psi: int) -> list[dict]:
    """One row per contender: time vs DDP, bytes and elements per parameter beside the formulas, loss."""
    steps = pd.DataFrame(step_rows)
    rows = []
    for name in CONTENDERS:
        if name not in records:
            continue
        rec, contender = records[name], CONTENDERS[name]
        formula = model_state_bytes(psi, contender.stage, world, k=8, param_bytes=4, grad_bytes=4).total / psi
        row = {"world_size": world, "contender": name, "stage": contender.stage, "library": contender.library,
               "what": contender.what, "status": rec["status"], "reason": rec["reason"], "psi": psi,
               "formula_B_per_param": formula, "formula_elements_per_param": PAPER_ELEMENTS[contender.stage],
               "cb_allowance_B_per_param": CB_ALLOWANCE_BUCKETS * setup.bucket_numel * 4 / psi}
        if rec["status"] == "ok":
            mine = steps[steps.contender == name]
            group = steps[(steps.group == contender.stage) & (steps.contender == "ddp")]
            q1, median, q3 = quartiles(list(mine.step_s))
            ratios = [statistics.median(mine[mine["round"] == r].step_s) / statistics.median(g.step_s)
                      for r, g in group.groupby("round") if (mine["round"] == r).any()]
            r1, ratio, r3 = (1.0, 1.0, 1.0) if name == "ddp" else quartiles(ratios)
            measured = rec["measured"]
            moved = {}
            for by_rank in measured:
                for kind, n in by_rank["moved"].items():
                    moved[kind] = max(moved.get(kind, 0), n)
            last = max(rec["losses"])
            row.update(timed_steps=len(mine), median_s=median, q1_s=q1, q3_s=q3,
                       ddp_median_s=statistics.median(group.step_s) if name != "ddp" else median,
                       ratio_to_ddp=ratio, ratio_q1=r1, ratio_q3=r3, rounds=len(ratios) if name != "ddp" else None,
                       live_B_per_param=max(m["after_backward_bytes"] for m in measured) / psi,
                       at_rest_B_per_param=max(m["at_rest_bytes"] for m in measured) / psi,
                       peak_B_per_param=max(m["peak_bytes"] for m in measured) / psi,
                       elements_per_param=sum(v for k, v in moved.items() if k != "other") / psi,
                       other_collective_calls=moved.get("other", 0),
                       **{f"moved_{k}_per_param": v / psi for k, v in sorted(moved.items()) if k != "other"},
                       loss_steps=last + 1, final_loss=statistics.fmean(rec["losses"][last]),
                       max_loss_diff=rec.get("max_loss_diff", 0.0),
                       loss_diff_first_steps=rec.get("loss_diff_first_steps", 0.0))
            row["loss_equal"] = row["loss_diff_first_steps"] <= LOSS_TOLERANCE
            row["excess_buckets"] = (row["live_B_per_param"] - formula) * psi / (setup.bucket_numel * 4)
        rows.append(row)
    return rows


def paired_ratios(steps: pd.DataFrame, world: int, stage: int, name: str, other: str) -> list[float]:
    """Per round of `stage`'s group at `world`: `name`'s step over `other`'s in the same round
    (medians of each one's steps in that round). Pairing by round takes out the machine's slow and
    fast minutes, which both contenders share."""
    g = steps[(steps.world_size == world) & (steps.group == stage)]
    mine, theirs = (g[g.contender == n].groupby("round").step_s.median() for n in (name, other))
    both = mine.index.intersection(theirs.index)
    return [float(mine[r] / theirs[r]) for r in both]


def not_slower(steps: pd.DataFrame, world: int, stage: int, name: str, other: str) -> dict:
    """Is `name` no slower than `other`? The median of the paired per-round ratios and its
    distribution-free 95% interval (experiments.bench_scaling.median_ci, the regression gate's): `name`
    is slower only when the whole interval lies above 1, i.e. beyond the noise the run measured."""
    ratios = paired_ratios(steps, world, stage, name, other)
    if not ratios:
        return {"median": None, "ci_low": None, "ci_high": None, "rounds": 0, "ok": None}
    low, high = median_ci(ratios)
    return {"median": statistics.median(ratios), "ci_low": low, "ci_high": high, "rounds": len(ratios),
            "ok": bool(low <= 1.0)}


def goal_check(rows: list[dict], steps: pd.DataFrame) -> list[dict]:
    """Per world size and stage: zero-ref's time against the best peer's (paired by round), its
    elements and bytes."""
    frame = pd.DataFrame(rows)
    checks = []
    for (world, stage), g in frame.groupby(["world_size", "stage"]):
        ours = g[g.contender == f"zero-ref-{stage}"]
        peers = g[(g.library != "zero_ref") & (g.status == "ok")]   # at stage 0: DDP
        if ours.empty or ours.iloc[0].status != "ok":
            continue
        z = ours.iloc[0]
        best = peers.loc[peers.ratio_to_ddp.idxmin()] if not peers.empty else None
        versus = None if best is None else not_slower(steps, world, stage, z.contender, best.contender)
        within_bytes = lambda r: bool(r.live_B_per_param <= r.formula_B_per_param + r.cb_allowance_B_per_param)  # noqa: E731
        checks.append({
            "world_size": world, "stage": stage, "zero_ref_ratio": z.ratio_to_ddp,
            "best_peer": None if best is None else best.contender,
            "best_peer_ratio": None if best is None else best.ratio_to_ddp,
            "versus_best_peer": versus, "time_ok": None if versus is None else versus["ok"],
            "elements_per_param": z.elements_per_param, "formula_elements": z.formula_elements_per_param,
            "elements_exact": bool(abs(z.elements_per_param - z.formula_elements_per_param) <= COMM_TOLERANCE),
            "live_B_per_param": z.live_B_per_param, "formula_B_per_param": z.formula_B_per_param,
            "bytes_ok": within_bytes(z), "loss_equal": bool(z.loss_equal),
            "peers_with_all_three": [p.contender for p in peers.itertuples()
                                     if not_slower(steps, world, stage, p.contender, z.contender)["ok"]
                                     and abs(p.elements_per_param - p.formula_elements_per_param) <= COMM_TOLERANCE
                                     and within_bytes(p)]})
        c = checks[-1]
        c["holds"] = bool(c["time_ok"] is not False and c["elements_exact"] and c["bytes_ok"] and c["loss_equal"])
    return checks


# --- outputs ----------------------------------------------------------------------------------
COLUMNS = ["world_size", "contender", "stage", "library", "status", "reason", "timed_steps", "median_s", "q1_s",
           "q3_s", "ddp_median_s", "ratio_to_ddp", "ratio_q1", "ratio_q3", "rounds", "live_B_per_param",
           "formula_B_per_param", "cb_allowance_B_per_param", "excess_buckets", "at_rest_B_per_param",
           "peak_B_per_param", "elements_per_param", "formula_elements_per_param", "loss_steps", "final_loss",
           "loss_diff_first_steps", "max_loss_diff", "loss_equal", "psi", "what"]
"""peers.csv's columns first (then moved_<kind>_per_param and other_collective_calls)."""


def write_outputs(out: Path, rows: list[dict], step_rows: list[dict], checks: list[dict], meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(rows)
    extra = sorted(c for c in frame.columns if c not in COLUMNS)
    frame[[c for c in COLUMNS if c in frame.columns] + extra].to_csv(out / "peers.csv", index=False)
    pd.DataFrame(step_rows).to_csv(out / "peers_steps.csv", index=False)
    (out / "meta.json").write_text(json.dumps(meta | {"goal_check": checks}, indent=2, default=str) + "\n")
    plot(out / "peers.png", frame, meta)
    (out / "REPORT.md").write_text(report(frame, checks, meta))


def plot(path: Path, frame: pd.DataFrame, meta: dict) -> None:
    """Three panels (time vs DDP, live B/Ψ, elements/Ψ), contenders grouped by stage, one bar per
    world size, every bar labelled; the formula as a black tick over each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in CONTENDERS if n in set(frame.contender)]
    worlds = sorted(frame.world_size.unique())
    width = 0.8 / len(worlds)
    x = {}
    for i, name in enumerate(names):   # a gap between stages
        x[name] = i + 0.6 * CONTENDERS[name].stage
    panels = [("ratio_to_ddp", None, "step time / DDP's (median of per-round ratios, bar: IQR)"),
              ("live_B_per_param", "formula_B_per_param", "live bytes per parameter after backward, per rank "
               "(log; tick: formula)"),
              ("elements_per_param", "formula_elements_per_param", "elements moved per parameter per step "
               "(tick: paper's 2/2/2/3)")]
    fig, axes = plt.subplots(3, 1, figsize=(max(10, 0.9 * len(names) * len(worlds) + 3), 12), sharex=True)
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]
    for ax, (column, formula, title) in zip(axes, panels):
        for j, world in enumerate(worlds):
            for name in names:
                row = frame[(frame.contender == name) & (frame.world_size == world)]
                if row.empty:
                    continue
                r = row.iloc[0]
                xpos = x[name] - 0.4 + width * (j + 0.5)
                if r.status != "ok":
                    ax.text(xpos, 0.02, r.status, rotation=90, transform=ax.get_xaxis_transform(), ha="center",
                            va="bottom", fontsize=7, color="grey")
                    continue
                value = r[column]
                error = None
                if column == "ratio_to_ddp":
                    error = [[value - r.ratio_q1], [r.ratio_q3 - value]]
                ax.bar(xpos, value, width * 0.9, color=colors[j % len(colors)], yerr=error, capsize=2,
                       label=f"world {world}" if name == names[0] else None)
                if formula:
                    ax.hlines(r[formula], xpos - width * 0.45, xpos + width * 0.45, color="black", linewidth=2)
                label = f"{value:.2f}" if column != "elements_per_param" else f"{value:.4f}"
                top = max(value, r.ratio_q3) if column == "ratio_to_ddp" else value
                ax.annotate(label, (xpos, top), textcoords="offset points", xytext=(0, 3), ha="center",
                            va="bottom", fontsize=7, rotation=90)
        if column == "ratio_to_ddp":
            ax.axhline(1.0, color="black", linewidth=0.8)
        ax.margins(y=0.25)
        if column == "live_B_per_param":
            ax.set_yscale("log")
            low, high = ax.get_ylim()
            ax.set_ylim(low, high * 2)
        ax.set_title(title, fontsize=10)
        for stage in range(4):
            members = [x[n] for n in names if CONTENDERS[n].stage == stage]
            if members:
                ax.axvspan(min(members) - 0.5, max(members) + 0.5, color="grey", alpha=0.06 * (stage % 2 + 1))
                if column == "ratio_to_ddp":
                    ax.text((min(members) + max(members)) / 2, 0.98, f"stage {stage}", ha="center", va="top",
                            transform=ax.get_xaxis_transform(), fontsize=9)
    axes[-1].legend(fontsize=8, loc="upper left")
    axes[-1].set_xticks([x[n] for n in names], names, rotation=35, ha="right", fontsize=8)
    setup = meta["setup"]
    fig.suptitle(f"peers, GPT-2 {setup['layers']}x{setup['hidden']} (Ψ = {meta['psi']:,}), fp32, {meta['steps']} "
                 f"timed steps; shaded: stages 0-3", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _f(value, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def report(frame: pd.DataFrame, checks: list[dict], meta: dict) -> str:
    setup, v = meta["setup"], meta["versions"]
    lines = [
        "# Peers side by side (generated by experiments/peers.py; do not edit)", "",
        f"- command: `{meta['command']}`; git {meta['git_revision']}; {meta['date_utc']}; {meta['seconds']:.0f} s",
        f"- versions: torch {v['torch']}, deepspeed {v['deepspeed'] or '(not installed)'}, transformers "
        f"{v['transformers']}; {meta['hardware']['cpu']}, {meta['hardware']['cores']} cores; load average "
        f"{meta['load_average_1min_before_after'][0]:.1f} before, {meta['load_average_1min_before_after'][1]:.1f} after",
        f"- model: tiny_gpt2 {setup['layers']} layers x {setup['hidden']}, {setup['heads']} heads, vocab "
        f"{setup['vocab']}, seq {setup['seq']}: Ψ = {meta['psi']:,}; fp32; global batch {setup['batch']} (each rank "
        f"its slice); AdamW lr {setup['lr']}, betas {tuple(setup['betas'])}, eps {setup['eps']}, weight decay "
        f"{setup['weight_decay']}; seed {setup['seed']}; bucket {setup['bucket_numel']:,} elements",
        f"- steps: {meta['warmup']} warm-up (the last measured) + {meta['steps']} timed, in {meta['rounds']} rounds; "
        f"DDP restarted per stage, its losses the same every time: {meta['ddp_losses_repeatable']}", "",
        "Time: median over rounds of (step / DDP's step in the same round), the slowest rank's step; IQR: of those "
        "ratios. The stages run one after another (DDP beside each), so ratios compare within a stage; across "
        "stages they are from different minutes of a shared machine. Live B/Ψ: bytes of tensor storage alive on a rank after backward, before the optimizer step "
        "(parameters, gradients and optimizer states all alive), per parameter; formula: "
        "model_state_bytes(Ψ, stage, Nd, k=8, param_bytes=4, grad_bytes=4). Peak: the most alive during the step "
        "(activations included). Elements: what one rank's collectives move per step, counted at torch's dispatcher "
        "the paper's way (all-reduce 2n; reduce-scatter, all-gather, broadcast, reduce n). Loss: of the last step, "
        f"mean over ranks; Δloss: the largest |loss - DDP's| over ranks, in the first "
        f"{meta['loss_first_steps']} steps (checked: at most {meta['loss_tolerance']:g}) and over all steps (reported: "
        "fp32 round-off that Adam amplifies, see LOSS_TOLERANCE).", ""]
    for world, g in frame.groupby("world_size"):
        lines += [f"## World size {world}", "",
                  "| contender | stage | time vs DDP (IQR) | median s | live B/Ψ (formula) | excess, buckets | at rest | "
                  "peak | elements/Ψ (paper) | moved by kind /Ψ | loss | Δloss first steps | all steps |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in g.itertuples():
            if r.status != "ok":
                lines.append(f"| {r.contender} | {r.stage} | {r.status}: {r.reason} | | | | | | | | | | |")
                continue
            kinds = ", ".join(f"{c[6:-10]} {getattr(r, c):.3f}" for c in g.columns
                              if c.startswith("moved_") and not pd.isna(getattr(r, c)))
            lines.append(
                f"| {r.contender} | {r.stage} | {r.ratio_to_ddp:.2f} ({r.ratio_q1:.2f}-{r.ratio_q3:.2f}) | "
                f"{r.median_s:.3f} | {r.live_B_per_param:.2f} ({r.formula_B_per_param:.1f}) | {r.excess_buckets:.1f} | "
                f"{r.at_rest_B_per_param:.2f} | {r.peak_B_per_param:.1f} | {r.elements_per_param:.4f} "
                f"({r.formula_elements_per_param:.0f}) | {kinds} | {r.final_loss:.6f} | {r.loss_diff_first_steps:.1e} | "
                f"{r.max_loss_diff:.1e} |")
        lines.append("")
    lines += ["## The goal", "", f"{meta['goal']}. Time: zero-ref's step against the best peer's of its stage (the "
              "lowest median ratio to DDP), paired by round: the median of (zero-ref's step / the peer's step in the "
              "same round) and its distribution-free 95% interval; zero-ref is slower only when the whole interval "
              "lies above 1, beyond the noise the run measured (the regression gate's rule); "
              f"elements: within {COMM_TOLERANCE:g}Ψ of 2/2/2/3Ψ; bytes: live bytes after backward at most the formula "
              f"+ {CB_ALLOWANCE_BUCKETS} buckets of {meta['setup']['bucket_numel']:,} fp32 elements (the paper's "
              "constant-size buffers CB, counted apart from model states; the same bytes for every contender); loss "
              f"equal to DDP's in the first {meta['loss_first_steps']} steps (to {meta['loss_tolerance']:g}).", "",
              "| world | stage | zero-ref vs DDP | best peer (vs DDP) | zero-ref / best peer, paired (95% CI) | "
              "time | elements/Ψ | exact | B/Ψ (formula) | bytes | loss | goal | peers as fast, exact and within "
              "the bytes |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in checks:
        yes = lambda b: "n/a" if b is None else ("yes" if b else "**no**")  # noqa: E731
        lines.append(f"| {c['world_size']} | {c['stage']} | {c['zero_ref_ratio']:.2f} | {c['best_peer'] or '-'} "
                     f"({_f(c['best_peer_ratio'])}) | {_paired(c['versus_best_peer'])} | {_time_verdict(c)} | "
                     f"{c['elements_per_param']:.4f} | "
                     f"{yes(c['elements_exact'])} | {c['live_B_per_param']:.2f} ({c['formula_B_per_param']:.1f}) | "
                     f"{yes(c['bytes_ok'])} | {yes(c['loss_equal'])} | {'holds' if c['holds'] else '**fails**'} | "
                     f"{', '.join(c['peers_with_all_three']) or 'none'} |")
    held = sum(c["holds"] for c in checks)
    lines += ["", f"The goal holds in {held} of {len(checks)} (world size, stage) cases in this run.", "",
              "Settings beyond each library's defaults (all in meta.json): DeepSpeed gets `gradient_clipping: 0` in "
              "every variant (its default clips the gradient norm to 1.0, which no other contender does); "
              + "; ".join(f"{n}: {json.dumps(c['settings'])}" for n, c in meta["contenders"].items() if c["settings"])
              + ".", ""]
    return "\n".join(lines)


def _paired(versus: dict | None) -> str:
    if not versus or versus["median"] is None:
        return "-"
    return f"{versus['median']:.3f} ({versus['ci_low']:.3f}-{versus['ci_high']:.3f}, {versus['rounds']} rounds)"


def _time_verdict(check: dict) -> str:
    """faster (the whole interval below 1), as fast (it holds 1: a tie within the noise), **slower**."""
    versus = check["versus_best_peer"]
    if not versus or versus["ok"] is None:
        return "n/a"
    if not versus["ok"]:
        return "**slower**"
    return "faster" if versus["ci_high"] < 1.0 else "as fast"


def run_study(out: Path, quick: bool = False, quiet: bool = False) -> dict:
    """For `zero-ref reproduce`: the default run (quick: world 2, GPT-2 2x64, 4 timed steps, eight
    contenders); one headline row per world size and stage."""
    argv = ["--out", str(out)] + (["--quiet"] if quiet else [])
    if not quick:   # every contender at world 2 and 4, 20 timed steps (rounds) each: about 15 minutes on 2 cores
        argv += ["--steps", "20"]
    if quick:   # one peer of each kind beside zero-ref's stages: about 2 minutes on 2 idle cores
        argv += ["--world-size", "2", "--steps", "4", "--layers", "2", "--hidden", "64", "--vocab", "512",
                 "--seq", "32", "--batch", "4", "--contenders", "zero-ref-0", "zero-ref-1", "zero-ref-2", "zero-ref-3",
                 "zero-redundancy-optimizer", "fsdp2-no-reshard", "fsdp2-reshard", "deepspeed-2"]
    main(argv)
    meta = json.loads((out / "meta.json").read_text())
    headline = []
    for c in meta["goal_check"]:
        stage, world = c["stage"], c["world_size"]
        peer = (f"best peer {c['best_peer']} {c['best_peer_ratio']:.2f}x; paired {_paired(c['versus_best_peer'])}: "
                f"{_time_verdict(c).strip('*')}") if c["best_peer"] else "no peer ran"
        headline.append({
            "item": f"peers, stage {stage}, world {world}: zero-ref-{stage} vs the stage's peers",
            "paper": f"{PAPER_ELEMENTS[stage]:.0f}Ψ moved; {c['formula_B_per_param']:.1f} B/Ψ (fp32)",
            "ours": f"{c['zero_ref_ratio']:.2f}x DDP ({peer}); {c['elements_per_param']:.4f}Ψ; "
                    f"{c['live_B_per_param']:.2f} B/Ψ",
            "error": "goal holds" if c["holds"] else "goal fails: " + ", ".join(
                k for k in ("time_ok", "elements_exact", "bytes_ok", "loss_equal") if c[k] is False),
            "how": "real run"})
    return {"headline": headline, "meta": meta}


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the study; return the rows of peers.csv."""
    parser = argparse.ArgumentParser(prog="python -m experiments.peers", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, nargs="+", default=[2, 4], help="world sizes, one run each (default 2 4)")
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS),
                        metavar="NAME", help="contenders to run (default all): " + ", ".join(CONTENDERS)
                        + "; ddp always runs (the baseline)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per contender (default 20)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first, the last measured (>= 2)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds the timed steps are split into "
                        "(default --steps: one step of each contender per round)")
    parser.add_argument("--layers", type=int, default=Setup.layers)
    parser.add_argument("--hidden", type=int, default=Setup.hidden)
    parser.add_argument("--heads", type=int, default=Setup.heads)
    parser.add_argument("--vocab", type=int, default=Setup.vocab)
    parser.add_argument("--seq", type=int, default=Setup.seq)
    parser.add_argument("--batch", type=int, default=Setup.batch, help="global batch (sequences), split over ranks")
    parser.add_argument("--bucket-numel", type=int, default=None, help="zero-ref's bucket_numel, DDP's bucket and "
                        "DeepSpeed's buckets where set (default 12 * hidden**2: about one block)")
    parser.add_argument("--lr", type=float, default=Setup.lr)
    parser.add_argument("--weight-decay", type=float, default=Setup.weight_decay)
    parser.add_argument("--seed", type=int, default=Setup.seed)
    parser.add_argument("--timeout", type=float, default=600, help="seconds any one call may take before its ranks "
                        "are killed (default 600)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "peers")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = args.steps
    for flag, value, low in (("--steps", args.steps, 1), ("--warmup", args.warmup, 2), ("--rounds", args.rounds, 1),
                             *(("--world-size", w, 1) for w in args.world_size)):
        if value < low:
            parser.error(f"{flag} must be >= {low}, got {value}")
    if args.rounds > args.steps:
        parser.error(f"--rounds {args.rounds} must be <= --steps {args.steps} (each round times at least one step)")
    for world in args.world_size:
        if args.batch % world:
            parser.error(f"--batch {args.batch} must be divisible by every --world-size, not by {world}")
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden} must be divisible by --heads {args.heads}")
    names = ["ddp"] + [n for n in args.contenders if n != "ddp"]
    setup = Setup(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab, seq=args.seq,
                  batch=args.batch, lr=args.lr, weight_decay=args.weight_decay, seed=args.seed,
                  bucket_numel=args.bucket_numel or 12 * args.hidden**2, steps=args.warmup + args.steps)
    psi = sum(p.numel() for p in setup.model().parameters())
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr))
    say(f"peers: tiny_gpt2 {setup.layers}x{setup.hidden}, vocab {setup.vocab}, seq {setup.seq}: Ψ = {psi:,}; global "
        f"batch {setup.batch}; fp32; {args.warmup} warm-up + {args.steps} timed steps in {args.rounds} rounds; "
        f"world {' and '.join(map(str, args.world_size))}")
    for name in names:
        if why := CONTENDERS[name].missing():
            say(f"  {name}: skipped: {why}")

    start, load_before = time.perf_counter(), os.getloadavg()[0]
    rows, step_rows, ddp_repeatable = [], [], True
    total_rounds = len(args.world_size) * len(groups(names)) * args.rounds
    with tqdm(total=total_rounds, desc="rounds", unit="round", disable=args.quiet, dynamic_ncols=True) as progress:
        for world in args.world_size:
            records, steps = run_world(world, names, setup, args, progress)
            ddp_runs = records.pop("_ddp_losses")
            ddp_repeatable &= all(run == ddp_runs[0] for run in ddp_runs)
            rows += summarize(world, records, steps, setup, psi)
            step_rows += steps
    meta = provenance() | {
        "seconds": round(time.perf_counter() - start, 1), "load_average_1min_before_after": [load_before,
                                                                                             os.getloadavg()[0]],
        "versions": versions(), "setup": asdict(setup), "psi": psi, "world_sizes": args.world_size,
        "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds, "ddp_losses_repeatable": ddp_repeatable,
        "loss_tolerance": LOSS_TOLERANCE, "loss_first_steps": FIRST_STEPS, "comm_tolerance": COMM_TOLERANCE,
        "cb_allowance_buckets": CB_ALLOWANCE_BUCKETS,
        "contenders": {n: {"stage": c.stage, "library": c.library, "what": c.what,
                           "settings": resolved_settings(c, setup),
                           **({"deepspeed_config": deepspeed_config(c.stage, resolved_settings(c, setup), setup, w)
                               for w in args.world_size[:1]} if c.library == "deepspeed" else {})}
                       for n, c in CONTENDERS.items() if n in names},
        "goal": "per stage, zero-ref's time no worse than the best peer of that stage in the same run, with exact "
                "2/2/2/3Ψ and the formula's bytes"}
    checks = goal_check(rows, pd.DataFrame(step_rows))
    write_outputs(args.out, rows, step_rows, checks, meta)
    say(f"wrote {args.out}/peers.csv, peers_steps.csv, meta.json, peers.png, REPORT.md ({meta['seconds']:.0f} s)")
    return rows


if __name__ == "__main__":
    main()
