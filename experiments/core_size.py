"""How much one reads to learn the algorithm: the size of `zero_ref/core/` and the reading list of
one stage-3 step.

Two measurements, both from the code as it is, none by hand:

* **files**: every file of `zero_ref/core/` with its lines (all, and without blank lines: code,
  docstrings and comments, as cloc counts them).
* **stage-3 step**: the core functions one stage-3 training step runs (forward, backward, step of
  GPT-2 S at world 2, after WARMUP_STEPS steps: the steady state), found with `sys.setprofile` on every
  thread, not chosen by hand. A reader following one parameter through the step reads those
  functions, plus each file's module docstring and the docstring of each class whose methods ran;
  the lines of that union are counted per file. Measured under checks="off" (the core alone) and
  "strict" (the guard's files listed beside it, not counted against the core).

Writes results/core/files.csv, stage3_step_off.csv, stage3_step_strict.csv, meta.json, REPORT.md.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import threading
from pathlib import Path

import pandas as pd

from experiments.provenance import ROOT, provenance

CORE = ROOT / "zero_ref" / "core"
PACKAGE = ROOT / "zero_ref"
WARMUP_STEPS = 5
"""Steps before the traced one: stage 3 learns its gather schedules in the first, and under
checks="off" stops their closing rounds after three more (units.TRUST_AFTER)."""


def _lines(text_lines: list[str]) -> tuple[int, int]:
    """(all lines, lines that are not blank)."""
    return len(text_lines), sum(1 for line in text_lines if line.strip())


def file_sizes() -> pd.DataFrame:
    """Every core file's lines, largest first."""
    rows = [{"file": path.name, **dict(zip(("lines", "non_blank"), _lines(path.read_text().splitlines())))}
            for path in sorted(CORE.glob("*.py"))]
    return pd.DataFrame(rows).sort_values("lines", ascending=False, ignore_index=True)


