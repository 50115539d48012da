"""`zero-ref reproduce` is incremental: a study reruns only when its key (the code it imports, its
arguments, the machine) changed, and REPORT.md marks a study stale by that fact.

The end-to-end test reads keys from a copy of the project, so that it can edit a study's code the
way a developer does, and runs two fast studies (activations: analysis; gpu: a summary).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from experiments import study_key
from experiments.provenance import ROOT, provenance

FAST = ["activations", "gpu"]


def test_reach_follows_imports_strings_and_data():
    """A study's files: its module, what it imports (inside functions too), modules named in code
    strings (run with -m), packages' __init__ files and the data a module reads; not docstrings."""
    files = study_key.file_hashes("experiments.memory_study")
    assert "zero_ref/analysis/at_scale.py" in files              # `python -m zero_ref.analysis.at_scale`
    assert "experiments/paper_data/table1_memory.csv" in files   # read by paper_values
    assert {"experiments/__init__.py", "zero_ref/__init__.py", "zero_ref/core/stage3.py"} <= set(files)
    assert "experiments/peers.py" not in files and "experiments/throughput.py" not in files
    assert any(name.startswith("benchmarks/") for name in study_key.file_hashes("experiments.bench"))
    with pytest.raises(ValueError, match="not a module of zero_ref"):
        study_key.reach("numpy.linalg")


def test_changes_name_what_differs():
    env = {"torch": "2.13.0", "device": "cpu", "cores": 2}
    key = study_key.study_key("activations", "experiments.activation_study", True, ROOT / "results", env)
    assert study_key.changes(key, key) == []
    assert "no key stored" in study_key.changes(None, key)[0]
    edited = json.loads(json.dumps(key))
    edited["files"]["experiments/activation_study.py"] = "0" * 16
    edited["digest"] = "x"
    assert study_key.changes(edited, key) == ["changed: experiments/activation_study.py"]
    other = study_key.study_key("activations", "experiments.activation_study", False, ROOT / "results",
                                env | {"device": "NVIDIA H200"})
    assert study_key.changes(key, other) == ["args: quick=False", "env: device=NVIDIA H200"]


def _copy_project(tmp: Path) -> Path:
    """The project's code (no results, no git) under ``tmp``."""
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for folder in ("zero_ref", "experiments", "triton_kernels", "benchmarks"):
        shutil.copytree(ROOT / folder, tmp / folder, ignore=skip)
    return tmp


def test_rerun_skips_current_studies_and_reruns_a_touched_one(tmp_path, monkeypatch, capsys):
    """Keys are read from a copy of the project (where this test edits code as a developer does);
    the studies themselves run from the installed project, in their own processes."""
    from experiments import reproduce

    tree = _copy_project(tmp_path / "project")
    monkeypatch.setattr(study_key, "ROOT", tree)
    out = tmp_path / "results"
    args = ["--quick", "--out", str(out), "--only", *FAST]

    first = reproduce.main(args)
    assert first["ran"] == sorted(FAST) and (out / ".logs" / "activations.log").exists()
    start = time.perf_counter()
    second = reproduce.main(args)
    seconds = time.perf_counter() - start
    assert second["ran"] == [] and seconds < 30, seconds
    assert "current (not rerun)" in capsys.readouterr().out

    for name in ("activation_study.py", "markdown.py"):   # gpu_report imports markdown too
        path = tree / "experiments" / name
        path.write_text(path.read_text() + "\n# touched\n")
    third = reproduce.main([*args, "--only", "activations"])   # gpu not considered: kept, marked stale
    assert third["ran"] == ["activations"]
    report = (out / "REPORT.md").read_text()
    studies = {line.split("]")[0].lstrip("| ["): line for line in report.splitlines() if line.startswith("| [")}
    assert "stale (changed: experiments/markdown.py" in studies["gpu"]
    assert "current (" in studies["activations"]
    assert reproduce.plan(["activations"], out, True, force=True)[0] == ["activations"]   # --force: current too
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]   # every run kept
    assert [run["studies"] for run in runs] == [sorted(FAST), [], ["activations"]]


