"""`zero-ref reproduce`: run every study of the paper that exists, write results/ and REPORT.md.

A study is a module under experiments/ (``STUDIES`` names it; experiments/README.md maps each paper
artifact to it) whose ``run_study(out, quick, quiet) -> {"headline": rows, "meta": {...}}`` writes
its CSVs, plots and own REPORT.md under ``results/<study>/`` and returns one row per paper claim it
checks: ``item``, ``paper`` (the paper's value), ``ours``, ``error`` and ``how`` (analysis / engine
at scale / search / real run / performance model). This module runs them (``--jobs N``: the untimed
ones N at a time, each in its own process; the timed ones always alone, afterwards) and has
`experiments.reproduce_report` write ``results/REPORT.md``: a single page that says what is
reproduced and what is not. Later studies plug in by adding an entry to ``STUDIES``.

    python -m experiments.reproduce            # every study
    python -m experiments.reproduce --quick    # fewer cases, traces and real runs; none of FULL_ONLY
    python -m experiments.reproduce --only throughput    # one study
    python -m experiments.reproduce --jobs 2   # the untimed studies two at a time

How long a run takes is recorded where it ran, never copied here: ``seconds`` in results/meta.json
(the whole run, with the studies it ran) and in each results/<study>/headline.json (that study).
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from tqdm import tqdm

from experiments.provenance import ROOT, provenance
from experiments.reproduce_report import write_report

STUDIES = {
    "memory": ("Memory and model size: Table 1, Figure 1, Table 2, Sec 10.4 (Fig 4's sizes)", "experiments.memory_study"),
    "activations": ("Activation memory: Sec 3.2, 4.2.1 and 6.1's numbers beside the analysis, every mismatch",
                    "experiments.activation_study"),
    "comm_volume": ("Elements moved per step by stage and world size (Sec 7), counted by wrapping "
                    "torch.distributed's collectives in real gloo runs", "experiments.comm_volume_study"),
    "walkthrough": ("The walkthrough's timelines: one traced step per stage (gathers, reductions, frees, bytes "
                    "alive) beside the formulas; docs/", "experiments.timeline_report"),
    "convergence": ("Convergence on real text: stages 0-3 against DDP on the Python standard library's source, "
                    "fp32 and bf16, with parameter groups and a warmup + cosine schedule", "experiments.convergence"),
    "zero_r": ("ZeRO-R: partitioned activation checkpoints (Pa, Pa+cpu), Sec 6.1 and Sec 8", "experiments.zero_r_study"),
    "fragmentation": ("Fragmentation measured (MD): Table 2, Fig 4 and Fig 6 searched again, Fig 7",
                      "experiments.fragmentation_study"),
    "throughput": ("Throughput: the performance model checked on timed runs, superlinear scaling at our scale, "
                   "Figs 2, 3, 4, 8 projected to the paper's V100s", "experiments.throughput_report"),
    "bench_step": ("Step time of every stage against DDP (project targets; the elements each stage moves are "
                   "counted in comm_volume)", "experiments.bench_step"),
    "kernels": ("Fused optimizer-step kernels (Triton rows need CUDA)", "experiments.bench_kernels"),
    "benchmarks": ("The scaling regression suite: every stage against DDP at Nd 1, 2, 4 for three GPT-2 sizes, "
                   "gated against the committed baseline", "experiments.bench"),
    "scaling_curves": ("Scaling curves: bytes and elements per rank against Nd (1-1024) and Ψ beside the paper's "
                       "formulas, step time against Nd", "experiments.scaling_curves"),
    "peers": ("Peers side by side: DDP, ZeroRedundancyOptimizer, FSDP2, DeepSpeed ZeRO 1-3 and zero-ref 0-3 on one "
              "model, seed and data stream", "experiments.peers"),
    "gpu": ("GPU checks as recorded on a lent CUDA machine (experiments/gpu_check.sh; summarised here, run there)",
            "experiments.gpu_report"),
}
"""study folder -> (what it reproduces, the module whose ``run_study`` runs it; imported only when it runs)."""
FULL_ONLY = {"bench_step", "kernels", "throughput", "benchmarks", "peers"}
"""Benchmarks that take minutes: skipped by --quick."""


TIMED = FULL_ONLY | {"scaling_curves", "walkthrough"}
"""Studies whose results include wall-clock times (or, for the walkthrough, what overlaps what):
they run one at a time with nothing beside them, after the others, whatever ``--jobs`` says."""


def _run_study(folder: str, out: Path, quick: bool, quiet: bool) -> dict:
    """Run one study into ``out/folder`` and save its headline rows with their provenance and time."""
    start = time.perf_counter()
    result = importlib.import_module(STUDIES[folder][1]).run_study(out / folder, quick, quiet)
    record = {"headline": result["headline"], "seconds": round(time.perf_counter() - start, 1), **provenance()}
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
    parser.add_argument("--quick", action="store_true", help="the short version: fewer cases, traces and real runs, "
                        f"and none of {', '.join(sorted(FULL_ONLY))}")
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
