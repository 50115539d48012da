"""Scaling curves, not points: bytes and elements per rank against Nd and Ψ, beside the paper.

Two sources, one set of plots:

1. **The engine at scale** (measured here). For each model of ``MODELS`` (three Hugging Face
   GPT-2 sizes), each stage 0-3 and Nd = 1, 2, 4, ..., 1024, the real engine runs as rank 0 of a
   fake process group of Nd ranks (``zero_ref.analysis.at_scale.fake_world``) on a model built under
   ``torch.device("meta")``: tensors with shapes and no data, so any Nd costs the same fraction
   of a second. Two training steps are run (forward on ``BATCH_PER_RANK`` x seq tokens,
   ``lm_loss``, ``engine.backward``, ``engine.step``); the second is counted with
   ``CountCollectives`` (the first also agrees on the bucket order), and ``engine.memory_report()``
   is read after it, in the steady state: stages 2 and 3 allocate their constant-size gradient
   buckets (the paper's CB, ``comm_buffers``) in the first backward, so a report read right after
   ``initialize`` would miss them. HF GPT-2 builds and trains on meta tensors without a change.
2. **Real runs** (read, not measured here): the pytest-benchmark JSON of the scaling suite, gloo
   ranks on CPU at Nd 1-4, with step times, DDP's step times and the same byte and element counts.

Beside each measurement, the paper's formulas (``zero_ref.analysis.memory_model``):

* bytes: ``model_state_bytes(Ψ, stage, Nd, k=8, param_bytes=4, grad_bytes=4)``. In fp32 the
  engine keeps no master copy (the fp32 parameters *are* the master weights, core/optim.py), so its
  optimizer holds Adam's two moments only: K = 8 bytes per parameter, 16Ψ in all at stage 0, not
  the paper's mixed-precision 2 + 2 + 12. The engine may exceed the formula by padding alone:
  every flat group is padded to a multiple of Nd (``at_scale.padding_bound``).
* elements moved per rank per step: ``comm_volume_elements`` = 2Ψ at stages 0-2, 3Ψ at stage 3,
  counted the paper's way (a reduce-scatter or all-gather of n: n; an all-reduce of n: 2n). The
  engine adds padding and one small all-reduce of the step's statistics (gradient norm, overflow
  flag). At Nd = 1 it issues nothing, as a real one-rank run: its collectives over one rank are
  local copies (comm.Comm), so the count is 0 (the engine's ledger still counts 2Ψ / 3Ψ).

The paper gives no formula for step time: its plot shows the real runs alone.

    python -m experiments.scaling_curves [--bench-json PATH] [--out results/scaling_curves] [--quiet]

The plots and REPORT.md are drawn by scaling_curves_report.py.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from experiments.peer_systems import block_numel
from experiments.provenance import ROOT, provenance
from experiments.scaling_curves_report import render
from zero_ref.analysis import memory_model as mm
from zero_ref.analysis.at_scale import fake_world, padding_bound
from zero_ref.analysis.collective_count import CountCollectives
from zero_ref.config import ZeroConfig
from zero_ref.engine import initialize
from zero_ref.models import lm_loss, tiny_gpt2

NDS = tuple(2**i for i in range(11))
"""Data-parallel degrees of the at-scale sweep: 1, 2, 4, ..., 1024."""
PSI_ND = 64
"""The Nd at which the *_vs_psi plots compare the three models (the largest swept Nd if not swept)."""
BATCH_PER_RANK = 4
K_FP32 = 8
"""Optimizer bytes per parameter in fp32: Adam's momentum and variance, no master copy."""
CATEGORIES = ("params", "grads", "optimizer_states", "buffers", "comm_buffers")
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


@dataclass(frozen=True)
class GPT2Size:
    """One GPT-2 of the benchmark suite: a Hugging Face ``GPT2LMHeadModel`` (tied head), fp32."""

    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int = 4096
    seq: int = 128

    def build(self, seed: int = 0):
        """The model (on the current default device: wrap in ``torch.device("meta")`` for shapes only)."""
        return tiny_gpt2(self.layers, self.hidden, self.heads, self.vocab, self.seq, seed)

    @property
    def bucket_numel(self) -> int:
        """The engine's bucket size in the suite: one transformer block per bucket (and stage-3 unit)."""
        return block_numel(self.hidden)

    def config(self, stage: int) -> ZeroConfig:
        """The engine's configuration in the suite and in the sweep (fp32, torch kernels)."""
        return ZeroConfig(stage=stage, dtype="fp32", kernels="torch", bucket_numel=self.bucket_numel)


MODELS = {size.name: size for size in (GPT2Size("S", 2, 128, 4), GPT2Size("M", 4, 256, 4), GPT2Size("L", 6, 384, 6))}


