"""`zero-ref reproduce`: run every study of the paper that exists, write results/ and REPORT.md.

Each study is a function ``run(out, quick, quiet) -> {"headline": rows, "meta": {...}}``
that writes its CSVs, plots and own REPORT.md under ``results/<study>/`` and returns one row per
paper claim it checks: ``item``, ``paper`` (the paper's value), ``ours``, ``error`` and ``how``
(analysis / engine at scale / search / real run / performance model). This module runs them
(``--jobs N``: the untimed ones N at a time, each in its own process; the timed ones always alone,
afterwards) and has `experiments.reproduce_report` write ``results/REPORT.md``: a single page that
says what is reproduced and what is not. Later studies plug in by adding an entry to ``STUDIES``.

    python -m experiments.reproduce            # the default: about 100 minutes on 2 CPU cores
    python -m experiments.reproduce --quick    # about 5 minutes: fewer cases, traces and real runs, no benchmarks, no peers
                                               # and no throughput study
    python -m experiments.reproduce --only throughput    # one study (about 12 minutes)
    python -m experiments.reproduce --jobs 2   # the untimed studies two at a time
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from tqdm import tqdm

from experiments.provenance import ROOT, provenance
from experiments.reproduce_report import NOT_AN_ERROR, write_report


def _memory(out: Path, quick: bool, quiet: bool) -> dict:
    from experiments.memory_study import run_study

    return run_study(out, quick, quiet)


def _step_time(out: Path, quick: bool, quiet: bool) -> dict:
    """bench_step.py in fp32 and bf16: every stage's step time against DDP on this machine."""
    from experiments.bench_step import main as bench

    headline = []
    # bf16 also times stages 2 and 3 with reduce_dtype="fp32" (the cost of fp32 reductions); fewer
    # steps, since bf16 matmuls are slow on CPUs without native bf16 (about 11 s a step without AVX-512)
    runs = (("fp32", out, []), ("bf16", out / "bf16", ["--steps", "12", "--warmup", "2", "--fp32-reduce-stages", "2", "3"]))
    for dtype, folder, extra in runs:
        rows = bench(["--dtype", dtype, "--out", str(folder), *extra])
        ddp = next(r for r in rows if r["system"] == "ddp")
        for r in rows:
            if r["system"] == "ddp":
                continue
            if r["system"].endswith("-r32"):
                headline.append({
                    "item": f"step time, stage {int(r['stage'])} with reduce_dtype='fp32', bf16, world 2",
                    "paper": "(not in the paper)", "ours": f"{r['ratio_to_same_stage']:.3f}x the bf16 reduction",
                    "error": "cost measured, no goal", "how": "real run"})
                continue
            headline.append({
                "item": f"step time, stage {int(r['stage'])} vs DDP + AdamW(foreach), {dtype}, world 2",
                "paper": "2Ψ comm. for stages 0-2, 3Ψ for stage 3 (no step time given)",
                "ours": f"{r['ratio_to_ddp']:.3f}x DDP ({r['median_s'] * 1e3:.0f} vs {ddp['median_s'] * 1e3:.0f} ms)",
                "error": f"project goal <= {r['goal']:.2f}x: {r['pass']}", "how": "real run"})
    return {"headline": headline, "meta": {}}


