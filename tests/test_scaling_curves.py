"""experiments/scaling_curves.py: the engine at scale against the paper's formulas, and the report
it writes from a pytest-benchmark JSON of real runs.

One run (model S; Nd 1, 3, 8 and the real runs' Nd 2; stages 0-3) is shared by the tests: each
at-scale case is a fraction of a second on meta tensors.
"""

import json

import pandas as pd
import pytest

from experiments import scaling_curves as sc
from experiments.scaling_curves_report import render
from zero_ref.analysis import memory_model as mm

S = sc.MODELS["S"]
PSI = mm.gpt2_like_params(S.layers, S.hidden, vocab=S.vocab, seq=S.seq)   # 937,472: the tied head counted once
BROKEN = (1, 2)                                                           # (stage, world) whose real bytes we falsify


def entry(stage: int, world: int) -> dict:
    """A benchmark entry in the suite's schema, with the bytes the paper's formula gives for model S
    in fp32 (K = 8). At Nd 1 and 2 no flat group of S needs padding (Ψ is even) and stages 0-1 keep
    no gradient buckets, so these are exactly the bytes the engine must hold."""
    shards = world if stage >= 1 else 1
    states = {"params": 4 * PSI, "grads": 4 * PSI, "optimizer_states": 8 * PSI // shards}
    if (stage, world) == BROKEN:
        states["optimizer_states"] += 8
    memory = states | {"buffers": 0, "comm_buffers": 0, "total": sum(states.values())}
    info = {"model": "S", "layers": S.layers, "hidden": S.hidden, "heads": S.heads, "vocab": S.vocab, "seq": S.seq,
            "psi": PSI, "stage": stage, "world_size": world, "batch_per_rank": 4, "dtype": "fp32", "rounds": 3,
            "ratio_to_ddp": {"median": 1.1, "ci_low": 1.0, "ci_high": 1.2, "values": [1.0, 1.1, 1.2]},
            "step_s": {"median": 0.11 * world, "values": [0.1, 0.11, 0.12]},
            "ddp_step_s": {"median": 0.1 * world, "values": [0.1, 0.1, 0.1]},
            "bytes_per_rank": memory,
            "ddp_bytes_per_rank": {"params": 4 * PSI, "grads": 4 * PSI, "optimizer_states": 8 * PSI, "total": 16 * PSI},
            # over one rank nothing reaches torch.distributed
            "elements_per_step": {"all_reduce": 2 * PSI if world > 1 else 0}, "elements_total": 2 * PSI if world > 1 else 0,
            "elements_over_psi": 2.0 if world > 1 else 0.0,
            "max_loss_diff_vs_ddp": 0.0}
    return {"name": f"test_step[S-{stage}-{world}]", "params": {}, "stats": {"median": 0.1}, "extra_info": info}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    folder = tmp_path_factory.mktemp("scaling")
    bench = folder / "bench.json"
    bench.write_text(json.dumps({"commit_info": {"id": "abc123"},
                                 "benchmarks": [entry(s, w) for s in (0, 1) for w in (1, 2)]}))
    result = sc.run(folder / "out", bench, quiet=True, models=("S",), nds=(1, 3, 8))
    return folder / "out", result | {"headline": render(folder / "out")}


def test_engine_bytes_are_the_formula_plus_padding(study):
    out, _ = study
    rows = pd.read_csv(out / "scaling_at_scale.csv")
    swept = {(s, nd) for s in range(4) for nd in (1, 3, 8)} | {(s, 2) for s in (0, 1)}   # + the real runs' cases
    assert sorted(zip(rows.stage, rows.nd)) == sorted(swept)
    assert (rows.psi == PSI).all()
    assert ((rows.padding >= 0) & (rows.padding <= rows.padding_bound)).all(), rows[["stage", "nd", "padding"]]
    # Nd 1, 2, 8 divide Ψ: no padding at all, every category is the formula's to the byte
    exact = rows[rows.nd != 3]
    for category in ("params", "grads", "optimizer_states"):
        assert (exact[category] == exact[f"formula_{category}"]).all(), category
    # Nd 3 does not divide Ψ: sharded groups are padded, so the check above is not vacuous there
    assert (rows[(rows.nd == 3) & (rows.stage >= 1)].padding > 0).all()
    assert rows.loc[(rows.stage == 0) & (rows.nd == 8), "engine_total"].item() == 16 * PSI
    assert rows.loc[(rows.stage == 3) & (rows.nd == 8), "engine_total"].item() == 16 * PSI // 8


def test_elements_per_step_are_the_papers_count(study):
    out, _ = study
    rows = pd.read_csv(out / "scaling_at_scale.csv")
    assert (rows.formula_elements_over_psi == rows.stage.map({0: 2, 1: 2, 2: 2, 3: 3})).all()
    # over one rank nothing reaches torch.distributed (local copies), as in a real one-rank run
    assert (rows.elements_total[rows.nd == 1] == 0).all()
    rows = rows[rows.nd > 1]
    excess = rows.elements_over_psi - rows.formula_elements_over_psi
    # never below the paper; above it by padding (< Nd elements per collective and group) plus one
    # all-reduce of the step's statistics (tens of elements), both far under 1e-3 of Ψ here
    assert ((excess > 0) & (excess < 1e-3)).all(), rows[["stage", "nd", "elements_over_psi"]]
    assert (rows.elements_reduce_scatter[rows.stage >= 1] >= PSI).all()
    assert (rows.elements_all_gather[rows.stage == 3] >= 2 * PSI).all()


def test_run_writes_curves_report_and_the_real_run_check(study):
    out, result = study
    for name in ("scaling_at_scale.csv", "scaling_real.csv", "meta.json", "REPORT.md", "bytes_vs_nd.png",
                 "elements_vs_nd.png", "step_time_vs_nd.png", "bytes_vs_psi.png", "elements_vs_psi.png"):
        assert (out / name).stat().st_size > 0, name
    real = pd.read_csv(out / "scaling_real.csv")
    assert len(real) == 4 and real["bytes_per_rank.total"].notna().all()
    report = (out / "REPORT.md").read_text()
    assert "in **3 of 4** runs" in report
    assert "optimizer_states: 3,749,896 real vs 3,749,888 at scale" in report   # the falsified entry, named
    check = next(r for r in result["headline"] if r["item"].startswith("real-run bytes"))
    assert check["ours"].startswith("3/4 equal in every category")
    assert "stage 1 Nd 2" in check["error"]
    assert all(set(r) == {"item", "paper", "ours", "error", "how"} for r in result["headline"])
    meta = json.loads((out / "meta.json").read_text())
    assert meta["bench_commit_info"] == {"id": "abc123"} and meta["part2"] == "read"


def test_load_real_rejects_a_wrong_schema_or_shape(tmp_path):
    bad = entry(0, 1)
    del bad["extra_info"]["ratio_to_ddp"]
    (tmp_path / "a.json").write_text(json.dumps({"benchmarks": [bad]}))
    with pytest.raises(ValueError, match="ratio_to_ddp"):
        sc.load_real(tmp_path / "a.json")
    other = entry(0, 1)
    other["extra_info"]["hidden"] = 64
    (tmp_path / "b.json").write_text(json.dumps({"benchmarks": [other]}))
    with pytest.raises(ValueError, match="shape"):
        sc.load_real(tmp_path / "b.json")


def test_newest_bench_json_prefers_the_last_run_then_the_newest_saved_one(tmp_path):
    assert sc.newest_bench_json(tmp_path) is None
    (tmp_path / "Linux-CPython-3.11-64bit").mkdir()
    for name in ("0002_baseline.json", "0001_baseline.json"):
        (tmp_path / "Linux-CPython-3.11-64bit" / name).write_text("{}")
    assert sc.newest_bench_json(tmp_path).name == "0002_baseline.json"
    (tmp_path / "run.json").write_text("{}")
    assert sc.newest_bench_json(tmp_path) == tmp_path / "run.json"


def test_timing_dependent_bytes_are_shown_not_compared():
    """A category the real run marks timing-dependent (stage 3's buckets on gloo) is listed beside
    the check, not counted against it; unmarked, the same difference is a mismatch."""
    categories = dict.fromkeys(sc.CATEGORIES, 0) | {"params": 4 * PSI}
    at_scale = pd.DataFrame([{"model": "S", "stage": 3, "nd": 1, **categories, "comm_buffers": 2048,
                              "report_total": 4 * PSI + 2048, "psi": PSI, "engine_total": 4 * PSI,
                              "elements_total": 0}])

    def real(marked: list[str]) -> pd.DataFrame:
        bytes_ = {f"bytes_per_rank.{c}": v for c, v in categories.items()} | {
            "bytes_per_rank.comm_buffers": 1024, "bytes_per_rank.total": 4 * PSI + 1024}
        return pd.DataFrame([{"model": "S", "stage": 3, "world_size": 1, **bytes_, "psi": PSI,
                              "real_states": 4 * PSI, "elements_total": 0,
                              "bytes_timing_dependent": json.dumps(marked)}])

    shown = sc.compare_real(real(["comm_buffers", "total"]), at_scale).iloc[0]
    assert shown.bytes_equal and shown.elements_equal and shown.mismatches == ""
    assert "comm_buffers: 1,024 real vs 2,048 at scale" in shown.timing_dependent
    counted = sc.compare_real(real([]), at_scale).iloc[0]
    assert not counted.bytes_equal and "comm_buffers: 1,024 real vs 2,048 at scale" in counted.mismatches
