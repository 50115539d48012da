"""`zero-ref reproduce`: run every study of the paper that exists, write results/ and REPORT.md.

Each study is a function ``run(out, quick, quiet) -> {"headline": rows, "meta": {...}}``
that writes its CSVs, plots and own REPORT.md under ``results/<study>/`` and returns one row per
paper claim it checks: ``item``, ``paper`` (the paper's value), ``ours``, ``error`` and ``how``
(analysis / engine at scale / search / real run). This module runs them in turn and writes
``results/REPORT.md``: a single page, every paper table and figure with the paper's value, ours,
and how ours was obtained. Later studies plug in by adding an entry to ``STUDIES``.

    python -m experiments.reproduce            # the default: about 100 minutes on 2 CPU cores
    python -m experiments.reproduce --quick    # about 5 minutes: fewer cases, traces and real runs, no benchmarks, no peers
                                               # and no throughput study
    python -m experiments.reproduce --only throughput    # one study (about 12 minutes)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from experiments.provenance import ROOT, provenance


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
                 "ours": f"{float(r['gbps']):.1f} GB/s", "error": f"{float(r['frac_copy_bw']):.2f} of copy bandwidth",
                 "how": "real run"} for r in rows if r["op"] == "adamw_step"]
    return {"headline": headline, "meta": {}}


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


def _scaling_curves(out: Path, quick: bool, quiet: bool) -> dict:
    from experiments.scaling_curves import NDS, run

    if quick:   # GPT-2 S only, four Nd: seconds
        return run(out, None, quiet, models=("S",), nds=(1, 4, 64, 1024))
    return run(out, None, quiet, nds=NDS)


STUDIES = {
    "memory": ("Memory and model size: Table 1, Figure 1, Table 2, Sec 10.4 (Fig 4's sizes)", _memory),
    "zero_r": ("ZeRO-R: partitioned activation checkpoints (Pa, Pa+cpu), Sec 6.1 and Sec 8", _zero_r),
    "fragmentation": ("Fragmentation measured (MD): Table 2, Fig 4 and Fig 6 searched again, Fig 7", _fragmentation),
    "throughput": ("Throughput: the performance model checked on timed runs, superlinear scaling at our scale, "
                   "Figs 2, 3, 4, 8 projected to the paper's V100s", _throughput),
    "bench_step": ("Step time of every stage against DDP (project targets; the paper's 2Ψ/3Ψ volumes are in "
                   "comm_stats)", _step_time),
    "kernels": ("Fused optimizer-step kernels (Triton rows need CUDA)", _kernels),
    "benchmarks": ("The scaling regression suite: every stage against DDP at Nd 1, 2, 4 for three GPT-2 sizes, "
                   "gated against the committed baseline", _benchmarks),
    "scaling_curves": ("Scaling curves: bytes and elements per rank against Nd (1-1024) and Ψ beside the paper's "
                       "formulas, step time against Nd", _scaling_curves),
    "peers": ("Peers side by side: DDP, ZeroRedundancyOptimizer, FSDP2, DeepSpeed ZeRO 1-3 and zero-ref 0-3 on one "
              "model, seed and data stream", _peers),
}
"""study folder -> (what it reproduces, its runner)."""
FULL_ONLY = {"bench_step", "kernels", "throughput", "benchmarks", "peers"}
"""Benchmarks that take minutes: skipped by --quick."""


def _cell(value) -> str:
    return str(value).replace("|", "/")


def write_report(out: Path, sections: list[tuple[str, str, dict]], meta: dict) -> Path:
    """results/REPORT.md: one table per study, one row per paper claim."""
    hw = meta["hardware"]
    lines = ["# zero-ref: the ZeRO paper reproduced", "",
             f"Generated by `{meta['command']}` (quick={meta['quick']}) at git `{meta['git_revision']}` on "
             f"{meta['date_utc']}, in {meta['seconds']:.0f} s on {hw['cores']} cores ({hw['cpu']}), "
             f"{hw.get('memory_gb')} GB, torch {hw['torch']}{', GPU ' + hw['gpu'] if 'gpu' in hw else ', no GPU'}.", "",
             "The paper (Rajbhandari et al., ZeRO, SC20) ran on up to 400 V100s; this machine has none. Every "
             "number below is obtained one of these ways: **analysis** (the paper's formulas, "
             "`zero_ref.memory_model`), **engine at scale** (our real `initialize()` for the paper's shapes on "
             "meta tensors as one rank of a fake process group of Nd ranks, bytes read from the engine and from "
             "torch's MemTracker), **search** (the largest model that fits, from the per-GPU accounting with "
             "the stated allowances), **real run** (gloo ranks on this CPU). Each study's own REPORT.md gives "
             "every cell, the assumptions and the allowances.", ""]
    for folder, title, result in sections:
        earlier = result.get("earlier")
        note = (f" From an earlier run (`{earlier['command']}` at git `{earlier['git_revision']}` on "
                f"{earlier['date_utc']}), not rerun this time." if earlier else "")
        lines += [f"## {title}", "", f"Details: [{folder}/REPORT.md]({folder}/REPORT.md).{note}", "",
                  "| paper table / figure | paper | ours | error | how ours was obtained |", "|---|---|---|---|---|"]
        for row in result["headline"]:
            lines.append("| " + " | ".join(_cell(row[k]) for k in ("item", "paper", "ours", "error", "how")) + " |")
        lines.append("")
    path = out / "REPORT.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> dict:
    """Run every study (``--quick``: the short version) and write ``--out``/REPORT.md."""
    parser = argparse.ArgumentParser(prog="zero-ref reproduce", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the short version (about 5 minutes on 2 cores)")
    parser.add_argument("--out", type=Path, default=ROOT / "results", help="results folder (default: results/)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--only", choices=sorted(STUDIES), nargs="+", help="run only these studies (the others keep their last headline rows in REPORT.md, marked as such)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    sections = []
    names = args.only or [name for name in STUDIES if not (args.quick and name in FULL_ONLY)]
    ran = {}
    for folder in tqdm(names, desc="studies", disable=args.quiet, file=sys.stderr):
        title, runner = STUDIES[folder]
        ran[folder] = runner(args.out / folder, args.quick, args.quiet)
        record = {"headline": ran[folder]["headline"], **provenance()}
        (args.out / folder / "headline.json").write_text(json.dumps(record, indent=1) + "\n")
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
