"""Cluster launch: two torchrun agents on 127.0.0.1 act as two nodes (one rank each, c10d
rendezvous, gloo) and train through the `zero-ref train` command exactly as two spawned ranks do:
the same losses and the same elements moved, written by rank 0 to the CSV it appends to."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from zero_ref.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["train", "--stage", "2", "--dtype", "fp32", "--kernels", "torch", "--steps", "4", "--layers", "2",
         "--hidden", "32", "--heads", "4", "--vocab", "128", "--seq", "16", "--batch", "4"]


def _agent(port: int, csv: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "zero-ref-test",
               "-m", "zero_ref.cli", *TRAIN, "--csv", str(csv)]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.timeout(300)
def test_two_torchrun_nodes_train_like_two_spawned_ranks(tmp_path):
    from zero_ref.cli import main

    torchrun_csv, spawned_csv = tmp_path / "torchrun.csv", tmp_path / "spawned.csv"
    port = free_port()
    agents = [_agent(port, torchrun_csv) for _ in range(2)]
    outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    main([*TRAIN, "--nproc", "2", "--csv", str(spawned_csv)])
    columns = ["rank", "world_size", "first_loss", "last_loss", "elements_moved", "total"]
    torchrun, spawned = (pd.read_csv(path)[columns].sort_values("rank").reset_index(drop=True)
                         for path in (torchrun_csv, spawned_csv))
    assert list(torchrun["rank"]) == [0, 1] and (torchrun.world_size == 2).all()
    pd.testing.assert_frame_equal(torchrun, spawned)


THROUGHPUT = ["--stage", "3", "--layers", "2", "--hidden", "32", "--heads", "4", "--vocab", "128", "--seq", "16",
              "--batch", "2", "--steps", "2", "--warmup", "1", "--profile-steps", "1", "--threads", "1"]


@pytest.mark.timeout(300)
def test_two_torchrun_nodes_time_a_run_like_two_spawned_ranks(tmp_path):
    """experiments/throughput.py (what the SLURM scripts launch) under two torchrun agents: rank 0
    alone writes the row, with the same model, world size and elements moved as a spawned run."""
    from experiments.throughput import main

    port = free_port()
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend",
         "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "zero-ref-throughput", "-m",
         "experiments.throughput", *THROUGHPUT, "--out", str(tmp_path / "torchrun")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    main([*THROUGHPUT, "--world-size", "2", "--out", str(tmp_path / "spawned")])
    columns = ["world_size", "nd", "local_params", "ledger_all_gather", "ledger_reduce_scatter", "moved_all_gather",
               "flops_per_rank"]
    torchrun, spawned = (pd.read_csv(tmp_path / name / "throughput.csv") for name in ("torchrun", "spawned"))
    assert len(torchrun) == 1 and torchrun.world_size.iloc[0] == 2          # one row: rank 0's
    pd.testing.assert_frame_equal(torchrun[columns], spawned[columns])
    # Stage 3 on gloo frees a gradient buffer once a background wait sees its reduction finish, so
    # the peak may differ by up to one buffer: a unit here has 12,704 elements, 51 KB in fp32
    # (measured: 576,308 against 576,180 bytes in one CI run)
    assert abs(torchrun.peak_gb.iloc[0] - spawned.peak_gb.iloc[0]) <= 51e-6 + 1e-9, (torchrun.peak_gb, spawned.peak_gb)
