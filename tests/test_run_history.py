"""Every timed run kept: history/ gains each run once, and the runs committed before history was
kept are added from git (experiments/run_history.py)."""

import json
import subprocess

import pandas as pd

from experiments import run_history


def test_runs_committed_before_history_are_added_once(tmp_path):
    out = tmp_path / "results" / "kernels"
    out.mkdir(parents=True)
    git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    for day, gbps in (("2026-01-01", 8.0), ("2026-01-02", 9.0)):   # two runs, the second replacing the first
        pd.DataFrame({"op": ["adamw_step"], "gbps": [gbps]}).to_csv(out / "bench.csv", index=False)
        (out / "meta.json").write_text(json.dumps({"date": f"{day}T00:00:00+00:00", "git_revision": "abc"}))
        git("add", "-A")
        git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", day)
    assert len(run_history.from_git(out, "bench.csv", tmp_path)) == 2
    assert run_history.from_git(out, "bench.csv", tmp_path) == []   # kept once
    history = run_history.keep(out, "bench.csv")                      # the current run: already there
    assert sorted(history.gbps) == [8.0, 9.0]
    row = run_history.spread(history, ["op"], "gbps").iloc[0]
    assert run_history.described(row, ".1f") == "8.5 (8.0-9.0, 2 runs)"
