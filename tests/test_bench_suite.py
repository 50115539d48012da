"""The scaling regression suite (benchmarks/, experiments/bench_scaling.py): it runs, it matches the
committed baseline's exact quantities, and its gate fails an engine that was deliberately slowed."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from experiments.bench_scaling import BenchRank, BenchSpec, gate, measure, median_ci
from experiments.peer_systems import Setup, block_numel
from experiments.scaling_curves import MODELS
from zero_ref.launch import RankPool

ROOT = Path(__file__).resolve().parents[1]


class SlowBenchRank(BenchRank):
    """A BenchRank whose zero_ref steps take `slowdown_s` longer: the injected regression."""

    slowdown_s = 0.0

    def slow_down(self, seconds: float) -> None:
        self.slowdown_s = seconds

    def _train_step(self, name):
        if name != "ddp":
            time.sleep(self.slowdown_s)
        return super()._train_step(name)


def test_the_suite_bucket_is_one_whole_block():
    """The timed runs' bucket_numel is a GPT-2 block's element count (one bucket, one reduction and
    one stage-3 unit per block), for every model of the suite and the peers' default."""
    for size in MODELS.values():
        block = size.build().transformer.h[0]
        assert size.bucket_numel == block_numel(size.hidden) == sum(p.numel() for p in block.parameters())
    assert Setup().bucket_numel == block_numel(Setup().hidden)


def test_median_interval_is_distribution_free():
    assert median_ci([3.0, 1.0, 2.0]) == (1.0, 3.0)                  # below 6 values: min and max
    values = [float(v) for v in range(12)]
    assert median_ci(values) == (2.0, 9.0)                            # n = 12: the 3rd from each end
    with pytest.raises(ValueError):
        median_ci([])


def test_the_gate_fails_a_slowed_engine_and_any_change_of_bytes_or_elements():
    spec = BenchSpec(model="S", stages=(2,))
    with RankPool(1, SlowBenchRank, spec) as pool:
        # 9 rounds: the median's interval leaves out the extreme round at each end (at 5 it is the
        # min and the max, and on a shared machine one round's DDP step took 5x the others'); a sleep
        # of ten DDP steps: far above what such a machine does to the interval (three were not)
        before = measure(pool, spec, 2, rounds=9, warmup=1)
        pool.call("slow_down", 10 * before["ddp_step_s"]["median"])
        after = measure(pool, spec, 2, rounds=9, warmup=0)
    assert gate(before, before) == []
    failures = gate(before, after)
    assert len(failures) == 1 and failures[0].startswith("step time regressed"), failures
    assert after["ratio_to_ddp"]["median"] > 2 * before["ratio_to_ddp"]["median"]
    assert after["bytes_per_rank"] == before["bytes_per_rank"]             # the sleep moved nothing
    grown = dict(after, bytes_per_rank=dict(after["bytes_per_rank"], grads=after["bytes_per_rank"]["grads"] + 4))
    assert any("bytes per rank changed" in f for f in gate(before, grown))
    assert after["bytes_timing_dependent"] == []                           # stage 2 blocks: exact
    more_buckets = dict(before["bytes_per_rank"], comm_buffers=before["bytes_per_rank"]["comm_buffers"] + 4)
    loose = dict(before, bytes_per_rank=more_buckets, bytes_timing_dependent=["comm_buffers", "total"])
    assert gate(before, loose) == [] and gate(before, dict(loose, bytes_timing_dependent=[]))
    other = dict(before, world_size=2)
    assert gate(other, before)[0].startswith("not the same benchmark")


def test_smoke_of_the_suite_passes_its_gate_against_the_committed_baseline(tmp_path):
    """`pytest benchmarks/ --bench-smoke`: GPT-2 S at Nd 2, every stage under both checks settings,
    3 rounds. Against the committed baseline its bytes and elements must match exactly; time only
    within a doubled threshold, since 3 rounds on a shared CI machine say little."""
    out = tmp_path / "smoke.json"
    # not as an xdist worker (`pytest -n 2`): pytest-benchmark turns itself off where it sees one
    env = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_XDIST")}
    done = subprocess.run([sys.executable, "-m", "pytest", str(ROOT / "benchmarks"), "--benchmark-only",
                           "--bench-smoke", "-q", "-p", "no:cacheprovider", "--gate-threshold=1.0",
                           f"--benchmark-json={out}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    benchmarks = {b["name"]: b["extra_info"] for b in json.loads(out.read_text())["benchmarks"]}
    assert sorted(benchmarks) == sorted(f"test_step[S-nd2-stage{s}{c}]" for s in range(4) for c in ("", "-off"))
    for name, info in benchmarks.items():
        assert info["gate"] == "checked", f"{name}: the committed baseline has no such benchmark"
        psi = info["psi"]
        assert info["formula_elements_over_psi"] == (3 if info["stage"] == 3 else 2)
        # the paper's 2Ψ / 3Ψ plus padding (< Nd per flat group) and the step statistics (grad norm,
        # non-finite flag, which parameters got gradients: a few scalars per parameter tensor)
        assert 0 <= info["elements_total"] - info["formula_elements_over_psi"] * psi < 200, name
        states = sum(info["bytes_per_rank"][k] for k in ("params", "grads", "optimizer_states"))
        assert 0 <= states - info["formula_bytes_per_rank"]["total"] < 16 * 2 * 100, name
    _report_keeps_every_run(out, tmp_path / "report")


def _report_keeps_every_run(run_json, folder):
    """bench_report draws REPORT.md from a run's JSON and keeps each run once in history/bench.csv,
    so the ratio across runs counts every run, and none replaces another."""
    from experiments.bench_report import render

    folder.mkdir()
    (folder / "run.json").write_bytes(run_json.read_bytes())
    for day in ("2026-01-01", "2026-01-01", "2026-01-02"):   # the same run twice, then another
        meta = {"command": "zero-ref bench --smoke", "git_revision": "abc", "date_utc": f"{day}T00:00:00+00:00",
                "exit_status": 0, "threshold": 1.0, "baseline": None, "saved_as": None}
        (folder / "meta.json").write_text(json.dumps(meta))
        rows = render(folder)
    history = pd.read_csv(folder / "history" / "bench.csv")
    assert sorted(history.run_id.value_counts().tolist()) == [8, 8]
    assert ", 2 runs)" in (folder / "REPORT.md").read_text()
    assert rows[-1]["ours"] == "8 benchmarks, pytest exit status 0 (all pass)"
