"""The studies `zero-ref reproduce` runs: each paper artifact's module, and which ones are timed.

A study is a module under experiments/ (experiments/README.md maps each paper artifact to it) whose
``run_study(out, quick, quiet) -> {"headline": rows, "meta": {...}}`` writes its CSVs, plots and own
REPORT.md under ``results/<study>/`` and returns one row per paper claim it checks: ``item``,
``paper`` (the paper's value), ``ours``, ``error`` and ``how``. Later studies plug in by adding an
entry to ``STUDIES``.
"""

from __future__ import annotations

import json
from pathlib import Path

from experiments.study_key import changes, environment, study_key

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
    "memory_gap": ("What the paper's largest models held beyond our accounting, at the measured fragmentation: "
                   "the gap per point, a recomputed layer measured, the rest unexplained", "experiments.memory_gap"),
    "throughput": ("Throughput: the performance model checked on timed runs, superlinear scaling at our scale, "
                   "Figs 2, 3, 4, 8 projected to the paper's V100s", "experiments.throughput_study"),
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


REPORTS = {
    "convergence": "experiments.convergence_report",
    "fragmentation": "experiments.fragmentation_report",
    "throughput": "experiments.throughput_report",
    "bench_step": "experiments.bench_step_report",
    "kernels": "experiments.kernels_report",
    "peers": "experiments.peer_report",
    "benchmarks": "experiments.bench_report",
    "scaling_curves": "experiments.scaling_curves_report",
}
"""study -> its report step: a module whose ``render(out) -> headline rows`` draws the plots and
writes REPORT.md from the tables a run left in ``out`` (and keeps that run in ``out/history/``,
`experiments.run_history`). Its files form the key's "report" part, apart from what the study
measures: a change there redraws the study from its tables instead of measuring it again."""

TIMED = FULL_ONLY | {"scaling_curves", "walkthrough"}
"""Studies whose results include wall-clock times (or, for the walkthrough, what overlaps what):
they run one at a time with nothing beside them, after the others, whatever ``--jobs`` says."""


def current_keys(out: Path, quick: bool | None = None) -> dict[str, dict]:
    """Every study's key now (`experiments.study_key`), with ``quick`` or, when None, with the
    arguments its stored results were made with."""
    env, timed_env, keys = environment(), environment(timed=True), {}
    for name, (_, module) in STUDIES.items():
        if quick is None:
            saved = out / name / "headline.json"
            stored = (json.loads(saved.read_text()).get("key") or {}) if saved.exists() else {}
            as_run = stored.get("args", {}).get("quick", False)
        keys[name] = study_key(name, module, as_run if quick is None else quick, out,
                               timed_env if name in TIMED else env, REPORTS.get(name))
    return keys


def report_sections(out: Path, keys: dict[str, dict]) -> list[tuple[str, str, dict]]:
    """(study, title, its headline.json with "stale": what changed in its code, arguments or inputs)
    for every study with results in ``out``, in ``STUDIES`` order: what REPORT.md is written from."""
    sections = []
    for folder, (title, _) in STUDIES.items():
        saved = out / folder / "headline.json"
        if saved.exists():
            record = json.loads(saved.read_text())
            stale = changes(record.get("key"), keys[folder], parts=("files", "args", "reads", "report"))
            sections.append((folder, title, record | {"stale": stale}))
    return sections


