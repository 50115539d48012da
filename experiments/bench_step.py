"""Step time of each ZeRO stage against DDP + AdamW(foreach=True), measured in one run.

Goals (the engine-hardening issue): stage 0 takes at most 1.00x DDP's step time, stage 1 1.02x,
stage 2 1.05x, stage 3 1.15x, on the same model, batch, seed and world size.

What is timed: whole training steps, forward + loss + backward + optimizer step (+ clearing the
gradients), with ``time.perf_counter`` on every rank after a barrier, so a step's time is that of
the slowest rank. Warm-up steps are run first and not timed.

The systems, all in the same ranks of one spawn (``zero_ref.launch.spawn``):

* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (bucket size matched to zero_ref's
  ``bucket_numel``) with ``torch.optim.AdamW(foreach=True)``; ``zero_grad(set_to_none=True)``.
  With ``--dtype bf16`` the model is cast to bf16 (``model.to(torch.bfloat16)``) and AdamW keeps
  its moments in bf16 with no fp32 master copy: the plain "cast the model" baseline, which does
  less optimizer work than zero_ref's mixed precision (fp32 masters and moments, bf16 copy).
* ``zero-s``: ``zero_ref.initialize(model, ZeroConfig(stage=s, dtype, kernels="torch",
  bucket_numel))`` and ``engine(tokens)`` / ``engine.backward(loss)`` / ``engine.step()``.
* ``zero-s-r32`` (``--fp32-reduce-stages``): the same with ``reduce_dtype="fp32"``, gradients
  accumulated and reduced in fp32 under bf16; its ratio to ``zero-s`` is the cost of fp32 reductions.

Fairness on a noisy shared machine: the systems are interleaved, round-robin over ``--rounds``
rounds (each round runs every system for ``steps / rounds`` steps, in an order rotated by one each
round; by default one step per round), and every system sees the same sequence of batches. The
CPU time other processes take during each step is measured (/proc/stat's busy time, less what our
ranks used) and reported. Beside the goal's measure (median step over DDP's median step) the
table shows noise-robust views: the paired ratio (per round, this system's step over DDP's; median
over rounds), the ratio of the fastest steps, the ratio of CPU seconds per step, and the ratio of
medians over the quiet steps only (other processes took < --quiet-threshold of the machine).
Each system's losses are compared with DDP's step for step as a check that they train the same
model (in fp32 they agree exactly: same reduction order, AdamW operation for operation).

By default ``bucket_numel`` is one transformer block (``peer_systems.block_numel``: 12 h² + 13 h), so
stages 0-2 reduce about one bucket per block and stage 3 gathers and reduces one block per unit.

Outputs in ``--out`` (default results/bench_step): bench_step.csv (one row per system),
bench_step_steps.csv (every timed step), meta.json, bench_step.png, REPORT.md; with
``--profile-steps N`` also profile_<system>.txt (after the timed steps: cProfile by wall clock and
by main-thread CPU, then torch.profiler, N steps each on rank 0, with a summary in ms per step),
written by bench_step_report.py.

Usage: ``python experiments/bench_step.py [--world-size 2] [--stages 0 1 2 3] [--dtype fp32]``
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import math
import os
import platform
import pstats
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

# make the repository root importable when run as `python experiments/bench_step.py`
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import zero_ref  # noqa: E402
from zero_ref.launch import spawn  # noqa: E402
from zero_ref.models import lm_loss, tiny_gpt2, token_batches  # noqa: E402
from experiments.peer_systems import EngineSystem, TorchSystem, block_numel  # noqa: E402
from experiments.bench_step_report import draw, print_table, write_outputs  # noqa: E402
from experiments.provenance import git_revision, hardware  # noqa: E402

GOALS = {0: 1.00, 1: 1.02, 2: 1.05, 3: 1.15}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PHASES = ("forward", "backward", "optimizer")


# --- the systems under test ---------------------------------------------------------------------
class DDPSystem(TorchSystem):
    """DDP + torch.optim.AdamW(foreach=True): the baseline."""

    name, stage = "ddp", None

    def __init__(self, args, model: torch.nn.Module):
        from torch.nn.parallel import DistributedDataParallel

        model = model.to(DTYPES[args.dtype])
        bucket_mb = args.bucket_numel * DTYPES[args.dtype].itemsize / 2**20
        ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
        super().__init__(ddp, torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                                foreach=True))


class ZeroSystem(EngineSystem):
    """zero_ref at one stage."""

    def __init__(self, args, model: torch.nn.Module, stage: int, reduce_dtype: str | None = None):
        self.name, self.stage = f"zero-{stage}" + ("-r32" if reduce_dtype else ""), stage
        config = zero_ref.ZeroConfig(stage=stage, dtype=args.dtype, lr=args.lr,
                                     weight_decay=args.weight_decay, kernels="torch",
                                     bucket_numel=args.bucket_numel, reduce_dtype=reduce_dtype)
        super().__init__(zero_ref.initialize(model, config))


def make_model(args) -> torch.nn.Module:
    return tiny_gpt2(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads,
                     vocab_size=args.vocab, n_positions=args.seq, seed=args.seed)


def timed_step(system, tokens) -> tuple[list, float]:
    """One training step; returns the wall times of its phases (forward incl. loss, backward,
    optimizer step), then the CPU time this process (all its threads) spent in the step, and the
    loss."""
    c0 = time.process_time()
    t0 = time.perf_counter()
    loss = lm_loss(system.forward(tokens).logits, tokens)
    t1 = time.perf_counter()
    system.backward(loss)
    t2 = time.perf_counter()
    system.step()
    t3 = time.perf_counter()
    c3 = time.process_time()
    return [t1 - t0, t2 - t1, t3 - t2, c3 - c0], loss.item()


# --- what every rank runs -----------------------------------------------------------------------
def rank_main(rank: int, world_size: int, args) -> dict:
    systems = [DDPSystem(args, make_model(args))]
    systems += [ZeroSystem(args, make_model(args), s) for s in args.stages]
    systems += [ZeroSystem(args, make_model(args), s, "fp32") for s in args.fp32_reduce_stages]
    batches = token_batches(args.vocab, args.batch, args.seq, rank, world_size, seed=args.seed + 1)
    total = args.warmup + args.steps
    data = [next(batches)[1] for _ in range(total)]
    per_round = math.ceil(args.steps / args.rounds)

    step_of = {s.name: 0 for s in systems}            # next batch index per system
    times = {s.name: [] for s in systems}   # per timed step: [forward, backward, optimizer, cpu, machine busy]
    rounds = {s.name: [] for s in systems}             # per timed step: its round
    losses = {s.name: [] for s in systems}             # per step (warm-up included)
    progress = tqdm(total=len(systems) * total, desc="steps", unit="step", dynamic_ncols=True) if rank == 0 else None

    def run(system, n: int, timed: bool, round_index: int = -1) -> None:
        for _ in range(n):
            i = step_of[system.name]
            dist.barrier()
            busy_before = busy_cpu_seconds()
            phases, loss = timed_step(system, data[i])
            busy_after = busy_cpu_seconds()
            phases.append(None if busy_before is None else busy_after - busy_before)
            step_of[system.name] = i + 1
            losses[system.name].append(loss)
            if timed:
                times[system.name].append(phases)
                rounds[system.name].append(round_index)
            if progress is not None:
                progress.update(1)
                progress.set_postfix_str(system.name)

    for system in systems:                             # warm-up, not timed
        run(system, args.warmup, timed=False)
    dist.barrier()
    busy0, own0, wall0 = busy_cpu_seconds(), time.process_time(), time.perf_counter()
    for r in range(args.rounds):                       # interleaved, order rotated every round
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for system in order:
            left = args.steps - len(times[system.name])
            run(system, min(per_round, left), timed=True, round_index=r)
    dist.barrier()
    busy1, own1, wall1 = busy_cpu_seconds(), time.process_time(), time.perf_counter()
    if progress is not None:
        progress.close()

    profiles = {}
    if args.profile_steps > 0:
        for system in systems:
            if args.profile and system.name not in args.profile:
                continue
            profiles[system.name] = profile_system(system, data, step_of, args.profile_steps, rank)
    timed_window = dict(wall_s=wall1 - wall0, own_cpu_s=own1 - own0,
                        machine_busy_cpu_s=None if busy0 is None else busy1 - busy0)
    return {"times": times, "rounds": rounds, "losses": losses, "profiles": profiles, "window": timed_window,
            "threads": torch.get_num_threads()}


def profile_system(system, data, step_of, n: int, rank: int) -> str | None:
    """Run 3 x n more steps of `system`; on rank 0 under cProfile timing wall clock, then cProfile
    timing the main thread's CPU (blind to waits, but also to other processes taking the core),
    then torch.profiler. Returns the report text on rank 0."""
    from torch.profiler import ProfilerActivity, profile

    def steps():
        for _ in range(n):
            i = step_of[system.name] % len(data)
            dist.barrier()
            timed_step(system, data[i])
            step_of[system.name] += 1

    profilers = {"wall": cProfile.Profile(time.perf_counter), "cpu": cProfile.Profile(time.thread_time)}
    for profiler in profilers.values():
        if rank == 0:
            profiler.enable()
        steps()
        if rank == 0:
            profiler.disable()
    if rank == 0:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            steps()
    else:
        steps()
    if rank != 0:
        return None
    out = io.StringIO()
    out.write(f"# {system.name}: cProfile and torch.profiler on rank 0, {n} steps each\n\n")
    out.write(profile_summary(profilers, n))
    for kind, profiler in profilers.items():
        stats = pstats.Stats(profiler, stream=out)
        out.write(f"\n## cProfile ({kind} time), by cumulative time\n")
        stats.sort_stats("cumulative").print_stats(45)
        out.write(f"\n## cProfile ({kind} time), by own time\n")
        stats.sort_stats("tottime").print_stats(30)
    out.write(f"\n## torch.profiler, {n} steps, by self CPU time\n")
    out.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    out.write(f"\n## torch.profiler, {n} steps, by total CPU time\n")
    out.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30))
    return out.getvalue()


def profile_summary(profilers: dict, n: int) -> str:
    """ms per step, cumulative, of the step's own functions and of zero_ref's, triton_kernels' and
    torch.optim's, by wall clock and by main-thread CPU."""
    interesting = ("zero_ref", "triton_kernels", "torch/optim", "bench_step.py", "distributed_c10d.py")
    table: dict[str, dict[str, float]] = {}
    for kind, profiler in profilers.items():
        for (filename, line, func), (_, _, _, cumtime, _) in pstats.Stats(profiler).stats.items():
            short = next((filename[filename.index(k):] for k in interesting if k in filename), None)
            if short is None and not func.startswith("<built-in method torch._C._distributed_c10d"):
                continue
            label = f"{short}:{line}({func})" if short else func
            table.setdefault(label, {})[kind] = cumtime / n * 1e3
    rows = sorted(table.items(), key=lambda kv: -kv[1].get("wall", 0.0))
    lines = ["## summary: ms per step (cumulative), rank 0", "",
             f"{'wall':>8} {'cpu':>8}  function"]
    for label, v in rows[:40]:
        lines.append(f"{v.get('wall', float('nan')):8.1f} {v.get('cpu', float('nan')):8.1f}  {label}")
    return "\n".join(lines) + "\n"