def _kernels(out: Path, quick: bool, quiet: bool) -> dict:
    """bench_kernels.py: the optimizer-step kernels against torch's AdamW and the copy bandwidth."""
    import csv

    from experiments.bench_kernels import main as bench

    bench(["--out", str(out), "--threads", "1"])
    with open(out / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    headline = [{"item": f"{r['op']} {r['backend']}, {int(r['size']):,} elements ({r['device']})",
                 "paper": "memory-bound: time set by bytes moved (Sec 3)",
                 "ours": f"{float(r['gbps']):.1f} GB/s = {float(r['frac_copy_bw']):.2f} of copy bandwidth",
                 "error": NOT_AN_ERROR, "how": "real run"} for r in rows if r["op"] == "adamw_step"]
    return {"headline": headline, "meta": {}}


def _activations(out: Path, quick: bool, quiet: bool) -> dict:
    from experiments.activation_study import run_study

    return run_study(out, quick, quiet)


def _comm_volume(out: Path, quick: bool, quiet: bool) -> dict:
    from experiments.comm_volume_study import run_study

    return run_study(out, quick, quiet)


def _walkthrough(out: Path, quick: bool, quiet: bool) -> dict:
    from experiments.timeline_report import run_study

    return run_study(out, quick, quiet)


def _convergence(out: Path, quick: bool, quiet: bool) -> dict:
    from experiments.convergence import run_study

    return run_study(out, quick, quiet)


def _zero_r(out: Path, quick: bool, quiet: bool) -> dict:
    from experiments.zero_r_study import run_study

    return run_study(out, quick, quiet)


def _fragmentation(out: Path, quick: bool, quiet: bool) -> dict:
    from experiments.fragmentation_study import run_study

    return run_study(out, quick, quiet)


def _throughput(out: Path, quick: bool, quiet: bool) -> dict:
    from experiments.throughput_report import run_study

    return run_study(out, quick, quiet)


def _benchmarks(out: Path, quick: bool, quiet: bool) -> dict:
    from experiments.bench import run_study

    return run_study(out, quick, quiet)


def _peers(out: Path, quick: bool, quiet: bool) -> dict:
    from experiments.peers import run_study

    return run_study(out, quick, quiet)


def _gpu(out: Path, quick: bool, quiet: bool) -> dict:
    from experiments.gpu_report import run_study

    return run_study(out, quick, quiet)


def _scaling_curves(out: Path, quick: bool, quiet: bool) -> dict:
    from experiments.scaling_curves import NDS, run

    if quick:   # GPT-2 S only, four Nd: seconds
        return run(out, None, quiet, models=("S",), nds=(1, 4, 64, 1024))
    return run(out, None, quiet, nds=NDS)


STUDIES = {
    "memory": ("Memory and model size: Table 1, Figure 1, Table 2, Sec 10.4 (Fig 4's sizes)", _memory),
    "activations": ("Activation memory: Sec 3.2, 4.2.1 and 6.1's numbers beside the analysis, every mismatch",
                    _activations),
    "comm_volume": ("Elements moved per step by stage and world size (Sec 7), counted by wrapping "
                    "torch.distributed's collectives in real gloo runs", _comm_volume),
    "walkthrough": ("The walkthrough's timelines: one traced step per stage (gathers, reductions, frees, bytes "
                    "alive) beside the formulas; docs/", _walkthrough),
    "convergence": ("Convergence on real text: stages 0-3 against DDP on the Python standard library's source, "
                    "fp32 and bf16, with parameter groups and a warmup + cosine schedule", _convergence),
    "zero_r": ("ZeRO-R: partitioned activation checkpoints (Pa, Pa+cpu), Sec 6.1 and Sec 8", _zero_r),
    "fragmentation": ("Fragmentation measured (MD): Table 2, Fig 4 and Fig 6 searched again, Fig 7", _fragmentation),
    "throughput": ("Throughput: the performance model checked on timed runs, superlinear scaling at our scale, "
                   "Figs 2, 3, 4, 8 projected to the paper's V100s", _throughput),
    "bench_step": ("Step time of every stage against DDP (project targets; the elements each stage moves are "
                   "counted in comm_volume)", _step_time),
    "kernels": ("Fused optimizer-step kernels (Triton rows need CUDA)", _kernels),
    "benchmarks": ("The scaling regression suite: every stage against DDP at Nd 1, 2, 4 for three GPT-2 sizes, "
                   "gated against the committed baseline", _benchmarks),
    "scaling_curves": ("Scaling curves: bytes and elements per rank against Nd (1-1024) and Ψ beside the paper's "
                       "formulas, step time against Nd", _scaling_curves),
    "peers": ("Peers side by side: DDP, ZeroRedundancyOptimizer, FSDP2, DeepSpeed ZeRO 1-3 and zero-ref 0-3 on one "
              "model, seed and data stream", _peers),
    "gpu": ("GPU checks as recorded on a lent CUDA machine (experiments/gpu_check.sh; summarised here, run there)",
            _gpu),
}
"""study folder -> (what it reproduces, its runner)."""
FULL_ONLY = {"bench_step", "kernels", "throughput", "benchmarks", "peers"}
"""Benchmarks that take minutes: skipped by --quick."""


TIMED = FULL_ONLY | {"scaling_curves", "walkthrough"}
"""Studies whose results include wall-clock times (or, for the walkthrough, what overlaps what):
they run one at a time with nothing beside them, after the others, whatever ``--jobs`` says."""


def _run_study(folder: str, out: Path, quick: bool, quiet: bool) -> dict:
    """Run one study into ``out/folder`` and save its headline rows with their provenance."""
    result = STUDIES[folder][1](out / folder, quick, quiet)
    record = {"headline": result["headline"], **provenance()}
    (out / folder / "headline.json").write_text(json.dumps(record, indent=1) + "\n")
    return result


def run_studies(names: list[str], out: Path, quick: bool, quiet: bool, jobs: int = 1) -> dict[str, dict]:
    """Run the named studies; the untimed ones `jobs` at a time in their own processes (their bars
    silenced), then the timed ones here, one by one. The first failure stops what has not started
    and is raised once the running studies have finished (their results are kept)."""
    untimed = [name for name in names if name not in TIMED] if jobs > 1 else []
    ran: dict[str, dict] = {}
    bar = tqdm(total=len(names), desc="studies", disable=quiet, file=sys.stderr)
    if untimed:
        failure = None
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(min(jobs, len(untimed)), mp_context=context) as pool:
            futures = {pool.submit(_run_study, name, out, quick, True): name for name in untimed}
            for future in as_completed(futures):
                if future.cancelled():
                    continue
                if future.exception() is not None:
                    failure = failure or (futures[future], future.exception())
                    for other in futures:   # what has not started; the running ones finish
                        other.cancel()
                    continue
                ran[futures[future]] = future.result()
                bar.update()
        if failure:
            raise RuntimeError(f"study {failure[0]} failed (finished: {', '.join(ran) or 'none'})") from failure[1]
    for name in names:
        if name not in ran:
            ran[name] = _run_study(name, out, quick, quiet)
            bar.update()
    bar.close()
    return ran


def main(argv: list[str] | None = None) -> dict:
    """Run every study (``--quick``: the short version) and write ``--out``/REPORT.md."""
    parser = argparse.ArgumentParser(prog="zero-ref reproduce", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the short version (about 5 minutes on 2 cores)")
    parser.add_argument("--out", type=Path, default=ROOT / "results", help="results folder (default: results/)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--only", choices=sorted(STUDIES), nargs="+", help="run only these studies (the others keep their last headline rows in REPORT.md, marked as such)")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="run the untimed studies N at a time, each in its own process (default 1; the timed "
                             f"studies, {', '.join(sorted(TIMED))}, always run alone)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    start = time.perf_counter()
    sections = []
    names = args.only or [name for name in STUDIES if not (args.quick and name in FULL_ONLY)]
    ran = run_studies(names, args.out, args.quick, args.quiet, args.jobs)
    for folder, (title, _) in STUDIES.items():   # studies not run now keep their last headline rows
        saved = args.out / folder / "headline.json"
        if folder in ran:
            sections.append((folder, title, ran[folder]))
        elif saved.exists():
            record = json.loads(saved.read_text())
            sections.append((folder, title, {"headline": record["headline"], "earlier": record}))
    meta = provenance() | {"quick": args.quick, "seconds": round(time.perf_counter() - start, 1), "studies": names}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    path = write_report(args.out, sections, meta)
    print(f"wrote {path} ({meta['seconds']:.0f} s)")
    return {"report": path, "sections": sections, "meta": meta}


if __name__ == "__main__":
    main()