# ------------------------------------------------------------------------------ Part 1: at scale
def measure_case(size: GPT2Size, stage: int, nd: int) -> dict:
    """One (model, stage, Nd) row: rank 0's bytes by category and elements by kind in a steady-state
    step, each beside the paper's formula (see the module docstring)."""
    with fake_world(nd):
        with torch.device("meta"):
            model = size.build()
        tensors = len(list(model.parameters()))              # parameters() lists a tied weight once
        psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
        engine = initialize(model, size.config(stage))
        tokens = torch.zeros(BATCH_PER_RANK, size.seq, dtype=torch.long, device="meta")
        for _ in range(2):
            with CountCollectives() as counter:
                engine.backward(lm_loss(engine(tokens).logits, tokens))
                engine.step()
        report = engine.memory_report()
        engine.close()
    formula = mm.model_state_bytes(psi, stage, nd, k=K_FP32, param_bytes=4, grad_bytes=4)
    states = report["params"] + report["grads"] + report["optimizer_states"]
    moved = {f"elements_{kind}": counter.moved.get(kind, 0) for kind in KINDS}
    elements = sum(moved.values())
    return {"model": size.name, "psi": psi, "stage": stage, "nd": nd,
            **{c: report[c] for c in CATEGORIES}, "report_total": report["total"], "engine_total": states,
            "formula_params": formula.params, "formula_grads": formula.grads,
            "formula_optimizer_states": formula.optimizer_states, "formula_total": formula.total,
            "padding": states - formula.total, "padding_bound": padding_bound(tensors, nd), **moved,
            "other_calls": counter.moved.get("other", 0), "elements_total": elements,
            "elements_over_psi": elements / psi, "formula_elements_over_psi": mm.comm_volume_elements(psi, stage) / psi}


def sweep(cases: list[tuple[str, int, int]], quiet: bool = False) -> pd.DataFrame:
    """``measure_case`` for every (model name, stage, Nd), with a progress bar unless ``quiet``."""
    rows = [measure_case(MODELS[name], stage, nd)
            for name, stage, nd in tqdm(cases, desc="engine at scale", disable=quiet)]
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------ Part 2: real runs
REQUIRED = ("model", "layers", "hidden", "heads", "vocab", "seq", "dtype", "psi", "stage", "world_size", "step_s",
            "ddp_step_s", "ratio_to_ddp", "bytes_per_rank", "elements_total", "elements_over_psi")


def _model_order(column: pd.Series) -> pd.Series:
    """A sort key: models in the order of ``MODELS`` (S, M, L), other columns as they are."""
    return column.map(list(MODELS).index) if column.name == "model" else column


def newest_bench_json(root: Path = ROOT / "results" / "benchmarks") -> Path | None:
    """The suite's last run (``run.json``, written by ``zero-ref bench``), else its newest saved
    run (``*/NNNN_name.json``, by counter), or None."""
    if (root / "run.json").is_file():
        return root / "run.json"
    found = sorted(root.glob("*/*.json"), key=lambda p: p.name)
    return found[-1] if found else None


