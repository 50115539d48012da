"""Benchmark the fused kernels against torch, in achieved bandwidth and as a fraction of copy speed.

Every kernel here is memory bound, so the honest yardstick is bandwidth: the bytes the job must
move (read once, write once) divided by the time, compared with what a plain device-to-device
copy reaches on the same machine in the same run. Measured jobs (``n`` elements each):

* ``adamw_step``: one mixed-precision AdamW step on a flat shard: fp32 master, bf16 gradient,
  fp32 moments, and a bf16 copy of the new weights. Minimum traffic 28 bytes/element (read
  master 4 + grad 2 + m 4 + v 4; write master 4 + m 4 + v 4 + copy 2). Rows: our fused kernel
  (``triton``, CUDA only), its unfused torch twin, and torch's ``AdamW(fused=True)`` and
  ``AdamW(foreach=True)``, each of which must also upcast the gradient into ``.grad`` and cast
  the weights afterwards: the work the fused kernel absorbs.
* ``unflatten``: a bf16 flat buffer into 200 bf16 tensors (100 weight/bias pairs), 4 bytes/element.
  Rows: ``triton`` (one launch), the torch twin (one copy per tensor), ``torch._foreach_copy_``.
* ``norm``: sum of squares and inf/NaN flag of a bf16 gradient, 2 bytes/element.

Output (``--out``, default results/kernels): bench.csv and meta.json (the run), then bench.png,
README.md and history/bench.csv (every run kept) from experiments/kernels_report.py.
Usage: ``python experiments/bench_kernels.py [--sizes 1M,4M,16M] [--repeats 10] [--out DIR]
[--threads N]``.
"""

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path

import torch
from tqdm import tqdm

# make the repository root importable when run as `python experiments/bench_kernels.py`
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.device_clock import median_seconds  # noqa: E402
from experiments.kernels_report import render  # noqa: E402
from experiments.provenance import git_revision, hardware  # noqa: E402
import triton_kernels  # noqa: E402

BYTES_PER_ELEMENT = {"adamw_step": 28, "unflatten": 4, "norm": 2}
BASELINE = {"adamw_step": ("torch-AdamW-fused+cast", "torch-AdamW-foreach+cast"),
            "unflatten": ("torch-twin",), "norm": ("torch-twin",)}
HYPER = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def parse_sizes(text: str) -> list[int]:
    """Parse ``"1M,4M,256M"`` (K/M/G suffixes, powers of two) into element counts."""
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}
    sizes = []
    for item in text.split(","):
        item = item.strip().upper()
        sizes.append(int(item[:-1]) * scale[item[-1]] if item[-1] in scale else int(item))
    return sizes


def hardware_name(device: torch.device) -> str:
    """Name the hardware: the GPU's name, or the CPU model and core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    info = hardware()
    return f"{info['cpu']} ({info['cores']} cores)"


def copy_bandwidth(device: torch.device, numel: int, repeats: int) -> float:
    """Measure ``dst.copy_(src)`` on ``numel`` fp32 elements; return bytes/s (read + write)."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / median_seconds(lambda: dst.copy_(src), device, repeats)


def _row_name(kernels) -> str:
    """Name a ``triton_kernels`` backend in the results: ``triton`` or ``torch-twin``."""
    return "triton" if kernels.name == "triton" else "torch-twin"


def adamw_jobs(n: int, device: torch.device, kernels: list) -> dict:
    """Return ``{backend: callable}`` doing one mixed-precision AdamW step on ``n`` elements."""
    g = torch.Generator(device=device).manual_seed(0)
    master = torch.randn(n, device=device, generator=g)
    grad = torch.randn(n, device=device, generator=g).to(torch.bfloat16)
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    copy = torch.empty(n, dtype=torch.bfloat16, device=device)
    jobs = {}
    for k in kernels:
        jobs[_row_name(k)] = (lambda k=k: k.fused_adamw_(master, grad, exp_avg, exp_avg_sq, copy,
                                                           step=10, grad_scale=0.5, **HYPER))
    for flavour in ("fused", "foreach"):
        param = torch.nn.Parameter(master.clone())
        param.grad = torch.zeros_like(param)
        try:
            opt = torch.optim.AdamW([param], lr=HYPER["lr"], eps=HYPER["eps"],
                                    weight_decay=HYPER["weight_decay"], **{flavour: True})
            opt.step()  # fails here if this device has no such implementation
        except (RuntimeError, ValueError, TypeError) as err:
            print(f"  torch AdamW({flavour}=True) unavailable on {device}: {err}")
            continue

        def torch_step(param=param, opt=opt):
            """Upcast the bf16 grad into .grad, step, cast the weights: torch's whole job."""
            param.grad.copy_(grad)
            opt.step()
            copy.copy_(param.detach())

        jobs[f"torch-AdamW-{flavour}+cast"] = torch_step
    return jobs


