"""The peers study (experiments/peers.py) end to end on a tiny GPT-2 at world 2, and its pieces.

One smoke run of the stage-3 contenders in two blocks of fresh processes (most of its time is
starting each contender's ranks): DDP, FSDP2 resharding after forward, zero-ref stage 3 and, when
DeepSpeed is installed, its ZeRO-3 releasing parameters after use. Every contender must train exactly as DDP does (fp32 losses equal), move the
paper's elements per parameter, and the outputs must be written."""

import importlib.util
import json

import pandas as pd
import pytest

from experiments import peer_runs, peers
from experiments.peer_report import time_verdict
from experiments.peer_systems import CONTENDERS

TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "512", "--seq", "32", "--batch", "4"]
SMOKE = ["ddp", "fsdp2-reshard", "zero-ref-3", "deepspeed-3-release"]
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("peers")
    rows = peers.main(["--world-size", "2", "--steps", "2", "--rounds", "2", "--contenders", *SMOKE,
                       "--out", str(out), "--quiet", "--timeout", "240", *TINY])
    return out, {r["contender"]: r for r in rows}


@pytest.mark.timeout(600)
def test_every_contender_trains_as_ddp_does_and_moves_the_papers_elements(smoke):
    out, rows = smoke
    assert set(rows) == set(SMOKE)
    ran = [name for name in SMOKE if name != "deepspeed-3-release" or HAS_DEEPSPEED]
    for name in ran:
        row = rows[name]
        assert row["status"] == "ok", (name, row["reason"])
        # two blocks, each from the initial weights: 2 warm-up steps + 1 timed step, twice
        assert row["loss_steps"] == 3 and row["timed_steps"] == 2, name
        assert row["max_loss_diff"] <= peers.LOSS_TOLERANCE, (name, row["max_loss_diff"])
        assert row["loss_equal"] and row["loss_diff_first_steps"] <= row["max_loss_diff"], name
        assert row["final_loss"] == pytest.approx(rows["ddp"]["final_loss"], abs=peers.LOSS_TOLERANCE)
        assert row["median_s"] > 0 and row["ratio_q1"] <= row["ratio_to_ddp"] <= row["ratio_q3"], name
        assert row["other_collective_calls"] == 0, name
    psi = rows["ddp"]["psi"]
    assert psi == 134_912
    # DDP all-reduces every gradient once: exactly 2Ψ; it holds parameters, gradients, its buckets
    # (a second copy of the gradients) and Adam's two moments after backward: 20 B/Ψ (formula 16)
    assert rows["ddp"]["elements_per_param"] == 2.0
    assert rows["ddp"]["moved_all_reduce_per_param"] == 2.0
    assert rows["ddp"]["live_B_per_param"] == pytest.approx(20.0, abs=0.05)
    # zero-ref: the paper's 2Ψ / 3Ψ up to padding and the step's small statistics all-reduce
    row = rows["zero-ref-3"]
    assert 3.0 <= row["elements_per_param"] <= 3.0 + peers.COMM_TOLERANCE, row
    assert row["moved_reduce_scatter_per_param"] == pytest.approx(1.0, abs=1e-3)
    assert row["moved_all_gather_per_param"] == pytest.approx(2.0, abs=1e-3)
    # FSDP2 resharding after forward gathers twice and reduce-scatters once: 3Ψ (up to padding);
    # after backward it holds exactly the stage-3 formula: 16 B/Ψ / Nd
    fsdp = rows["fsdp2-reshard"]
    assert fsdp["elements_per_param"] == pytest.approx(3.0, abs=1e-3)
    # (read after backward: on a fresh CI machine FSDP2 once still held about 1 B/Ψ more, 9.05 against
    # 8.01 here, a buffer of its own not yet freed at the reading; the full study reads 8.01)
    assert fsdp["formula_B_per_param"] - 0.05 <= fsdp["live_B_per_param"] <= fsdp["formula_B_per_param"] + 1.1
    assert fsdp["formula_B_per_param"] == 8.0
    if HAS_DEEPSPEED:   # releasing after use, DeepSpeed gathers twice and reduce-scatters: >= 3Ψ
        assert rows["deepspeed-3-release"]["elements_per_param"] >= 3.0
    else:
        assert rows["deepspeed-3-release"]["status"] == "skipped"
        assert "deepspeed is not installed" in rows["deepspeed-3-release"]["reason"]


