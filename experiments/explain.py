"""`zero-ref explain --stage N`: one real ZeRO step, traced, told in the terminal.

Runs experiments/timeline.py's traced step (a three-block model, world 2 on gloo, one warm-up step
first) for the stages asked and prints rank 0's events in order: when (ms since the step began),
which rank, what happened (a phase, a block's computation, a collective from its issue to gloo
finishing it and the host's wait, a unit freed, a gradient bucket taken from or given back to the
pool) and the bytes alive on the rank at that moment; then the model states against the paper's
formula, the elements moved against 2Ψ/3Ψ, and the timeline checks. With rich installed the list
is a table; `--plain` (or no rich) prints plain columns.

    zero-ref explain --stage 3
    zero-ref explain --stage 1 2 --rank 1 --plain
    zero-ref explain --stage 3 --json rows.json     # also every rank's rows, for scripts and tests
"""

from __future__ import annotations

import argparse
import json
import sys

from zero_ref.config import STAGE_NAMES

KIND = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "all_reduce": "all-reduce",
        "broadcast": "broadcast", "control": "control exchange"}
PHASE = {"forward": "forward (engine(batch))", "backward": "backward (engine.backward)",
         "optimizer": "optimizer (engine.step: AdamW)", "after_update": "after the update (engine.step)"}


def describe(row: dict, stage: int) -> str:
    """One row of timeline.rows_of in words."""
    what, group, name = row["what"], row["group"], row["name"]
    unit = f"{'unit' if stage == 3 else 'bucket'} {group} ({name})" if group >= 0 else ""
    ms = lambda a, b: f"{(b - a) / 1e3:.2f} ms"   # noqa: E731
    if row["lane"] == "phase":
        return f"== {PHASE.get(what, what)}, {ms(row['start_us'], row['end_us'])}"
    if row["lane"] == "compute":
        if what.startswith("update"):
            where = "every bucket whole (replicated state)" if stage == 0 else "this rank's shards"
            return f"{what}: AdamW on {where}, {ms(row['start_us'], row['end_us'])}"
        return f"{what} computes, {ms(row['start_us'], row['end_us'])}"
    if row["lane"] == "buffers":
        return {"free unit": f"free {unit}: its full parameters are released (shard kept)",
                "take bucket": f"{unit} takes a gradient buffer from the pool (CB)",
                "reduced bucket": f"{unit}: reduced chunk added into the gradient shard, buffer back to the pool",
                }[what]
    purpose = {"gather unit": f"{unit}: its parameters, a shard from every rank",
               "reduce bucket": f"{unit} gradients" + (", averaged on every rank" if row["kind"] == "all_reduce"
                                                       else ", this rank keeps its averaged shard"),
               "regather bucket": f"{unit}: the updated parameter shards",
               "schedule round": "gather-schedule round (which units next)",
               "step statistics": "the step's statistics (norm, overflow flag, used parameters)"}.get(what, what)
    done = f"gloo done +{ms(row['start_us'], row['done_us'])}" if row["done_us"] is not None else "gloo done ?"
    waited = f", host waited {ms(row['wait_start_us'], row['end_us'])}" if row["wait_start_us"] is not None else ""
    return f"{KIND.get(row['kind'], row['kind'])} #{row['seq']} {purpose}; {done}{waited}"


def lines(rows: list[dict], stage: int) -> list[tuple[str, str, str, str, str]]:
    """(time ms, rank, what, bytes, bytes alive) per row, in order."""
    out = []
    for row in rows:
        moved = f"{row['bytes']:,}" if row["bytes"] else ""
        out.append((f"{row['start_us'] / 1e3:8.2f}", str(row["rank"]), describe(row, stage), moved,
                    f"{row['bytes_alive']:,}"))
    return out


def summary(f: dict) -> list[str]:
    from experiments.timeline_report import FORMULA, MOVED

    psi = f["psi"]
    said = [f"model states after the step (memory_report, rank 0): {f['states_bytes'][0]:,} B; the paper's "
            f"{FORMULA[f['stage']]} with Ψ = {psi:,}, K = 12, Nd = {f['world']}: {f['formula_bytes']:,.0f} B; "
            f"constant-size gradient buckets (CB): {f['cb_bytes'][0]:,} B",
            f"bytes alive: {f['alive_start'][0]:,} at the step's start, {f['alive_peak'][0]:,} at its peak (rank 0)",
            f"elements moved by this rank: {f['moved']['total']:,} = {f['moved']['total'] / psi:.4f}Ψ "
            f"(the paper: {MOVED[f['stage']]}; "
            + ", ".join(f"{KIND[k]} {v:,}" for k, v in f["moved"].items() if k != "total" and v) + ")",
            f"reductions issued while backward still computes: {f['issued_in_backward']} of {f['reductions']}"]
    problems = [f"rank {rank}: {p}" for rank, ps in f["problems"].items() for p in ps]
    said.append("timeline checks: " + ("all hold on every rank" if not problems else "VIOLATED: " + "; ".join(problems)))
    return said


def show(f: dict, rank: int, plain: bool) -> None:
    stage = f["stage"]
    title = (f"stage {stage} ({STAGE_NAMES[stage]}): one training step on rank {rank} of {f['world']} "
             f"(gloo, CPU), a model of 3 blocks, Ψ = {f['psi']:,}, bf16")
    table = lines(f["rows"][rank], stage)
    header = ("ms", "rank", "what", "bytes", "bytes alive")
    try:
        if plain:
            raise ImportError
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print(f"{header[0]:>8}  {header[1]:>4}  {header[2]:<100}  {header[3]:>10}  {header[4]:>12}")
        for t, r, what, moved, alive in table:
            print(f"{t:>8}  {r:>4}  {what:<100}  {moved:>10}  {alive:>12}")
        for line in summary(f):
            print("  " + line)
        print()
        return
    grid = Table(title=title, title_justify="left", show_lines=False)
    for name, justify in zip(header, ("right", "right", "left", "right", "right")):
        grid.add_column(name, justify=justify, overflow="fold")
    for t, r, what, moved, alive in table:
        grid.add_row(t, r, what, moved, alive, style="bold" if what.startswith("==") else None)
    console = Console(width=max(140, Console().width))
    console.print(grid)
    for line in summary(f):
        console.print("  " + line, highlight=False)
    console.print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zero-ref explain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=int, nargs="+", choices=(0, 1, 2, 3), default=[3],
                        help="the stages to trace and tell, one after another (default 3)")
    parser.add_argument("--rank", type=int, default=0, help="whose events to print (default 0)")
    parser.add_argument("--plain", action="store_true", help="plain text, even when rich is installed")
    parser.add_argument("--json", help="also write every rank's rows of every stage asked to this file")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not 0 <= args.rank < 2:
        parser.error("--rank must be 0 or 1 (the trace runs 2 ranks)")
    from experiments.timeline import trace
    from experiments.timeline_report import facts

    found = [facts(raws) for raws in trace(tuple(args.stage))]
    for f in found:
        show(f, args.rank, args.plain)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({str(f["stage"]): {str(rank): rows for rank, rows in f["rows"].items()} for f in found}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
