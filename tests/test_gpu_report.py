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


def test_the_host_term_floors_each_phase_at_the_smallest_batch_timed(tmp_path):
    """A phase is predicted no faster than the same model's phase at its smallest timed batch; that
    run is the floor's fit and is not checked; another stage has its own floor."""
    if not (RECORDED / "calibration.json").exists():
        pytest.skip("no GPU calibration is recorded in results/gpu")
    import pandas as pd

    from experiments.gpu_calibrate import compare

    (tmp_path / "throughput").mkdir(parents=True)
    shutil.copy(RECORDED / "calibration.json", tmp_path)
    runs = pd.read_csv(RECORDED / "throughput" / "throughput.csv")
    large = runs[(runs.stage == 2) & (runs.batch == 8)].iloc[0]
    small = large.copy()
    small["batch"], small["forward_s"], small["backward_s"], small["step_s"] = 1, 1.0, 0.001, 0.001
    other = large.copy()
    other["stage"] = 3
    pd.DataFrame([large, small, other]).to_csv(tmp_path / "throughput" / "throughput.csv", index=False)
    rows = pd.DataFrame(compare(tmp_path, show=False)).set_index(["stage", "batch", "phase"])
    checked = rows.loc[(2, 8)]
    assert checked.loc["forward", "predicted_with_host_s"] == 1.0                     # the host bound wins
    assert checked.loc["backward", "predicted_with_host_s"] == checked.loc["backward", "predicted_s"]
    assert checked.loc["whole step", "predicted_with_host_s"] == pytest.approx(
        sum(checked.loc[p, "predicted_with_host_s"] for p in ("forward", "backward", "step")))
    assert rows.loc[(2, 1), "predicted_with_host_s"].isna().all()        # the fit itself
    assert rows.loc[(3, 8), "predicted_with_host_s"].isna().all()        # no smaller stage-3 batch timed
