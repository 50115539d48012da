"""Throughput at our own scale: the performance model checked against timed runs, and superlinear
scaling reproduced by the mechanism the paper names (Sec 10.3), measured.

1. **Calibration** (experiments/calibrate.py): block/head FLOP rates on a (tokens, hidden) grid,
   the AdamW rate and the engine's collectives, measured on this machine now: each world size just
   before and again just after the runs at that size, the two averaged (the machine is shared, and
   its speed drifts by tens of percent over minutes: measured 0.485 s and 0.363 s for the same run
   90 minutes apart; ``drift`` in validation.csv says how far the two calibrations lie apart).
2. **Validation**: timed runs (experiments/throughput.py) of a held-out model (its width and batch
   lie between the calibration grid's points) at world 1-4 and stages 0-3, plus one
   model-parallel run (MP 2, Pa); each phase (forward, backward, step) and the whole step
   predicted by zero_ref.analysis.perf_model from the calibration and the run's own collective counts.
   Goal: every prediction within 15% of the measured median.
3. **Superlinear scaling at our scale**: a fixed model (stage 2, Pos+g) and a fixed per-rank
   memory budget, the engine's own allocation trace of a steady-state step as the accounting (the
   budget lets batch 2 fit on one rank; the first step's higher peak is reported beside it). For
   Nd = 1, 2, 4 the largest batch that fits is found by search; it grows with Nd because Pos+g's
   per-rank states shrink. Each Nd is timed at that batch and at Nd=1's batch, so the gain from
   the batch is measured apart from the gain from more ranks.

4. **The paper's figures** (experiments/paper_projection.py): Figures 2, 3, 4, 8 projected to the
   paper's V100s by the same model.

    python -m experiments.throughput_study [--quick] [--out results/throughput]

Outputs in results/throughput/: calibration_*.csv, validation.csv, superlinear.csv,
paper_projection.csv, fig3_mechanism.csv and meta.json; experiments/throughput_report.py (the
report step) draws the plots and REPORT.md from them and keeps every run in history/.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd

from experiments import calibrate, paper_projection
from experiments.batch_search import max_batch, step_peak_bytes
from experiments.provenance import ROOT, provenance
from experiments.run_spec import RunSpec
from experiments.throughput import main as throughput_main
from zero_ref.analysis import perf_model as pm

VOCAB = 4096
HELD_OUT = RunSpec(layers=6, hidden=320, heads=10, seq=calibrate.SEQ, vocab=VOCAB, batch=3, steps=12, warmup=3,
                   profile_steps=1, threads=1)
"""The validation model: hidden 320 and 3 x 128 tokens lie between calibration points."""
SUPERLINEAR = RunSpec(layers=4, hidden=256, heads=4, seq=calibrate.SEQ, vocab=VOCAB, stage=2, steps=12, warmup=3,
                      profile_steps=1, threads=1)
"""The superlinear study's fixed model (Pos+g, fp32)."""


def _argv(spec: RunSpec, world: int, out: str) -> list[str]:
    argv = ["--world-size", str(world), "--out", out]
    for name, value in spec.__dict__.items():
        if isinstance(value, bool):
            argv += [f"--{name.replace('_', '-')}"] if value else []
        else:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def timed(spec: RunSpec, world: int, out: str) -> dict:
    """One timed run through the command line's own path (spawned gloo ranks)."""
    return throughput_main(_argv(spec, world, out))


def predicted(row: dict, cal: dict, one_core_per_rank: bool = False, smooth: bool = True) -> pm.Prediction:
    """The model's step for a timed run's row: its shape and world, its own collective counts
    (``one_core_per_rank``: as if every rank had its cores to itself; ``smooth``: see
    calibrate.cpu_cluster)."""
    spec = RunSpec(**{k: type(getattr(RunSpec, k))(row[k]) if not isinstance(getattr(RunSpec, k), bool)
                      else str(row[k]) == "True" for k in RunSpec.__dataclass_fields__})
    nd = int(row["nd"])
    moved = {k: float(row.get(f"ledger_{k}") or 0) for k in ("all_reduce", "reduce_scatter", "all_gather",
                                                               "broadcast")}
    calls = {k: float(row.get(f"calls_{k}") or 0) for k in moved}
    if spec.mp > 1:       # below the engine the MP group's all-reduces are counted too: the model's
        model_calls = (sum(pm.mp_all_reduce_calls(spec.layers, spec.checkpoints != "none")) + pm.MP_LOSS_CALLS
                       + pm.MP_STEP_STATS_CALLS)   # and the vote's sum over the MP group
        calls["all_reduce"] = max(1.0, calls["all_reduce"] - model_calls)
    step = pm.StepSpec(spec.layers, spec.hidden, spec.seq, spec.vocab, spec.batch, nd, spec.mp, spec.stage,
                       spec.checkpoints, 4, {k: v for k, v in moved.items() if v}, calls,
                       pm.optimizer_elements(int(row["local_params"]), spec.stage, nd))
    return pm.predict(step, calibrate.cpu_cluster(cal, int(row["world_size"]), alone=one_core_per_rank,
                                                  smooth=smooth))


