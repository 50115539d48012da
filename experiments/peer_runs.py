"""How the peers study (experiments/peers.py) runs its contenders: stage by stage, in blocks of
freshly started processes, each block in rounds.

A stage's group is DDP (the baseline) plus that stage's contenders. The group runs ``blocks``
times. Each block starts every member's ranks anew (``zero_ref.launch.RankPool``: its own
processes and process group), trains steps 0..n-1 from the initial weights on the same batches,
and closes them again:

* warm-up: ``warmup`` untimed steps per member, the last one measured (collectives counted, live
  bytes read);
* rounds: the block's share of the timed steps, in rounds; in each round every member runs its
  share of steps, in an order rotated every round, so a slow minute of the shared machine falls on
  every member of the round.

Why blocks: a process set keeps a speed of its own for its whole life. Measured at 42041ba
(world 2, GPT-2 4x256, fp32, 20 rounds): zero-ref stage 1 over ZeroRedundancyOptimizer was
1.174 (95% CI 1.047-1.271) in one run and 0.94 in another, while both built side by side in
the same processes gave 0.960-0.973. Pairing by round removes the machine's minute-to-minute
noise, not that. Fresh processes per block sample it, and the verdict (peers.not_slower) asks
every block.

One stage at a time also keeps memory in bounds: all 14 contenders' ranks at world 4 would be 56
processes of about 0.4 GB.
"""

from __future__ import annotations

import math
import statistics
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from experiments.bench_scaling import FIRST_STEPS
from experiments.peer_systems import CONTENDERS, PeerRank, Setup
from zero_ref.launch import RankError, RankPool


def groups(names: list[str]) -> dict[int, list[str]]:
    """stage -> the chosen contenders of that stage other than DDP, in table order."""
    out: dict[int, list[str]] = {}
    for name, contender in CONTENDERS.items():
        if name in names and name != "ddp":
            out.setdefault(contender.stage, []).append(name)
    return out or {0: []}


