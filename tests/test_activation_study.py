"""The activation study (experiments/activation_study.py): the paper's Sec 3.2 / 4.2.1 / 6.1 numbers
beside zero_ref.analysis.memory_model's, each mismatch computed, nothing typed twice. Arithmetic only: fast."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from experiments import activation_study as study
from experiments.paper_values import headline, number
from zero_ref.analysis import memory_model as mm


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("activations")
    headline_rows = study.run_study(out)["headline"]
    return out, pd.read_csv(out / "activations.csv"), headline_rows


def test_writes_the_csv_report_and_provenance(result):
    out, frame, rows = result
    meta = json.loads((out / "meta.json").read_text())
    assert meta["git_revision"] and meta["hardware"]["cores"] >= 1 and meta["date_utc"]
    report = (out / "REPORT.md").read_text()
    assert "Not reproduced" in report and "what-if" in report
    model = frame[frame.kind == "model"]
    assert len(rows) == len(model) == 8


def test_paper_values_come_from_paper_data_and_ours_from_the_model(result):
    _, frame, _ = result
    for r in frame[frame.paper_quantity != "ratio of the two rows above"].itertuples():
        assert r.paper == number(headline(r.paper_quantity)["value"]), r.item
    model = frame[frame.kind == "model"].set_index("item")
    gb = lambda **kw: mm.activation_bytes(**kw) / mm.GB
    assert model.loc["GPT-2 1.5B activations at seq 1K batch 32 (no checkpointing)", "ours"] == pytest.approx(
        gb(hidden=1600, batch=32, seq=1024, layers=48))
    sec61 = "100B model activation checkpoints per GPU at batch 32 seq 1024 MP 16 (one per layer)"
    assert model.loc[sec61, "ours"] == pytest.approx(gb(hidden=8192, batch=32, seq=1024, layers=125,
                                                        checkpointing=True, nm=16))
    ratio = model[model.index.str.startswith("Pa's reduction")].iloc[0]
    assert ratio.ours == 16 and ratio.paper == pytest.approx(33 / 2)


def test_the_mismatches(result):
    """The docstring's findings, now computed: 60 GB reproduced (+0.7%), 8 GB not (-37%), Sec 6.1's
    33 GB and 2 GB twice ours in fp16 and matched at one byte per value."""
    _, frame, _ = result
    model = frame[frame.kind == "model"]
    failed = set(model[~model.reproduced].section + " " + model[~model.reproduced].paper_quantity)
    assert failed == {"Sec 3.2 GPT-2 1.5B activations with activation checkpointing",
                      "Sec 3.2 GPT-like 100B activations at batch 32 with checkpointing",
                      "Sec 6.1 100B model activation checkpoints per GPU at batch 32 seq 1024 MP 16 (one per layer)",
                      "Sec 6.1 same with Pa"}
    by = {(r.kind, r.item): r for r in frame.itertuples()}
    assert by["model", "GPT-2 1.5B activations with activation checkpointing"].mismatch_pct == pytest.approx(-37.1, abs=0.1)
    for r in model[model.section == "Sec 6.1"].itertuples():
        if r.paper_unit.startswith("GB"):
            assert r.mismatch_pct > 100                      # fp16: about twice the paper
    what_if = frame[(frame.kind == "what-if") & (frame.bytes_per_value == 1)]
    assert len(what_if) == 2 and what_if.reproduced.all()   # one byte per value gives 33 GB and 2 GB
    overhead = by["model", "activation checkpointing recompute overhead"].ours
    assert 30 < overhead < 100 / 3                           # one more forward per forward + 2 backward, less the head