# --- summary and outputs ------------------------------------------------------------------------
def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def summarize(results: list[dict], args) -> tuple[list[dict], list[dict]]:
    """Per-step time = the slowest rank's; per system: median, quartiles, ratio, goal."""
    names = list(results[0]["times"])
    step_rows, rows = [], []
    medians = {}
    for name in names:
        per_rank = [r["times"][name] for r in results]
        steps = []
        for k in range(len(per_rank[0])):
            phases = [[rank_times[k][j] for rank_times in per_rank] for j in range(len(PHASES))]
            total = max(sum(rank_times[k][:len(PHASES)]) for rank_times in per_rank)
            cpu = max(rank_times[k][len(PHASES)] for rank_times in per_rank)
            # CPU that other processes took during this step: the machine's busy CPU seconds
            # (read on rank 0 around the step) less what our ranks used (all their threads)
            busy = per_rank[0][k][len(PHASES) + 1]
            other = None if busy is None else max(0.0, busy - sum(rt[k][len(PHASES)] for rt in per_rank))
            steps.append(total)
            step_rows.append(dict(system=name, step=k, round=results[0]["rounds"][name][k], step_s=total,
                                  **{f"{p}_s": max(v) for p, v in zip(PHASES, phases)}, cpu_s=cpu,
                                  other_cpu_frac=None if other is None else other / (total * (os.cpu_count() or 1))))
        q1, med, q3 = quartiles(steps)
        medians[name] = med
        row = dict(system=name, dtype=args.dtype, world_size=args.world_size, steps=len(steps),
                   median_s=med, q1_s=q1, q3_s=q3, iqr_s=q3 - q1, min_s=min(steps),
                   cpu_median_s=statistics.median(sr["cpu_s"] for sr in step_rows if sr["system"] == name))
        for j, p in enumerate(PHASES):
            row[f"{p}_median_s"] = statistics.median(max(rt[k][j] for rt in per_rank)
                                                     for k in range(len(steps)))
        ddp_losses, losses = results[0]["losses"]["ddp"], results[0]["losses"][name]
        row["max_loss_diff_vs_ddp"] = max(abs(a - b) for a, b in zip(losses, ddp_losses))
        row["final_loss"] = losses[-1]
        rows.append(row)
    # paired ratio: in each round, this system's median step over DDP's; the median over rounds.
    # Load from other processes that comes and goes then hits both sides of each ratio alike.
    by_round: dict[str, dict[int, list[float]]] = {}
    for sr in step_rows:
        by_round.setdefault(sr["system"], {}).setdefault(sr["round"], []).append(sr["step_s"])
    for row in rows:
        mine, ddp = by_round[row["system"]], by_round["ddp"]
        row["paired_ratio"] = statistics.median(statistics.median(mine[r]) / statistics.median(ddp[r])
                                                for r in mine if r in ddp)
    # quiet steps: those during which other processes took less than --quiet-threshold of the machine
    for row in rows:
        quiet = [sr["step_s"] for sr in step_rows if sr["system"] == row["system"]
                 and sr["other_cpu_frac"] is not None and sr["other_cpu_frac"] < args.quiet_threshold]
        row["quiet_steps"] = len(quiet)
        row["quiet_median_s"] = statistics.median(quiet) if quiet else float("nan")
    for row in rows:
        row["quiet_ratio"] = row["quiet_median_s"] / next(r["quiet_median_s"] for r in rows if r["system"] == "ddp")
    for row in rows:
        stage = None if row["system"] == "ddp" else int(row["system"].split("-")[1])
        fp32_reduce = row["system"].endswith("-r32")
        row["stage"] = stage
        row["reduce_dtype"] = "fp32" if fp32_reduce else args.dtype
        row["ratio_to_ddp"] = row["median_s"] / medians["ddp"]
        row["min_ratio"] = row["min_s"] / next(r["min_s"] for r in rows if r["system"] == "ddp")
        row["cpu_ratio"] = row["cpu_median_s"] / next(r["cpu_median_s"] for r in rows if r["system"] == "ddp")
        row["goal"] = GOALS[stage] if stage is not None and not fp32_reduce else float("nan")
        row["pass"] = "" if stage is None or fp32_reduce else ("pass" if row["ratio_to_ddp"] <= row["goal"] else "FAIL")
        same = f"zero-{stage}"
        row["ratio_to_same_stage"] = row["median_s"] / medians[same] if fp32_reduce and same in medians else float("nan")
    return rows, step_rows


