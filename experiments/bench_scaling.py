"""The scaling regression suite's measurements: each ZeRO stage against DDP, round by round.

What one measurement is: a model (``MODELS``: GPT-2 S, M or L, fp32), a world size Nd and a stage.
Its ranks (a ``zero_ref.launch.RankPool``) hold DDP + ``torch.optim.AdamW(foreach=True)`` and
zero_ref at every stage side by side, built from the same weights, fed the same batches. A
*round* runs one DDP step and one step of the stage under test, in alternating order (DDP first
in even rounds, second in odd ones), each timed on every rank after a barrier (a step takes as
long as its slowest rank). On a shared machine load comes and goes, but within a round it hits
both sides alike, so the suite's measure of time is the **ratio to DDP per round**, summarised by
its median and a distribution-free 95% confidence interval of that median (order statistics):
the run-to-run noise the suite measures itself.

Beside time, two exact quantities: bytes per rank by category (``engine.memory_report()``) and
elements moved per step by collective kind (``CountCollectives``, below the engine, over one
step). They do not depend on the machine's load, so a baseline must match them exactly.

``gate(baseline, current)`` is the regression check (see its docstring); benchmarks/ runs the
measurements under pytest-benchmark and applies it; ``zero-ref bench`` wraps that.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist

import zero_ref
from experiments.peer_systems import EngineSystem, TorchSystem
from experiments.scaling_curves import MODELS
from zero_ref.analysis import memory_model
from zero_ref.analysis.collective_count import CountCollectives
from zero_ref.models import lm_loss, token_batches

THRESHOLD = 0.10
"""How much worse than the baseline a time ratio may get beyond both runs' measured noise."""
FIRST_STEPS = 10
"""Steps over which a stage's losses must equal DDP's to within round-off (fp32). Later they may
drift apart by more: at Nd = 4 DDP's all-reduce and ZeRO's reduce-scatter sum in different orders,
and Adam turns gradients that are zero but for round-off (attention key biases) into full-size
updates, so last-bit differences grow (GPT-2 L at Nd 4: <= 1e-6 for 10 steps, 5e-4 to 2e-3 by step 15)."""


@dataclass(frozen=True)
class BenchSpec:
    """What the ranks of one measurement hold: the model, the stages beside DDP, the batch."""

    model: str = "M"
    stages: tuple[int, ...] = (0, 1, 2, 3)
    checks: tuple[str, ...] = ("strict",)
    """ZeroConfig.checks settings measured for each stage (system_name)"""
    batch_per_rank: int = 4
    lr: float = 1e-3
    weight_decay: float = 0.01
    seed: int = 0
    data_steps: int = 64
    """distinct batches; step k of every system uses batch k mod data_steps"""

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"BenchSpec.model must be one of {sorted(MODELS)}, got {self.model!r}")
        if not self.stages or any(s not in (0, 1, 2, 3) for s in self.stages):
            raise ValueError(f"BenchSpec.stages must be a non-empty subset of 0-3, got {self.stages!r}")
        if not self.checks or any(c not in ("strict", "off") for c in self.checks):
            raise ValueError(f"BenchSpec.checks must be a non-empty subset of ('strict', 'off'), got {self.checks!r}")


def system_name(stage: int, checks: str = "strict") -> str:
    """The name of zero-ref at `stage` with `checks` among a rank's systems: "zero-3", "zero-3-off"."""
    return f"zero-{stage}" + ("" if checks == "strict" else f"-{checks}")


