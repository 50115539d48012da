"""Elements moved per step by stage and world size, counted below the engine (the paper's Sec 7).

The paper's communication analysis (Sec 7, counted per process as it counts them: an all-reduce
of n moves 2n, being a reduce-scatter and an all-gather of n each):

    stage 0 (baseline DP)  all-reduce of the gradients                              2Ψ
    stage 1 (Pos)          reduce-scatter of the gradients + all-gather of the
    stage 2 (Pos+g)        updated parameters                                       2Ψ
    stage 3 (Pos+g+p)      all-gather in forward + all-gather in backward +
                           reduce-scatter of the gradients                          3Ψ

This study trains a small GPT-like model (``zero_ref.models.ParallelGPT`` without model
parallelism, fp32) with ``zero_ref.initialize`` on real gloo ranks at world sizes 1-4
(``zero_ref.launch.spawn``), every stage, and counts what one step moves with
``zero_ref.analysis.collective_count.CountCollectives``: a TorchDispatchMode that sees every c10d
collective torch.distributed runs, whoever called it. It does not ask the engine (its own ledger,
``engine.comm_stats()``, is written beside the count as a cross-check, never used for it). The
counted step is the second: the first learns the order in which gradients become ready. Forward +
backward and ``engine.step()`` are counted apart, so the table shows when each volume moves
(stages 1-2 gather the updated parameters in the step; stage 3 gathers in forward and backward).

What the count adds to the formula, each in its own column:

* the step's statistics (``step_statistics``): the all-reduce issued inside ``engine.step()``, a
  small vector (the sum of squares for the global gradient norm, the non-finite flag, one entry
  per parameter: did it get a gradient, and a fingerprint of the hyper-parameters that every rank
  must share) that the formula does not count; none at Nd = 1. No formula of the paper moves
  anything by all-reduce in the step, so its size is read from the count, not from the engine;
* padding: each flat group is padded to a multiple of Nd, so a reduce-scatter or all-gather call
  moves at most Nd - 1 elements more than its share of Ψ (``padding_bound``: calls × (Nd - 1)).

At Nd = 1 nothing needs to move and nothing is issued: over one rank the engine's collectives are
local copies (comm.Comm), so the count is 0; the engine's ledger still counts the paper's way.

Outputs in ``--out`` (default ``results/comm_volume``): comm_volume.csv, REPORT.md, meta.json.

    python -m experiments.comm_volume_study            # world sizes 1-4 (about a minute on 2 cores)
    python -m experiments.comm_volume_study --quick    # world size 2 only
"""

from __future__ import annotations

import json
import numbers
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd

from experiments import markdown
from experiments.provenance import provenance, study_main
from zero_ref.analysis import memory_model as mm

WORLDS = (1, 2, 3, 4)
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "other")