def busy_cpu_seconds() -> float | None:
    """CPU seconds every process on this machine has spent busy since boot (/proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)   # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--fp32-reduce-stages", type=int, nargs="*", default=[], choices=[0, 1, 2, 3],
                        help="also time these stages with reduce_dtype='fp32' (systems zero-s-r32)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per system first")
    parser.add_argument("--rounds", type=int, default=None,
                        help="round-robin rounds the timed steps are split into (default --steps: "
                             "every round times one step of each system)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences), split over ranks")
    parser.add_argument("--bucket-numel", type=int, default=None,
                        help="zero_ref bucket_numel and DDP bucket size (default one block: 12 hidden**2 + 13 hidden)")
    parser.add_argument("--quiet-threshold", type=float, default=0.05,
                        help="a step is quiet when other processes took less than this share of the machine")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="after timing, profile 3 x this many steps of each system on rank 0")
    parser.add_argument("--profile", nargs="*", default=None,
                        help="systems to profile (e.g. ddp zero-1); default all")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before the ranks are killed")
    parser.add_argument("--out", default="results/bench_step")
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = args.steps
    if args.bucket_numel is None:
        args.bucket_numel = block_numel(args.hidden)
    if args.batch % args.world_size:
        parser.error(f"--batch {args.batch} must be divisible by --world-size {args.world_size}")

    n_params = sum(p.numel() for p in make_model(args).parameters())
    print(f"tiny_gpt2: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, seq {args.seq}: "
          f"{n_params / 1e6:.2f}M parameters; global batch {args.batch}; world {args.world_size}; "
          f"{args.dtype}; bucket_numel {args.bucket_numel}")
    start = time.perf_counter()
    load_before = os.getloadavg()
    busy_before, own_before = busy_cpu_seconds(), own_cpu_seconds()
    results = spawn(rank_main, args.world_size, args, timeout=args.timeout, collective_timeout_s=600)
    rows, step_rows = summarize(results, args)
    wall = time.perf_counter() - start
    other_cpu = other_timed = None
    if busy_before is not None:   # CPU time other processes took from our cores during the run
        other_cpu = max(0.0, busy_cpu_seconds() - busy_before - (own_cpu_seconds() - own_before))
        window = results[0]["window"]   # ... and during the timed steps only
        other_timed = max(0.0, window["machine_busy_cpu_s"] - sum(r["window"]["own_cpu_s"] for r in results))
    meta = dict(
        command=shlex.join([os.path.basename(sys.executable), *sys.argv]),
        git_revision=git_revision(), hardware=hardware(), torch=torch.__version__,
        python=platform.python_version(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        wall_s=wall, load_average_1min_before_after=[load_before[0], os.getloadavg()[0]],
        other_processes_cpu_s=other_cpu,
        other_processes_cpu_fraction=None if other_cpu is None else other_cpu / (wall * (os.cpu_count() or 1)),
        timed_window=results[0]["window"],
        other_processes_cpu_s_timed=other_timed,
        other_processes_cpu_fraction_timed=(None if other_timed is None else
                                            other_timed / (results[0]["window"]["wall_s"] * (os.cpu_count() or 1))),
        threads_per_rank=results[0]["threads"], parameters=n_params,
        args={k: v for k, v in vars(args).items()},
        goals={f"zero-{s}": GOALS[s] for s in args.stages},
        timing=("whole step (forward + lm_loss + backward + optimizer step + clearing grads), "
                "time.perf_counter on each rank after a barrier; a step's time is the slowest rank's; "
                "median and IQR over the timed steps; systems interleaved round-robin, order rotated each round"),
        baseline=(f"DDP(bucket_cap_mb={args.bucket_numel * DTYPES[args.dtype].itemsize / 2**20:.3f}) + "
                  "torch.optim.AdamW(foreach=True), zero_grad(set_to_none=True)"
                  + ("; model cast to bf16 with model.to(torch.bfloat16), AdamW states in bf16, "
                     "no fp32 master weights" if args.dtype == "bf16" else "; fp32")),
        zero_ref_config=dict(dtype=args.dtype, lr=args.lr, weight_decay=args.weight_decay,
                             kernels="torch", bucket_numel=args.bucket_numel),
        summary=rows)
    write_outputs(args, rows, step_rows, results, meta)
    draw(Path(args.out))
    print_table(rows)
    if other_timed is not None:
        share = meta["other_processes_cpu_fraction_timed"]
        print(f"other processes used {other_timed:.1f} CPU-s during the timed steps ({share:.0%} of the "
              "machine)" + ("; timings are disturbed, rerun on a quiet machine" if share > 0.1 else ""))
    print(f"\nwrote {args.out}/bench_step.csv, bench_step_steps.csv, meta.json, bench_step.png"
          + (", profile_*.txt" if results[0]["profiles"] else "") + f" ({meta['wall_s']:.0f} s)")
    return rows


def run_study(out, quick: bool = False, quiet: bool = False) -> dict:
    """The reproduce entry (full runs only): every stage against DDP in fp32 into ``out``, and in bf16
    into ``out``/bf16 with stages 2 and 3 also timed with reduce_dtype="fp32" (the cost of fp32
    reductions). bf16 runs fewer steps: its matmuls are slow on CPUs without native bf16 (about 11 s
    a step without AVX-512). The report step (bench_step_report.render) draws both and gives the rows."""
    for dtype, folder, extra in (("fp32", out, []), ("bf16", out / "bf16", ["--steps", "12", "--warmup", "2",
                                                                          "--fp32-reduce-stages", "2", "3"])):
        main(["--dtype", dtype, "--out", str(folder), *extra])
    return {"meta": {}}


if __name__ == "__main__":
    main()
