"""The memory-gap study: a 2019 Megatron layer measured with MemTracker fits the stated form, and
each paper point's gap is what our accounting leaves of the device."""

from __future__ import annotations

import pandas as pd
import pytest

from experiments import memory_gap
from experiments.fragmentation_study import search_cases
from experiments.provenance import ROOT


@pytest.fixture(scope="module")
def fit():
    """Five layers: enough for the three coefficients, with one each way of s, h, a, b and Nm."""
    return memory_gap.fit_layer([(1, 128, 64, 4, 1), (1, 256, 64, 4, 1), (1, 128, 128, 8, 1), (2, 128, 64, 4, 2),
                                 (1, 256, 128, 8, 2)])


def test_the_layer_fits_and_its_attention_costs_what_2019_held(fit):
    """Scores, softmax, dropout mask and output: 2 + 2 + 1 + 2 bytes per b·a·s² value, plus the
    backward's gradient of one of them at a time; the fit reproduces every measured layer."""
    layers, coefficients = fit
    assert 7 <= coefficients["beta"] <= 10, coefficients
    assert (layers.fit_error_pct.abs() <= 10).all(), layers
    longer = layers.bytes[1] - layers.bytes[0]           # s 128 -> 256 at b 1, h 64, a 4
    assert longer > 4 * (256 ** 2 - 128 ** 2) * 7      # grows with s², by at least the seven bytes


def test_the_gap_is_what_the_accounting_leaves_of_the_device(fit):
    searches = pd.read_csv(ROOT / "results" / "fragmentation" / "searches.csv").set_index("case")
    study, case, paper_b, family = search_cases(quick=True)[0]
    row = memory_gap.gap_row(study, case, paper_b, family, searches.loc[case.name], fit[1])
    held = row["states_gb"] + row["buffers_gb"] + row["activations_gb"] + row["context_gb"] + row["fragmentation_gb"]
    assert held + row["gap_gb"] == pytest.approx(row["device_gb"], rel=0.03)   # up to part of one layer
    assert row["unexplained_gb"] == pytest.approx(row["gap_gb"] - row["layer_measured_extra_gb"])
    assert row["sequences_to_fill"] > 0 and row["shape"].endswith("x" + searches.loc[case.name].ours_shape.split("x")[1])
