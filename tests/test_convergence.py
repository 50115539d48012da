"""The convergence study's runs are exact where they must be (experiments/convergence.py).

A short real run of the study's own code at world size 2 on a slice of the standard library's
text (the first 60 files): 20 steps of a one-layer byte-level GPT-2 in fp32 with the study's AdamW
parameter groups, warmup + cosine LambdaLR and gradient clipping, stages 1 and 3 against torch's
DDP + AdamW. Every step's training loss and the final validation loss must equal DDP's within
EXACT_TOL. So that the check can fail, the same spawn also trains a reference with one wrong
hyper-parameter (the no-decay group decayed at 0.1, the mistake the groups exist to prevent): its
losses must differ from DDP's by far more than the tolerance. (Checked by hand as well: with the
reference's no-decay weight decay set to 0.01 inside `ddp_reference`, the first test fails.)
"""

import math

import pytest

from experiments.convergence import EXACT_TOL, OPTIM, Run, Setting, run_in_rank, summarize
from experiments.stdlib_text import VAL_EVERY, load_corpus, train_batch, val_batches
from zero_ref.launch import spawn

SMALL = Setting("fp32", steps=20, global_batch=8, seq=64, warmup=5, eval_every=10, val_windows=8,
                model={"n_layer": 1, "n_embd": 64, "n_head": 4, "vocab_size": 256, "n_positions": 64})
FILES = 60


@pytest.fixture(scope="module")
def steps():
    import pandas as pd

    runs = [Run("ddp", SMALL), Run(1, SMALL), Run(3, SMALL), Run("ddp", SMALL, no_decay_wd=0.1)]
    result = spawn(run_in_rank, 2, runs, FILES, OPTIM, True, timeout=120)
    return pd.DataFrame(result[0]["rows"])


def test_stages_follow_ddp_step_by_step(steps):
    train = steps.pivot(index="step", columns="system", values="train_loss").dropna()
    assert len(train) == SMALL.steps and train["ddp"].iloc[-1] < train["ddp"].iloc[0] - 1   # it learns
    for stage in ("stage 1", "stage 3"):
        assert (train[stage] - train["ddp"]).abs().max() <= EXACT_TOL, stage
    summary = summarize(steps).set_index("system")
    for stage in ("stage 1", "stage 3"):
        assert summary.loc[stage, "exact_pass"] == "pass" and summary.loc[stage, "val_pass"] == "pass"
        assert abs(summary.loc[stage, "val_diff"]) <= EXACT_TOL, stage


def test_a_wrong_reference_is_caught(steps):
    """The no-decay group decayed (0.1 instead of 0): within 20 steps the curves part by more than 10x
    the tolerance (1.25e-3 measured), so the check above fails if the engine ignored the groups (or
    the reference did)."""
    train = steps.pivot(index="step", columns="system", values="train_loss").dropna()
    wrong = "ddp, no-decay group wd 0.1"
    assert (train[wrong] - train["ddp"]).abs().max() > 10 * EXACT_TOL
    assert summarize(steps).set_index("system").loc["stage 1", "exact_pass"] == "pass"


def test_corpus_is_deterministic_and_split_by_file():
    corpus = load_corpus(FILES)
    info = corpus.info
    assert info["files_total"] == FILES and info["val_files"] == math.ceil(FILES / VAL_EVERY)
    assert info["train_bytes"] == len(corpus.train) and info["val_bytes"] == len(corpus.val)
    assert load_corpus(FILES).info["train_sha256"] == info["train_sha256"]
    # a step's global batch is the same whatever the world size: ranks hold consecutive slices
    whole = train_batch(corpus.train, 7, 4, 32, 0, 1)
    halves = [train_batch(corpus.train, 7, 4, 32, rank, 2) for rank in range(2)]
    assert whole.tolist() == halves[0].tolist() + halves[1].tolist()
    assert whole.max() < 256 and not whole.equal(train_batch(corpus.train, 8, 4, 32, 0, 1))
    assert sum(len(b) for b in val_batches(corpus.val, 8, 32, 1, 2, batch=3)) == 4
