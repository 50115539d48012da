"""The walkthrough's timelines (experiments/timeline.py) from a real traced run, and `zero-ref explain`.

One run of the command for stages 1-3 (two gloo ranks, a warm-up step, then one step under
torch.profiler) gives both the terminal output and every rank's rows. The rows must show what the
issue asks: at stage 3, per unit, the gather completes before the unit's forward and backward
computation and the free comes after it, and gradient reductions overlap backward; at stages 1-2,
each bucket's parameter all-gather comes after the update of its shard. The same checks must fail
on deliberately reordered rows, so that they can fail at all.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re

import pytest

from experiments.timeline import check
from zero_ref import cli
from zero_ref.core.labels import label

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def explained(tmp_path_factory):
    """`zero-ref explain --stage 1 2 3 --plain --json PATH`, through the CLI's entry-point dispatch."""
    path = tmp_path_factory.mktemp("explain") / "rows.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        cli.main(["explain", "--stage", "1", "2", "3", "--plain", "--json", str(path)])
    assert done.value.code == 0
    rows = {int(stage): {int(rank): r for rank, r in ranks.items()} for stage, ranks in json.loads(path.read_text()).items()}
    return out.getvalue(), rows


def _lane(rows, lane, prefix):
    return [r for r in rows if r["lane"] == lane and r["what"].startswith(prefix)]


def test_explain_prints_the_step_in_order(explained):
    out, _ = explained
    section = out[out.index("stage 3 (Pos+g+p)"):]
    for words in ("all-gather #", "unit 0 (blocks.0)", "free unit 2 (blocks.2)", "reduce-scatter #", "bytes alive",
                  "== backward", "timeline checks: all hold on every rank", "the paper: 3Ψ"):
        assert words in section, words
    times = [float(m.group(1)) for m in re.finditer(r"^\s+(\d+\.\d+)\s+0\s", section, re.MULTILINE)]
    assert len(times) > 20 and times == sorted(times)
    states, formula = re.search(r"memory_report, rank 0\): ([\d,]+) B; the paper's .*?: ([\d,]+) B", section).groups()
    assert states == formula                 # 16Ψ/Nd bytes of model states, exactly


def test_stage3_gathers_before_use_frees_after_and_reduces_during_backward(explained):
    _, rows = explained
    for rank, r in rows[3].items():
        assert check(r, 3) == [], rank
        computes = _lane(r, "compute", "forward ") + _lane(r, "compute", "backward ")
        assert len(computes) == 6                              # 3 units, forward and backward
        assert len(_lane(r, "collective", "gather unit")) == 6 and len(_lane(r, "buffers", "free unit")) == 6
        backward_end = max(c["end_us"] for c in _lane(r, "compute", "backward "))
        assert any(x["start_us"] < backward_end for x in _lane(r, "collective", "reduce bucket"))


def test_stages_1_2_gather_parameters_after_the_update(explained):
    _, rows = explained
    for stage in (1, 2):
        for rank, r in rows[stage].items():
            assert check(r, stage) == [], (stage, rank)
            regathers = _lane(r, "collective", "regather bucket")
            optimizer = _lane(r, "phase", "optimizer")[0]
            assert len(regathers) == 3 and all(g["start_us"] > optimizer["start_us"] for g in regathers)


def test_the_checks_fail_on_reordered_events(explained):
    _, rows = explained
    stage3 = rows[3][0]

    def broken(stage, rows, edit):
        edited = copy.deepcopy(rows)
        edit(edited)
        return check(edited, stage)

    def gather_late(r):   # the gather of unit 1 completes only after its forward began
        compute = _lane(r, "compute", "forward blocks.1")[0]
        gather = max((g for g in _lane(r, "collective", "gather unit") if g["group"] == compute["group"]
                      and g["start_us"] <= compute["start_us"]), key=lambda g: g["start_us"])
        gather["end_us"] = gather["done_us"] = compute["start_us"] + 1

    def freed_early(r):   # unit 0 freed in the middle of its forward
        compute = _lane(r, "compute", "forward blocks.0")[0]
        free = min((f for f in _lane(r, "buffers", "free unit") if f["group"] == compute["group"]),
                   key=lambda f: f["start_us"])
        free["start_us"] = (compute["start_us"] + compute["end_us"]) / 2

    def reduced_after_backward(r):
        end = max(c["end_us"] for c in _lane(r, "compute", "backward "))
        for x in _lane(r, "collective", "reduce bucket"):
            x["start_us"] = end + 1

    assert any("after the computation starts" in p for p in broken(3, stage3, gather_late))

    def gloo_event_closes_late(r):   # gloo's thread closes its event after the woken waiter went on
        compute = _lane(r, "compute", "forward blocks.1")[0]
        gather = max((g for g in _lane(r, "collective", "gather unit") if g["group"] == compute["group"]
                      and g["start_us"] <= compute["start_us"]), key=lambda g: g["start_us"])
        assert gather["wait_start_us"] is not None and gather["end_us"] <= compute["start_us"]
        gather["done_us"] = compute["start_us"] + 1000

    assert not any("after the computation starts" in p for p in broken(3, stage3, gloo_event_closes_late))
    assert any("freed while gathered" in p for p in broken(3, stage3, freed_early))
    assert any("do not overlap backward" in p for p in broken(3, stage3, reduced_after_backward))

    def gathered_before_update(r):   # bucket 1's parameters all-gathered while its shard is being updated
        update = _lane(r, "compute", "update bucket 1")[0]
        next(g for g in _lane(r, "collective", "regather bucket") if g["group"] == 1)["start_us"] = update["start_us"]

    def gathered_before_step(r):
        _lane(r, "collective", "regather bucket")[0]["start_us"] = _lane(r, "phase", "optimizer")[0]["start_us"] - 1

    for stage in (1, 2):
        assert any("before the update" in p for p in broken(stage, rows[stage][0], gathered_before_update))
        assert any("before the optimizer step" in p for p in broken(stage, rows[stage][0], gathered_before_step))


def test_labels_cost_nothing_without_a_profiler():
    # with no profiler running a label is one shared no-op (the traced run above shows them recorded)
    assert label("zero_ref::x") is label("zero_ref::y", 1) and not hasattr(label("zero_ref::x"), "name")