def _flatten(value: dict, prefix: str = "") -> dict:
    """Nested dicts to "outer.inner" columns; lists (per-round values) to JSON strings."""
    flat = {}
    for key, item in value.items():
        if isinstance(item, dict):
            flat |= _flatten(item, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = json.dumps(item) if isinstance(item, list) else item
    return flat


def load_real(path: Path) -> tuple[pd.DataFrame, dict]:
    """The benchmark JSON's entries as one flat row each (extra_info, plus the entry's name and
    pytest-benchmark's median), and its commit_info. Raises ValueError on a missing key, or where
    a model's shape is not the one of ``MODELS`` with its name (its bytes would not be comparable)."""
    data = json.loads(Path(path).read_text())
    rows = []
    for entry in data["benchmarks"]:
        info = entry.get("extra_info", {})
        if info.get("checks", "strict") != "strict":   # the curves are the default engine's; the bench
            continue                                     # report has checks="off" beside it
        missing = [key for key in REQUIRED if key not in info]
        if missing:
            raise ValueError(f"{path}: benchmark {entry['name']!r} lacks extra_info keys {missing}")
        size = MODELS.get(info["model"])
        shape = tuple(info[k] for k in ("layers", "hidden", "heads", "vocab", "seq", "dtype"))
        if size is None or shape != (size.layers, size.hidden, size.heads, size.vocab, size.seq, "fp32"):
            raise ValueError(f"{path}: benchmark {entry['name']!r} is model {info['model']!r} of shape {shape} "
                             f"(layers, hidden, heads, vocab, seq, dtype); the sweep measures fp32 "
                             f"{MODELS.get(info['model'])}: its bytes would not be comparable")
        rows.append({"name": entry["name"], "bench_median_s": entry["stats"]["median"], **_flatten(info)})
    frame = pd.DataFrame(rows).sort_values(["model", "stage", "world_size"], ignore_index=True, key=_model_order)
    frame["real_states"] = sum(frame[f"bytes_per_rank.{c}"] for c in CATEGORIES[:3])
    return frame, data.get("commit_info", {})


def compare_real(real: pd.DataFrame, at_scale: pd.DataFrame) -> pd.DataFrame:
    """Each real run beside the at-scale case of the same (model, stage, Nd): bytes by category
    (and memory_report's total), Ψ and elements per step must be equal exactly: the same engine on
    the same shapes, meta tensors only drop the values. Categories the run marks timing-dependent
    (``bytes_timing_dependent``: stage 3's buckets on gloo, whose reducer never blocks and reuses a
    bucket once its reduction has finished) are shown, not compared: the engine at scale keeps the
    blocking reducer's max_in_flight + 1, as on CUDA."""
    merged = real.merge(at_scale, left_on=["model", "stage", "world_size"], right_on=["model", "stage", "nd"],
                        suffixes=("_real", ""), validate="many_to_one")
    rows = []
    for row in merged.to_dict("records"):
        pairs = {c: (row[f"bytes_per_rank.{c}"], row[c]) for c in CATEGORIES}
        pairs["total"] = (row["bytes_per_rank.total"], row["report_total"])
        pairs["Ψ"] = (row["psi_real"], row["psi"])
        marked = row.get("bytes_timing_dependent")           # a JSON list; absent from older suites' runs
        timing = set(json.loads(marked)) if isinstance(marked, str) else set()
        differ = {c: f"{c}: {a:,.0f} real vs {b:,.0f} at scale" for c, (a, b) in pairs.items() if a != b}
        bad = [text for c, text in differ.items() if c not in timing]
        rows.append({"model": row["model"], "stage": row["stage"], "world": row["world_size"],
                     "real_states": row["real_states"],
                     "at_scale_states": row["engine_total"], "bytes_equal": not bad,
                     "elements_real": row["elements_total_real"], "elements_at_scale": row["elements_total"],
                     "elements_equal": row["elements_total_real"] == row["elements_total"],
                     "mismatches": "; ".join(bad),
                     "timing_dependent": "; ".join(text for c, text in differ.items() if c in timing)})
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------------------- run
def run(out: Path, bench_json: Path | None = None, quiet: bool = False, *, models: tuple[str, ...] = tuple(MODELS),
        nds: tuple[int, ...] = NDS) -> dict:
    """Measure the at-scale sweep (``models`` x stages 0-3 x ``nds``, plus the real runs' own cases
    of those models), read the benchmark JSON (``bench_json``; None: the newest under results/benchmarks),
    and write the tables (scaling_at_scale.csv, scaling_real.csv, scaling_check.csv) and meta.json
    under ``out``, which scaling_curves_report.render draws; return meta."""
    start = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    bench_json = Path(bench_json) if bench_json is not None else newest_bench_json()
    real, commit, part2 = None, {}, "read"
    if bench_json is None:
        part2 = "no benchmark run under results/benchmarks (run `zero-ref bench`, or pass --bench-json)"
        print(f"scaling_curves: Part 2 (real runs) skipped: {part2}")
    elif not bench_json.is_file():
        raise FileNotFoundError(f"bench_json = {bench_json} is not a file")
    else:
        real, commit = load_real(bench_json)
        real.to_csv(out / "scaling_real.csv", index=False)
    cases = [(m, s, nd) for m in models for s in range(4) for nd in nds]
    if real is not None:
        cases += [case for case in zip(real.model, real.stage, real.world_size) if case[0] in models]
    swept = time.perf_counter()
    at_scale = sweep(list(dict.fromkeys(cases)), quiet)
    swept = time.perf_counter() - swept
    at_scale = at_scale.sort_values(["model", "stage", "nd"], ignore_index=True, key=_model_order)
    at_scale.to_csv(out / "scaling_at_scale.csv", index=False)
    if real is not None:
        compare_real(real, at_scale).to_csv(out / "scaling_check.csv", index=False)
    meta = provenance() | {"seconds": round(time.perf_counter() - start, 1), "sweep_seconds": round(swept, 1),
                           "models": {m: asdict(MODELS[m]) for m in models}, "nds": list(nds), "k": K_FP32,
                           "psi_nd": PSI_ND if PSI_ND in nds else max(nds),
                           "batch_per_rank": BATCH_PER_RANK, "bench_json": str(bench_json) if bench_json else None,
                           "bench_commit_info": commit, "part2": part2}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return {"meta": meta}


def run_study(out: Path, quick: bool = False, quiet: bool = False) -> dict:
    """The reproduce entry: ``run`` over every model and Nd of ``NDS``; ``quick``: GPT-2 S at four Nd."""
    if quick:
        return run(out, None, quiet, models=("S",), nds=(1, 4, 64, 1024))
    return run(out, None, quiet)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "scaling_curves")
    parser.add_argument("--bench-json", type=Path, default=None,
                        help="pytest-benchmark JSON of the scaling suite (default: results/benchmarks/run.json, else the newest saved run)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    result = run(args.out, args.bench_json, args.quiet)
    return result | {"headline": render(args.out)}


if __name__ == "__main__":
    main()
