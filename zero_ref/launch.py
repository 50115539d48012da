"""Start N ranks on this machine and run a function in each (for the CLI, tests and experiments).

`spawn` starts `world_size` new processes, joins them into one process group on 127.0.0.1 with a
free port, runs `fn(rank, world_size, *args)` in each and returns every rank's (picklable)
result. A rank that raises makes `spawn` raise with that rank's traceback; ranks that do not
finish within `timeout` seconds are killed and `spawn` raises TimeoutError, so a hang never
outlives its budget. Under torchrun use `init_from_env` instead: the launcher has already started
the processes.

`RankPool` keeps its ranks alive between calls: each rank builds an object once, then runs that
object's methods when told, so a benchmark can interleave several systems step by step (or keep
several process groups, one per peer, alive side by side) without paying start-up every time.

Ranks are forked from a *fork server* (multiprocessing's "forkserver" start method; "spawn" where
the platform has none) that has imported torch once: a rank starts in about 0.1 s instead of the
2-3 s a fresh interpreter needs to import torch, and it still inherits no threads and no CUDA state
from the caller (the server never touches CUDA). The server starts with the caller's environment at
the first launch; each rank then takes the caller's environment as it is at its own launch
(`_adopt_environment`), so only what torch reads while it is imported (OMP_NUM_THREADS, TORCH_LOGS)
keeps the first launch's value.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait
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


START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
"""How ranks are started (see the module docstring)."""


def _context():
    """The multiprocessing context ranks start from; its fork server, if any, preloads torch."""
    if START_METHOD == "forkserver":
        mp.set_forkserver_preload(["torch"])   # takes effect when the server first starts
    return mp.get_context(START_METHOD)


def _adopt_environment(environ: dict[str, str]) -> None:
    """Make this rank's environment the caller's at launch (a forked rank starts with the fork
    server's, which is the caller's at its first launch)."""
    for key in set(os.environ) - set(environ):
        del os.environ[key]
    os.environ.update(environ)


def _join_group(rank: int, world_size: int, port: int, backend: str, collective_timeout_s: float) -> None:
    """What torchrun would do for this rank: its environment, its threads, the process group."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=collective_timeout_s))


def _rank_main(rank: int, fn: Callable, world_size: int, port: int, result_dir: str, backend: str,
               collective_timeout_s: float, environ: dict[str, str], args: tuple) -> None:
    _adopt_environment(environ)
    _join_group(rank, world_size, port, backend, collective_timeout_s)
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
        _context()   # for its fork server's preload: start_processes takes the method by name
        context = mp.start_processes(
            _rank_main,
            args=(fn, world_size, free_port(), result_dir, backend, collective_timeout_s, dict(os.environ), args),
            nprocs=world_size, join=False, start_method=START_METHOD)
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


class RankError(RuntimeError):
    """A rank of a RankPool raised; the message holds its traceback. The pool is closed."""


def _pool_rank(rank: int, world_size: int, port: int, backend: str, collective_timeout_s: float, conn,
               environ: dict[str, str], factory: Callable, args: tuple) -> None:
    """One rank of a RankPool: build the object, then serve method calls until told to stop."""
    try:
        _adopt_environment(environ)
        _join_group(rank, world_size, port, backend, collective_timeout_s)
        target = factory(rank, world_size, *args)
        conn.send(("ok", None))
        while (request := conn.recv()) is not None:
            method, call_args, call_kwargs = request
            conn.send(("ok", getattr(target, method)(*call_args, **call_kwargs)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class RankPool:
    """`world_size` ranks on this machine that stay alive between calls.

    Each rank joins one process group (gloo or NCCL, 127.0.0.1, a free port), runs
    `factory(rank, world_size, *args)` once and keeps the object it returns; `pool.call(name, ...)`
    then runs `object.name(...)` on every rank at once and returns the results in rank order.
    A rank that raises, dies or overruns `timeout_s` makes `call` raise (RankError with that
    rank's traceback, or TimeoutError) and closes the pool, since the other ranks may be waiting
    in a collective that will never complete. `factory` must be importable by name.

        with RankPool(2, Trainer, config) as pool:
            losses = pool.call("step", batch_index=0)
    """

    def __init__(self, world_size: int, factory: Callable[..., Any], *args, backend: str = "gloo",
                 timeout_s: float = 600, collective_timeout_s: float = 120):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.timeout_s = world_size, timeout_s
        context = _context()
        port = free_port()
        self._conns, self._processes = [], []
        for rank in range(world_size):
            ours, theirs = context.Pipe()
            process = context.Process(target=_pool_rank, daemon=True, name=f"zero_ref-pool-rank{rank}",
                                      args=(rank, world_size, port, backend, collective_timeout_s, theirs,
                                            dict(os.environ), factory, args))
            process.start()
            theirs.close()
            self._conns.append(ours)
            self._processes.append(process)
        self._collect(f"{getattr(factory, '__name__', factory)}(...)")

    def call(self, method: str, *args, **kwargs) -> list[Any]:
        """Run `method(*args, **kwargs)` on every rank's object; the results in rank order."""
        if not self._conns:
            raise RuntimeError("this RankPool is closed")
        for conn in self._conns:
            conn.send((method, args, kwargs))
        return self._collect(method)

    def _collect(self, what: str) -> list[Any]:
        results: dict[int, Any] = {}
        waiting = dict(enumerate(self._conns))
        deadline = time.monotonic() + self.timeout_s
        while waiting:
            ready = wait(list(waiting.values()), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self.close(kill=True)
                raise TimeoutError(f"ranks {sorted(waiting)} did not finish {what} in {self.timeout_s:.0f} s")
            for rank in [r for r, conn in waiting.items() if conn in ready]:
                try:
                    status, value = waiting.pop(rank).recv()
                except EOFError:
                    status, value = "error", f"rank {rank} exited (code {self._processes[rank].exitcode})"
                if status == "error":
                    self.close(kill=True)
                    raise RankError(f"rank {rank} failed in {what}:\n{value}")
                results[rank] = value
        return [results[rank] for rank in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        """Stop the ranks (politely, or at once with `kill`); a closed pool refuses calls."""
        for conn in self._conns:
            if not kill:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for process in self._processes:
            process.join(timeout=0 if kill else 30)
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self._conns:
            conn.close()
        self._conns, self._processes = [], []

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close(kill=exc[0] is not None)
