"""Fragmentation measured: allocation traces replayed through a caching-allocator model (MD, Fig 7).

The memory study's searches (Table 2, Fig 4, Fig 6) lose a share of each GPU to the caching
allocator's fragmentation; it chose 15%. Here that share is measured instead, per case:

1. **trace**: one rank of the case's Nd x Nm grid runs two real training steps of the model the
   search found, on meta tensors (experiments/fragmentation_trace.py): the real engine, torch's
   checkpointing with our Pa/Pa+cpu hooks, every storage allocated and freed in order;
2. **replay** through zero_ref.analysis.caching_allocator (PyTorch's CUDA caching-allocator rules): the
   smallest device that runs the steps, against the bytes they ask for at their peak, gives the
   fragmentation share;
3. **search again** with the measured share (and trace the new model): the answer beside the
   paper's and beside the answer at the chosen 15%.

The search starts from no allowance at all (the accounting alone), so the paper's numbers play no
part in the measured share. The 2019 baseline (stage 0, Megatron-LM / PyTorch DDP) runs without
MD; ZeRO's configurations with MD (activations.CheckpointArena), and the same model without MD is
traced too for Fig 4 and Fig 6, to show what MD buys. Fig 7 (the most memory PyTorch caches per configuration C1-C5
at 40B and 100B; the paper gives only its order) is the replay's peak of reserved bytes.

What the traces leave out: memory outside the caching allocator (CUDA context, cuBLAS and NCCL
workspaces: the search's 1 GB), the baseline's fp32 gradient copy (one long-lived buffer), and
attention is the math path (torch's meta kernels), which holds the seq x seq scores as 2019's
Megatron-LM did.

Writes ``fragmentation.csv`` (one row per trace), ``searches.csv`` (per case: paper, ours at 15%,
ours measured), ``fig7.csv`` (full runs), ``fragmentation.png``, ``REPORT.md`` and ``meta.json``.

    python -m experiments.fragmentation_study --out results/fragmentation
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from experiments import markdown
from experiments.fragmentation_trace import TraceCase, measure
from experiments.max_model_size import (
    FAMILY,
    FIG6_BATCH,
    FIG6_FAMILY,
    FIG6_GPUS,
    FIG6_NM,
    NO_MP_CASES,
    Assumptions,
    Case,
    largest_model,
    per_gpu_bytes,
    table2_cases,
)
from experiments.paper_values import FIG6_B, NO_MP_B
from experiments.provenance import ROOT, provenance
from zero_ref.analysis import caching_allocator as ca
from zero_ref.analysis.alloc_trace import AllocationTrace
from zero_ref.analysis.at_scale import ModelShape
from zero_ref.analysis.presets import PAPER_CONFIGS

CHOSEN = 0.15
"""The memory study's chosen fragmentation share, which this study replaces."""

QUICK_BUCKET_NUMEL, QUICK_STEPS = 2**26, 1
"""--quick's traces: gradient buckets of 2**26 elements, 16x the engine's default of 2**22, and one
training step, not two. At stage 2 the engine fills each bucket-sized piece of a reduction one
rank's row at a time, Nd = 128 small copies per piece, each recorded by the trace, which made
--quick's three traces of Fig 4's ZeRO case take minutes; and a trace's peak is in its first step
(the repack), so the second adds time, not a different peak. The shares measured move by tenths of
a percent. Full runs keep the default bucket and two steps."""

FIG7 = {"40B": (ModelShape(50, 8192, 32), 16), "100B": (ModelShape(125, 8192, 64), 32)}
"""Fig 7's models (appendix): shape and batch per GPU, at MP 16 on 400 GPUs."""