def calibrated_around(cal: dict, world: int, quick: bool, timed_runs) -> tuple[dict, list]:
    """Calibrate ``world`` ranks before and after ``timed_runs()`` (which times runs there and returns
    them); the calibration merged into ``cal`` is the two's average (``calibrate.average``: this
    machine is shared and drifts while the runs take their turn; ``drift`` says how far)."""
    before = calibrate.calibrate(VOCAB, quick, worlds=(world,))
    runs = timed_runs()
    after = calibrate.calibrate(VOCAB, quick, worlds=(world,))
    return calibrate.merge(cal, calibrate.average(before, after)), runs


def validation_runs(out: str, quick: bool, world: int) -> list[dict]:
    """The held-out model's timed runs at ``world`` ranks, every stage (at 2, also MP 2 with Pa)."""
    specs = [replace(HELD_OUT, stage=s) for s in ((0, 3) if quick else (0, 1, 2, 3))]
    if world == 2:
        specs.append(replace(HELD_OUT, stage=1, mp=2, checkpoints="pa"))
    return [timed(spec, world, out) for spec in specs]


def validation(cal: dict, runs: list[dict]) -> pd.DataFrame:
    """Predicted vs measured per phase (and the whole step) for timed runs."""
    rows = []
    for row in runs:
        p, world = predicted(row, cal), int(row["world_size"])
        phases = p.phases()
        for phase in ("forward", "backward", "step", "total"):
            measured = float(row["median_step_s"] if phase == "total" else row[f"{phase}_s"])
            model = p.seconds if phase == "total" else phases[phase]
            rows.append({"world": world, "stage": int(row["stage"]), "mp": int(row["mp"]),
                         "checkpoints": row["checkpoints"], "batch": int(row["batch"]), "phase": phase,
                         "measured_s": measured, "predicted_s": model, "ratio": model / measured,
                         "spread": float(row["spread"]), "drift": cal.get("drift", {}).get(world, float("nan"))})
    return pd.DataFrame(rows)


def superlinear(cal: dict, out: str, quick: bool) -> pd.DataFrame:
    """Nd = 1, 2, 4 (quick: 1, 2) under one per-rank budget: the batch that fits, timed at that batch
    and at Nd=1's, with the model's prediction beside each (and with one core per rank); each Nd
    calibrated again around its runs."""
    base = SUPERLINEAR
    budget = step_peak_bytes(base, 1, 2) * 1.02
    fits = {nd: max_batch(base, nd, budget) for nd in ((1, 2) if quick else (1, 2, 4))}
    first_step = {nd: step_peak_bytes(base, nd, b, steady=False) for nd, b in fits.items()}
    rows = []
    for nd, batch in fits.items():
        cases = [("batch that fits", batch)] + ([("Nd=1's batch", fits[1])] if nd > 1 else [])
        cal, runs = calibrated_around(cal, nd, quick,
                                      lambda: [timed(replace(base, batch=b), nd, out) for _, b in cases])
        for (label, b), row in zip(cases, runs):
            model, one_core = predicted(row, cal), predicted(row, cal, one_core_per_rank=True)
            rows.append({"nd": nd, "case": label, "batch": b, "budget_mb": budget / 1e6,
                         "first_step_peak_mb": first_step[nd] / 1e6 if b == batch else float("nan"),
                         "peak_mb": float(row["peak_gb"]) * 1e3,
                         "measured_first_step_peak_mb": float(row["first_step_peak_gb"]) * 1e3,
                         "step_s": float(row["median_step_s"]),
                         "samples_per_s": float(row["samples_per_s"]),
                         "samples_per_s_per_rank": float(row["samples_per_s"]) / nd,
                         "tflops_per_rank": float(row["tflops_per_rank"]),
                         "forward_s": float(row["forward_s"]), "backward_s": float(row["backward_s"]),
                         "step_phase_s": float(row["step_s"]),
                         "fixed_s": model.terms["optimizer"] + model.terms["dp_step"] + model.terms["dp_backward"],
                         "predicted_step_s": model.seconds,
                         "predicted_samples_per_s_one_core_per_rank": b * nd / one_core.seconds})
    frame = pd.DataFrame(rows)
    grown = frame[frame.case == "batch that fits"].set_index("nd")
    one = grown.loc[1, "samples_per_s"]
    frame["speedup_vs_nd1"] = frame.samples_per_s / one
    frame["predicted_speedup_one_core_per_rank"] = (frame.predicted_samples_per_s_one_core_per_rank
                                                    / grown.loc[1, "predicted_samples_per_s_one_core_per_rank"])
    return frame


