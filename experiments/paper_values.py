"""The paper's numbers that the memory study compares against, with where each comes from.

These are inputs, copied from the paper (arXiv 1910.02054 v3 / SC20; see shared/paper/
zero-paper-facts.md beside the repository, whose CSVs tests/test_memory_study.py checks them
against when that folder is present). Units: GB = 1e9 bytes, B = 1e9 parameters.
"""

TABLE1_GB = {
    # (model, Nd): (Pos, Pos+g, Pos+g+p), per-device model states, Table 1 as printed (the paper
    # truncates some 128B and 1T cells, e.g. 513.5 -> 513, so comparisons allow 1 GB).
    ("7.5B", 1): (120, 120, 120),
    ("7.5B", 4): (52.5, 41.3, 30),
    ("7.5B", 16): (35.6, 21.6, 7.5),
    ("7.5B", 64): (31.4, 16.6, 1.88),
    ("7.5B", 256): (30.4, 15.4, 0.47),
    ("7.5B", 1024): (30.1, 15.1, 0.12),
    ("128B", 1): (2048, 2048, 2048),
    ("128B", 4): (896, 704, 512),
    ("128B", 16): (608, 368, 128),
    ("128B", 64): (536, 284, 32),
    ("128B", 256): (518, 263, 8),
    ("128B", 1024): (513, 257, 2),
    ("1T", 1): (16000, 16000, 16000),
    ("1T", 4): (7000, 5500, 4000),
    ("1T", 16): (4750, 2875, 1000),
    ("1T", 64): (4187, 2218, 250),
    ("1T", 256): (4046, 2054, 62.5),
    ("1T", 1024): (4011, 2013, 15.6),
}

FIGURE1_GB = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}
"""Figure 1 / Sec 5: 7.5B parameters, Nd = 64, K = 12: per-device model states by stage."""

TRILLION_AT_1024_GB = 15.6
"""Sec 1 / Table 1: a 1T model's states per GPU on 1024 GPUs with Pos+g+p (16 TB / 1024)."""

TABLE2_THEORY_B = {
    # MP degree: (baseline, Pos, Pos+g, Pos+g+p) as printed (0.5T, 1T, 2T written as 500, 1000, 2000)
    1: (2, 7.6, 14.4, 128), 2: (4, 15.2, 28.8, 256), 4: (8, 30.4, 57.6, 500),
    8: (16, 60.8, 115.2, 1000), 16: (32, 121.6, 230.4, 2000),
}

TABLE2_MEASURED_B = {1: (1.3, 6.2), 2: (2.5, 12.5), 4: (5, 25), 8: (10, 50), 16: (20, 100)}
"""Table 2's measured columns: MP degree -> (baseline, ZeRO-DP Pos). Nd = 64 in every row."""

NO_MP_B = {0: 1.4, 2: 13.0}
"""Sec 1 / 10.4 / Fig 4, 128 GPUs, no MP: PyTorch DDP's largest model (baseline) and ZeRO-100B's
(Pos+g with ZeRO-R)."""

FIG6_B = {"C1": 40, "C2": 60, "C3": 50, "C4": 140, "C5": 150}
"""Fig 6 (Sec 10.5): the largest model trainable under C1-C5 at MP 16 on 400 GPUs, batch 16 per
model-parallel group. C1, C2, C4 and C5 are stated in the text; C3 = 50B is inferred (the only size
of the appendix's max-model-size table not assigned to another configuration)."""


def paper_runs() -> list[dict]:
    """The paper's throughput runs (Figs 2, 3, 4, 8; arXiv v3 numbering), one row per run: the
    appendix's configuration (GPUs, MP, layers x hidden, heads, batch per GPU, ZeRO config) and
    the TFLOPS per GPU read from the figure where a reading exists (``paper_tflops_per_gpu``, None
    otherwise), each with its source (experiments/paper_data/runs.csv)."""
    import csv
    from pathlib import Path

    ints = ("gpus", "mp", "dp", "layers", "hidden", "heads", "batch_per_gpu", "total_batch")
    with open(Path(__file__).parent / "paper_data" / "runs.csv") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        row.update({k: int(row[k]) for k in ints})
        row["paper_tflops_per_gpu"] = float(row["paper_tflops_per_gpu"]) if row["paper_tflops_per_gpu"] else None
    return rows