def search_cases(quick: bool) -> list[tuple[str, Case, float, tuple]]:
    """(study, case, the paper's size in B, the family of shapes searched) of every
    measured max-model-size point: Table 2's measured columns, Fig 4's sizes, Fig 6's C1-C5."""
    cases = [("Fig 4 / Sec 10.4", case, NO_MP_B[case.stage], FAMILY) for case in NO_MP_CASES]
    if quick:
        return cases
    cases += [("Table 2", case, paper_b, FAMILY) for case, paper_b in table2_cases() if paper_b is not None]
    cases += [("Fig 6", Case(f"Fig 6 {name}", p.stage, FIG6_GPUS // FIG6_NM, FIG6_NM, FIG6_BATCH, p.checkpoints),
               FIG6_B[name], FIG6_FAMILY) for name, p in PAPER_CONFIGS.items()]
    return cases


def _largest(case: Case, fragmentation: float, family: tuple) -> ModelShape:
    return largest_model(case, Assumptions(fragmentation=fragmentation), family)[0]


def _accounted(shape: ModelShape, case: Case) -> float:
    """The search's bytes for `shape` without what the traces cannot hold (the 2019 baseline's
    fp32 gradient copy), to set beside the trace's peak."""
    terms = per_gpu_bytes(shape, case, Assumptions())
    return terms["total"] - (terms["buffers"] if case.stage == 0 else 0)


def _trace_case(case: Case, shape: ModelShape, md: bool, quick: bool = False) -> TraceCase:
    bucket = {"bucket_numel": QUICK_BUCKET_NUMEL} if quick else {}
    return TraceCase(shape, case.stage, case.nd, case.nm, case.batch, case.checkpoints, md, **bucket)


def _measure_all(cases: list[TraceCase], workers: int, quiet: bool, what: str, steps: int = 2) -> list[dict]:
    """measure() every trace case (`steps` steps each), `workers` processes at a time, results in
    input order."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        futures = [pool.submit(measure, case, steps) for case in cases]
        for future in tqdm(futures, desc=what, disable=quiet, file=sys.stderr):
            future.result()
    return [future.result() for future in futures]


def run(quick: bool = False, quiet: bool = False, workers: int | None = None) -> dict[str, pd.DataFrame]:
    """Both rounds of trace-replay-search for every case, and Fig 7 (full runs only)."""
    workers = workers or min(2, os.cpu_count() or 1)
    steps = QUICK_STEPS if quick else 2
    cases = search_cases(quick)
    md = lambda case: case.stage > 0                               # ZeRO with MD, the baseline without
    # round 1: the model the accounting alone allows (no fragmentation), traced
    first = [_largest(c, 0.0, fam) for _, c, _, fam in cases]
    fig7 = [] if quick else [TraceCase(shape, p.stage, FIG6_GPUS // FIG6_NM, FIG6_NM, batch, p.checkpoints, True)
                             for shape, batch in FIG7.values() for p in PAPER_CONFIGS.values()]
    measured = _measure_all([_trace_case(c, s, md(c), quick) for (_, c, _, _), s in zip(cases, first)] + fig7,
                            workers, quiet, "fragmentation: round 1", steps)
    round1, fig7_rows = measured[:len(cases)], measured[len(cases):]
    # round 2: the model that fits with the share measured in round 1, traced with and without MD
    second = [_largest(c, r["fragmentation"], fam) for (_, c, _, fam), r in zip(cases, round1)]
    zero = [i for i, (study, c, _, _) in enumerate(cases) if md(c) and study != "Table 2"]   # MD's effect
    measured = _measure_all([_trace_case(c, s, md(c), quick) for (_, c, _, _), s in zip(cases, second)]
                            + [_trace_case(cases[i][1], second[i], False, quick) for i in zero],
                            workers, quiet, "fragmentation: round 2", steps)
    round2, without_md = measured[:len(cases)], dict(zip(zero, measured[len(cases):]))

    traces, searches = [], []
    for i, ((study, case, paper_b, family), r1, r2) in enumerate(zip(cases, round1, round2)):
        final = _largest(case, r2["fragmentation"], family)
        chosen = _largest(case, CHOSEN, family)
        for round_, row in ((1, r1), (2, r2)):
            traces.append({"study": study, "case": case.name, "round": round_} | row)
        if i in without_md:
            traces.append({"study": study, "case": case.name, "round": 2} | without_md[i])
        searches.append({
            "study": study, "case": case.name, "stage": case.stage, "nd": case.nd, "nm": case.nm,
            "batch": case.batch, "checkpoints": case.checkpoints, "md": md(case), "paper_b": paper_b,
            "chosen_fragmentation": CHOSEN, "ours_chosen_b": chosen.params / 1e9,
            "error_chosen_pct": 100 * (chosen.params / 1e9 - paper_b) / paper_b,
            "fragmentation_round1": r1["fragmentation"], "fragmentation": r2["fragmentation"],
            "fragmentation_without_md": without_md[i]["fragmentation"] if i in without_md else None,
            "ours_b": final.params / 1e9, "ours_shape": final.label(),
            "error_pct": 100 * (final.params / 1e9 - paper_b) / paper_b,
            "converged": final == second[i],
            "traced_shape": second[i].label(), "trace_peak_gb": r2["peak_requested_gb"],
            "accounting_gb": _accounted(second[i], case) / 1e9,
            "change_pct": 100 * (final.params - chosen.params) / chosen.params,
        })
    fig7_table = pd.DataFrame([{"model": size, "config": name} | row
                               for (size, name), row in zip(((s, n) for s in FIG7 for n in PAPER_CONFIGS), fig7_rows)])
    return {"traces": pd.DataFrame(traces), "searches": pd.DataFrame(searches), "fig7": fig7_table}


def fig7_order(fig7: pd.DataFrame) -> dict[str, bool]:
    """The paper's statements about Fig 7, checked on the replay's cached (reserved) peaks."""
    cached = fig7.set_index(["model", "config"]).peak_reserved_gb
    close = lambda a, b: abs(a - b) <= 0.05 * max(a, b)
    return {"C1 > C2 at 40B": cached["40B", "C1"] > cached["40B", "C2"],
            "C1 > C2 at 100B": cached["100B", "C1"] > cached["100B", "C2"],
            "C4 ~ C5 at 40B (within 5%)": close(cached["40B", "C4"], cached["40B", "C5"]),
            "C5 < C4 at 100B (by more than 5%)": cached["100B", "C5"] < 0.95 * cached["100B", "C4"]}


def _c4_c5_at_40b(fig7: pd.DataFrame) -> str:
    """Why C5 is below C4 at 40B here: the difference against Pa's checkpoint bytes."""
    shape, batch = FIG7["40B"]
    pa_gb = shape.layers * batch * shape.seq * shape.hidden * 2 / FIG6_NM / 1e9
    requested = fig7.set_index(["model", "config"]).peak_requested_gb
    return (f"At 40B, C4's peak request exceeds C5's by {requested['40B', 'C4'] - requested['40B', 'C5']:.3f} GB, "
            f"and Pa's checkpoints at 40B are {pa_gb:.3f} GB (L x b x s x h fp16 / Nm): our steps peak while "
            "every checkpoint is alive, so moving them to the host (C5) lowers the peak. The paper's 40B peak, "
            "which Pa+cpu did not lower, must come where the checkpoints are not all alive (its optimizer step "
            "or its buffers), which our steps do not reproduce.")


# ----------------------------------------------------------------------------------- output
def plot(out: Path, tables: dict[str, pd.DataFrame]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid")
    searches, fig7 = tables["searches"], tables["fig7"]
    panels = 3 if len(fig7) else 2
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 1.5 + 0.42 * len(searches)))
    short = searches.case.str.replace("Table 2 ", "").str.replace("ZeRO-100B ", "").str.replace(" DDP", "")
    frag = pd.concat([pd.DataFrame({"case": short, "share %": 100 * searches.fragmentation,
                                    "measured": "as run (baseline: no MD; ZeRO: MD)"}),
                      pd.DataFrame({"case": short, "share %": 100 * searches.fragmentation_without_md,
                                    "measured": "ZeRO without MD"}).dropna()])
    sns.barplot(data=frag, y="case", x="share %", hue="measured", ax=axes[0], orient="h")
    axes[0].axvline(100 * CHOSEN, ls="--", c="gray", label="chosen before (15%)")
    axes[0].set(title="fragmentation share, measured (trace + allocator model)", ylabel="")
    axes[0].legend(fontsize=7)
    sizes = pd.concat([pd.DataFrame({"case": short, "ratio": searches[col] / searches.paper_b, "share": label})
                       for col, label in (("ours_chosen_b", "15%, chosen"), ("ours_b", "measured"))])
    sns.barplot(data=sizes, y="case", x="ratio", hue="share", ax=axes[1], orient="h")
    axes[1].axvline(1, c="black", lw=1)
    axes[1].set(title="largest model: ours / paper's", ylabel="", xlim=(0.5, None))
    if len(fig7):
        sns.barplot(data=fig7, x="config", y="peak_reserved_gb", hue="model", ax=axes[2])
        axes[2].axhline(32 * 2**30 / 1e9, ls="--", c="red", label="32 GiB V100")
        axes[2].set(title="Fig 7: most memory cached per iteration (replay)", ylabel="GB", xlabel="")
        axes[2].legend()
    fig.tight_layout()
    fig.savefig(out / "fragmentation.png", dpi=120)
    plt.close(fig)


