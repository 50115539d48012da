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

Output (``--out``, default results/kernels): bench.csv, bench.png, meta.json and README.md.
Usage: ``python experiments/bench_kernels.py [--sizes 1M,4M,16M] [--repeats 10] [--out DIR]
[--threads N]``.
"""

import argparse
import csv
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time

import torch
from tqdm import tqdm

# make the repository root importable when run as `python experiments/bench_kernels.py`
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


def synchronizer(device: torch.device | None):
    """What waits for the device's queued work before a clock is read: ``torch.cuda.synchronize``
    on CUDA, nothing on the CPU (None: the CPU), where every call returns when its work is done."""
    return torch.cuda.synchronize if device is not None and device.type == "cuda" else (lambda: None)


def median_seconds(fn, device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Run ``fn`` ``warmup`` times, then time ``repeats`` calls one by one; return the median.

    On CUDA each timed call is bracketed by ``torch.cuda.synchronize`` so the time covers the
    kernels, not just their launch.
    """
    sync = synchronizer(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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


def write_outputs(out: str, rows: list[dict], copy_bps: float, note: str, meta: dict) -> None:
    """Write bench.csv, bench.png (seaborn), meta.json and a README.md summary into ``out``."""
    import matplotlib
    matplotlib.use("Agg")
    import pandas as pd
    import seaborn as sns

    os.makedirs(out, exist_ok=True)
    df = pd.DataFrame(rows)
    df.to_csv(os.path.join(out, "bench.csv"), index=False)
    grid = sns.relplot(data=df, x="size", y="gbps", hue="backend", col="op", kind="line",
                       marker="o", height=3.5, facet_kws={"sharey": False})
    for ax in grid.axes.flat:
        ax.set_xscale("log", base=2)
        ax.axhline(copy_bps / 1e9, color="grey", linestyle="--", linewidth=1)
    grid.set_axis_labels("elements", "achieved GB/s (dashed: copy bandwidth)")
    grid.figure.suptitle(f"fused kernels vs torch on {meta['hardware']}", y=1.03)
    grid.savefig(os.path.join(out, "bench.png"), dpi=120, bbox_inches="tight")
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    lines = [
        "# Kernel benchmark (generated by experiments/bench_kernels.py; do not edit)", "",
        f"- command: `{meta['command']}`", f"- git revision: {meta['git_revision']}",
        f"- hardware: {meta['hardware']}", f"- date: {meta['date']}",
        f"- torch {meta['torch']}, triton {meta['triton']}, python {meta['python']}, "
        f"torch CPU threads: {meta['cpu_threads']}; 1-min load average before/after: "
        "{:.2f}/{:.2f} (other work on the machine makes timings noisy)".format(
            *meta["load_average_1min_before_after"]),
        f"- copy bandwidth (dst.copy_(src), fp32, {meta['copy_numel']} elements): "
        f"{copy_bps / 1e9:.1f} GB/s", "",
        "GB/s counts the bytes each job must move (adamw_step 28 B/element, unflatten 4, norm 2);"
        " speedup is against the first torch baseline listed in meta.json. A fraction of copy"
        " bandwidth above 1 means the data partly stayed in cache (small sizes on a CPU).", "",
    ]
    if note:
        lines += [f"**{note}**", ""]
    lines += ["| op | backend | elements | median ms | GB/s | of copy bw | speedup vs torch |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['backend']} | {r['size']:,} | {r['median_s'] * 1e3:.3f} | "
                     f"{r['gbps']:.1f} | {r['frac_copy_bw']:.2f} | {r['speedup_vs_torch']:.2f} |")
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


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
    write_outputs(args.out, rows, copy_bps, note, meta)
    for r in rows:
        print(f"{r['op']:>10} {r['backend']:>26} {r['size']:>11,} {r['median_s'] * 1e3:9.3f} ms "
              f"{r['gbps']:8.1f} GB/s {r['frac_copy_bw']:5.2f} of copy "
              f"x{r['speedup_vs_torch']:.2f}")
    print(f"wrote {args.out}/bench.csv, bench.png, meta.json, README.md")


def run_study(out, quick: bool = False, quiet: bool = False) -> dict:
    """The reproduce entry (full runs only): the benchmark at its default sizes on one torch thread
    into ``out``, and one headline row per AdamW-step measurement."""
    from experiments.paper_values import NOT_AN_ERROR

    main(["--out", str(out), "--threads", "1"])
    with open(os.path.join(out, "bench.csv")) as f:
        rows = list(csv.DictReader(f))
    headline = [{"item": f"{r['op']} {r['backend']}, {int(r['size']):,} elements ({r['device']})",
                 "paper": "memory-bound: time set by bytes moved (Sec 3)",
                 "ours": f"{float(r['gbps']):.1f} GB/s = {float(r['frac_copy_bw']):.2f} of copy bandwidth",
                 "error": NOT_AN_ERROR, "how": "real run"} for r in rows if r["op"] == "adamw_step"]
    return {"headline": headline, "meta": {}}


if __name__ == "__main__":
    main()
