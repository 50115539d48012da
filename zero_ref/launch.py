"""Start N ranks on this machine and run a function in each (for the CLI, tests and experiments).

`spawn` starts `world_size` fresh processes (the "spawn" start method: no inherited threads or
CUDA state), joins them into one process group on 127.0.0.1 with a free port, runs
`fn(rank, world_size, *args)` in each and returns every rank's (picklable) result. A rank that
raises makes `spawn` raise with that rank's traceback; ranks that do not finish within `timeout`
seconds are killed and `spawn` raises TimeoutError, so a hang never outlives its budget.
Under torchrun use `init_from_env` instead: the launcher has already started the processes.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_from_env(backend: str | None = None, timeout_s: float = 300) -> None:
    """Initialise the default process group from torchrun's environment variables (or as a single
    process when none are set). The backend defaults to NCCL on CUDA and gloo elsewhere."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def _rank_main(rank: int, fn: Callable, world_size: int, port: int, result_dir: str, backend: str,
               collective_timeout_s: float, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=collective_timeout_s))
    try:
        result = fn(rank, world_size, *args)
        with open(Path(result_dir) / f"{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args, backend: str = "gloo", timeout: float = 300,
          collective_timeout_s: float = 120) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` new processes; return their results in
    rank order. `fn` must be importable by name (defined at a module's top level)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    with tempfile.TemporaryDirectory(prefix="zero_ref_spawn_") as result_dir:
        context = mp.start_processes(
            _rank_main, args=(fn, world_size, free_port(), result_dir, backend, collective_timeout_s, args),
            nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise TimeoutError(f"{world_size} ranks running {fn.__name__} did not finish in {timeout:.0f} s")
        results = []
        for rank in range(world_size):
            with open(Path(result_dir) / f"{rank}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results
