"""A CUDA device measured for the performance model, and the model checked against the GPU's timed runs.

Two parts, both run by ``experiments/gpu_check.sh``:

* ``measure`` (one rank under ``torchrun``, NCCL): ``calibrate.compute_rates`` in bf16 on the
  device, over a (tokens, hidden) grid at the timed run's sequence length and vocabulary, and
  ``calibrate.step_rate``, the engine's whole bf16 optimizer step (norm, fused AdamW, clearing
  gradients) per element, at two sizes, ``block_issue_times`` and ``calibrate.stage3_own`` (stage 3
  minus stage 0 on a 4 x 1024 GPT, bf16) -> ``<out>/calibration.json``.
  The same rates as the CPU calibration, so ``throughput_study.predicted`` reads either.
* ``compare`` (anywhere, also here after the run came back): for each row of
  ``<out>/throughput/throughput.csv``, the model's phases (forward, backward, optimizer step) and
  whole step against the timed ones -> ``<out>/model_vs_measured.csv``. At world size 1 no
  collective runs, so this checks the compute and optimizer terms alone. Beside them, the same
  with a host term (``host_floors``): no phase faster than the same model's phase timed at the
  smallest batch, for steps the host cannot issue as fast as the GPU runs them.

Usage: ``torchrun --standalone --nproc_per_node 1 experiments/gpu_calibrate.py measure --out results/gpu``
then ``python experiments/gpu_calibrate.py compare --out results/gpu``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GRID_TOKENS = (1024, 2048, 4096, 8192, 16384)
GRID_HIDDEN = (1024, 2048, 4096)
SEQ, VOCAB = 1024, 50257            # the timed run's shape (gpu_check.sh: GPT-2 24 x 1024)
OWN_SHAPE = {"layers": 4, "hidden": 1024, "heads": 16, "batch": 1}
"""The GPT on which stage 3's own work (calibrate.stage3_own: stage 3 minus stage 0) is measured."""


def measure(out: Path, reps: int) -> dict:
    """Measure the rates on this rank's CUDA device; write and return the calibration."""
    import torch
    import torch.distributed as dist

    from experiments import calibrate

    dist.init_process_group("nccl")
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    start = time.perf_counter()
    rates = calibrate.compute_rates(VOCAB, SEQ, GRID_TOKENS, GRID_HIDDEN, reps, device=device, dtype=torch.bfloat16)
    # the optimizer step at two sizes of four parameter groups each: a rate that grows with the size
    # shows fixed costs per step (the model takes the larger size's rate)
    adamw_by_width = {width: calibrate.step_rate(None, width=width, reps=reps, device=device, dtype="bf16")
                      for width in (1024, 4096)}
    adamw = adamw_by_width[4096]
    issue = {tokens: block_issue_times(device, reps, tokens) for tokens in (2048, 8192)}
    own = calibrate.stage3_own(None, VOCAB, SEQ, OWN_SHAPE, reps, device=device, dtype="bf16")
    cal = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "dtype": "bf16",
           "seq": SEQ, "vocab": VOCAB, "worlds": [1],
           "rates": {"1": {name: {f"{t},{h}": rate for (t, h), rate in points.items()}
                           for name, points in rates.items()}},
           "adamw": {"1": adamw}, "adamw_by_width": adamw_by_width, "stage3_own": {"1": own},
           "block_issue": {str(tokens): times for tokens, times in issue.items()},
           "seconds": time.perf_counter() - start}
    dist.destroy_process_group()
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps(cal, indent=1))
    for name, points in rates.items():
        best = max(points, key=points.get)
        print(f"{name}: {points[best] / 1e12:.0f} TFLOPS at best (tokens, hidden) = {best}, "
              f"{min(points.values()) / 1e12:.0f} at worst")
    for width, rate in adamw_by_width.items():
        print(f"optimizer step, 4 x {width} x {width}: {rate / 1e9:.2f} G elements/s (bf16 engine, fp32 master)")
    print(f"stage 3's own work, {OWN_SHAPE}: forward {own[0] * 1e9:.3f}, backward {own[1] * 1e9:.3f} ns per "
          "element of a gather pass")
    _print_issue(cal["block_issue"])
    return cal


def _print_issue(block_issue: dict) -> None:
    for tokens, by_part in block_issue.items():
        for how, times in by_part.items():
            print(f"{tokens} tokens, {how} forward: issued in {1e3 * times['issue_s']:.3f} ms, "
                  f"kernels done at {1e3 * times['wall_s']:.3f} ms")