def _step_trace(rank: int, world: int, checks: str) -> list[tuple[str, int]]:
    """(file, first line) of every zero_ref function one stage-3 step runs on this rank."""
    import dataclasses

    import torch

    import zero_ref
    from experiments.scaling_curves import MODELS
    from zero_ref.models import lm_loss

    size = MODELS["S"]
    engine = zero_ref.initialize(size.build(), dataclasses.replace(size.config(3), checks=checks))
    batch = torch.randint(0, size.vocab, (4, size.seq), generator=torch.Generator().manual_seed(rank))

    def step():
        engine.backward(lm_loss(engine(batch).logits, batch))
        engine.step()

    for _ in range(WARMUP_STEPS):
        step()
    seen: set[tuple[str, int]] = set()
    package = str(PACKAGE)

    def profiler(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(package):
            seen.add((frame.f_code.co_filename, frame.f_code.co_firstlineno))
        return profiler

    threading.setprofile(profiler)
    sys.setprofile(profiler)
    try:
        step()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    engine.close()
    return sorted(seen)


def _spans(path: Path, first_lines: set[int]) -> list[tuple[int, int, str]]:
    """(start, end, name) of the functions that start at `first_lines` (decorators included), each
    class docstring of a class holding one of them, and the module docstring."""
    tree = ast.parse(path.read_text())
    spans = []
    if ast.get_docstring(tree) is not None:
        doc = tree.body[0]
        spans.append((doc.lineno, doc.end_lineno, "module docstring"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            if any(_first_line(m) in first_lines or m.lineno in first_lines for m in methods) \
                    and ast.get_docstring(node) is not None:
                doc = node.body[0]
                spans.append((node.lineno, doc.end_lineno, f"class {node.name}"))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            if _first_line(node) in first_lines or node.lineno in first_lines:
                spans.append((_first_line(node), node.end_lineno, getattr(node, "name", "<lambda>")))
    return spans


def _first_line(node) -> int:
    return min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])


def reading_list(traced: list[tuple[str, int]]) -> pd.DataFrame:
    """Per file: the functions run, and the lines (all, non-blank) of the union of their spans."""
    by_file: dict[str, set[int]] = {}
    for filename, first in traced:
        by_file.setdefault(filename, set()).add(first)
    rows = []
    for filename, firsts in sorted(by_file.items()):
        path = Path(filename)
        text = path.read_text().splitlines()
        spans = _spans(path, firsts)
        covered = sorted({n for start, end, _ in spans for n in range(start, end + 1)})
        names = sorted({name for _, _, name in spans if name not in ("<lambda>", "module docstring")
                        and not name.startswith("class ")})
        rel = path.relative_to(PACKAGE)
        rows.append({"file": str(rel), "layer": rel.parts[0] if len(rel.parts) > 1 else "zero_ref",
                     "functions": len(names), "lines": len(covered),
                     "non_blank": sum(1 for n in covered if text[n - 1].strip()),
                     "file_lines": len(text), "names": " ".join(names)})
    return pd.DataFrame(rows).sort_values(["layer", "lines"], ascending=[True, False], ignore_index=True)


def measure(checks: str = "off") -> pd.DataFrame:
    """The stage-3 step's reading list at world 2 under `checks`."""
    from zero_ref.launch import spawn

    return reading_list(spawn(_step_trace, 2, checks, timeout=300)[0])


def _summary(files: pd.DataFrame, step: pd.DataFrame) -> dict:
    core = step[step.layer == "core"]
    return {"core_files": len(files), "core_lines": int(files.lines.sum()),
            "core_non_blank": int(files.non_blank.sum()), "largest_file": files.file[0],
            "largest_lines": int(files.lines[0]), "step_core_files": len(core),
            "step_core_lines": int(core.lines.sum()), "step_core_non_blank": int(core.non_blank.sum()),
            "step_other_files": int((step.layer != "core").sum()),
            "step_other_lines": int(step.lines[step.layer != "core"].sum())}


def run_study(out: Path) -> dict:
    """Both checks settings: files.csv, stage3_step_{off,strict}.csv, meta.json, REPORT.md."""
    out.mkdir(parents=True, exist_ok=True)
    files = file_sizes()
    files.to_csv(out / "files.csv", index=False)
    steps = {checks: measure(checks) for checks in ("off", "strict")}
    summaries = {}
    for checks, step in steps.items():
        step.to_csv(out / f"stage3_step_{checks}.csv", index=False)
        summaries[checks] = _summary(files, step)
    meta = provenance() | {"summary": summaries}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    first = summaries["off"]
    lines = ["# zero_ref/core: its size, and what one reads to follow one stage-3 step", "",
             f"`{meta['command']}` at {meta['git_revision']} on {meta['date_utc']}.", "",
             f"**Core:** {first['core_files']} files, {first['core_lines']} lines "
             f"({first['core_non_blank']} not blank); the largest is {first['largest_file']} "
             f"({first['largest_lines']} lines).", ""]
    for checks, step in steps.items():
        summary = summaries[checks]
        lines += [f"## One stage-3 step, checks=\"{checks}\"", "",
                  f"GPT-2 S at world 2 (gloo), forward, backward and step after {WARMUP_STEPS} warm-up steps: the functions "
                  f"it runs are in {summary['step_core_files']} core files, {summary['step_core_lines']} lines to read "
                  f"({summary['step_core_non_blank']} not blank), module and class docstrings included; "
                  f"{summary['step_other_files']} files outside the core add {summary['step_other_lines']}.", "",
                  "| layer | file | functions run | lines to read | non-blank | the file's lines |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r.layer} | {r.file} | {r.functions} | {r.lines} | {r.non_blank} | {r.file_lines} |"
                  for r in step.itertuples()]
        lines.append("")
    lines += ["## Every core file", "", "| file | lines | not blank |", "|---|---|---|"]
    lines += [f"| {r.file} | {r.lines} | {r.non_blank} |" for r in files.itertuples()]
    (out / "REPORT.md").write_text("\n".join(lines) + "\n")
    return {"meta": meta, "files": files, "steps": steps}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "core")
    args = parser.parse_args(argv)
    result = run_study(args.out)
    print((args.out / "REPORT.md").read_text())
    return result


if __name__ == "__main__":
    main()
