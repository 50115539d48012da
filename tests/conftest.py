"""Shared by every test module: the tests' own helpers are importable (awkward.py, scenarios.py...),
and the tests too slow for a developer's loop are marked `slow`, in one place.

`pytest -m "not slow"` is the fast tier (a few minutes on 2 cores); `pytest` runs everything. What
is slow was measured (`pytest --durations=80`, a full run on 2 cores): a module whose shared
fixture spawns ranks or runs studies, or a test that took 3 s or more.
"""

import multiprocessing
import multiprocessing.forkserver
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


RANK_IMPORTS = ["torch", "torch._dynamo", "transformers.models.gpt2.modeling_gpt2",
                "transformers.models.llama.modeling_llama", "transformers.models.mixtral.modeling_mixtral",
                "transformers.models.switch_transformers.modeling_switch_transformers",
                "pytest", "pandas", "zero_ref", "scenarios", "awkward"]
"""What the ranks' fork server imports before it forks any rank (see _start_the_fork_server)."""


def _start_the_fork_server() -> None:
    """Start zero_ref.launch's fork server now, having it import RANK_IMPORTS rather than torch alone.

    Every rank's first engine imports torch._dynamo (torch.optim.Optimizer's methods are wrapped by
    torch._disable_dynamo, which imports it on first call), and the ranks that build Hugging Face
    models (test_peers' contenders, test_hf_models, the GPT-2 tests) import transformers: 2-4 s of
    one core per rank, paid again by every spawn and RankPool, about a hundred of them in this
    suite. Each rank also imports the test module its function comes from, so pytest (0.2 s), and
    zero_ref (0.16 s), the shared test models, and, in the experiments' ranks, pandas (0.4 s). Imported once in the server, each forked rank has them already. Nothing else changes for
    the ranks: the server is the one launch.py would start at the first launch (launch._context's
    later preload call leaves a running server alone) and, as there, each rank takes the caller's
    environment at its launch. Two things are read when imported: triton's TRITON_INTERPRET
    (torch._dynamo imports triton), so test_engine_kernels, whose ranks need it set, starts fresh
    interpreters instead; and no test sets the variables transformers reads. The one thread these
    imports start beyond torch's is the BLAS pool of numpy (imported by transformers): OpenBLAS
    stops it around a fork, as every fork-started worker of a numpy program relies on."""
    from zero_ref import launch

    if launch.START_METHOD == "forkserver":
        multiprocessing.set_forkserver_preload(RANK_IMPORTS)
        multiprocessing.forkserver.ensure_running()


def pytest_configure(config) -> None:
    """Start the fork server where tests run: in this process, or under pytest-xdist (``-n 2``, the
    README's command) in each worker, not in the controller, which runs none."""
    if not getattr(config.option, "numprocesses", None) or os.environ.get("PYTEST_XDIST_WORKER"):
        _start_the_fork_server()


SLOW_MODULES = {
    "test_bench_suite",
    "test_call_sequences",
    "test_checkpoint",
    "test_cluster_launch",
    "test_engine_features",
    "test_engine_hardening",
    "test_hf_models",
    "test_memory_study",
    "test_mixed_precision",
    "test_model_parallel",
    "test_peers",
    "test_scaling_curves",
    "test_throughput",
    "test_torch_habits",
}
"""Modules whose tests share a fixture that spawns ranks or runs studies, or are mostly slow."""

SLOW_TESTS = {
    "test_comm.py::test_gloo_reduce_scatter_by_all_to_all_matches_torch",
    "test_comm_volume.py::test_collectives_counted_by_torch_match_the_ledger_and_the_paper",
    "test_convergence.py::test_stages_follow_ddp_step_by_step",
    "test_engine_exact.py::test_activation_checkpointing_under_every_stage",
    "test_engine_kernels.py::test_triton_and_torch_kernels_train_identically",
    "test_errors.py::test_configs_or_param_groups_that_differ_across_ranks_are_refused_on_every_rank",
    "test_errors.py::test_models_that_differ_across_ranks_and_bad_backward",
    "test_failures.py::test_a_collective_call_made_on_one_rank_only_fails_every_rank_within_the_timeout",
    "test_failures.py::test_an_evaluation_on_one_rank_only_goes_through_the_model_not_the_engine",
    "test_failures.py::test_dead_or_stuck_rank_fails_the_others_within_the_timeout",
    "test_gpt2.py::test_tiny_gpt2_all_stages_same_losses",
    "test_mp_state_dict.py::test_mp_full_state_dict_is_the_unsplit_model_and_loads_and_consolidates",
    "test_param_access.py::test_load_state_dict_at_an_odd_world_size_with_tied_and_frozen_parameters",
    "test_param_access.py::test_load_state_dict_writes_the_master_at_every_stage_in_bf16",
    "test_param_access.py::test_writes_inside_the_forward_are_adopted_when_every_rank_makes_them_alike_and_refused_otherwise",
    "test_param_groups.py::test_groups_and_schedule_match_torch_and_resume_exactly",
    "test_rank_pool.py::test_a_call_past_the_timeout_raises_and_kills_the_ranks",
    "test_slurm.py::test_dry_run_launches_every_run",
    "test_stage3_reads.py::test_parameters_read_outside_their_units_window_are_exact_at_stage_3",
    "test_timeline.py::test_explain_prints_the_step_in_order",
    "test_engine_exact.py::test_all_stages_match_adamw[3]",
    "test_engine_exact.py::test_all_stages_match_adamw[4]",
}
"""Tests of other modules that took 3 s or more (a name without [...] marks every case of it)."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (``-n 2``), each test module runs on one worker, so that a module's shared
    fixture (ranks spawned once, a quick reproduce) is built once. Set here rather than by
    ``--dist loadfile`` in pyproject.toml: pytest-benchmark turns itself off wherever --dist is set,
    and benchmarks/ is run by pytest from the same root."""
    from xdist.scheduler import LoadFileScheduling

    return LoadFileScheduling(config, log)


LONGEST_MODULE = "test_memory_study"
"""The module whose shared fixture takes longest (a quick reproduce, about two minutes)."""


def pytest_collection_modifyitems(items):
    """Mark the slow tests, and run the slow modules first, the longest of all first: with two
    workers (``-n 2``, each module on one) the long ones start early and the two end together."""
    order = lambda item: (item.module.__name__ != LONGEST_MODULE, item.module.__name__ not in SLOW_MODULES)
    items.sort(key=order)   # stable: within each group, the collection's order
    for item in items:
        name = item.nodeid.removeprefix("tests/")
        if item.module.__name__ in SLOW_MODULES or name in SLOW_TESTS or name.split("[")[0] in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
