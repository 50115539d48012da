"""Bounded failure: dead or stuck ranks, one-rank failures, non-finite losses. (Damaged and fuzzed
checkpoints: test_checkpoint_inputs.py.)"""

import multiprocessing
import os
import pickle
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zero_ref
from awkward import AwkwardNet, global_batches, loss_fn, reference_train
from zero_ref.launch import START_METHOD, free_port, spawn

TIMEOUT_S = 2.0
"""The engines' comm_timeout_s where a test waits for it to run out: short, for the suite's time."""


def _doomed_rank(rank, world_size, port, mode, out_dir):
    """Rank 1 dies (or hangs) before backward of step 2; the others must fail within the bound."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    engine = zero_ref.initialize(AwkwardNet(), zero_ref.ZeroConfig(stage=2, lr=1e-2, kernels="torch",
                                                                   comm_timeout_s=TIMEOUT_S))
    for step, (tokens,) in enumerate(global_batches(5, 1, 12)):
        local = tokens.chunk(world_size)[rank]
        loss = loss_fn(engine(local), local)
        if step == 2 and rank == 1:
            if mode == "dies":
                os._exit(3)
            time.sleep(60)
        start = time.monotonic()
        try:
            engine.backward(loss)
            engine.step()
        except Exception as err:   # noqa: BLE001 - the test inspects whatever was raised
            result = (type(err).__name__, str(err), time.monotonic() - start)
            try:   # the ranks may now be at different points: the engine must refuse to go on
                engine.zero_grad()
                result += ("zero_grad went on",)
            except RuntimeError as refused:
                result += (str(refused),)
            Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(result))
            os._exit(0)
    Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(None))


@pytest.mark.parametrize("mode", ["dies", "hangs"])
def test_dead_or_stuck_rank_fails_the_others_within_the_timeout(tmp_path, mode):
    ctx = multiprocessing.get_context(START_METHOD)   # forked from the ranks' server: torch imported
    port = free_port()
    procs = [ctx.Process(target=_doomed_rank, args=(r, 3, port, mode, str(tmp_path))) for r in range(3)]
    for p in procs:
        p.start()
    for r in (0, 2):
        procs[r].join(timeout=120)
    for p in procs:
        p.kill()
    for r in (0, 2):
        name, message, elapsed, afterwards = pickle.loads(Path(tmp_path, f"{r}.pkl").read_bytes())
        assert name == "CollectiveError" and "did not complete" in message, message
        assert "cannot go on" in afterwards, afterwards
        assert elapsed < TIMEOUT_S + 5, elapsed
        if mode == "hangs":
            assert f"within {TIMEOUT_S:g} s" in message and elapsed >= TIMEOUT_S - 0.5
        elif elapsed < 0.8 * TIMEOUT_S:   # the dead rank's connections closed: not a timeout, and not said to be
            assert "the backend gave up after" in message and f"within {TIMEOUT_S:g} s" not in message, message


def _step_fails_on_rank_1(rank, world_size, stage):
    """Rank 1's optimizer raises (as an out-of-memory would) in the second step, after the ranks
    agreed to update; what each rank sees then, and whether its engine goes on."""
    engine = zero_ref.initialize(AwkwardNet(), zero_ref.ZeroConfig(stage=stage, lr=1e-2, kernels="torch",
                                                                   comm_timeout_s=TIMEOUT_S))
    seen = []
    for step, (tokens,) in enumerate(global_batches(3, 1, 12)):
        if step == 1 and rank == 1:
            def out_of_memory(*args, **kwargs):
                raise RuntimeError("out of memory (simulated)")
            engine.stage.optimizer.step = out_of_memory
        local = tokens.chunk(world_size)[rank]
        try:
            engine.backward(loss_fn(engine(local), local))
            seen.append(("stepped", engine.step()))
        except Exception as err:   # noqa: BLE001 - the test inspects whatever was raised
            seen.append((type(err).__name__, str(err)))
            break
    try:
        engine.zero_grad()
        seen.append(("zero_grad went on", ""))
    except RuntimeError as refused:
        seen.append(("refused", str(refused)))
    return seen


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_step_that_raises_on_one_rank_while_updating_stops_every_rank(stage):
    """No rank goes on with a partly updated model: the failing rank raises its error, then refuses
    every call; the others raise CollectiveError within the timeout (in that step's regather at
    stages 1-2, in the next step's first collective at stages 0 and 3), then refuse too."""
    others, failing = spawn(_step_fails_on_rank_1, 2, stage)
    assert failing[:2] == [("stepped", True), ("RuntimeError", "out of memory (simulated)")], failing
    assert failing[2][0] == "refused" and "partly updated" in failing[2][1] and "step 2" in failing[2][1], failing
    assert others[0] == ("stepped", True)
    updated_before_failing = [("stepped", True)] if stage in (0, 3) else []
    assert others[1:-2] == updated_before_failing, others
    assert others[-2][0] == "CollectiveError", others
    assert others[-1][0] == "refused" and "cannot go on" in others[-1][1], others


def _one_rank_calls(rank, world_size, stage, calls):
    """Train 3 steps; after the first, rank r makes calls[r] (None: nothing), as `if rank == 0:
    engine.full_state_dict()` does. What each rank raised, and when."""
    engine = zero_ref.initialize(AwkwardNet(), zero_ref.ZeroConfig(stage=stage, dtype="bf16", lr=1e-2, kernels="torch",
                                                                   comm_timeout_s=TIMEOUT_S))
    seen = []
    start = time.monotonic()
    try:
        for step, (tokens,) in enumerate(global_batches(3, 1, 12)):
            local = tokens.chunk(world_size)[rank]
            engine.backward(loss_fn(engine(local), local))
            engine.step()
            try:
                if step == 0 and calls[rank] == "full_state_dict":
                    engine.full_state_dict()
                elif step == 0 and calls[rank] == "save_checkpoint":
                    engine.save_checkpoint(f"{os.environ['ONE_RANK_CALLS_DIR']}/ckpt")
                elif step == 0 and calls[rank] in ("engine forward", "module forward"):
                    with torch.no_grad():   # an evaluation on this rank only
                        (engine if calls[rank] == "engine forward" else engine.module)(local)
            except ValueError as refused:   # the calls differ: refused on every rank, training goes on
                seen.append(("ValueError", str(refused), time.monotonic() - start))
        seen.append(("trained", sum(v.double().sum().item() for v in engine.full_state_dict().values())))
    except Exception as err:   # noqa: BLE001 - the test inspects whatever was raised
        seen.append((type(err).__name__, str(err), time.monotonic() - start))
    return seen


@pytest.mark.parametrize("stage", [0, 3])
def test_a_collective_call_made_on_one_rank_only_fails_every_rank_within_the_timeout(stage, tmp_path, monkeypatch):
    """`if rank == 0: engine.full_state_dict()`: rank 0's first collective used to pair with rank 1's
    gradient bucket, and gloo aborted the process (stage 0, bf16: SIGABRT, 'Received data size
    doesn't match expected size'). Now every rank raises CollectiveError within the timeout, rank
    0's naming the call."""
    monkeypatch.setenv("ONE_RANK_CALLS_DIR", str(tmp_path))
    first, second = spawn(_one_rank_calls, 2, stage, ["full_state_dict", None])
    (name, message, elapsed), = first
    assert name == "CollectiveError" and message.startswith("rank 0: full_state_dict") and \
        "every rank must make it" in message, message
    assert second[0][0] == "CollectiveError", second
    assert elapsed < TIMEOUT_S + 5 and second[0][2] < TIMEOUT_S + 5, (first, second)


def test_an_evaluation_on_one_rank_only_goes_through_the_model_not_the_engine(tmp_path, monkeypatch):
    """engine(...) is collective (AwkwardNet has a float buffer: broadcast_buffers); on rank 0 alone it
    times out and says what to do instead, and engine.module(...) there changes nothing."""
    monkeypatch.setenv("ONE_RANK_CALLS_DIR", str(tmp_path))
    first, second = spawn(_one_rank_calls, 2, 1, ["engine forward", None])
    (name, message, _), = first
    assert name == "CollectiveError" and "engine.module(...)" in message and "broadcast_buffers" in message, message
    assert second[0][0] == "CollectiveError", second
    first, second = spawn(_one_rank_calls, 2, 1, ["module forward", None])
    assert first == second and first[0][0] == "trained", (first, second)


@pytest.mark.parametrize("stage", [0, 2])
def test_different_collective_calls_at_once_raise_on_every_rank_and_change_nothing(stage, tmp_path, monkeypatch):
    monkeypatch.setenv("ONE_RANK_CALLS_DIR", str(tmp_path))
    first, second = spawn(_one_rank_calls, 2, stage, ["full_state_dict", "save_checkpoint"])
    for seen in (first, second):
        name, message, _ = seen[0]
        assert name == "ValueError" and "rank 0: full_state_dict, rank 1: save_checkpoint" in message, seen
        assert seen[1][0] == "trained", seen
    assert first[1] == second[1], "the ranks must train on as one model"
    assert not list(tmp_path.iterdir()), "nothing may be written"


def _step_on_rank_0_only(rank, world_size, stage, cases):
    """At the second step's boundary only rank 0 calls step(); the others go on to `then` (a
    forward, or full_state_dict). What each raised, then step() everywhere, and the end state."""
    out = []
    for accum, then in cases:
        engine = zero_ref.initialize(AwkwardNet(), zero_ref.ZeroConfig(stage=stage, lr=1e-2, kernels="torch",
                                                                       grad_accum_steps=accum, comm_timeout_s=30))
        seen = []
        for step, micro_batches in enumerate(global_batches(3, accum, 12)):
            for tokens in micro_batches:
                local = tokens.chunk(world_size)[rank]
                engine.backward(loss_fn(engine(local), local))
            if step == 1:
                try:
                    engine.step() if rank == 0 else (engine(local) if then == "forward" else engine.full_state_dict())
                except ValueError as refused:
                    seen.append(str(refused))
            engine.step()
        out.append((seen, engine.full_state_dict()))
        engine.close()
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_step_called_on_some_ranks_only_is_refused_on_every_rank_then_exact(stage):
    """Before, rank 0 updated alone and, at stage 0, went on with a model the others did not have
    (their next call's statistics paired with its step's); at stages 1-2 its regather met their
    gradient reductions. Now every rank raises ValueError at that boundary, nothing is updated, and
    step() everywhere then makes the run exact against AdamW."""
    cases = [(1, "forward"), (2, "full_state_dict")]
    for out in spawn(_step_on_rank_0_only, 2, stage, cases):
        for (accum, then), (seen, state) in zip(cases, out):
            assert len(seen) == 1 and "engine.step() was called at this step boundary on 1 of 2 ranks" in seen[0], \
                (accum, then, seen)
            expected, _ = reference_train(global_batches(3, accum, 12))
            assert max((state[k] - expected[k]).abs().max().item() for k in expected) < 1e-5, (accum, then)


def _nonfinite(rank, world_size):
    out = {}
    for mode in ("error", "skip"):
        engine = zero_ref.initialize(AwkwardNet(), zero_ref.ZeroConfig(stage=1, dtype="bf16", kernels="torch",
                                                                       nonfinite=mode))
        (tokens,) = global_batches(1, 1, 12)[0]
        engine.backward(loss_fn(engine(tokens), tokens) * float("nan"))
        try:
            out[mode] = ("updated", engine.step(), engine.skipped_steps)
        except FloatingPointError as err:
            out[mode] = ("error", str(err))
    return out


def test_nonfinite_loss_in_bf16_errors_or_skips():
    (out,) = spawn(_nonfinite, 1)
    assert out["error"][0] == "error" and "non-finite" in out["error"][1]
    assert out["skip"] == ("updated", False, 1)