def test_a_study_that_reads_one_rerun_reruns_after_it(tmp_path):
    """scaling_curves reads benchmarks' results: when benchmarks reruns, scaling_curves is planned
    too, and runs after it; so do zero_r after fragmentation, throughput after it, gpu after throughput and
    memory_gap after both fragmentation and gpu."""
    from experiments import reproduce
    from experiments.studies import current_keys

    key = current_keys(tmp_path, quick=False)["scaling_curves"]
    (tmp_path / "scaling_curves").mkdir()
    (tmp_path / "scaling_curves" / "headline.json").write_text(json.dumps({"headline": [], "key": key}))
    todo, _, why, _ = reproduce.plan(["scaling_curves", "benchmarks"], tmp_path, False, force=False)
    assert todo == ["benchmarks", "scaling_curves"] and why["scaling_curves"] == ["reads: benchmarks rerun now"]
    # benchmarks then runs; scaling_curves, planned before, stores the reads as they are when it starts
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "headline.json").write_text(json.dumps(
        {"headline": [], "key": {"digest": "new"}, "date_utc": "2026-12-07T17:00:00+00:00"}))
    started = study_key.with_reads_now("scaling_curves", key, tmp_path)
    assert started["reads"]["benchmarks"] == {"digest": "new", "date_utc": "2026-12-07T17:00:00+00:00"}
    assert study_key.changes(started, current_keys(tmp_path, quick=False)["scaling_curves"]) == []
    assert reproduce._after_what_they_read(["zero_r", "memory_gap", "fragmentation", "gpu", "throughput"]) == \
        ["fragmentation", "zero_r", "throughput", "gpu", "memory_gap"]


def test_a_rerun_reaches_the_readers_of_its_readers(tmp_path):
    """throughput reruns; gpu reads it and memory_gap reads gpu, though memory_gap comes before gpu in
    STUDIES: both are planned (one pass in STUDIES order once left memory_gap current-looking, and
    stale right after the run)."""
    from experiments import reproduce
    from experiments.studies import current_keys

    for name in ("fragmentation", "gpu", "memory_gap"):   # each current, with what it reads as it is now
        (tmp_path / name).mkdir()
        key = current_keys(tmp_path, quick=False)[name]
        (tmp_path / name / "headline.json").write_text(json.dumps({"headline": [], "key": key}))
    assert reproduce.plan(["memory_gap", "gpu"], tmp_path, False, force=False)[0] == []
    todo, _, why, _ = reproduce.plan(["memory_gap", "throughput", "gpu"], tmp_path, False, force=False)
    assert sorted(todo) == ["gpu", "memory_gap", "throughput"]
    assert why["gpu"] == ["reads: throughput rerun now"] and why["memory_gap"] == ["reads: gpu rerun now"]


def test_a_change_to_the_report_step_alone_redraws_from_the_tables(tmp_path, monkeypatch):
    """kernels has a report step (kernels_report): its files are the key's "report" part, out of
    what the study measures. Editing it plans a redraw, not a run; the redraw draws the kept tables,
    stores the new report part, keeps the run once in history/, and the next plan has nothing to do."""
    from experiments import reproduce
    from experiments.studies import current_keys

    tree = _copy_project(tmp_path / "project")
    monkeypatch.setattr(study_key, "ROOT", tree)
    measured = study_key.file_hashes("experiments.bench_kernels", ("experiments.kernels_report",))
    assert "experiments/kernels_report.py" not in measured and "experiments/bench_kernels.py" in measured
    out = tmp_path / "results"
    (out / "kernels").mkdir(parents=True)
    for name in ("bench.csv", "meta.json"):
        shutil.copy(ROOT / "results" / "kernels" / name, out / "kernels" / name)
    key = current_keys(out, quick=False)["kernels"]
    (out / "kernels" / "headline.json").write_text(json.dumps({"headline": [], "key": key, **provenance()}))
    assert reproduce.plan(["kernels"], out, False, force=False)[::3] == ([], [])   # current

    report = tree / "experiments" / "kernels_report.py"
    report.write_text(report.read_text() + "\n# a plot fixed\n")
    todo, keys, why, redrawn = reproduce.plan(["kernels"], out, False, force=False)
    assert todo == [] and why["kernels"] == [] and redrawn == ["kernels"]
    assert study_key.changes(key, keys["kernels"], ("report",)) == ["report changed: experiments/kernels_report.py"]
    for _ in range(2):   # twice: the run is kept once
        rows = reproduce.redraw("kernels", out, keys["kernels"])
    assert study_key.stored_key(out, "kernels")["digest"] == key["digest"]   # readers of its tables stay current
    assert rows and all(r["item"].startswith("adamw_step") for r in rows)
    assert (out / "kernels" / "bench.png").exists() and "across runs" in (out / "kernels" / "README.md").read_text()
    history = (out / "kernels" / "history" / "bench.csv").read_text().splitlines()
    assert len(history) == len((out / "kernels" / "bench.csv").read_text().splitlines())   # one header, one run
    assert reproduce.plan(["kernels"], out, False, force=False)[::3] == ([], [])
    done = reproduce.main(["--out", str(out), "--quiet", "--redraw", "kernels"])   # on demand, from the CLI
    assert done["ran"] == [] and done["redrawn"] == ["kernels"]
    with pytest.raises(SystemExit):   # no tables to draw
        reproduce.main(["--out", str(out), "--quiet", "--redraw", "peers"])