def _markdown(frame: pd.DataFrame) -> str:
    """A frame as a markdown table, floats to three significant digits."""
    return markdown.table(frame, lambda v: f"{v:.3g}" if isinstance(v, float) else str(v))


def _findings(s: pd.DataFrame) -> list[str]:
    """What the measurements say, in words computed from them."""
    ratio = s.trace_peak_gb / s.accounting_gb
    zero = s[s.fragmentation_without_md.notna()]
    lines = [f"- The measured share is {100 * s.fragmentation.min():.1f}% to {100 * s.fragmentation.max():.1f}% "
             f"(round 1: {100 * s.fragmentation_round1.min():.1f}% to {100 * s.fragmentation_round1.max():.1f}%), "
             f"against the {100 * CHOSEN:.0f}% chosen before. With it, the searches move by "
             f"{s.change_pct.min():+.1f}% to {s.change_pct.max():+.1f}% from the answers at 15%, "
             f"to {s.error_pct.min():+.1f}% ... {s.error_pct.max():+.1f}% from the paper's sizes.",
             f"- The traces' peaks are {ratio.min():.2f}x to {ratio.max():.2f}x the search's accounting for the "
             "same models: the accounting's activation terms describe a real step well. So what the chosen "
             "share made up for, where the searches now overshoot, is memory that the paper's runs held and "
             "neither our accounting nor our engine's steps hold (their framework's own buffers and "
             "workspaces, Table 2's unstated batch size), not the caching allocator's fragmentation of steps "
             "like ours.",
             f"- {int((~s.converged).sum())} of {len(s)} searches did not settle: the share measured at the "
             "model round 2 traced gives a neighbouring shape (shares differ by tenths of a percent)."]
    if len(zero):
        lower = (zero.fragmentation < zero.fragmentation_without_md).sum()
        lines.append(f"- MD (the contiguous checkpoint arena) lowers the share in {lower} of {len(zero)} ZeRO cases "
                     f"(mean {100 * zero.fragmentation_without_md.mean():.2f}% without, "
                     f"{100 * zero.fragmentation.mean():.2f}% with): at these sizes each checkpoint is a large "
                     "block with a segment of its own, so checkpoints rarely share segments with short-lived "
                     "tensors. MD matters where they would: " + _illustration() + ".")
    return lines


