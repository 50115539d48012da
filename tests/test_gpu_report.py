"""experiments/gpu_report.py: the recorded GPU run (results/gpu, written by gpu_check.sh on a CUDA
machine) summarised without a GPU; and what it says when nothing is recorded."""

import csv
import json
import re
import shutil
from pathlib import Path

import pytest

from experiments.gpu_report import budget_outcome, run_study

RECORDED = Path(__file__).resolve().parents[1] / "results" / "gpu"


def test_the_recorded_run_is_summarised_from_its_own_files(tmp_path):
    if not (RECORDED / "gpu.txt").exists():
        pytest.skip("no GPU run is recorded in results/gpu")
    out = tmp_path / "gpu"
    shutil.copytree(RECORDED, out)
    rows = {row["item"]: row for row in run_study(out)["headline"]}
    with open(RECORDED / "engine_check.csv") as f:
        checks = list(csv.DictReader(f))
    passed = sum(c["pass"] == "True" for c in checks)
    assert rows["engine checks on CUDA (NCCL, world 1)"]["ours"] == f"{passed} of {len(checks)} pass"
    assert sum(item.startswith("engine check failing") for item in rows) == len(checks) - passed
    assert re.fullmatch(r"\d+ passed.*", rows["the kernel tests, Triton compiled"]["ours"])
    with open(RECORDED / "throughput" / "throughput.csv") as f:
        timed = list(csv.DictReader(f))
    assert sum(item.startswith("GPT-2 ") for item in rows) == len(timed)
    # the model's predictions are recomputed here from the recorded calibration, one row per phase
    with open(out / "model_vs_measured.csv") as f:
        assert len(list(csv.DictReader(f))) == 4 * len(timed)
    assert "GPU checks on" in (out / "REPORT.md").read_text()


def test_the_budget_run_is_read_whether_it_ran_or_ran_out(tmp_path):
    (tmp_path / "budget.log").write_text('noise\n{"world_size": 1, "stage": 2, "batch": 3, "peak_gb": 9.5}\n')
    assert budget_outcome(tmp_path) == "batch 3 ran held to the budget: peak 9.50 GB"
    (tmp_path / "budget.log").write_text(
        '  File "/x/zero_ref/optim.py", line 74, in __init__\n'
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.32 GiB. GPU 0 has a total capacity of "
        "139.80 GiB of which 129.29 GiB is free. 9.31 GiB allowed; Of the allocated memory 8.07 GiB is allocated "
        "by PyTorch, and 1.14 GiB is reserved by PyTorch but unallocated.\n")
    assert budget_outcome(tmp_path) == ("out of memory in zero_ref/optim.py __init__: asked for 1.32 GiB with "
                                        "8.07 GiB allocated and 1.14 GiB reserved beside it, 9.31 GiB allowed")
    assert budget_outcome(tmp_path / "missing") == "not run"


def test_nothing_recorded_says_so(tmp_path):
    rows = run_study(tmp_path / "gpu")["headline"]
    assert [row["ours"] for row in rows] == ["no GPU run recorded"]
    assert "No GPU run is recorded" in (tmp_path / "gpu" / "REPORT.md").read_text()
    json.dumps(rows)   # saved as headline.json by reproduce