def unflatten_jobs(n: int, device: torch.device, kernels: list) -> dict:
    """Return ``{backend: callable}`` copying a bf16 flat buffer into 100 weight/bias pairs."""
    pairs = 100
    bias = max(1, n // pairs // 1024)
    sizes = [n // pairs - bias, bias] * pairs
    sizes[-2] += n - sum(sizes)
    tensors = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in sizes]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    flat = torch.randn(n, device=device).to(torch.bfloat16)
    jobs = {}
    for k in kernels:
        jobs[_row_name(k)] = lambda k=k: k.unflatten_(flat, tensors, offsets)
    if hasattr(torch, "_foreach_copy_"):
        views = list(flat.split(sizes))
        jobs["torch-foreach_copy"] = lambda: torch._foreach_copy_(tensors, views)
    return jobs


def norm_jobs(n: int, device: torch.device, kernels: list) -> dict:
    """Return ``{backend: callable}`` computing the sum of squares and inf/NaN flag of bf16."""
    grad = torch.randn(n, device=device).to(torch.bfloat16)
    return {_row_name(k): (lambda k=k: k.norm_and_overflow(grad)) for k in kernels}


def run(sizes: list[int], repeats: int, device: torch.device) -> tuple[list[dict], float, str]:
    """Time every job at every size; return the rows, copy bandwidth (B/s) and a note."""
    kernels = [triton_kernels.load("torch")]
    note = ""
    auto = triton_kernels.load("auto", device)  # compiled Triton on CUDA, else torch
    if auto.name == "triton":
        kernels.insert(0, auto)
    else:
        why = ("no CUDA device" if device.type != "cuda"
               else triton_kernels.triton_unavailable_reason() or "TRITON_INTERPRET is set")
        note = (f"Triton rows skipped: they need compiled Triton on CUDA ({why}); "
                "only torch rows were measured.")
        print(note)
    copy_bps = copy_bandwidth(device, max(sizes), repeats)
    print(f"copy bandwidth on {hardware_name(device)}: {copy_bps / 1e9:.1f} GB/s")
    rows = []
    factories = {"adamw_step": adamw_jobs, "unflatten": unflatten_jobs, "norm": norm_jobs}
    tasks = [(op, n) for n in sizes for op in factories]
    for op, n in tqdm(tasks, desc="bench", unit="job"):
        jobs = factories[op](n, device, kernels)
        times = {name: median_seconds(fn, device, repeats) for name, fn in jobs.items()}
        baseline = next((b for b in BASELINE[op] if b in times), None)
        base_s = times[baseline] if baseline else float("nan")
        for name, seconds in times.items():
            gbps = BYTES_PER_ELEMENT[op] * n / seconds / 1e9
            rows.append(dict(device=hardware_name(device), backend=name, op=op, size=n,
                             median_s=seconds, gbps=gbps, frac_copy_bw=gbps * 1e9 / copy_bps,
                             baseline=baseline,
                             speedup_vs_torch=base_s / seconds))
        del jobs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows, copy_bps, note


def write_outputs(out: str, rows: list[dict], meta: dict) -> None:
    """Write the run's tables, bench.csv and meta.json, into ``out``; kernels_report draws them."""
    import pandas as pd

    os.makedirs(out, exist_ok=True)
    pd.DataFrame(rows).to_csv(os.path.join(out, "bench.csv"), index=False)
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)


def main(argv=None) -> None:
    """Parse arguments, run the benchmark, write the outputs."""
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1M,4M,16M,64M,256M" if cuda else "1M,4M,16M",
                        help="comma-separated element counts, K/M/G suffixes (powers of two)")
    parser.add_argument("--repeats", type=int, default=20 if cuda else 5)
    parser.add_argument("--out", default="results/kernels")
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (0: torch's default); 1 is steadier on a busy CPU")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sizes = parse_sizes(args.sizes)
    load_before = os.getloadavg()
    rows, copy_bps, note = run(sizes, args.repeats, device)
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = "not installed"
    meta = dict(command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                git_revision=git_revision(), hardware=hardware_name(device), device=str(device),
                torch=torch.__version__, triton=triton_version, python=platform.python_version(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                sizes=sizes, repeats=args.repeats, copy_numel=max(sizes),
                copy_bandwidth_gbps=copy_bps / 1e9, bytes_per_element=BYTES_PER_ELEMENT,
                baselines=BASELINE, hyperparameters=HYPER, note=note,
                triton_env_interpret=os.environ.get("TRITON_INTERPRET", ""),
                cpu_threads=torch.get_num_threads(),
                load_average_1min_before_after=[load_before[0], os.getloadavg()[0]])
    write_outputs(args.out, rows, meta)
    render(Path(args.out))
    for r in rows:
        print(f"{r['op']:>10} {r['backend']:>26} {r['size']:>11,} {r['median_s'] * 1e3:9.3f} ms "
              f"{r['gbps']:8.1f} GB/s {r['frac_copy_bw']:5.2f} of copy "
              f"x{r['speedup_vs_torch']:.2f}")
    print(f"wrote {args.out}/bench.csv, bench.png, meta.json, README.md")


def run_study(out, quick: bool = False, quiet: bool = False) -> dict:
    """The reproduce entry (full runs only): the benchmark at its default sizes on one torch thread
    into ``out``; its report step (kernels_report.render) gives the headline rows."""
    main(["--out", str(out), "--threads", "1"])
    return {"meta": {}}


if __name__ == "__main__":
    main()