def block_issue_times(device, reps: int, tokens: int = 8192, hidden: int = 1024) -> dict:
    """One block of the timed run's shape, forward with autograd recording, bare and as the timed
    model runs it (torch.utils.checkpoint, plain), and the head (logits and the model's loss): the
    host's time to issue it (until the call returns; the kernels run on) and the time until its
    kernels are done, medians. Where the two are equal the forward is bound by the host issuing
    kernels, not by the GPU running them."""
    import statistics

    import torch

    from experiments import calibrate
    from zero_ref.core.activations import checkpoint_blocks
    from zero_ref.models import ParallelGPTBlock

    blocks = torch.nn.ModuleList([ParallelGPTBlock(hidden, hidden // 64, None, iter(range(10)))])
    blocks = blocks.to(device, torch.bfloat16)
    x = torch.randn(tokens // SEQ, SEQ, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    embedding = torch.randn(VOCAB, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, VOCAB, (tokens // SEQ, SEQ), device=device)
    times = {}
    for how in ("block, bare", "block, checkpointed", "head"):
        if how == "block, checkpointed":
            checkpoint_blocks(blocks, "plain")
        run = (lambda: calibrate.model_head_loss(torch.nn.functional.linear(x, embedding), labels)) if how == "head" \
            else (lambda: blocks[0](x))
        issued, done = [], []
        for rep in range(reps + 2):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            y = run()
            issued.append(time.perf_counter() - start)
            torch.cuda.synchronize(device)
            done.append(time.perf_counter() - start)
            del y
        times[how] = {"issue_s": statistics.median(issued[2:]), "wall_s": statistics.median(done[2:])}
    return times


def load_calibration(path: Path) -> dict:
    """calibration.json in the form calibrate.cpu_cluster reads: {world: {name: {(t, h): FLOP/s}}}."""
    raw = json.loads(path.read_text())
    rates = {int(w): {name: {tuple(int(v) for v in key.split(",")): rate for key, rate in points.items()}
                      for name, points in by_name.items()} for w, by_name in raw["rates"].items()}
    return {**raw, "rates": rates, "adamw": {int(w): r for w, r in raw["adamw"].items()}, "links": {},
            "stage3_own": {int(w): tuple(v) for w, v in raw.get("stage3_own", {}).items()}}


def _shape(run) -> tuple:
    return tuple(run[k] for k in ("layers", "hidden", "heads", "seq", "vocab", "stage", "mp", "checkpoints", "dtype",
                                  "world_size"))


def host_floors(runs) -> dict:
    """The host term: per model and stage, each phase as timed at the smallest batch timed. The host
    issues the same kernels at any batch (their number does not grow with it), so a phase can be no
    faster than it was at the smallest batch unless the GPU was the bound there; and then that time
    is the GPU's at a smaller batch, below its time at any larger one. So ``max(model, floor)``
    never undercuts a phase for having taken a host-bound run as a floor. gpu_check.sh times batch 1
    for this; the floor's own run is its fit, not a check of it."""
    floors = {}
    for _, run in runs.sort_values("batch").iterrows():
        floors.setdefault(_shape(run), {"batch": run["batch"], "forward": run["forward_s"],
                                        "backward": run["backward_s"], "step": run["step_s"]})
    return floors


def compare(out: Path, show: bool = True) -> list[dict]:
    """Predicted against measured, per phase, for every timed run in ``out``/throughput (``show``:
    print the table and the block timings too)."""
    import pandas as pd

    from experiments.throughput_study import predicted

    cal = load_calibration(out / "calibration.json")
    runs = pd.read_csv(out / "throughput" / "throughput.csv")
    floors = host_floors(runs)
    rows = []
    for _, run in runs.iterrows():
        if int(run["world_size"]) not in cal["rates"]:
            continue
        model = predicted(run.to_dict(), cal, smooth=False)   # one rank on an idle GPU: the points as measured
        measured = {"forward": run["forward_s"], "backward": run["backward_s"], "step": run["step_s"],
                    "whole step": run["median_step_s"]}
        modelled = {**model.phases(), "whole step": model.seconds}
        floor = floors.get(_shape(run))
        if floor is not None and floor["batch"] < run["batch"]:
            with_host = {phase: max(modelled[phase], floor[phase]) for phase in ("forward", "backward", "step")}
            with_host["whole step"] = sum(with_host.values())
        else:             # no smaller batch timed, or this run is the floor's own
            with_host = dict.fromkeys(modelled, float("nan"))
        for phase, seconds in measured.items():
            rows.append({"device": cal["device"], "layers": run["layers"], "hidden": run["hidden"],
                         "batch": run["batch"], "seq": run["seq"], "stage": run["stage"], "dtype": run["dtype"],
                         "phase": phase, "measured_s": seconds, "predicted_s": modelled[phase],
                         "error": modelled[phase] / seconds - 1,
                         "host_floor_batch": floor["batch"] if floor is not None else float("nan"),
                         "predicted_with_host_s": with_host[phase],
                         "error_with_host": with_host[phase] / seconds - 1})
    frame = pd.DataFrame(rows)
    frame.to_csv(out / "model_vs_measured.csv", index=False)
    if not show:
        return rows
    print(frame.to_string(index=False))
    for _, run in runs.iterrows():
        print(f"timed forward of {run['layers']} blocks and the head: {1e3 * run['forward_s'] / run['layers']:.3f} ms "
              "per block, all told")
    _print_issue(cal.get("block_issue", {}))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("measure", "compare"))
    parser.add_argument("--out", default="results/gpu", type=Path)
    parser.add_argument("--reps", type=int, default=10, help="timed repeats per point (median)")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps {args.reps} must be >= 1")
    measure(args.out, args.reps) if args.part == "measure" else compare(args.out)


if __name__ == "__main__":
    main()
