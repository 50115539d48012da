"""Timed training steps of one configuration: here (spawned gloo ranks) or on a cluster (torchrun, SLURM).

    python -m experiments.throughput --world-size 2 --stage 2 --layers 4 --hidden 256 --batch 4
    torchrun --nnodes 8 --nproc_per_node 16 --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 \\
        -m experiments.throughput --paper "Fig 4" --label 13B --system ZeRO --out results/cluster/fig4

The model is a GPT-2-like ``ParallelGPT`` split Megatron-style over ``--mp`` ranks (a 2-D mesh,
"dp" x "mp"; ZeRO shards over "dp"), built on the meta device and materialised layer by layer on
each rank's device by ``zero_ref.initialize`` (so a 100B model is never whole anywhere), with its
blocks checkpointed (``--checkpoints``, or a paper configuration ``--config C1..C5``): the
``RunSpec`` and ``build_engine`` of run_spec.py, which the batch search builds too.

What is measured, per step, after ``--warmup`` untimed steps (a barrier starts each step):

* phases by the host clock (CUDA synchronised at each boundary), each the mean over the ranks:
  forward, backward (with the gradient reductions it waits for), step (AdamW and the regather);
  the whole step is the slowest rank's (``step_times``);
* from ``torch.profiler`` over ``--profile-steps`` more steps (the engine labels its phases, see
  engine.py): forward, backward, optimizer (AdamW) and regather time, and the host's waits on
  collectives inside each phase: reduction wait, gather wait (``profiled_phases``);
* samples/s and TFLOPS per rank, FLOPs by ``zero_ref.analysis.perf_model.training_flops``: Megatron's
  count, **with checkpoint recomputation counted** when blocks are checkpointed;
* peak memory: CUDA's ``max_memory_allocated``; on the CPU the peak of every allocation since the
  model's construction in the last warm-up step (alloc_trace's recorder: accounted bytes), and
  over all warm-up steps (the first step repacks the buckets once, see batch_search.step_peak_bytes);
* elements moved per step: the engine's ledger (data parallel) and every collective counted
  below the engine (collective_count, which also sees the model-parallel all-reduces).

``--max-batch-budget-gb X`` first searches the largest batch per rank whose steps, the first one
included, fit X GB on this rank (the engine's own allocation trace of those steps on meta tensors,
batch_search.py; on CUDA replayed through the caching-allocator model),
then times that batch; on CUDA the run is held to X GB (``set_per_process_memory_fraction``), so a
search that undercounts fails loudly (out of memory) instead of timing a run that does not fit.
``--dry-run`` checks the arguments and prints the plan without starting anything (the SLURM
scripts' test uses it). Rank 0 appends one row to ``--out``/throughput.csv
and writes the per-step times beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

import torch
import torch.distributed as dist

from experiments.run_spec import RunSpec, build_engine
from zero_ref.analysis.presets import PAPER_CONFIGS

PHASES = ("forward", "backward", "step")


# ------------------------------------------------------------------------------- one rank's run
def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tokens(spec: RunSpec, step: int, dp_rank: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(spec.seed * 1_000_003 + step * 4099 + dp_rank)
    return torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=generator).to(device)


def profiled_phases(profiler, steps: int) -> dict[str, float]:
    """Seconds per step by the engine's labels (engine.py): ``profiled_<phase>_s`` for "forward",
    "backward", "optimizer" (AdamW) and "after_update" (stages 1-2's regather), and
    ``wait_<phase>_<kind>`` for the host's waits on collectives, each "zero_ref.wait <kind>" event
    placed in the phase whose interval holds its start ("step" outside them: the step's statistics;
    autograd may run hooks on another thread, so nesting is read from times, not from parents).
    The reduction wait is ``wait_backward_reduce_scatter`` (or ``_all_reduce``), the gather waits
    ``wait_*_all_gather``."""
    events = [e for e in profiler.events() if e.name.startswith("zero_ref.")]
    phases = [(e.name.split(".", 1)[1], e.time_range.start, e.time_range.end)
              for e in events if not e.name.startswith("zero_ref.wait")]
    out: dict[str, float] = {}
    for name, start, end in phases:
        out[f"profiled_{name}_s"] = out.get(f"profiled_{name}_s", 0.0) + (end - start) / 1e6 / steps
    for e in events:
        if not e.name.startswith("zero_ref.wait"):
            continue
        kind = e.name.split()[1]
        where = next((name for name, start, end in phases if start <= e.time_range.start <= end), "step")
        key = f"wait_{where}_{kind}"
        out[key] = out.get(key, 0.0) + e.time_range.elapsed_us() / 1e6 / steps
    return out


def rank_main(rank: int, world_size: int, spec: RunSpec) -> dict:
    """Build, warm up, time, profile and measure one configuration on this rank (every rank)."""
    from zero_ref.analysis.alloc_trace import record_allocations
    from zero_ref.analysis.collective_count import CountCollectives

    device = _device()
    spec.check(world_size)
    if spec.threads:
        torch.set_num_threads(spec.threads)
    if spec.budget_gb and device.type == "cuda":      # the budget enforced: past it the allocator raises OOM
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec.budget_gb * 1e9 / total), device)
    # on the CPU the warm-up records every allocation from the model's construction on (alloc_trace):
    # the peak of its steps is what the rank holds at most; on CUDA the allocator says it
    recording = record_allocations({"cpu"}) if device.type == "cpu" else contextlib.nullcontext()
    with recording as trace:
        mesh, engine, local_params = build_engine(spec, device)
        dp_rank = mesh.get_local_rank("dp")
        counter = itertools.count()

        def step(timed: list | None = None) -> None:
            tokens = _tokens(spec, next(counter), dp_rank, device)
            marks = [time.perf_counter()]
            loss = engine(tokens)
            _sync(device)
            marks.append(time.perf_counter())
            engine.backward(loss)
            _sync(device)
            marks.append(time.perf_counter())
            engine.step()
            _sync(device)
            marks.append(time.perf_counter())
            if timed is not None:
                timed.append([b - a for a, b in zip(marks, marks[1:])])

        for i in range(max(spec.warmup, 1 if trace is not None else 0)):
            if trace is not None:
                trace.mark(f"step {i}")
            step()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timed: list = []
    for _ in range(spec.steps):
        dist.barrier()
        step(timed)
    profiled = {}
    if spec.profile_steps:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(spec.profile_steps):
                step()
        profiled = profiled_phases(prof, spec.profile_steps)
    with CountCollectives() as below:
        step()
    if device.type == "cuda":
        peak = first_peak = torch.cuda.max_memory_allocated(device)
        peak_how = "cuda max_memory_allocated over the timed steps"
    else:
        live = trace.live_bytes()
        last = trace.marks[f"step {max(spec.warmup, 1) - 1}"]
        peak, first_peak = max(live[last:]), max(live[trace.marks["step 0"]:])
        peak_how = "alloc_trace: every allocation from construction on, peak of the last warm-up step"
    ledger = engine.comm_stats()["last_step"]
    engine.close()
    return {"rank": rank, "times": timed, "local_params": local_params, "profiled": profiled,
            "peak_bytes": peak, "first_peak_bytes": first_peak, "peak_how": peak_how,
            "ledger": {k: v for k, v in ledger.items() if v}, "below": dict(below.moved), "calls": dict(below.calls),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "threads": torch.get_num_threads()}


def step_times(results: list[dict]) -> tuple[list[list[float]], list[float]]:
    """Every rank's timed steps -> (per step, each phase's mean over the ranks; per step, the
    slowest rank's whole step). A barrier starts each step, so the slowest rank's sum of phases is
    the step's wall time. A phase is each rank's mean, not its slowest: ranks that share cores
    (or straggle) take turns being slow, and the sum of each phase's slowest rank would be no
    rank's step at all."""
    per_rank = [r["times"] for r in results]
    phases = [[statistics.fmean(rank[i][j] for rank in per_rank) for j in range(len(PHASES))]
              for i in range(len(per_rank[0]))]
    walls = [max(sum(rank[i]) for rank in per_rank) for i in range(len(per_rank[0]))]
    return phases, walls


def summarize(spec: RunSpec, world_size: int, results: list[dict]) -> dict:
    """One row: medians over the timed steps of each phase (the ranks' mean) and of the whole
    step (the slowest rank's), rates, memory and traffic of rank 0."""
    r0 = results[0]
    phase_times, per_step = step_times(results)
    median = statistics.median(per_step)
    nd = world_size // spec.mp
    flops = spec.flops()["total"] / spec.mp
    row = asdict(spec) | {"world_size": world_size, "nd": nd, "device": r0["device"], "threads": r0["threads"],
                          "local_params": r0["local_params"],
                          "median_step_s": median, "min_step_s": min(per_step),
                          "spread": (max(per_step) - min(per_step)) / median}
    for i, phase in enumerate(PHASES):
        row[f"{phase}_s"] = statistics.median(t[i] for t in phase_times)
    row |= r0["profiled"]
    row |= {"samples_per_s": spec.batch * nd / median, "tflops_per_rank": flops / median / 1e12,
            "flops_per_rank": flops, "flops_count": "Megatron, recomputation counted" if spec.checkpoints != "none"
            else "Megatron, no recomputation",
            "peak_gb": max(r["peak_bytes"] for r in results) / 1e9, "peak_how": r0["peak_how"],
            "first_step_peak_gb": max(r["first_peak_bytes"] for r in results) / 1e9}
    row |= {f"ledger_{k}": v for k, v in r0["ledger"].items()} | {f"moved_{k}": v for k, v in r0["below"].items()}
    row |= {f"calls_{k}": v for k, v in r0["calls"].items()}
    return row


# --------------------------------------------------------------------------------- command line
def paper_spec(figure: str, label: str, system: str, config: str | None = None, gpus: int | None = None,
               seq: int = 1024, vocab: int = 50257) -> tuple[RunSpec, int]:
    """The paper's run ``label`` of ``figure`` for ``system`` from experiments/paper_data/runs.csv,
    told apart by its ZeRO ``config`` (Fig 8) or GPU count ``gpus`` (Fig 3) where a figure has
    several: its RunSpec (ZeRO: its C1-C5 config, else stage 2 with Pa when model-parallel; the
    baseline: stage 0) and GPU count. Without ``gpus`` the first such run is taken."""
    from experiments.paper_values import paper_runs

    runs = [run for run in paper_runs() if (run["figure"], run["label"], run["system"]) == (figure, label, system)
            and config in (None, run["zero_config"])]
    runs = [run for run in runs if run["gpus"] == gpus] or runs
    if not runs:
        raise ValueError(f"no run {label!r} of {figure!r} for system {system!r} in the paper's appendix tables")
    run, zero = runs[0], system == "ZeRO"
    preset = PAPER_CONFIGS.get(run["zero_config"]) if run["zero_config"] else None
    stage = preset.stage if preset else (2 if zero else 0)
    checkpoints = preset.checkpoints if preset else ("pa" if zero and run["mp"] > 1 else "plain")
    spec = RunSpec(layers=run["layers"], hidden=run["hidden"], heads=run["heads"], seq=seq, vocab=vocab,
                   batch=run["batch_per_gpu"], stage=stage, mp=run["mp"], checkpoints=checkpoints,
                   md=zero, dtype="fp16", bucket_numel=2**22 if zero else 0)
    return spec, run["gpus"]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in fields(RunSpec):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", help="(default off)")
        else:
            parser.add_argument(flag, type={"int": int, "float": float}.get(str(f.type), str), default=None,
                                help=f"(default {f.default})")
    parser.add_argument("--config", choices=sorted(PAPER_CONFIGS), help="a paper configuration: sets stage, "
                        "checkpoints and md")
    parser.add_argument("--paper", help='a figure of the paper ("Fig 2", "Fig 3", "Fig 4", "Fig 8"): take the run '
                        "--label/--system from its appendix table")
    parser.add_argument("--label", help="with --paper: the model-size label as printed (e.g. 60B)")
    parser.add_argument("--system", default="ZeRO", choices=("ZeRO", "Baseline"))
    parser.add_argument("--world-size", type=int, default=None, help="spawn this many gloo ranks here "
                        "(default: torchrun's WORLD_SIZE, else 1)")
    parser.add_argument("--max-batch-budget-gb", type=float, default=None,
                        help="search the largest batch per rank that fits this many GB, then time it")
    parser.add_argument("--out", default="results/throughput/runs")
    parser.add_argument("--dry-run", action="store_true", help="check the arguments, print the plan, start nothing")
    return parser.parse_args(argv)


def spec_from(args: argparse.Namespace, world: int | None = None) -> tuple[RunSpec, int | None]:
    """The RunSpec the arguments ask for, and the GPU count of a --paper run (the run of ``world``
    GPUs where the figure has several)."""
    gpus = None
    spec = RunSpec()
    if args.paper:
        if not args.label:
            raise ValueError("--paper needs --label (the model size as printed, e.g. 60B)")
        spec, gpus = paper_spec(args.paper, args.label, args.system, args.config, world)
    if args.config:
        preset = PAPER_CONFIGS[args.config]
        spec = replace(spec, stage=preset.stage, checkpoints=preset.checkpoints, md=preset.md)
    # flags given on the command line (None: not given; store_true flags: False when not given, and
    # 0 == False, so compare by identity)
    given = {f.name: getattr(args, f.name) for f in fields(RunSpec)
             if getattr(args, f.name) is not None and getattr(args, f.name) is not False}
    return replace(spec, **given), gpus


def main(argv: list[str] | None = None) -> dict | None:
    from zero_ref.launch import init_from_env, spawn

    args = parse(argv)
    under_launcher = "WORLD_SIZE" in os.environ and args.world_size is None
    world = int(os.environ["WORLD_SIZE"]) if under_launcher else args.world_size
    spec, gpus = spec_from(args, world)
    if world is None:        # a dry run plans the paper's GPU count; a run here is one process
        world = (gpus or spec.mp) if args.dry_run else 1
    if gpus is not None and world != gpus:
        print(f"note: the paper ran this on {gpus} GPUs; this run has {world} ranks", file=sys.stderr)
    spec.check(world)
    nd = world // spec.mp
    plan = {"spec": asdict(spec), "world_size": world, "nd": nd, "paper_gpus": gpus,
            "flops_per_rank": spec.flops()["total"] / spec.mp, "out": args.out,
            "max_batch_budget_gb": args.max_batch_budget_gb}
    if args.dry_run:
        print(json.dumps(plan))
        return None
    if args.max_batch_budget_gb is not None:
        # every step must fit, the first too, whose repack (both bucket layouts at once) peaks above
        # the steady state; on CUDA the run is held to the budget, and the allocator's rounding and
        # caching count as well (an H200 run of the steady-state search's batch ran out of memory in
        # its first step: 8.07 GiB allocated, 1.14 GiB reserved beside it, 9.31 GiB allowed)
        from experiments.batch_search import max_batch

        on_cuda = under_launcher and torch.cuda.is_available()
        spec = replace(spec, batch=max_batch(spec, nd, args.max_batch_budget_gb * 1e9, steady=False,
                                             allocator=on_cuda), budget_gb=args.max_batch_budget_gb)
        if spec.batch == 0:
            raise SystemExit(f"not even one sequence per rank fits {args.max_batch_budget_gb} GB")
    if under_launcher:
        init_from_env()
        result = rank_main(dist.get_rank(), world, spec)
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        dist.destroy_process_group()
        if int(os.environ.get("RANK", 0)) != 0:
            return None
        results = gathered
    else:
        results = spawn(rank_main, world, spec, timeout=3600)
    row = summarize(spec, world, results)
    write(Path(args.out), row, *step_times(results))
    print(json.dumps({k: row[k] for k in ("world_size", "stage", "batch", "median_step_s", "samples_per_s",
                                          "tflops_per_rank", "peak_gb")}))
    return row


def write(out: Path, row: dict, times: list, walls: list) -> None:
    """Append ``row`` to out/throughput.csv (a new header starts a new file) and the step times
    (``step_times``: each phase's mean over the ranks, the slowest rank's whole step) beside it."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "throughput.csv"
    rows = list(csv.DictReader(open(path))) if path.exists() else []
    rows.append(row)
    header = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)
    tag = f"s{row['stage']}_w{row['world_size']}_mp{row['mp']}_b{row['batch']}_{row['checkpoints']}"
    with open(out / f"steps_{tag}.json", "w") as f:
        json.dump({"phases": list(PHASES), "times": times, "step_wall": walls,
                   "written": time.strftime("%Y-%m-%d %H:%M:%S")}, f)


if __name__ == "__main__":
    main()
