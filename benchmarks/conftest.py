"""Options and fixtures of the scaling regression suite (see test_scaling.py).

    pytest benchmarks/ --benchmark-only                       # S, M, L x Nd 1, 2, 4 x stages 0-3 x checks
    pytest benchmarks/ --benchmark-only --bench-smoke         # S at Nd 2, 3 rounds: seconds, for CI
    pytest benchmarks/ --benchmark-only --bench-models M --bench-worlds 2 --bench-rounds 20

Each benchmark is gated against the committed baseline (``--gate-baseline``, by default the newest
results/benchmarks/*/*_baseline.json) when the baseline has a benchmark of the same name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.bench import baseline_file
from experiments.bench_scaling import MODELS, THRESHOLD, BenchSpec
from zero_ref.launch import RankPool

ROOT = Path(__file__).resolve().parents[1]
SMOKE = {"models": ["S"], "worlds": [2], "rounds": 3, "warmup": 1}


def pytest_addoption(parser):
    group = parser.getgroup("zero-ref scaling suite")
    group.addoption("--bench-models", nargs="+", choices=sorted(MODELS), default=None,
                    help="GPT-2 sizes to measure (default: S M L)")
    group.addoption("--bench-worlds", nargs="+", type=int, default=None, help="world sizes Nd (default: 1 2 4)")
    group.addoption("--bench-stages", nargs="+", type=int, choices=[0, 1, 2, 3], default=[0, 1, 2, 3])
    group.addoption("--bench-checks", nargs="+", choices=["strict", "off"], default=["strict", "off"],
                    help="ZeroConfig.checks settings measured for each stage (default: both)")
    group.addoption("--bench-rounds", type=int, default=None, help="timed rounds per benchmark (default 12)")
    group.addoption("--bench-warmup", type=int, default=None, help="untimed rounds first (default 2)")
    group.addoption("--bench-smoke", action="store_true",
                    help=f"a few seconds' check that the suite runs: {SMOKE}")
    group.addoption("--gate-baseline", default=None,
                    help="pytest-benchmark JSON to gate against (default: newest results/benchmarks/*/*_baseline.json; "
                         "'none' to run without a gate)")
    group.addoption("--gate-threshold", type=float, default=THRESHOLD,
                    help=f"allowed regression of the time ratio beyond both runs' noise (default {THRESHOLD})")


def _option(config, name: str):
    """An option's value: given on the command line, else the smoke value, else the default."""
    given = config.getoption(f"--bench-{name}")
    if given is not None:
        return given
    if config.getoption("--bench-smoke"):
        return SMOKE[name]
    return {"models": ["S", "M", "L"], "worlds": [1, 2, 4], "rounds": 12, "warmup": 2}[name]


def pytest_generate_tests(metafunc):
    config = metafunc.config
    if "bench_pool" in metafunc.fixturenames:
        cases = [(m, w) for m in _option(config, "models") for w in _option(config, "worlds")]
        for _, world in cases:
            if world < 1:
                raise pytest.UsageError(f"--bench-worlds must be positive integers, got {world}")
        metafunc.parametrize("bench_pool", cases, indirect=True, scope="module",
                             ids=[f"{m}-nd{w}" for m, w in cases])
    if "stage" in metafunc.fixturenames:   # (stage, checks); strict keeps the ids of baselines before checks existed
        variants = [(s, c) for s in config.getoption("--bench-stages") for c in config.getoption("--bench-checks")]
        metafunc.parametrize("stage", variants, ids=[f"stage{s}" + ("" if c == "strict" else f"-{c}")
                                                     for s, c in variants])


@pytest.fixture(scope="module")
def bench_pool(request):
    """The ranks of one (model, Nd): DDP and every stage under test, alive for all its benchmarks."""
    model, world = request.param
    spec = BenchSpec(model=model, stages=tuple(request.config.getoption("--bench-stages")),
                     checks=tuple(request.config.getoption("--bench-checks")))
    with RankPool(world, _factory(), spec, timeout_s=1800) as pool:
        yield pool, spec


def _factory():
    from experiments.bench_scaling import BenchRank

    return BenchRank


@pytest.fixture(scope="session")
def rounds(request) -> tuple[int, int]:
    """(timed rounds, warm-up rounds) per benchmark."""
    timed, warmup = _option(request.config, "rounds"), _option(request.config, "warmup")
    if timed < 1 or warmup < 0:
        raise pytest.UsageError(f"--bench-rounds must be >= 1 and --bench-warmup >= 0, got {timed}, {warmup}")
    return timed, warmup


@pytest.fixture(scope="session")
def baseline(request) -> dict:
    """The baseline's extra_info records by benchmark name ({} without a baseline)."""
    path = request.config.getoption("--gate-baseline")
    if path == "none":
        return {}
    if path is None:   # the newest by its number, as `zero-ref bench` picks it (a clone's mtimes say nothing)
        path = baseline_file(ROOT / "results" / "benchmarks")
        if path is None:
            return {}
    with open(path) as f:
        return {b["name"]: b["extra_info"] for b in json.load(f)["benchmarks"]}