@dataclass(frozen=True)
class Setup:
    """The model and the step (pickled to the ranks)."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    vocab: int = 1000
    seq: int = 32
    batch: int = 12                  # global batch: divisible by every world size of WORLDS
    bucket_numel: int = 2**14        # several buckets per step, as at scale
    seed: int = 0


def rank_main(rank: int, world: int, setup: Setup, stages: tuple[int, ...]) -> list[dict]:
    """In each rank: for every stage a fresh engine, two steps, the second counted."""
    import zero_ref
    from zero_ref.analysis.collective_count import CountCollectives
    from zero_ref.models import ParallelGPT, token_batches

    rows = []
    for stage in stages:
        model = ParallelGPT(setup.layers, setup.hidden, setup.heads, setup.vocab, n_positions=setup.seq,
                            seed=setup.seed)
        trainable = [p for p in model.parameters() if p.requires_grad]
        cfg = zero_ref.ZeroConfig(stage=stage, dtype="fp32", kernels="torch", bucket_numel=setup.bucket_numel)
        batches = token_batches(setup.vocab, setup.batch, setup.seq, rank, world, seed=setup.seed + 1)
        with zero_ref.initialize(model, cfg) as engine:
            for step in range(2):
                tokens = next(batches)[1]
                backward, update = CountCollectives(), CountCollectives()
                with backward:
                    engine.backward(engine(tokens))
                with update:
                    engine.step()
            ledger = engine.comm_stats()["last_step"]
        rows.append({"stage": stage, "rank": rank, "psi": sum(p.numel() for p in trainable), "tensors": len(trainable),
                     "moved": dict(backward.moved + update.moved), "calls": dict(backward.calls + update.calls),
                     "backward_moved": sum(backward.moved.values()), "step_moved": sum(update.moved.values()),
                     "step_all_reduce": update.moved["all_reduce"], "ledger_total": ledger["total"]})
    return rows


def measure(worlds=WORLDS, setup: Setup = Setup(), stages=(0, 1, 2, 3), timeout: float = 600) -> pd.DataFrame:
    """One row per (world, stage): rank 0's count, checked equal on every rank."""
    from zero_ref.launch import spawn

    rows = []
    for world in worlds:
        ranks = spawn(rank_main, world, setup, tuple(stages), timeout=timeout)
        for per_stage in zip(*ranks):
            first = per_stage[0]
            same = all((r["moved"], r["step_moved"]) == (first["moved"], first["step_moved"]) for r in per_stage)
            rows.append(_row(world, first, same))
    return pd.DataFrame(rows)


def _row(world: int, r: dict, same_on_every_rank: bool) -> dict:
    psi, stage = r["psi"], r["stage"]
    moved = {k: r["moved"].get(k, 0) for k in KINDS}
    calls = {f"{k}_calls": r["calls"].get(k, 0) for k in KINDS}
    total = sum(moved.values())
    formula = mm.comm_volume_elements(psi, stage)
    sharded_calls = calls["reduce_scatter_calls"] + calls["all_gather_calls"]
    statistics = r["step_all_reduce"]
    padding_bound = sharded_calls * (world - 1)
    issued = formula if world > 1 else 0      # a group of one issues nothing: its collectives are local copies
    excess = total - issued
    return {"stage": stage, "scheme": mm.PAPER_NAMES[stage], "world": world, "psi": psi, "tensors": r["tensors"],
            **moved, "total": total, "forward_backward": r["backward_moved"], "in_step": r["step_moved"], **calls, "formula": int(formula), "formula_per_psi": formula / psi,
            "total_per_psi": total / psi, "excess": int(excess), "step_statistics": statistics,
            "padding_bound": padding_bound, "explained": 0 <= excess - statistics <= padding_bound,
            "same_on_every_rank": same_on_every_rank, "engine_ledger_total": r["ledger_total"],
            "ledger_agrees": r["ledger_total"] == (total if world > 1 else formula)}


