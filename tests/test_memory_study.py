"""The memory study: Table 1, Figure 1 and 1T@1024 from the engine at scale, the max-model-size
search against Table 2, small real runs, and `reproduce --quick` end to end.

One quick reproduce run (under two minutes on 2 cores) is shared by the tests that read its outputs,
so every number asserted here was produced by the code path that writes results/.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pandas as pd
import pytest

from experiments import max_model_size as mms
from experiments import paper_values as pv
from experiments.memory_real_runs import RealRun, one_rank_of, predict
from zero_ref.analysis import memory_model as mm
from zero_ref.analysis.at_scale import ModelShape, exact_shape, measure_at_scale

PAPER = Path(__file__).resolve().parents[1] / "experiments" / "paper_data"


pytestmark = pytest.mark.timeout(600)   # the first test using `quick` also runs the studies


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> Path:
    """`reproduce --quick` without the studies that spawn training ranks and have their own tests
    (comm_volume: test_comm_volume_study, walkthrough: test_timeline, convergence:
    test_convergence, scaling_curves: test_scaling_curves): the same runs twice would cost CI a
    minute for nothing. What is left (memory, activations, zero_r, fragmentation) runs two
    studies at a time, as `--jobs 2` does for users, all of it computing (its time is in the
    suite's --durations), hence this module's longer timeout."""
    from experiments.reproduce import FULL_ONLY, STUDIES, main

    own_tests = {"comm_volume", "walkthrough", "convergence", "scaling_curves"}
    out = tmp_path_factory.mktemp("results")
    longest_first = ["fragmentation", "memory", "zero_r"]   # so that the two workers end together
    rest = [name for name in STUDIES if name not in FULL_ONLY | own_tests | set(longest_first)]
    main(["--quick", "--quiet", "--jobs", "2", "--out", str(out), "--only", *longest_first, *rest])
    return out


# ------------------------------------------------------------------------- without the engine
def test_model_family_counts():
    """GPTLike has exactly gpt2_like_params parameters, and its MP slice what the slice formula says."""
    shape = ModelShape(3, 96, 4, vocab=500, seq=32)
    assert sum(p.numel() for p in shape.build("meta").parameters()) == shape.params
    for mp in (2, 4):
        assert sum(p.numel() for p in shape.build("meta", mp=mp).parameters()) == shape.params_per_mp_rank(mp)
    for psi, hidden, heads in [(7_500_000_000, 8000, 64), (10**12, 25600, 200)]:
        assert exact_shape(psi, hidden, heads).params == psi


def test_search_reproduces_theory_and_is_monotone():
    """With nothing but model states and the whole 32 GB, the search finds Table 2's theory; the
    real search finds less, and more with every stage."""
    bare = mms.Assumptions(device_bytes=32e9, context_bytes=0, fragmentation=0, baseline_fp32_grads=False,
                           cb_buffers=0)
    case = mms.Case("x", 1, 64, 1, 1)
    shape, terms = mms.largest_model(case, bare)
    assert terms["states"] <= 32e9 and shape.params <= mm.max_params_fitting(1, 64, 32e9)
    sizes = [mms.largest_model(mms.Case("x", s, 64, 1, 1), mms.Assumptions())[0].params for s in range(4)]
    assert sizes == sorted(sizes)


def test_engine_at_scale_small_case_with_padding():
    """Nd = 1000 does not divide the groups: the engine pads, within the stated bound."""
    r = measure_at_scale(ModelShape(2, 64, 4, vocab=1000, seq=16), 2, 1000)
    assert r.padding > 0 and r.within_padding and r.tracker_agrees


def test_every_paper_row_has_a_source_and_every_file_is_described():
    """Each CSV row in experiments/paper_data/ names where its numbers come from; the folder's
    README names every file in it."""
    readme = (PAPER / "README.md").read_text()
    files = sorted(p.name for p in PAPER.iterdir() if p.suffix in (".csv", ".md") and p.name != "README.md")
    assert len(files) >= 11 and "zero-paper-facts.md" in files
    for name in files:
        assert f"]({name})" in readme, f"{name} is not described in paper_data/README.md"
        if not name.endswith(".csv"):
            continue
        with (PAPER / name).open(newline="") as f:
            rows = list(csv.DictReader(f))
        columns = ["source"] if "source" in rows[0] else ["tflops_source", "config_source"]
        for i, row in enumerate(rows):
            for column in columns:
                assert row[column].strip(), f"{name} row {i + 2}: no {column}"
            read = [r for r in (row.get("source_of_tflops", ""), row[columns[0]]) if "figure" in r and "read" in r]
            if read or "approx" in ",".join(row):   # a number read from a figure states its uncertainty
                assert any("+-" in r or "±" in r or "uncertain" in r for r in read), f"{name} row {i + 2}"


def test_paper_values_are_the_paper_data():
    """paper_values reads the CSVs; spot checks against cells as printed in the paper."""
    assert pv.TABLE1_GB[("7.5B", 64)] == (31.4, 16.6, 1.88) and pv.TABLE1_GB[("128B", 1024)] == (513, 257, 2)
    assert len(pv.TABLE1_GB) == 18 and pv.TRILLION_AT_1024_GB == 15.6
    assert pv.FIGURE1_GB == {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}
    assert pv.TABLE2_MEASURED_B == {1: (1.3, 6.2), 2: (2.5, 12.5), 4: (5, 25), 8: (10, 50), 16: (20, 100)}
    assert pv.TABLE2_THEORY_B[4] == (8, 30.4, 57.6, 500) and pv.NO_MP_B == {0: 1.4, 2: 13}
    assert pv.FIG6_B == {"C1": 40, "C2": 60, "C3": 50, "C4": 140, "C5": 150}


def test_runs_csv_agrees_with_the_appendix_and_the_figure_readings():
    """runs.csv repeats the appendix configurations (model_configs.csv) and the figure readings
    (fig2/3/4 CSVs) for the throughput studies: every repeated cell must be the same."""
    runs = pd.read_csv(PAPER / "runs.csv", dtype=str, keep_default_na=False)
    configs = pd.read_csv(PAPER / "model_configs.csv", dtype=str, keep_default_na=False)
    same = {"label": "model_size_label", "system": "system", "gpus": "gpus", "mp": "mp_degree",
            "dp": "dp_degree_derived", "layers": "layers", "hidden": "hidden", "heads": "attention_heads",
            "batch_per_gpu": "batch_per_gpu", "total_batch": "total_batch", "zero_config": "zero_config"}
    for figure in ("Fig 2", "Fig 3", "Fig 4", "Fig 8"):
        ours = runs[runs.figure == figure][list(same)].reset_index(drop=True)
        appendix = configs[configs.arxiv_v3_body_figure == figure][list(same.values())].reset_index(drop=True)
        appendix.columns = list(same)
        appendix["zero_config"] = appendix.zero_config.str.split(" ").str[0]   # "C1 (per text)" -> "C1"
        assert ours.to_dict("records") == appendix.to_dict("records"), figure
    readings = {}
    for _, r in pd.read_csv(PAPER / "fig2_throughput.csv").iterrows():
        b = f"{r.model_size_params_B:g}B"
        readings[("Fig 2", b, "ZeRO", 0)] = r.zero100b_tflops_per_gpu_approx
        readings[("Fig 2", b, "Baseline", 0)] = r.baseline_megatron_mp_tflops_per_gpu_approx
    for i, r in pd.read_csv(PAPER / "fig3_superlinear_60B.csv").iterrows():
        readings[("Fig 3", "60B", "ZeRO", i)] = r.per_gpu_tflops_approx
    for _, r in pd.read_csv(PAPER / "fig4_no_mp_128gpus.csv").iterrows():
        system = "Baseline" if r.system.startswith("Baseline") else "ZeRO"
        readings[("Fig 4", f"{r.model_size_params_B:g}B", system, 0)] = r.tflops_per_gpu_approx
    found = {}
    for _, r in runs[runs.paper_tflops_per_gpu != ""].iterrows():
        index = ["64", "128", "256", "400"].index(r.gpus) if r.figure == "Fig 3" else 0
        found[(r.figure, r.label, r.system, index)] = float(r.paper_tflops_per_gpu)
        assert "read from" in r.tflops_source and "0.5" in r.tflops_source
    assert found == readings


def test_real_run_prediction_terms():
    """The unfused optimizer step's temporaries are 12 bytes per element of one bucket_numel chunk
    (the engine updates in constant-size chunks), on top of stage 0's 16 bytes per parameter."""
    run = RealRun()
    p = predict(run, 0, 2)
    assert run.bucket_numel < run.shape.params
    assert p["states"] == 16 * run.shape.params and p["step_temporaries"] == 12 * run.bucket_numel


def test_one_rank_of_a_fake_group_with_real_tensors():
    """The GPU path (real allocations, fake collectives), run on the CPU: peak within 10%."""
    run = RealRun(steps=1)
    for row in one_rank_of(8, run, [3], "cpu"):
        assert row["collectives"] == "fake"
        predicted = predict(run, row["stage"], 8, gloo=False)
        assert row["engine_states"] == pytest.approx(predicted["states"], rel=0.005)
        assert row["peak"] == pytest.approx(predicted["peak"], rel=0.10)


# ---------------------------------------------------------------------- from reproduce --quick
def test_table1_all_54_cells(quick):
    table = pd.read_csv(quick / "memory" / "table1.csv")
    assert len(table) == 54
    assert ((table.engine_gb - table.paper_gb).abs() <= 1.0).all()
    assert ((table.formula_gb - table.paper_gb).abs() <= 1.0).all()
    tracked = table[table.tracker_equals_engine.notna()]
    assert table.within_padding.all() and set(tracked.nd) >= {64} and tracked.tracker_equals_engine.astype(bool).all()
    assert (table.engine_gb * mm.GB - table.analysis_gb * mm.GB <= table.padding_bound_bytes).all()


def test_figure1(quick):
    fig1 = pd.read_csv(quick / "memory" / "figure1.csv").set_index("stage")
    for stage, paper_gb in pv.FIGURE1_GB.items():
        assert fig1.loc[stage, "engine_gb"] == pytest.approx(paper_gb, abs=0.05)
        assert fig1.loc[stage, "tracker_gb"] == fig1.loc[stage, "engine_gb"]


def test_trillion_parameters_at_1024_ranks(quick):
    bench = json.loads((quick / "memory" / "bench_1t.json").read_text())
    assert bench["psi"] == 10**12 and bench["nd"] == 1024 and bench["stage"] == 3
    assert bench["engine_total"] == bench["tracker_total"]
    exact = 16 * 10**12 // 1024                               # 15.625 GB: 16 bytes per parameter / Nd
    assert exact <= bench["engine_total"] <= exact + bench["padding_bound"]
    assert round(bench["engine_total"] / mm.GB, 1) == pv.TRILLION_AT_1024_GB
    assert bench["seconds"] < 60 and bench["max_rss_bytes"] < 2e9


def test_table2_search_against_measured(quick):
    table = pd.read_csv(quick / "memory" / "table2.csv")
    measured = table[table.paper_measured_b.notna()]
    assert len(measured) == 12                      # 5 MP degrees × (baseline, Pos) + the no-MP pair
    assert (measured.error_pct.abs() <= 15).all(), measured[["case", "ours_b", "paper_measured_b"]]
    theory = table[table.study == "Table 2"]
    assert (theory.formula_theory_b - theory.paper_theory_b).abs().max() < 50   # the paper's 0.5T/1T/2T
    confirmed = table[table.engine_states_gb.notna()]
    assert len(confirmed) >= 4
    assert ((confirmed.engine_states_gb - confirmed.states_gb).abs() < 0.01).all()


def test_every_chosen_number_has_its_sensitivity(quick):
    """The search is redone with each chosen number changed in turn; the chosen value reproduces
    table2.csv, and the REPORTs show every assumption's effect."""
    sensitivity = pd.read_csv(quick / "memory" / "table2_sensitivity.csv", keep_default_na=False)
    assert set(sensitivity.assumption) == {name for name, _, _ in mms.VARIANTS}
    table = pd.read_csv(quick / "memory" / "table2.csv")
    measured = table[table.paper_measured_b.notna()].set_index("case").error_pct
    for name, at in sensitivity.groupby("assumption"):
        chosen = at[at.chosen].set_index("case").error_pct
        assert len(chosen) == 12 and len(set(at.value)) >= 2, name
        assert (chosen - measured[chosen.index]).abs().max() < 1e-9, name
    frag = sensitivity[sensitivity.assumption == "fragmentation"].groupby("value").error_pct.apply(
        lambda e: e.abs().mean())
    assert frag["0%"] > frag["15%"] < frag["30%"]            # the chosen share is where the error is small
    for report in (quick / "REPORT.md", quick / "memory" / "REPORT.md"):
        text = report.read_text()
        assert all(f"`{name}`" in text or name in text for name, _, _ in mms.VARIANTS), report


def test_real_runs_predicted_vs_measured(quick):
    runs = pd.read_csv(quick / "memory" / "real_runs.csv")
    assert set(runs.stage) == {0, 1, 2, 3} and set(runs.world) == {2}
    assert (runs.states_error_pct.abs() < 0.5).all()        # padding only
    assert (runs.live_vs_engine_pct.abs() < 0.5).all()      # the tracker sees what the engine reports
    assert (runs.peak_error_pct.abs() <= 10).all(), runs[["stage", "peak_predicted", "peak_measured"]]


def test_reproduce_writes_everything(quick):
    memory = quick / "memory"
    for name in ("table1.csv", "memory_vs_nd.csv", "figure1.csv", "table2.csv", "table2_sensitivity.csv",
                 "max_model_vs_nd.csv", "real_runs.csv", "memory_vs_nd.png", "figure1.png", "max_model_vs_nd.png",
                 "real_runs.png", "REPORT.md", "meta.json", "assumptions.json", "bench_1t.json"):
        assert (memory / name).stat().st_size > 0, name
    for name in ("activations.csv", "REPORT.md", "meta.json", "headline.json"):
        assert (quick / "activations" / name).stat().st_size > 0, name
    meta = json.loads((quick / "meta.json").read_text())
    assert meta["quick"] and meta["git_revision"] and meta["hardware"]["cores"] >= 1
    report = (quick / "REPORT.md").read_text()
    assert report.startswith("# zero-ref against the ZeRO paper") and len(report.splitlines()) <= 120
    rows = {line.split(" | ")[0].lstrip("| "): line for line in report.splitlines() if line.startswith("| ")}
    for artifact in ("Table 1: model states per device, 54 cells", "Fig 1: 7.5B at Nd 64, per stage (GB)",
                     "Sec 1: 1T parameters at Nd 1024, Pos+g+p (GB per rank)", "Fig 4: largest model without MP "
                     "(baseline, ZeRO-100B)", "Sec 3.2, 4.2.1, 6.1: activation memory", "Fig 5 / Sec 10.6: Turing-NLG 17B"):
        assert artifact in rows, artifact
    assert " | ✔ | [memory](memory/REPORT.md) |" in rows["Table 1: model states per device, 54 cells"]
    for section in ("## Not reproduced", "## Chosen and fitted numbers", "one parameter fitted to twelve points",
                    "## Studies", "Sec 3.2: GPT-2 1.5B activations with activation checkpointing"):
        assert section in report, section
    zero_r = quick / "zero_r"
    for name in ("checkpoint_bytes.csv", "comm_per_block.csv", "sec61_100b.csv", "fig6.csv", "cb.csv",
                 "cb_analysis.csv", "zero_r.png", "fig6.png", "REPORT.md", "headline.json"):
        assert (zero_r / name).stat().st_size > 0, name
    checkpoints = pd.read_csv(zero_r / "checkpoint_bytes.csv")
    kept = (checkpoints.device_bytes + checkpoints.host_bytes).groupby(checkpoints["mode"]).max()
    assert kept["pa"] * 2 == kept["plain"] == kept["pa_cpu"] * 2      # MP = 2: half of plain
    assert (checkpoints[checkpoints["mode"] == "pa_cpu"].device_bytes == 0).all()
    cb = pd.read_csv(zero_r / "cb.csv").pivot(index="psi", columns="scheme", values="comm_buffer_bytes")
    small, large = cb.index.min(), cb.index.max()
    assert cb.loc[small, "CB"] == cb.loc[large, "CB"]                      # constant as Ψ grows ~9x
    assert cb.loc[large, "flatten everything"] >= 4 * large > 4 * small >= cb.loc[small, "CB"]
    fig6 = pd.read_csv(zero_r / "fig6.csv")
    assert set(fig6.config) == {"C1", "C2", "C3", "C4", "C5"} and len(fig6) == 15   # 3 fragmentation shares
    for _, at in fig6.groupby("fragmentation"):   # less kept on the GPU, larger models: C1 < C2, C3 < C4 < C5
        size = at.set_index("config").ours_b
        assert size["C1"] < size["C2"] and size["C3"] < size["C4"] < size["C5"]
    comm = pd.read_csv(zero_r / "comm_per_block.csv").set_index(["mode", "early_stop"])
    assert comm.loc[("pa", False), "all_reduce"] == 12 * comm.loc[("pa", False), "all_gather"]   # the paper's 1:12
    assert (checkpoints.arena_bytes == checkpoints.device_bytes + checkpoints.host_bytes).all()   # C1-C5 have MD
    assert (checkpoints.host_traffic_bytes_per_step == 2 * checkpoints.host_bytes).all()       # there and back


def test_fragmentation_measured_and_searched_again(quick):
    """reproduce --quick measures Fig 4's two cases: a share from the trace replayed through the
    allocator model, the search redone with it, the ZeRO case traced without MD too."""
    folder = quick / "fragmentation"
    for name in ("fragmentation.csv", "searches.csv", "fragmentation.png", "REPORT.md", "headline.json"):
        assert (folder / name).stat().st_size > 0, name
    searches = pd.read_csv(folder / "searches.csv")
    assert list(searches.case) == [case.name for case in mms.NO_MP_CASES]
    assert ((searches.fragmentation > 0) & (searches.fragmentation < 0.5)).all()
    for row, case in zip(searches.itertuples(), mms.NO_MP_CASES):   # the answer is the search at the measured share
        shape, _ = mms.largest_model(case, mms.Assumptions(fragmentation=row.fragmentation))
        assert shape.label() == row.ours_shape and shape.params / 1e9 == pytest.approx(row.ours_b)
    assert (searches.trace_peak_gb / searches.accounting_gb).between(0.9, 1.1).all()
    traces = pd.read_csv(folder / "fragmentation.csv")
    assert len(traces) == 5 and set(traces[traces["round"] == 2].md) == {True, False}
    assert (traces.min_capacity_gb >= traces.peak_requested_gb).all()
    assert (traces.min_capacity_gb <= traces.peak_reserved_gb + 1e-9).all()


def test_a_study_that_fails_in_its_own_process_is_named(tmp_path):
    """With --jobs, a study's failure in its worker process reaches the caller naming the study
    (here its results folder cannot be made: `out` is a file) and the timed studies, which would
    run after it, do not start; --jobs below 1 is refused."""
    from experiments.reproduce import main, run_studies

    out = tmp_path / "a_file"
    out.write_text("not a folder")
    with pytest.raises(RuntimeError, match="study activations failed"):
        run_studies(["activations", "walkthrough"], out, quick=True, quiet=True, jobs=2)
    with pytest.raises(SystemExit):
        main(["--jobs", "0", "--out", str(tmp_path)])