# ------------------------------------------------------------------------------- in every rank
class BenchRank:
    """One rank of a measurement (the RankPool factory): DDP ("ddp") and zero_ref ("zero-s") built
    from the same initial weights; ``step(name)`` runs and times one training step of one system."""

    def __init__(self, rank: int, world_size: int, spec: BenchSpec):
        from torch.nn.parallel import DistributedDataParallel

        self.spec, self.rank = spec, rank
        model = MODELS[spec.model]
        self.psi = sum(p.numel() for p in model.build(spec.seed).parameters())
        ddp = DistributedDataParallel(model.build(spec.seed), bucket_cap_mb=model.bucket_numel * 4 / 2**20)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=spec.lr, weight_decay=spec.weight_decay, foreach=True)
        self.systems = {"ddp": TorchSystem(ddp, optimizer)}
        for stage in spec.stages:       # the sweep's configuration, with the suite's optimizer settings
            for checks in spec.checks:
                config = replace(model.config(stage), lr=spec.lr, weight_decay=spec.weight_decay, checks=checks)
                self.systems[system_name(stage, checks)] = EngineSystem(
                    zero_ref.initialize(model.build(spec.seed), config))
        batches = token_batches(model.vocab, spec.batch_per_rank * world_size, model.seq, rank, world_size,
                                seed=spec.seed + 1)
        self.data = [next(batches)[1] for _ in range(spec.data_steps)]
        self.steps = dict.fromkeys(self.systems, 0)
        self.losses: dict[str, list[float]] = {name: [] for name in self.systems}

    def _train_step(self, name: str) -> torch.Tensor:
        system, tokens = self.systems[name], self.data[self.steps[name] % len(self.data)]
        loss = lm_loss(system.forward(tokens).logits, tokens)
        system.backward(loss)
        system.step()
        self.steps[name] += 1
        return loss

    def step(self, name: str) -> float:
        """One timed step of system `name` (forward, loss, backward, update); its seconds here."""
        dist.barrier()
        start = time.perf_counter()
        loss = self._train_step(name)
        seconds = time.perf_counter() - start
        self.losses[name].append(loss.item())
        return seconds

    def report(self, name: str) -> dict:
        """The exact quantities of system `name`: bytes per rank by category, elements moved in
        one more step by kind, and its losses so far beside DDP's for the same batches."""
        with CountCollectives() as counter:
            self.losses[name].append(self._train_step(name).item())
        if name == "ddp":
            ddp = self.systems["ddp"]
            params = sum(p.numel() * p.element_size() for p in ddp.module.parameters())
            moments = sum(t.numel() * t.element_size() for state in ddp.optimizer.state.values()
                          for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
            memory = {"params": params, "grads": params, "optimizer_states": moments,
                      "total": 2 * params + moments}
        else:
            memory = {k: v for k, v in self.systems[name].engine.memory_report().items()
                      if k in ("params", "grads", "optimizer_states", "buffers", "comm_buffers", "total")}
        diffs = [abs(a - b) for a, b in zip(self.losses[name], self.losses["ddp"])]
        return {"bytes": memory, "bytes_timing_dependent": _timing_dependent(self.systems[name]),
                "elements": dict(counter.moved), "psi": self.psi,
                "max_loss_diff_vs_ddp": max(diffs, default=float("nan")),
                "loss_diff_first_steps": max(diffs[:FIRST_STEPS], default=float("nan")), "compared_steps": len(diffs)}


def _timing_dependent(system) -> list[str]:
    """The byte categories that depend on timing: a gradient reducer that never blocks during
    backward (stage 3 on gloo) reuses a bucket only once its reduction has finished, so how many
    buckets exist at once depends on how fast the reductions ran."""
    buckets = getattr(getattr(getattr(system, "engine", None), "stage", None), "buckets", None)
    return [] if buckets is None or buckets.may_block else ["comm_buffers", "total"]


# ------------------------------------------------------------------------------- on the caller
class PairedRounds:
    """Rounds of (DDP step, system step) on a pool of BenchRanks, DDP first in even rounds and
    second in odd ones. ``before`` / ``step`` / ``after`` are one round's three parts, shaped for
    pytest-benchmark's ``pedantic(target=step, setup=before, teardown=after)``; ``run(n)`` runs n
    rounds without it. Every step's time is its slowest rank's."""

    def __init__(self, pool, system: str):
        self.pool, self.system = pool, system
        self.ddp_s: list[float] = []
        self.system_s: list[float] = []

    def _timed(self, name: str) -> float:
        return max(self.pool.call("step", name))

    def before(self) -> None:
        if len(self.system_s) % 2 == 0:
            self.ddp_s.append(self._timed("ddp"))

    def step(self) -> None:
        self.system_s.append(self._timed(self.system))

    def after(self) -> None:
        if len(self.system_s) % 2 == 0:      # an odd round just ended: DDP goes second
            self.ddp_s.append(self._timed("ddp"))

    def run(self, rounds: int) -> None:
        for _ in range(rounds):
            self.before()
            self.step()
            self.after()

    def summary(self, skip: int = 0) -> dict:
        """Per-round ratios to DDP after the first `skip` (warm-up) rounds: median, 95% CI, values."""
        mine, ddp = self.system_s[skip:], self.ddp_s[skip:len(self.system_s)]
        ratios = [a / b for a, b in zip(mine, ddp)]
        low, high = median_ci(ratios)
        return {"rounds": len(ratios),
                "ratio_to_ddp": {"median": statistics.median(ratios), "ci_low": low, "ci_high": high,
                                 "values": ratios},
                "step_s": {"median": statistics.median(mine), "values": mine},
                "ddp_step_s": {"median": statistics.median(ddp), "values": ddp}}


def median_ci(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval of the median: the k-th smallest and k-th largest
    values, with k the largest order such that P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2.
    Below 6 values no such k exists at 95%, and the interval is (min, max)."""
    ordered, n = sorted(values), len(values)
    if n == 0:
        raise ValueError("median_ci needs at least one value")
    alpha, k, below = (1 - confidence) / 2, 0, 0.0
    while k < n // 2 and below + math.comb(n, k) / 2**n <= alpha:
        below += math.comb(n, k) / 2**n
        k += 1
    k = max(k, 1)
    return ordered[k - 1], ordered[n - k]


def extra_info(spec: BenchSpec, world_size: int, stage: int, summary: dict, report: dict, ddp_report: dict,
               checks: str = "strict") -> dict:
    """The record of one measurement, as stored in pytest-benchmark's extra_info (the baseline's
    schema, read by the gate and by experiments/scaling_curves.py)."""
    model, psi = MODELS[spec.model], report["psi"]
    formula = memory_model.model_state_bytes(psi, stage, world_size, k=8, param_bytes=4, grad_bytes=4)
    elements_total = sum(v for kind, v in report["elements"].items() if kind != "other")   # other: a call count
    return {
        "model": model.name, "layers": model.layers, "hidden": model.hidden, "heads": model.heads,
        "vocab": model.vocab, "seq": model.seq, "psi": psi, "stage": stage, "checks": checks, "world_size": world_size,
        "batch_per_rank": spec.batch_per_rank, "dtype": "fp32", **summary,
        "bytes_per_rank": report["bytes"], "bytes_timing_dependent": report["bytes_timing_dependent"],
        "ddp_bytes_per_rank": ddp_report["bytes"],
        "formula_bytes_per_rank": {"params": formula.params, "grads": formula.grads,
                                   "optimizer_states": formula.optimizer_states, "total": formula.total},
        "elements_per_step": report["elements"], "elements_total": elements_total,
        "elements_over_psi": elements_total / psi,
        # the paper's count; at Nd = 1 nothing is issued below the engine (local copies), so 0 is measured there
        "formula_elements_over_psi": memory_model.comm_volume_elements(psi, stage) / psi,
        "ddp_elements_per_step": ddp_report["elements"],
        "max_loss_diff_vs_ddp": report["max_loss_diff_vs_ddp"], "loss_diff_first_steps": report["loss_diff_first_steps"],
        "compared_steps": report["compared_steps"], "spec": asdict(spec),
    }


def measure(pool, spec: BenchSpec, stage: int, rounds: int, warmup: int, checks: str = "strict") -> dict:
    """One measurement without pytest-benchmark: `warmup` + `rounds` paired rounds, then the
    exact quantities; returns the extra_info record."""
    paired = PairedRounds(pool, system_name(stage, checks))
    paired.run(warmup + rounds)
    return record(pool, spec, stage, paired, warmup, checks)


def record(pool, spec: BenchSpec, stage: int, paired: PairedRounds, warmup: int, checks: str = "strict") -> dict:
    """The extra_info record of rounds already run on `pool`."""
    report = pool.call("report", system_name(stage, checks))[0]
    ddp_report = pool.call("report", "ddp")[0]
    return extra_info(spec, pool.world_size, stage, paired.summary(skip=warmup), report, ddp_report, checks)


# ------------------------------------------------------------------------------------ the gate
def gate(baseline: dict, current: dict, threshold: float = THRESHOLD) -> list[str]:
    """Why `current` regressed from `baseline` (two extra_info records of the same benchmark);
    empty when it did not.

    * time: the ratio to DDP regressed when the lower end of its 95% interval lies above the upper
      end of the baseline's by more than `threshold` (both runs' noise is allowed for, then
      `threshold` more);
    * bytes per rank and elements moved per step are exact: any change at all fails, except in the
      byte categories that depend on timing (`bytes_timing_dependent`: stage 3's gradient buckets
      on gloo), which are reported, not gated.
    """
    for key in ("model", "psi", "stage", "world_size", "batch_per_rank"):
        if baseline[key] != current[key]:
            return [f"not the same benchmark: {key} is {current[key]!r} here and {baseline[key]!r} in the baseline"]
    failures = []
    now, then = current["ratio_to_ddp"], baseline["ratio_to_ddp"]
    if now["ci_low"] > then["ci_high"] * (1 + threshold):
        failures.append(
            f"step time regressed: {now['median']:.3f}x DDP (95% CI {now['ci_low']:.3f}-{now['ci_high']:.3f}) "
            f"against the baseline's {then['median']:.3f}x ({then['ci_low']:.3f}-{then['ci_high']:.3f}); the "
            f"gate allows up to {then['ci_high'] * (1 + threshold):.3f} for the interval's lower end")
    loose = set(current.get("bytes_timing_dependent", ())) | set(baseline.get("bytes_timing_dependent", ()))
    for key, what in (("bytes_per_rank", "bytes per rank"), ("elements_per_step", "elements moved per step")):
        changed = {k: (baseline[key].get(k), current[key].get(k))
                   for k in sorted(set(baseline[key]) | set(current[key]))
                   if baseline[key].get(k) != current[key].get(k) and not (key == "bytes_per_rank" and k in loose)}
        if changed:
            failures.append(f"{what} changed (exact quantities; baseline -> now): {changed}")
    return failures
