"""The paper's numbers the studies compare against, read from experiments/paper_data/.

The CSVs in ``paper_data/`` are the one copy of every number taken from the paper (arXiv
1910.02054 v3 / SC20), each row with its source (table, figure, section, or "read from a
figure" with its uncertainty); ``paper_data/README.md`` describes each file and
``paper_data/zero-paper-facts.md`` how they were read. This module only gives those rows the
shapes the studies use, so a number is never typed twice. Units: GB = 1e9 bytes, B = 1e9
parameters.

    TABLE1_GB[("7.5B", 64)]   -> (31.4, 16.6, 1.88)    Pos, Pos+g, Pos+g+p    (table1_memory.csv)
    FIGURE1_GB[2]             -> 16.6                  stage -> GB            (headline_numbers.csv)
    TABLE2_MEASURED_B[16]     -> (20, 100)             baseline, Pos          (table2_max_model_size.csv)
    FIG6_B["C3"]              -> 50                    C1-C5                  (configs_c1_c5.csv)
    headline("Turing-NLG size") -> the row of headline_numbers.csv, with its source
"""

from __future__ import annotations

import csv
from functools import cache
from pathlib import Path

DATA = Path(__file__).resolve().parent / "paper_data"
"""The folder of the paper's numbers (shipped with the package: pyproject's package-data)."""

NOT_AN_ERROR = "none: the paper gives no number (a measurement, not an error)"
"""The ``error`` cell of a study's headline row that reports a measurement the paper has no number for."""

_STAGES = {"Pos": 1, "Pos+g": 2, "Pos+g+p": 3}


def number(text: str) -> int | float:
    """A printed number as the paper printed it: 120 stays an int, 52.5 a float."""
    value = float(text)
    return int(value) if value.is_integer() else value


@cache
def rows(name: str) -> tuple[dict, ...]:
    """Every row of ``paper_data/<name>`` as a dict of strings (read once)."""
    with open(DATA / name, newline="") as f:
        return tuple(csv.DictReader(f))


def headline(quantity: str) -> dict:
    """The row of headline_numbers.csv whose ``quantity`` is exactly ``quantity``."""
    found = [r for r in rows("headline_numbers.csv") if r["quantity"] == quantity]
    if len(found) != 1:
        raise KeyError(f"{quantity!r}: {len(found)} rows in headline_numbers.csv")
    return found[0]


def _table1() -> dict[tuple[str, int], tuple]:
    cells: dict[tuple[str, int], dict[int, float]] = {}
    for r in rows("table1_memory.csv"):
        cells.setdefault((r["model"], int(r["nd_dp_degree"])), {})[_STAGES[r["stage"]]] = number(r["paper_value_gb"])
    return {key: (by[1], by[2], by[3]) for key, by in cells.items()}


TABLE1_GB = _table1()
"""(model, Nd) -> (Pos, Pos+g, Pos+g+p): per-device model states, Table 1 as printed (the paper
truncates some 128B and 1T cells, e.g. 513.5 -> 513, so comparisons allow 1 GB)."""

FIGURE1_GB = {stage: number(headline(f"Figure 1 example: {name}")["value"]) for stage, name in
              enumerate(("baseline per-device model states (7.5B; Nd=64; K=12)", "Pos", "Pos+g", "Pos+g+p"))}
"""Figure 1 / Sec 5: 7.5B parameters, Nd = 64, K = 12: per-device model states by stage."""

TRILLION_AT_1024_GB = TABLE1_GB[("1T", 1024)][2]
"""Sec 1 / Table 1: a 1T model's states per GPU on 1024 GPUs with Pos+g+p (16 TB / 1024)."""

TABLE2_THEORY_B = {
    int(r["mp_degree"]): tuple(number(r[f"theoretical_{c}_params_B"]) for c in ("baseline", "pos", "pos_g", "pos_g_p"))
    for r in rows("table2_max_model_size.csv")}
"""MP degree -> Table 2's theory columns (baseline, Pos, Pos+g, Pos+g+p) in B as printed (its 0.5T,
1T, 2T written as 500, 1000, 2000). Nd = 64 in every row."""

TABLE2_MEASURED_B = {
    int(r["mp_degree"]): (number(r["measured_baseline_params_B"]), number(r["measured_zero_dp_pos_params_B"]))
    for r in rows("table2_max_model_size.csv")}
"""Table 2's measured columns: MP degree -> (baseline, ZeRO-DP Pos). Nd = 64 in every row."""

NO_MP_B = {0: number(headline("max model size with basic DP on 32GB GPUs")["value"]),
           2: number(headline("max model without MP on 128 GPUs")["value"])}
"""Sec 1 / 10.4 / Fig 4, 128 GPUs, no MP: PyTorch DDP's largest model (baseline) and ZeRO-100B's
(Pos+g with ZeRO-R)."""

FIG6_B = {r["config"]: number(r["fig_max_model_size_params_B"]) for r in rows("configs_c1_c5.csv")}
"""Fig 6 (Sec 10.5): the largest model trainable under C1-C5 at MP 16 on 400 GPUs, batch 16 per
model-parallel group. C1, C2, C4 and C5 are stated in the text; C3 = 50B is inferred (the only size
of the appendix's max-model-size table not assigned to another configuration; see the CSV's
``max_model_size_basis``)."""


def paper_runs() -> list[dict]:
    """The paper's throughput runs (Figs 2, 3, 4, 8; arXiv v3 numbering), one row per run: the
    appendix's configuration (GPUs, MP, layers x hidden, heads, batch per GPU, ZeRO config) and
    the TFLOPS per GPU read from the figure where a reading exists (``paper_tflops_per_gpu``, None
    otherwise), each with its source (``tflops_source``, ``config_source``: runs.csv, which
    tests/test_memory_study.py checks against model_configs.csv and the figure CSVs)."""
    ints = ("gpus", "mp", "dp", "layers", "hidden", "heads", "batch_per_gpu", "total_batch")
    out = []
    for row in rows("runs.csv"):
        row = dict(row)
        row.update({k: int(row[k]) for k in ints})
        row["paper_tflops_per_gpu"] = float(row["paper_tflops_per_gpu"]) if row["paper_tflops_per_gpu"] else None
        out.append(row)
    return out