def test_outputs_are_written(smoke):
    out, rows = smoke
    table = pd.read_csv(out / "peers.csv")
    assert list(table.contender) == [n for n in CONTENDERS if n in SMOKE]
    steps = pd.read_csv(out / "peers_steps.csv")
    assert len(steps[steps.contender == "zero-ref-3"]) == 2
    assert sorted(steps[steps.contender == "zero-ref-3"].block) == [0, 1]   # one round in each block
    assert set(steps.contender) == {n for n, r in rows.items() if r["status"] == "ok"}
    meta = json.loads((out / "meta.json").read_text())
    assert meta["versions"]["torch"] and meta["git_revision"] and meta["ddp_losses_repeatable"] is True
    assert {c["stage"] for c in meta["goal_check"]} == {3} and meta["blocks"] == 2
    (check,) = meta["goal_check"]
    assert [b["block"] for b in check["versus_best_peer"]["blocks"]] == [0, 1]
    report = (out / "REPORT.md").read_text()
    assert "## World size 2" in report and "## The goal" in report and "| zero-ref-3 | 3 |" in report
    assert (out / "peers.png").stat().st_size > 10_000


def test_goal_check_compares_zero_ref_with_the_best_peer_of_its_stage_round_by_round():
    def row(name, stage, ratio, elements, live, library="torch"):
        return {"world_size": 2, "contender": name, "stage": stage, "library": library, "status": "ok",
                "ratio_to_ddp": ratio, "elements_per_param": elements, "formula_elements_per_param": 2.0,
                "live_B_per_param": live, "formula_B_per_param": 10.0, "cb_allowance_B_per_param": 0.5,
                "loss_equal": True}

    def steps(zero_ref_over_fsdp):
        """12 rounds of stage 2; the machine's speed drifts by up to 30% from round to round (shared by
        every contender of a round), zero-ref's step is the given multiple of FSDP2's in each round."""
        out = []
        for r, factor in enumerate(zero_ref_over_fsdp):
            machine = 1.0 + 0.3 * ((r * 7) % 5) / 4
            for name, step in (("ddp", 0.8), ("deepspeed-2", 1.04), ("fsdp2-no-reshard", 0.96),
                               ("zero-ref-2", 0.96 * factor)):
                out.append({"world_size": 2, "group": 2, "contender": name, "round": r, "step_s": step * machine})
        return pd.DataFrame(out)

    rows = [row("ddp", 0, 1.0, 2.0, 20.0), row("deepspeed-2", 2, 1.3, 3.0, 12.2, "deepspeed"),
            row("fsdp2-no-reshard", 2, 1.2, 2.0, 10.1), row("zero-ref-2", 2, 1.25, 2.0001, 10.4, "zero_ref")]
    slower = [1.03, 1.05] * 6                     # slower in every round: beyond the noise
    (check,) = peers.goal_check(rows, steps(slower))
    assert check["best_peer"] == "fsdp2-no-reshard" and check["versus_best_peer"]["ci_low"] > 1.0
    assert check["time_ok"] is False and not check["holds"] and time_verdict(check) == "**slower**"
    assert check["peers_with_all_three"] == ["fsdp2-no-reshard"]   # DeepSpeed moves 3Ψ

    tie = [0.97, 1.03] * 6                        # as often ahead as behind: a tie within the noise
    (check,) = peers.goal_check(rows, steps(tie))
    assert check["time_ok"] and check["elements_exact"] and check["bytes_ok"] and check["holds"]
    assert time_verdict(check) == "as fast" and check["peers_with_all_three"] == ["fsdp2-no-reshard"]

    faster = [0.95, 0.97] * 6
    (check,) = peers.goal_check(rows, steps(faster))
    assert time_verdict(check) == "faster" and check["peers_with_all_three"] == [] and check["holds"]

    rows[-1]["live_B_per_param"] = 10.6           # above formula + allowance
    assert not peers.goal_check(rows, steps(faster))[0]["holds"]


