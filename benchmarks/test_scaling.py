"""The scaling regression suite: every stage's step time as a ratio to DDP, bytes per rank and
elements moved per step, per GPT-2 size and world size, gated against a committed baseline.

Each benchmark runs paired rounds (experiments/bench_scaling.py): a DDP step and a step of the
stage, in alternating order, in the same ranks. pytest-benchmark times the stage's steps (its
table shows seconds per step as the caller sees them) and stores the suite's own measures in
``extra_info``: the per-round ratio to DDP with its median and 95% interval, the slowest rank's
step times, bytes per rank by category and elements moved per step by kind, with the paper's
formula beside them. The gate (``bench_scaling.gate``) then fails the benchmark when the ratio
regressed beyond both runs' noise by more than ``--gate-threshold``, or when bytes or elements
changed at all.
"""

from experiments.bench_scaling import FIRST_STEPS, PairedRounds, gate, record, system_name

LOSS_TOLERANCE = 1e-5
"""fp32: in its first FIRST_STEPS steps every stage must train as DDP does, to round-off
(observed: identical, or 1 ulp at Nd = 4). Later steps are recorded, not checked (FIRST_STEPS says why)."""


def test_step(benchmark, bench_pool, stage, rounds, baseline, request):
    pool, spec = bench_pool
    stage, checks = stage
    timed, warmup = rounds
    paired = PairedRounds(pool, system_name(stage, checks))
    benchmark.group = f"GPT-2 {spec.model}, Nd={pool.world_size}"
    if benchmark.disabled:                    # --benchmark-disable: run the rounds, no stats kept
        paired.run(warmup + timed)
    else:
        benchmark.pedantic(paired.step, setup=paired.before, teardown=paired.after,
                           rounds=timed, warmup_rounds=warmup)
    info = record(pool, spec, stage, paired, warmup, checks)
    benchmark.extra_info.update(info)
    assert info["loss_diff_first_steps"] <= LOSS_TOLERANCE, (
        f"stage {stage} trained differently from DDP: max |loss difference| over the first {FIRST_STEPS} steps "
        f"{info['loss_diff_first_steps']:.3g}")
    reference = baseline.get(request.node.name)
    benchmark.extra_info["gate"] = "no baseline" if reference is None else "checked"
    if reference is not None:
        failures = gate(reference, info, request.config.getoption("--gate-threshold"))
        assert not failures, "\n".join(failures)
