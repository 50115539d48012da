"""The communication-volume study (experiments/comm_volume_study.py) at world size 2: every c10d
collective of one step counted below the engine must add up to the paper's 2Ψ (stages 0-2) or 3Ψ
(stage 3), up to padding, besides the step's small statistics all-reduce; and the volumes move when
the paper says (stages 1-2 gather after the update, stage 3 in forward and backward)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from experiments import comm_volume_study as study
from zero_ref.models import ParallelGPT


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    out = tmp_path_factory.mktemp("comm_volume")
    result = study.run_study(out, quick=True)       # world 2, one spawn, every stage
    return out, pd.read_csv(out / "comm_volume.csv"), result["headline"]


@pytest.mark.timeout(120)
def test_counted_elements_are_the_papers_volumes(counted):
    out, frame, headline = counted
    setup = study.Setup()
    psi = sum(p.numel() for p in ParallelGPT(setup.layers, setup.hidden, setup.heads, setup.vocab,
                                             n_positions=setup.seq).parameters() if p.requires_grad)
    assert list(frame.stage) == [0, 1, 2, 3] and set(frame.world) == {2} and (frame.psi == psi).all()
    assert frame.same_on_every_rank.all() and (frame.other == 0).all()
    for r in frame.itertuples():
        paper = (3 if r.stage == 3 else 2) * psi
        assert r.formula == paper
        statistics = r.step_statistics
        assert 0 < statistics < min(1000, psi / 100), r.stage        # a small vector, not a gradient volume
        moved = r.total - statistics
        assert paper <= moved <= paper + r.padding_bound, (r.stage, moved, paper)
        assert r.explained
    by = frame.set_index("stage")
    assert by.loc[0, "all_reduce"] - by.loc[0, "step_statistics"] == 2 * psi          # DP: one all-reduce of Ψ
    for stage in (1, 2):   # reduce-scatter in backward, all-gather of the updated shards in the step
        assert by.loc[stage, "forward_backward"] == by.loc[stage, "reduce_scatter"] >= psi
        assert by.loc[stage, "in_step"] == by.loc[stage, "all_gather"] + by.loc[stage, "step_statistics"]
    assert by.loc[3, "in_step"] == by.loc[3, "step_statistics"]                       # stage 3: all in fwd/bwd
    assert by.loc[3, "all_gather"] >= 2 * psi
    assert len(headline) == 4 and json.loads((out / "meta.json").read_text())["git_revision"]
    assert "counted below the engine" in (out / "REPORT.md").read_text()
