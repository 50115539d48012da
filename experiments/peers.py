"""Peers side by side: DDP, torch's ZeroRedundancyOptimizer, FSDP2, DeepSpeed ZeRO 1-3 and zero-ref
stages 0-3 on one model, one seed and one data stream, each in its own processes.

The question (the peers issue's goal): per stage, is zero-ref's step time no worse than the best
peer of that stage in the same run, with exactly the paper's 2/2/2/3Ψ elements moved per step and
the formula's bytes? Every contender is measured the same way (experiments/peer_systems.py says
how): time relative to DDP, live bytes per parameter beside ``zero_ref.analysis.memory_model``'s
``model_state_bytes(Ψ, stage, Nd, k=8, param_bytes=4, grad_bytes=4)`` (fp32: 16 B/Ψ unsharded),
elements moved per parameter beside 2/2/2/3 (counted below every library, at torch's dispatcher),
and the loss of every step against DDP's (fp32, so the comparison is of the same work: equal to
round-off in the first FIRST_STEPS steps, the later drift reported; LOSS_TOLERANCE says why).

How it runs (experiments/peer_runs.py): one stage at a time, DDP beside that stage's contenders,
each in its own processes (``zero_ref.launch.RankPool``), in ``--blocks`` blocks of freshly started
processes. In each block every contender trains steps 0..n-1 from the initial weights on the same
batches: ``--warmup`` untimed steps (the last one measured: collectives counted, live bytes read),
then its share of the ``--steps`` timed steps, interleaved in rounds (``--rounds`` in all; each
round every contender of the stage, DDP included, runs its share of steps, in an order rotated
every round). The shared 2-core machine varies by about 20% run to run, so a ratio to DDP is the
median over rounds of (this contender's step / DDP's step in the same round), with the
interquartile range of those per-round ratios. zero-ref against the best peer of its stage is
judged block by block (``not_slower``): a process set keeps a speed of its own, which rounds do
not take out.

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
from dataclasses import asdict
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from experiments.bench_scaling import FIRST_STEPS, median_ci
from experiments.peer_report import PAPER_ELEMENTS, render
from experiments.peer_runs import groups, repeatable, run_world
from experiments.peer_systems import CONTENDERS, Setup, block_numel, deepspeed_config, resolved_settings, versions
from experiments.provenance import ROOT, provenance
from zero_ref.analysis.memory_model import model_state_bytes

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


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile); one value is all three."""
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


def paired_ratios(steps: pd.DataFrame, world: int, stage: int, name: str, other: str) -> dict[int, list[float]]:
    """Per block, per round of `stage`'s group at `world`: `name`'s step over `other`'s in the same
    round (medians of each one's steps in that round). Pairing by round takes out the machine's slow
    and fast minutes, which both contenders share; {block: [ratio of each round]}."""
    g = steps[(steps.world_size == world) & (steps.group == stage)]
    if "block" not in g:
        g = g.assign(block=0)
    mine, theirs = (g[g.contender == n].groupby(["block", "round"]).step_s.median() for n in (name, other))
    out: dict[int, list[float]] = {}
    for block, r in mine.index.intersection(theirs.index):
        out.setdefault(int(block), []).append(float(mine[block, r] / theirs[block, r]))
    return out


def not_slower(steps: pd.DataFrame, world: int, stage: int, name: str, other: str) -> dict:
    """Is `name` no slower than `other`? In each block (its own freshly started processes), the
    median of the paired per-round ratios and its distribution-free 95% interval
    (experiments.bench_scaling.median_ci, the regression gate's). A process set keeps a speed of its
    own (experiments/peer_runs.py), so a verdict must hold in every block: `name` is slower only
    when every block's whole interval lies above 1, faster only when every one lies below. Reported:
    the median of all rounds' ratios, the interval from the lowest block's low to the highest
    block's high, and each block's own."""
    by_block = paired_ratios(steps, world, stage, name, other)
    if not by_block:
        return {"median": None, "ci_low": None, "ci_high": None, "rounds": 0, "blocks": [], "ok": None}
    blocks = []
    for block, ratios in sorted(by_block.items()):
        low, high = median_ci(ratios)
        blocks.append({"block": block, "median": statistics.median(ratios), "ci_low": low, "ci_high": high,
                       "rounds": len(ratios)})
    pooled = [ratio for ratios in by_block.values() for ratio in ratios]
    low, high = min(b["ci_low"] for b in blocks), max(b["ci_high"] for b in blocks)
    return {"median": statistics.median(pooled), "ci_low": low, "ci_high": high, "rounds": len(pooled),
            "blocks": blocks, "ok": bool(low <= 1.0)}


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
    render(out)