def interleaved_example(long_first: bool) -> AllocationTrace:
    """Three long-lived and three short-lived 6 MiB tensors, then the short ones freed and 12 MiB
    asked for. Interleaved (L S L | S L S), each 20 MiB segment keeps a long-lived block, so the
    6 MiB holes cannot hold 12 MiB and a new segment is needed: 52 MiB for a peak of 36. Long ones
    first (what MD does for checkpoints), the short ones' segment empties and takes the 12 MiB."""
    kinds = "LLLSSS" if long_first else "LSLSLS"
    events = [(i, 6 * ca.MiB) for i in range(6)]
    events += [(i, -6 * ca.MiB) for i, kind in enumerate(kinds) if kind == "S"]
    events.append((6, 12 * ca.MiB))
    return AllocationTrace(events)


def _illustration() -> str:
    interleaved, grouped = (ca.fragmentation(interleaved_example(first)) for first in (False, True))
    return (f"three 6 MiB checkpoints interleaved with three 6 MiB temporaries lose {100 * interleaved:.0f}% "
            f"when 12 MiB is asked for next, {100 * grouped:.0f}% with the checkpoints together "
            "(fragmentation_study.interleaved_example)")


def write_report(out: Path, tables: dict[str, pd.DataFrame], meta: dict) -> list[dict]:
    """REPORT.md of this study; returns the headline rows for results/REPORT.md."""
    s, fig7 = tables["searches"], tables["fig7"]
    mean = lambda col: s[col].abs().mean()
    lines = ["# Fragmentation measured: traces of real steps through a caching-allocator model", "",
             f"Generated by `{meta['command']}` at git `{meta['git_revision']}` on {meta['date_utc']} "
             f"({meta['seconds']:.0f} s). How: experiments/fragmentation_study.py's docstring.", "",
             "## Largest model with the measured share, beside the chosen 15%", "",
             "`fragmentation` is measured in round 2, at the model that fits with round 1's share (round 1 "
             "traces the model the accounting alone allows). `converged`: searching again with round 2's "
             "share gives the model round 2 traced. `change_pct`: ours measured against ours at 15%.", "",
             _markdown(s[["case", "paper_b", "ours_chosen_b", "error_chosen_pct", "fragmentation_round1",
                          "fragmentation", "fragmentation_without_md", "ours_b", "ours_shape", "error_pct",
                          "converged", "change_pct"]]), "",
             "The trace's peak of requested bytes beside the search's accounting for the same model "
             "(without the baseline's fp32 gradient copy, which the engine does not make): how well the "
             "accounting's activation terms match a real step.", "",
             _markdown(s[["case", "traced_shape", "trace_peak_gb", "accounting_gb"]]
                       .assign(ratio=s.trace_peak_gb / s.accounting_gb)), "",
             f"Mean absolute error against the paper: {mean('error_chosen_pct'):.1f}% with the chosen 15%, "
             f"{mean('error_pct'):.1f}% with the measured shares.", "",
             *_findings(s), "",
             "![fragmentation](fragmentation.png)", "",
             "## Every trace", "", _markdown(tables["traces"].drop(columns=["trace"])), ""]
    headline = [{"item": f"{r.case}: largest model, fragmentation measured ({100 * r.fragmentation:.1f}%)",
                 "paper": f"{r.paper_b:g}B", "ours": f"{r.ours_b:.1f}B ({r.ours_shape})",
                 "error": f"{r.error_pct:+.1f}% (at 15% chosen: {r.error_chosen_pct:+.1f}%)",
                 "how": "trace + allocator model + search"} for r in s.itertuples()]
    with_md = s[s.fragmentation_without_md.notna()]
    if len(with_md):
        headline.append({"item": "MD (contiguous checkpoint arena): fragmentation without / with, ZeRO cases",
                         "paper": "MD avoids OOM with memory free (Sec 6.3)",
                         "ours": f"mean {100 * with_md.fragmentation_without_md.mean():.1f}% / "
                                 f"{100 * with_md.fragmentation.mean():.1f}%",
                         "error": "measured", "how": "trace + allocator model"})
    if len(fig7):
        order = fig7_order(fig7)
        lines += ["## Fig 7: the most memory cached per iteration", "",
                  "The replay's peak of reserved bytes during the steps (PyTorch's max cached memory), "
                  "no capacity limit; the paper gives no values, only the order checked here.", "",
                  _markdown(fig7[["model", "config", "peak_requested_gb", "peak_reserved_gb", "fragmentation"]]), "",
                  *[f"- {claim}: {'yes' if held else 'NO'}" for claim, held in order.items()], "",
                  _c4_c5_at_40b(fig7), ""]
        headline.append({"item": "Fig 7: cached memory order per config (40B, 100B)",
                         "paper": "C1 > C2; C4 ~ C5 at 40B; C5 < C4 at 100B",
                         "ours": "; ".join(f"{claim}: {'yes' if held else 'no'}" for claim, held in order.items()),
                         "error": f"{sum(order.values())} of {len(order)} hold", "how": "trace + allocator model"})
    (out / "REPORT.md").write_text("\n".join(lines))
    return headline


def run_study(out: Path, quick: bool = False, quiet: bool = False) -> dict:
    """Run, write CSVs, plot and REPORT.md into `out`; return the headline rows and meta."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tables = run(quick, quiet)
    tables["traces"].to_csv(out / "fragmentation.csv", index=False)
    tables["searches"].to_csv(out / "searches.csv", index=False)
    if len(tables["fig7"]):
        tables["fig7"].to_csv(out / "fig7.csv", index=False)
    plot(out, tables)
    meta = provenance() | {"quick": quick, "seconds": round(time.perf_counter() - start, 1)}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return {"headline": write_report(out, tables, meta), "meta": meta}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "fragmentation")
    parser.add_argument("--quick", action="store_true", help="Fig 4's two cases only (no Table 2, Fig 6, Fig 7), "
                        "traced with larger gradient buckets for one step (QUICK_BUCKET_NUMEL, QUICK_STEPS)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    return run_study(args.out, args.quick, args.quiet)


if __name__ == "__main__":
    main()