def calibration_frames(cal: dict) -> tuple[pd.DataFrame, pd.DataFrame]:
    rates = [{"world": w, "tokens": tok, "hidden": h} | {f"{name}_gflops": points[(tok, h)] / 1e9
                                                         for name, points in by_name.items()}
             | {"step_melem_per_s": cal["adamw"][w] / 1e6}
             | dict(zip(("stage3_own_forward_ns", "stage3_own_backward_ns", "stage3_copy_ns"),
                        (1e9 * v for v in cal.get("stage3_own", {}).get(w, (float("nan"),) * 3))))
             for w, by_name in cal["rates"].items() for tok, h in by_name["block_forward"]]
    links = pd.DataFrame(cal["link_rows"])
    links["fitted_s"] = [pm.collective_seconds(r.kind, r.moved, 4, r.world, cal["links"][(r.world, r.kind)])
                         for r in links.itertuples()]
    links["bandwidth_mb_s"] = [cal["links"][(r.world, r.kind)].bandwidth / 1e6 for r in links.itertuples()]
    links["latency_us"] = [cal["links"][(r.world, r.kind)].latency * 1e6 for r in links.itertuples()]
    return pd.DataFrame(rates), links


def run(out, quick: bool = False) -> dict:
    """Calibrate, validate, measure superlinear scaling; write the CSVs; return the calibration and
    the validation and superlinear frames."""
    out.mkdir(parents=True, exist_ok=True)
    runs = str(out / "runs")
    cal, checks = {}, []
    for world in (1, 2) if quick else (1, 2, 3, 4):     # each world size calibrated around its runs
        cal, timed_rows = calibrated_around(cal, world, quick, lambda: validation_runs(runs, quick, world))
        checks.append(validation(cal, timed_rows))
    rates, links = calibration_frames(cal)
    rates.to_csv(out / "calibration_rates.csv", index=False)
    links.to_csv(out / "calibration_links.csv", index=False)
    checks = pd.concat(checks, ignore_index=True)
    checks.to_csv(out / "validation.csv", index=False)
    scaling = superlinear(cal, runs, quick)
    scaling.to_csv(out / "superlinear.csv", index=False)
    return {"calibration": cal, "validation": checks, "superlinear": scaling}


def run_study(out: Path, quick: bool = False, quiet: bool = False) -> dict:
    """The reproduce entry: ``run``, then the paper's figures projected (paper_projection), every
    table and meta.json in ``out``; throughput_report.render draws them and gives the headline rows."""
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    fragmentation = paper_projection.measured_fragmentation(out.parent)
    study = run(out, quick)
    frame = paper_projection.projections(fragmentation, trace_memory=not quick, quiet=quiet)
    frame.to_csv(out / "paper_projection.csv", index=False)
    paper_projection.superlinear_mechanism(frame).to_csv(out / "fig3_mechanism.csv", index=False)
    meta = provenance() | {"quick": quick, "seconds": round(time.perf_counter() - start, 1), "vocab": VOCAB,
                           "fragmentation": fragmentation,
                           "calibration_seconds": round(study["calibration"]["seconds"], 1)}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return {"meta": meta}


def main(argv: list[str] | None = None) -> dict:
    from experiments.throughput_report import render

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "throughput")
    args = parser.parse_args(argv)
    return run_study(args.out, args.quick) | {"headline": render(args.out)}


if __name__ == "__main__":
    main()
