"""The `zero-ref` command.

    zero-ref reproduce [--quick]
    zero-ref bench [--smoke] [--save-baseline] [--peers]
    zero-ref explain --stage 3
    zero-ref train --stage 2 --dtype bf16 --nproc 2 --steps 50
    zero-ref consolidate CHECKPOINT OUT

trains a small GPT-2 (built from a config, nothing downloaded) on synthetic sequences with ZeRO,
spawning `--nproc` gloo ranks on this machine, or using the ranks torchrun started
(`torchrun --nproc_per_node 4 -m zero_ref.cli train ...`). Rank 0 shows a progress bar with the
loss, then every rank's memory by category and the elements moved per step.
"""

from __future__ import annotations

import argparse
import os
import sys

from .config import CHECKS, DTYPES, KERNELS, STAGE_NAMES


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a tiny GPT-2 with ZeRO and report memory and communication",
                       description="Train a tiny GPT-2 (models.tiny_gpt2) on synthetic sequences with ZeRO, spawning "
                                   "--nproc gloo ranks (or one process per rank under torchrun), and print each "
                                   "rank's loss, step time, memory by category and elements moved.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--stage", type=int, choices=sorted(STAGE_NAMES), default=2,
                   help="ZeRO stage: 0 plain data parallel, 1 Pos, 2 Pos+g, 3 Pos+g+p")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="parameters and gradients (the optimizer keeps fp32 masters)")
    p.add_argument("--nproc", "--world-size", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--hidden", type=int, default=64, help="hidden size")
    p.add_argument("--heads", type=int, default=4, help="attention heads (must divide --hidden)")
    p.add_argument("--vocab", type=int, default=1000, help="vocabulary size")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--grad-clip", type=float, default=1.0, help="clip the global gradient norm to this")
    p.add_argument("--grad-accum-steps", type=int, default=1, help="backwards per optimizer step")
    p.add_argument("--bucket-numel", type=int, default=2**22,
                   help="elements per gradient bucket (stages 0-2) or most per unit (stage 3): the paper's CB")
    p.add_argument("--no-overlap", action="store_true", help="reduce buckets synchronously")
    p.add_argument("--prefetch", type=int, default=1, help="stage 3: units gathered ahead of the one in use")
    p.add_argument("--kernels", choices=KERNELS, default="auto",
                   help="the optimizer step's kernels: auto is Triton on CUDA, torch elsewhere")
    p.add_argument("--checks", choices=CHECKS, default="strict",
                   help="strict: every cross-rank check and misuse refusal; off: the bare core (default strict)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one GPU per rank, NCCL")
    p.add_argument("--seed", type=int, default=0, help="model and data seed")
    p.add_argument("--csv", help="append one row per rank (memory, comm, step time) to this CSV file")


def _config_from(args):
    from .config import ZeroConfig

    return ZeroConfig(stage=args.stage, dtype=args.dtype, lr=args.lr, grad_clip=args.grad_clip,
                      grad_accum_steps=args.grad_accum_steps, bucket_numel=args.bucket_numel,
                      overlap=not args.no_overlap, prefetch=args.prefetch, kernels=args.kernels, checks=args.checks)


def train_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    """One rank of `zero-ref train`: returns this rank's losses, memory report and comm stats."""
    import time

    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    from .engine import initialize
    from .models import lm_loss, tiny_gpt2, token_batches

    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    model = tiny_gpt2(args.layers, args.hidden, args.heads, args.vocab, max(args.seq, 8), seed=args.seed).to(device)
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    engine = initialize(model, _config_from(args))
    micro_batch = args.batch // args.grad_accum_steps
    batches = token_batches(args.vocab, micro_batch, args.seq, rank, world_size, seed=args.seed + 1)
    losses, step_seconds = [], []
    bar = tqdm(range(args.steps), desc=f"stage {args.stage} {args.dtype} x{world_size}", disable=rank != 0,
               file=sys.stdout)
    for _ in bar:
        start = time.perf_counter()
        step_loss = torch.zeros((), device=device)
        for _ in range(args.grad_accum_steps):
            _, tokens = next(batches)
            tokens = tokens.to(device)
            loss = lm_loss(engine(tokens).logits, tokens)
            engine.backward(loss)
            step_loss += loss.detach().float() / args.grad_accum_steps
        engine.step()
        dist.all_reduce(step_loss, op=dist.ReduceOp.AVG)
        losses.append(step_loss.item())   # (a device sync, so the step time below is complete)
        step_seconds.append(time.perf_counter() - start)
        bar.set_postfix(loss=f"{losses[-1]:.4f}", grad_norm=f"{engine.grad_norm:.3g}", scale=engine.loss_scale)
    warmup = min(3, len(step_seconds) - 1)   # steps left out of the median (compilation, first allocations)
    timed = sorted(step_seconds[warmup:])
    return {"rank": rank, "psi": psi, "losses": losses, "memory": engine.memory_report(), "warmup": warmup,
            "comm": engine.comm_stats()["last_step"], "skipped": engine.skipped_steps,
            "median_step_s": timed[len(timed) // 2],
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}


def _print_train_report(results: list[dict], args) -> None:
    first = results[0]
    psi = first["psi"]
    print(f"\nstage {args.stage} ({STAGE_NAMES[args.stage]}), {args.dtype}, {len(results)} ranks, "
          f"Ψ = {psi:,} parameters; loss {first['losses'][0]:.4f} -> {first['losses'][-1]:.4f}, "
          f"skipped steps {first['skipped']}")
    print(f"{'rank':>4} {'params':>12} {'grads':>12} {'optim':>12} {'buffers':>10} {'CB':>10} {'total':>12}  (bytes)")
    for r in results:
        m = r["memory"]
        print(f"{r['rank']:>4} {m['params']:>12,} {m['grads']:>12,} {m['optimizer_states']:>12,} "
              f"{m['buffers']:>10,} {m['comm_buffers']:>10,} {m['total']:>12,}")
    print("(CB: the constant-size gradient buckets stages 2-3 keep for reuse)")
    comm = first["comm"]
    moved = ", ".join(f"{k} {v:,}" for k, v in comm.items() if k != "total" and v)
    print(f"elements moved per rank in the last step: {comm['total']:,} = {comm['total'] / psi:.3f} Ψ ({moved})")
    print(f"median step time (rank 0, over {len(first['losses']) - first['warmup']} steps after {first['warmup']} "
          f"warm-up): {first['median_step_s'] * 1e3:.1f} ms on {first['device']}")
    if args.csv:
        _append_csv(results, args)


def _append_csv(results: list[dict], args) -> None:
    """One row per rank: what ran, where, and what it measured."""
    import csv
    import datetime
    import subprocess
    from pathlib import Path

    revision = os.environ.get("ZERO_REF_REVISION") or subprocess.run(   # set where .git is not the code's own
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    path = Path(args.csv)
    path.parent.mkdir(parents=True, exist_ok=True)
    memory = ("params", "grads", "optimizer_states", "buffers", "comm_buffers", "total")
    fields = ["date", "git", "device", "stage", "dtype", "world_size", "rank", "psi", "steps", "first_loss",
              "last_loss", "skipped", "median_step_s", *memory, "peak_device_bytes", "elements_moved",
              "elements_moved_over_psi", "command"]
    new = not path.exists()
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        if new:
            writer.writeheader()
        for r in results:
            writer.writerow({
                "date": datetime.datetime.now().isoformat(timespec="seconds"), "git": revision,
                "device": r["device"], "stage": args.stage, "dtype": args.dtype, "world_size": len(results),
                "rank": r["rank"], "psi": r["psi"], "steps": args.steps, "first_loss": r["losses"][0],
                "last_loss": r["losses"][-1], "skipped": r["skipped"], "median_step_s": r["median_step_s"],
                **{k: r["memory"][k] for k in memory}, "peak_device_bytes": r["peak_device_bytes"],
                "elements_moved": r["comm"]["total"], "elements_moved_over_psi": r["comm"]["total"] / r["psi"],
                "command": " ".join(sys.argv)})


def _run_train(args) -> None:
    if args.batch % args.grad_accum_steps:
        raise SystemExit(f"--batch {args.batch} must be divisible by --grad-accum-steps {args.grad_accum_steps}")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:   # under torchrun
        import torch.distributed as dist

        from .launch import init_from_env

        init_from_env("nccl" if args.device == "cuda" else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        _check_batch(args, world)
        result = train_rank(rank, world, args)
        results = [None] * world
        dist.all_gather_object(results, result)
        if rank == 0:
            _print_train_report(results, args)
        dist.destroy_process_group()
        return
    from .launch import spawn

    _check_batch(args, args.nproc)
    backend = "nccl" if args.device == "cuda" else "gloo"
    _print_train_report(spawn(train_rank, args.nproc, args, backend=backend, timeout=3600), args)


def _check_batch(args, world: int) -> None:
    if (args.batch // args.grad_accum_steps) % world:
        raise SystemExit(f"the micro-batch ({args.batch} / {args.grad_accum_steps}) must be divisible by "
                         f"the number of ranks ({world})")


def _consolidate_parser(sub) -> None:
    p = sub.add_parser("consolidate", help="glue a sharded checkpoint into one fp32 state dict (offline, CPU)")
    p.add_argument("checkpoint", help="a checkpoint root (with `latest`), one checkpoint folder, or the folder a "
                                      "model-parallel save was given (holding mp<r>-of-<Nm>/: the slices are joined)")
    p.add_argument("out", help="output folder: model.safetensors, and hf/ for a Hugging Face model")


def _run_consolidate(args) -> None:
    from .io.checkpoint import CheckpointError, consolidate

    try:
        state = consolidate(args.checkpoint, args.out)
    except CheckpointError as err:
        raise SystemExit(f"zero-ref consolidate: {err}")
    print(f"wrote {len(state)} tensors ({sum(t.numel() for t in state.values()):,} values) to {args.out}")


def _plugin(name: str):
    """A command registered by another package under the "zero_ref.commands" entry points (the
    library itself never imports the experiments)."""
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group="zero_ref.commands") if ep.name == name]
    if not found:
        raise SystemExit(f"zero-ref {name}: no package provides this command; install the project with "
                         "`pip install -e .` from its checkout")
    return found[0].load()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["reproduce"]:   # the studies keep their own options: zero-ref reproduce --help
        _plugin("reproduce")(argv[1:])
        return
    if argv[:1] == ["bench"] and "--peers" in argv:   # the peers side by side: options after -- are theirs
        _plugin("peers")([a for a in argv[1:] if a not in ("--peers", "--")])
        return
    if argv[:1] == ["bench"]:       # so does the suite: zero-ref bench --help
        sys.exit(_plugin("bench")(argv[1:]))
    if argv[:1] == ["explain"]:     # and the walkthrough's traced step: zero-ref explain --help
        sys.exit(_plugin("explain")(argv[1:]))
    parser = argparse.ArgumentParser(prog="zero-ref", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("reproduce", help="run every study of the paper at the size this machine allows "
                                     "and write results/ and results/REPORT.md (see zero-ref reproduce --help)")
    sub.add_parser("bench", help="the scaling regression suite (pytest-benchmark, gated against the committed "
                                 "baseline) and, with --peers, the peers side by side (see zero-ref bench --help)")
    sub.add_parser("explain", help="one training step traced and told event by event: gathers, reductions, frees "
                                   "and the bytes alive (see zero-ref explain --help)")
    _train_parser(sub)
    _consolidate_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "train":
        _run_train(args)
    elif args.command == "consolidate":
        _run_consolidate(args)


if __name__ == "__main__":
    main()