def split(total: int, parts: int) -> list[int]:
    """`total` split into `parts` counts that differ by at most one, the larger first."""
    return [total // parts + (b < total % parts) for b in range(parts)]


def run_world(world: int, names: list[str], setup: Setup, args, progress) -> tuple[dict, list[dict]]:
    """Run every chosen contender at one world size, each stage's group in ``args.blocks`` blocks;
    return {name: record} (with "_ddp_losses": DDP's losses of every block) and the timed steps."""
    records = {name: {"status": "ok", "reason": "", "stage": CONTENDERS[name].stage, "losses": {},
                      "measured": []} for name in names}
    for name in names:
        if why := CONTENDERS[name].missing():
            records[name].update(status="skipped", reason=why)
    records["_ddp_losses"] = []
    step_rows: list[dict] = []
    steps, rounds = split(args.steps, args.blocks), split(args.rounds, args.blocks)
    for group_index, (stage, members) in enumerate(groups(names).items()):
        first_round = 0
        for block in range(args.blocks):
            progress.set_postfix_str(f"world {world}: starting stage {stage}, block {block + 1}/{args.blocks}")
            alive = ["ddp"] + [n for n in members if records[n]["status"] == "ok"]
            pools = start_pools(alive, world, setup, args.timeout, records)
            try:
                if "ddp" not in pools:
                    raise RuntimeError(f"DDP, the baseline, did not start: {records['ddp']['reason']}")
                plan = Block(world, stage, block, first_round, rounds[block], steps[block], args.warmup,
                             ddp_row=group_index == 0 and block == 0)
                run_block(plan, pools, records, progress, step_rows)
            finally:
                close_pools(list(pools.values()))
            first_round += rounds[block]
    return records, step_rows


@dataclass(frozen=True)
class Block:
    """One block of one stage's group: its rounds (numbered on across blocks) and timed steps.
    `ddp_row`: DDP's losses of this block make DDP's row (its first group's first block)."""

    world: int
    stage: int
    index: int
    first_round: int
    rounds: int
    steps: int
    warmup: int
    ddp_row: bool


def start_pools(names: list[str], world: int, setup: Setup, timeout: float, records: dict) -> dict[str, RankPool]:
    """The contenders' ranks, started side by side (start-up is mostly imports: both cores busy);
    a contender that fails to start gets the reason in its record instead."""

    def start(name: str) -> RankPool | None:
        try:
            return RankPool(world, PeerRank, name, setup, timeout_s=timeout, collective_timeout_s=timeout)
        except (RankError, TimeoutError) as error:
            records[name].update(status="failed", reason=last_line(error))
            return None

    with ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:
        started = dict(zip(names, pool.map(start, names)))
    return {name: p for name, p in started.items() if p is not None}


def close_pools(pools: list[RankPool]) -> None:
    """Close side by side (each rank takes a second or two to leave its process group and exit)."""
    with ThreadPoolExecutor(max_workers=max(1, len(pools))) as executor:
        list(executor.map(RankPool.close, pools))


def last_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def run_block(plan: Block, pools: dict[str, RankPool], records: dict, progress, step_rows: list[dict]) -> None:
    """Warm-up (the last step measured), then the block's timed rounds, for DDP and one stage's
    contenders; a contender that fails is dropped from the block (DDP failing ends the study)."""
    losses: dict[str, dict[int, list[float]]] = {name: {} for name in pools}

    def run(name: str, step: int, measure: bool = False, round_index: int = -1) -> None:
        try:
            by_rank = pools[name].call("step", step, measure=measure)
            if measure:
                pools[name].call("stop_recording")
        except (RankError, TimeoutError) as error:
            if name == "ddp":
                raise
            records[name].update(status="failed", reason=f"block {plan.index + 1}, step {step}: {last_line(error)}")
            del pools[name]   # the pool closed itself
            return
        losses[name][step] = [r["loss"] for r in by_rank]
        if measure:
            records[name]["measured"] += by_rank
        elif round_index >= 0:
            slowest = max(by_rank, key=lambda r: r["step_s"])
            step_rows.append({"world_size": plan.world, "group": plan.stage, "block": plan.index, "contender": name,
                              "round": round_index, "step": step,
                              **{k: slowest[k] for k in ("step_s", "forward_s", "backward_s", "optimizer_s")},
                              "loss": statistics.fmean(r["loss"] for r in by_rank)})

    for name in list(pools):
        for step in range(plan.warmup):
            if name in pools:
                run(name, step, measure=step == plan.warmup - 1)
    per_round = math.ceil(plan.steps / plan.rounds)
    end = plan.warmup + plan.steps
    for r in range(plan.rounds):
        order = list(pools)
        turn = plan.first_round + r
        for name in order[turn % len(order):] + order[:turn % len(order)]:
            first = plan.warmup + r * per_round
            for step in range(first, min(first + per_round, end)):
                if name in pools:
                    run(name, step, round_index=turn)
        progress.update(1)
        progress.set_postfix_str(f"world {plan.world}, stage {plan.stage}, block {plan.index + 1}")
    for name, by_step in losses.items():
        if name == "ddp":
            records["_ddp_losses"].append(by_step)
            if not plan.ddp_row:
                continue   # every block's DDP losses are checked equal (repeatable)
        rec = records[name]
        rec["losses"].update(by_step)
        if name != "ddp" and rec["status"] == "ok":
            first, everywhere = loss_differences(by_step, losses["ddp"])
            rec["loss_diff_first_steps"] = max(first, rec.get("loss_diff_first_steps", 0.0))
            rec["max_loss_diff"] = max(everywhere, rec.get("max_loss_diff", 0.0))


def loss_differences(losses: dict[int, list[float]], ddp_losses: dict[int, list[float]]) -> tuple[float, float]:
    """(the largest |loss - DDP's| over ranks in the first FIRST_STEPS steps, the largest over all
    steps) for per-step, per-rank losses {step: [loss of rank 0, rank 1, ...]}."""
    diffs = {s: max(abs(a - b) for a, b in zip(by_rank, ddp_losses[s])) for s, by_rank in losses.items()}
    return max((d for s, d in diffs.items() if s < FIRST_STEPS), default=0.0), max(diffs.values(), default=0.0)


def repeatable(runs: list[dict[int, list[float]]]) -> bool:
    """Did every run (DDP's, once per block) give the same losses at every step they share?"""
    seen: dict[int, list[float]] = {}
    return all(seen.setdefault(step, by_rank) == by_rank for run in runs for step, by_rank in run.items())