def run_study(out: Path, quick: bool = False, quiet: bool = False) -> dict:
    """For `zero-ref reproduce`: the default run (quick: world 2, GPT-2 2x64, 4 timed steps, eight
    contenders); peer_report.render gives one headline row per world size and stage."""
    argv = ["--out", str(out)] + (["--quiet"] if quiet else [])
    if not quick:   # every contender at world 2 and 4, 20 timed steps (rounds) each in 2 blocks: 21 minutes on 2 cores
        argv += ["--steps", "20"]
    if quick:   # one peer of each kind beside zero-ref's stages: about 2 minutes on 2 idle cores
        argv += ["--world-size", "2", "--steps", "4", "--layers", "2", "--hidden", "64", "--vocab", "512",
                 "--seq", "32", "--batch", "4", "--contenders", "zero-ref-0", "zero-ref-1", "zero-ref-2", "zero-ref-3",
                 "zero-redundancy-optimizer", "fsdp2-no-reshard", "fsdp2-reshard", "deepspeed-2"]
    main(argv)
    return {"meta": json.loads((out / "meta.json").read_text())}


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
    parser.add_argument("--blocks", type=int, default=2, help="blocks each stage's rounds are split into, each in "
                        "freshly started processes (default 2; the time verdict must hold in every block)")
    parser.add_argument("--layers", type=int, default=Setup.layers)
    parser.add_argument("--hidden", type=int, default=Setup.hidden)
    parser.add_argument("--heads", type=int, default=Setup.heads)
    parser.add_argument("--vocab", type=int, default=Setup.vocab)
    parser.add_argument("--seq", type=int, default=Setup.seq)
    parser.add_argument("--batch", type=int, default=Setup.batch, help="global batch (sequences), split over ranks")
    parser.add_argument("--bucket-numel", type=int, default=None, help="zero-ref's bucket_numel, DDP's bucket and "
                        "DeepSpeed's buckets where set (default one block: 12 hidden**2 + 13 hidden)")
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
                             ("--blocks", args.blocks, 1),
                             *(("--world-size", w, 1) for w in args.world_size)):
        if value < low:
            parser.error(f"{flag} must be >= {low}, got {value}")
    if args.rounds > args.steps:
        parser.error(f"--rounds {args.rounds} must be <= --steps {args.steps} (each round times at least one step)")
    if args.blocks > args.rounds:
        parser.error(f"--blocks {args.blocks} must be <= --rounds {args.rounds} (each block runs at least one round)")
    for world in args.world_size:
        if args.batch % world:
            parser.error(f"--batch {args.batch} must be divisible by every --world-size, not by {world}")
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden} must be divisible by --heads {args.heads}")
    names = ["ddp"] + [n for n in args.contenders if n != "ddp"]
    setup = Setup(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab, seq=args.seq,
                  batch=args.batch, lr=args.lr, weight_decay=args.weight_decay, seed=args.seed,
                  bucket_numel=args.bucket_numel or block_numel(args.hidden),
                  steps=args.warmup + math.ceil(args.steps / args.blocks))
    psi = sum(p.numel() for p in setup.model().parameters())
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr))
    say(f"peers: tiny_gpt2 {setup.layers}x{setup.hidden}, vocab {setup.vocab}, seq {setup.seq}: Ψ = {psi:,}; global "
        f"batch {setup.batch}; fp32; {args.warmup} warm-up + {args.steps} timed steps in {args.rounds} rounds, "
        f"{args.blocks} blocks; "
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
            ddp_repeatable &= repeatable(records.pop("_ddp_losses"))
            rows += summarize(world, records, steps, setup, psi)
            step_rows += steps
    meta = provenance() | {
        "seconds": round(time.perf_counter() - start, 1), "load_average_1min_before_after": [load_before,
                                                                                             os.getloadavg()[0]],
        "versions": versions(), "setup": asdict(setup), "psi": psi, "world_sizes": args.world_size,
        "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds, "blocks": args.blocks,
        "ddp_losses_repeatable": ddp_repeatable,
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