def write_report(out: Path, frame: pd.DataFrame, setup: Setup, meta: dict) -> None:
    hw = meta["hardware"]
    table = frame.set_index(["stage", "world"])[["scheme", "all_reduce", "reduce_scatter", "all_gather",
                                                 "broadcast", "forward_backward", "in_step", "total", "formula",
                                                 "total_per_psi", "excess", "step_statistics", "padding_bound",
                                                 "explained"]]
    table.index = [f"{s} / {w}" for s, w in table.index]
    table.index.name = "stage / world"
    table["explained"] = table.explained.map({True: "yes", False: "no"})
    cell = lambda v: f"{v:.6f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, numbers.Integral) else str(v)
    lines = [
        "# Elements moved per step, by stage and world size (the paper's Sec 7, counted below the engine)", "",
        f"Generated by `{meta['command']}` at git `{meta['git_revision']}` on {meta['date_utc']}; "
        f"{hw['cores']} cores ({hw['cpu']}), torch {hw['torch']}{', GPU ' + hw['gpu'] if 'gpu' in hw else ', no GPU'}; "
        f"quick={meta['quick']}.", "",
        f"Model: `ParallelGPT` {setup.layers} layers × {setup.hidden} (vocab {setup.vocab}, seq {setup.seq}), "
        f"Ψ = {int(frame.psi.iloc[0]):,} trainable elements in {int(frame.tensors.iloc[0])} tensors, fp32, "
        f"global batch {setup.batch}, bucket_numel {setup.bucket_numel:,}. Real gloo ranks on this CPU; each "
        "rank counts every c10d collective of one step (the second) with `zero_ref.analysis.collective_count."
        "CountCollectives` (all-reduce of n: 2n; reduce-scatter, all-gather, broadcast of n: n). The engine's "
        "own ledger is not used for the count (`engine_ledger_total` in the CSV is a cross-check: the count "
        f"over several ranks, the formula over one, in {int(frame.ledger_agrees.sum())} of {len(frame)} rows). "
        "Every rank counted the "
        f"same in {int(frame.same_on_every_rank.sum())} of {len(frame)} rows.", "",
        "The paper (Sec 7.1-7.2): 2Ψ for stages 0-2, 3Ψ for stage 3. `excess` = total − formula (at world 1: "
        "total − 0, see below); it is "
        "`explained` when it is the step's statistics all-reduce (`step_statistics`: the all-reduce counted "
        "inside `engine.step()`, a small vector for the gradient norm, the overflow flag, which parameters "
        "got gradients and the ranks' agreement on hyper-parameters; none at world 1) plus at most "
        "`padding_bound` (each reduce-scatter or all-gather call "
        f"pads by fewer than Nd elements). Explained in {int(frame.explained.sum())} of {len(frame)} rows. "
        "`forward_backward` and `in_step`: the total split by when it moved.", "",
        markdown.table(table, cell, index=True), "",
        "At world 1 nothing needs to move and nothing is issued: over a group of one the engine's collectives "
        "are local copies that never reach torch.distributed (comm.Comm), so the count below is 0, while the "
        "engine's ledger still counts what the paper counts (`engine_ledger_total` = the formula). Over "
        "several ranks the all-reduce of stages 1-3 is the statistics alone; stage 0's "
        "all-reduce is the gradients (2Ψ, in backward) plus the statistics (in the step).", "",
        "Files: [comm_volume.csv](comm_volume.csv) (every kind, calls per kind, the ledger), "
        "[meta.json](meta.json).", ""]
    (out / "REPORT.md").write_text("\n".join(lines))


def headline(frame: pd.DataFrame) -> list[dict]:
    """One row per stage for results/REPORT.md."""
    rows = []
    for stage, at in frame.groupby("stage"):
        worlds = ", ".join(f"Nd {r.world}: {r.total_per_psi:.5f}" for r in at.itertuples() if r.world > 1)
        if (at.world == 1).any():
            worlds += f"; Nd 1: {at[at.world == 1].total_per_psi.iloc[0]:g} issued (local copies)"
        rows.append({"item": f"Sec 7: elements per rank per step / Ψ, {mm.PAPER_NAMES[stage]} (stage {stage})",
                     "paper": f"{at.formula_per_psi.iloc[0]:g}Ψ", "ours": worlds,
                     "error": f"excess explained (statistics + padding) in {int(at.explained.sum())}/{len(at)}",
                     "how": "real run (gloo), torch.distributed collectives counted"})
    return rows


def run_study(out: Path, quick: bool = False, quiet: bool = False, worlds=None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    setup = Setup()
    frame = measure(worlds or ((2,) if quick else WORLDS), setup)
    frame.to_csv(out / "comm_volume.csv", index=False)
    meta = provenance() | {"quick": quick, "setup": asdict(setup)}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    write_report(out, frame, setup, meta)
    return {"headline": headline(frame), "meta": meta}


def main(argv: list[str] | None = None) -> dict:
    return study_main(run_study, "comm_volume", __doc__.splitlines()[0], "world size 2 only", argv)


if __name__ == "__main__":
    main()