def test_a_time_verdict_must_hold_in_every_block_of_fresh_processes():
    """Two blocks of 6 rounds. A process set keeps a speed of its own: zero-ref's processes 15% slow
    in one block and not in the other is no verdict; slow in both is."""
    def steps(*blocks):
        out = []
        for block, factors in enumerate(blocks):
            for i, factor in enumerate(factors):
                for name, step in (("ddp", 0.8), ("zero-redundancy-optimizer", 0.9), ("zero-ref-1", 0.9 * factor)):
                    out.append({"world_size": 2, "group": 1, "block": block, "contender": name,
                                "round": 6 * block + i, "step_s": step * (1 + 0.1 * (i % 3))})
        return pd.DataFrame(out)

    slow, tie, fast = [1.15, 1.17] * 3, [0.97, 1.03] * 3, [0.93, 0.95] * 3
    one_slow_block = peers.not_slower(steps(slow, tie), 2, 1, "zero-ref-1", "zero-redundancy-optimizer")
    assert [b["ci_low"] > 1.0 for b in one_slow_block["blocks"]] == [True, False]
    assert one_slow_block["ok"] and one_slow_block["ci_low"] == pytest.approx(0.97)
    assert one_slow_block["ci_high"] == pytest.approx(1.17) and one_slow_block["rounds"] == 12
    assert [b["median"] for b in one_slow_block["blocks"]] == pytest.approx([1.16, 1.0])
    assert not peers.not_slower(steps(slow, slow), 2, 1, "zero-ref-1", "zero-redundancy-optimizer")["ok"]
    both_fast = peers.not_slower(steps(fast, fast), 2, 1, "zero-ref-1", "zero-redundancy-optimizer")
    assert both_fast["ok"] and both_fast["ci_high"] < 1.0
    assert time_verdict({"versus_best_peer": both_fast}) == "faster"
    assert time_verdict({"versus_best_peer": one_slow_block}) == "as fast"


def test_blocks_split_the_work_and_ddp_must_repeat_itself_in_every_block():
    assert peer_runs.split(20, 2) == [10, 10] and peer_runs.split(7, 3) == [3, 2, 2] and peer_runs.split(1, 1) == [1]
    run = {0: [8.0, 8.1], 1: [7.9, 8.0]}
    assert peer_runs.repeatable([run, dict(run), {0: [8.0, 8.1]}])
    assert not peer_runs.repeatable([run, {0: [8.0, 8.1], 1: [7.9, 8.000001]}])


def test_losses_must_equal_ddps_in_the_first_steps_and_later_drift_is_reported():
    ddp = {s: [8.0 - 0.01 * s, 8.1 - 0.01 * s] for s in range(22)}
    # the drift measured at world 4: 1 ulp early, round-off grown by Adam to 3e-5 by the last steps
    drift = {s: [a + (2.4e-7 if s < peers.FIRST_STEPS else 3e-5 * s / 21), b] for s, (a, b) in ddp.items()}
    first, everywhere = peer_runs.loss_differences(drift, ddp)
    assert first == pytest.approx(2.4e-7) and everywhere == pytest.approx(3e-5)
    assert first <= peers.LOSS_TOLERANCE < everywhere
    # a difference in the work itself (DeepSpeed's default clipping: 1.4e-4 by the fourth step) fails
    clipped = {s: [a, b + (1.4e-4 if s >= 3 else 0.0)] for s, (a, b) in ddp.items()}
    assert peer_runs.loss_differences(clipped, ddp)[0] > peers.LOSS_TOLERANCE
    assert peer_runs.loss_differences(ddp, ddp) == (0.0, 0.0)


@pytest.mark.parametrize("argv, message", [
    (["--contenders", "ddp", "deepspeed-4"], "--contenders: invalid choice: 'deepspeed-4'"),
    (["--warmup", "1"], "--warmup must be >= 2"),
    (["--world-size", "3"], "--batch 16 must be divisible by every --world-size, not by 3"),
    (["--steps", "2", "--rounds", "3"], "--rounds 3 must be <= --steps 2"),
    (["--steps", "4", "--blocks", "5"], "--blocks 5 must be <= --rounds 4"),
    (["--blocks", "0"], "--blocks must be >= 1"),
])
def test_bad_input_names_the_flag_and_what_is_allowed(argv, message, capsys):
    with pytest.raises(SystemExit):
        peers.main(argv)
    error = capsys.readouterr().err
    assert message in error
    if "--contenders" in argv:
        assert "zero-ref-3" in error and "fsdp2-reshard" in error   # the allowed names
