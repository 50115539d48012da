"""`zero-ref reproduce`: run the paper's studies whose inputs changed, write results/ and REPORT.md.

The studies are `experiments.studies.STUDIES` (experiments/README.md maps each paper artifact to
its study); each writes ``results/<study>/`` and returns its headline rows.

The job is incremental: each study's ``headline.json`` stores its key (`experiments.study_key`: the
hash of every project file it imports, its arguments and the machine), and a study runs only when
its key now differs (``--force``: always). Each runs in a fresh process of its own, its output in
``results/.logs/<study>.log``, while one progress line shows the whole job (``--jobs N``: the
untimed studies N at a time, longest first; the timed ones always alone, afterwards). At the end
`experiments.pages` writes ``results/REPORT.md`` from every study's rows, each marked current or
stale, and renders the pages that quote results (README.md, docs/); a summary table is printed.

    python -m experiments.reproduce            # every study whose key changed
    python -m experiments.reproduce --force    # every study
    python -m experiments.reproduce --quick    # fewer cases, traces and real runs; none of FULL_ONLY
    python -m experiments.reproduce --only throughput    # consider one study
    python -m experiments.reproduce --jobs 2   # the untimed studies two at a time
    python -m experiments.reproduce --redraw peers   # a study's plots and report from its tables, no run

How long a run takes is recorded where it ran, never copied here: ``seconds`` in results/meta.json
(the whole run, with the studies it ran) and in each results/<study>/headline.json (that study).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import multiprocessing
import os
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from tqdm import tqdm

from experiments.provenance import ROOT, provenance
from experiments.pages import render_pages
from experiments.studies import FULL_ONLY, REPORTS, STUDIES, TIMED, current_keys
from experiments.study_key import READS, changes, stored_key, with_reads_now

def _run_study(folder: str, out: Path, quick: bool, key: dict, log: Path) -> dict:
    """Run one study into ``out/folder`` in this process, its output (this process's and its
    children's, profiler lines included) going to ``log``; save its headline rows with their key,
    provenance and time."""
    log.parent.mkdir(parents=True, exist_ok=True)
    key = with_reads_now(folder, key, out)   # planned before what it reads ran: read it as it is now
    with open(log, "w") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        start = time.perf_counter()
        result = importlib.import_module(STUDIES[folder][1]).run_study(out / folder, quick, False)
        if folder in REPORTS:   # its report step draws the tables the run left and gives the rows
            result["headline"] = importlib.import_module(REPORTS[folder]).render(out / folder)
    record = {"headline": result["headline"], "seconds": round(time.perf_counter() - start, 1), "key": key,
              **provenance()}
    (out / folder / "headline.json").write_text(json.dumps(record, indent=1) + "\n")
    return result


def redraw(folder: str, out: Path, key: dict) -> list[dict]:
    """Run ``folder``'s report step alone on the tables its last run left (its measurement is
    current; only the report step's code changed), and store the report part of ``key`` beside the
    measured parts the run stored, with when it was redrawn. The stored ``digest`` stays the one the
    run made: a study that reads this one (``study_key.READS``) is not made stale by a redraw."""
    rows = importlib.import_module(REPORTS[folder]).render(out / folder)
    path = out / folder / "headline.json"
    record = json.loads(path.read_text())
    if record.get("key"):   # results made before keys were kept stay without one: stale, whatever is drawn
        # the digest stays the measured one: the studies that read this one's tables read the same tables
        record["key"] = record["key"] | {"report": key["report"]}
    record.update(headline=rows, redrawn={k: v for k, v in provenance().items() if k != "hardware"})
    path.write_text(json.dumps(record, indent=1) + "\n")
    return rows


def _printed(log: Path, tail_bytes: int | None = None) -> list[str]:
    """A study's output as lines, each progress bar at its last state (the part after its last
    carriage return that is not blank); ``tail_bytes``: read only that much of the end."""
    with open(log, "rb") as handle:
        if tail_bytes is not None:
            handle.seek(max(0, log.stat().st_size - tail_bytes))
        text = handle.read().decode(errors="replace").replace("\r\n", "\n")
    return [([part for part in line.split("\r") if part.strip()] or [""])[-1] for line in text.split("\n")]


def _last_words(log: Path, width: int = 40) -> str:
    """What a running study printed last (its progress bar's latest state), cut to ``width``."""
    try:
        shown = [line.strip() for line in _printed(log, 2048) if line.strip()]
    except OSError:
        return ""
    return shown[-1][:width] if shown else ""


class _Display:
    """One progress line for the whole job: studies done, the ones running with their time against
    their last run's, what each printed last, and the time left by those estimates."""

    def __init__(self, names: list[str], estimates: dict[str, float | None], logs: dict[str, Path], quiet: bool):
        self.estimates, self.logs, self.running, self.stop = estimates, logs, {}, threading.Event()
        self.left = set(names)
        self.bar = tqdm(total=len(names), desc="reproduce", unit="study", disable=quiet, file=sys.stderr,
                        bar_format="{desc} {n}/{total} studies [{elapsed}]{postfix}", dynamic_ncols=True)
        self.ticker = threading.Thread(target=self._tick, daemon=True)
        self.ticker.start()

    def started(self, name: str) -> None:
        self.running[name] = time.perf_counter()

    def finished(self, name: str) -> None:
        self.running.pop(name, None)
        self.left.discard(name)
        self.bar.update()

    def _tick(self) -> None:
        while not self.stop.wait(1.0):
            now, parts, left = time.perf_counter(), [], 0.0
            for name, since in list(self.running.items()):
                estimate = self.estimates.get(name)
                left += max(0.0, (estimate or 0) - (now - since))
                parts.append(f"{name} {now - since:.0f}s" + (f"/~{estimate:.0f}s" if estimate else "")
                             + f" {_last_words(self.logs[name])}")
            left += sum(self.estimates.get(n) or 0 for n in self.left - set(self.running))
            self.bar.set_postfix_str(" | ".join(parts) + (f" | ~{left / 60:.0f} min left" if left else ""))

    def close(self) -> None:
        self.stop.set()
        self.ticker.join()
        self.bar.close()


def run_studies(names: list[str], out: Path, quick: bool, quiet: bool, jobs: int = 1,
                keys: dict[str, dict] | None = None) -> dict[str, dict]:
    """Run the named studies, each in a fresh process of its own (its output in ``out/.logs/``):
    the untimed ones ``jobs`` at a time, then one by one, in ``STUDIES`` order, the timed ones and
    those that read another study's results. The first failure stops
    what has not started and is raised, naming the study and its log, once the running studies
    have finished (their results are kept)."""
    keys = keys or current_keys(out, quick)
    logs = {name: out / ".logs" / f"{name}.log" for name in names}
    estimates = {name: _last_seconds(out, name, keys[name]) for name in names}
    display = _Display(names, estimates, logs, quiet)
    ran: dict[str, dict] = {}
    context = multiprocessing.get_context("spawn")
    try:
        after = {n for n in names if set(READS.get(n, ())) & set(names)}   # reads a study run now: after it
        untimed = [n for n in names if n not in TIMED and n not in after]
        if jobs > 1 and all(estimates[n] is not None for n in untimed):   # longest first: the pool ends sooner
            untimed.sort(key=lambda n: -estimates[n])
        alone = _after_what_they_read(sorted((n for n in names if n in TIMED or n in after), key=list(STUDIES).index))
        for batch, width in ((untimed, jobs), (alone, 1)):
            if not batch:
                continue
            with ProcessPoolExecutor(min(width, len(batch)), mp_context=context, max_tasks_per_child=1) as pool:
                futures = {pool.submit(_run_study, name, out, quick, keys[name], logs[name]): name for name in batch}
                for name in batch[:width]:   # the pool starts them in the order submitted
                    display.started(name)
                next_up, failure = width, None
                for future in as_completed(futures):
                    name = futures[future]
                    if future.cancelled():
                        continue
                    if future.exception() is not None:
                        failure = failure or (name, future.exception())
                        for other in futures:   # what has not started; the running ones finish
                            other.cancel()
                    else:
                        ran[name] = future.result()
                    display.finished(name)
                    if next_up < len(batch) and not failure:
                        display.started(batch[next_up])
                        next_up += 1
                if failure:
                    name, error = failure
                    raise RuntimeError(f"study {name} failed (finished: {', '.join(ran) or 'none'}); its output: "
                                       f"{logs[name]}, ending:\n{_tail(logs[name])}") from error
    finally:
        display.close()
    return ran


def _after_what_they_read(names: list[str]) -> list[str]:
    """``names`` in their order, except that a study comes after every study of ``names`` it reads."""
    ordered, left = [], list(names)
    while left:
        ready = next((n for n in left if not set(READS.get(n, ())) & set(left)), left[0])   # left[0]: a cycle
        ordered.append(ready)
        left.remove(ready)
    return ordered


def _tail(log: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a study's output, each progress bar at its last state."""
    return "\n".join(_printed(log)[-lines:]) if log.exists() else "(no output)"


def _last_seconds(out: Path, name: str, key: dict) -> float | None:
    """How long ``name`` took last time it ran with the same arguments (None: never)."""
    path = out / name / "headline.json"
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    same_args = (record.get("key") or {}).get("args", {"quick": "quick" in record.get("command", "")}) == key["args"]
    return record.get("seconds") if same_args else None


def plan(names: list[str], out: Path, quick: bool, force: bool) -> tuple[list[str], dict[str, dict], dict, list[str]]:
    """Which of ``names`` to run: those whose stored key differs from their key now in what they
    measure (all with ``force``). Returns them, every study's current key, why each stored key is
    stale, and the studies whose report step alone changed (redrawn from their tables, not run)."""
    keys = current_keys(out, quick)
    why = {name: changes(stored_key(out, name), keys[name]) for name in STUDIES}
    todo = [name for name in names if force or why[name]]
    added = True
    while added:   # a study that reads one rerun now goes stale with it, and so on down the reads: rerun it after
        added = False
        for name in names:
            if name not in todo and set(READS.get(name, ())) & set(todo):
                todo.append(name)
                why[name] = why[name] or [f"reads: {', '.join(sorted(set(READS[name]) & set(todo)))} rerun now"]
                added = True
    redrawn = [name for name in names if name not in todo and name in REPORTS
               and changes(stored_key(out, name), keys[name], parts=("report",))]
    return todo, keys, why, redrawn


def log_run(out: Path, meta: dict) -> None:
    """Append ``meta`` (one run of reproduce: its command, revision, machine, start and end, the studies
    it ran and its seconds) to ``out``/runs.jsonl, once: every run is kept there, none replaced. A run
    is its whole record (two runs of one command may end in the same second: `started_utc` has
    microseconds), so logging the same meta.json again adds nothing."""
    log = out / "runs.jsonl"
    runs = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    meta = json.loads(json.dumps(meta))   # as it will read back
    if meta not in runs:
        with open(log, "a") as handle:
            handle.write(json.dumps(meta) + "\n")


def summary(names: list[str], ran: dict, why: dict[str, list[str]], out: Path, redrawn: tuple[str, ...] = ()) -> str:
    """The table printed at the end: each study, what this run did with it, its time."""
    rows = []
    for name in STUDIES:
        path = out / name / "headline.json"
        seconds = json.loads(path.read_text()).get("seconds") if path.exists() else None
        if name in ran:
            status = "ran"
        elif name in redrawn:
            status = "redrawn from its tables (its report step changed)"
        elif name not in names:
            status = "not asked" + (" (stale)" if why[name] else "")
        elif why[name]:
            status = "stale: " + "; ".join(why[name])
        else:
            status = "current (not rerun)"
        rows.append((name, status[:90], "-" if seconds is None else f"{seconds:.0f} s"))
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{n:<{width}}  {t:>7}  {s}" for n, s, t in [("study", "status", "time"), *rows])


def main(argv: list[str] | None = None) -> dict:
    """Run every study whose key changed (``--force``: all; ``--quick``: the short version) and write
    ``--out``/REPORT.md."""
    parser = argparse.ArgumentParser(prog="zero-ref reproduce", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the short version: fewer cases, traces and real runs, "
                        f"and none of {', '.join(sorted(FULL_ONLY))}")
    parser.add_argument("--force", action="store_true", help="rerun the studies even where their results are current")
    parser.add_argument("--out", type=Path, default=ROOT / "results", help="results folder (default: results/)")
    parser.add_argument("--quiet", action="store_true", help="no progress display and no summary")
    parser.add_argument("--only", choices=sorted(STUDIES), nargs="+", metavar="STUDY",
                        help="consider only these studies (the others keep their last headline rows in REPORT.md, "
                             f"marked stale where they are): {', '.join(STUDIES)}")
    parser.add_argument("--redraw", choices=sorted(REPORTS), nargs="+", metavar="STUDY",
                        help="draw these studies' plots and reports again from the tables of their last run, "
                             f"measuring nothing (studies with a report step: {', '.join(REPORTS)})")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="run the untimed studies N at a time, each in its own process (default 1; the timed "
                             f"studies, {', '.join(sorted(TIMED))}, always run alone)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    start, started_utc = time.perf_counter(), datetime.datetime.now(datetime.timezone.utc).isoformat()
    names = args.only or [name for name in STUDIES if not (args.quick and name in FULL_ONLY)]
    if args.redraw:   # only these, from their tables; the keys are those their tables were made with
        keys, todo = current_keys(args.out), []
        to_redraw = [name for name in args.redraw if (args.out / name / "headline.json").exists()]
        missing = sorted(set(args.redraw) - set(to_redraw))
        if missing:
            parser.error(f"--redraw {' '.join(missing)}: no tables under {args.out} (run the study first)")
    else:
        todo, keys, _, to_redraw = plan(names, args.out, args.quick, args.force)
    args.out.mkdir(parents=True, exist_ok=True)
    if (args.out / "meta.json").exists():   # a run made before the log was kept
        log_run(args.out, json.loads((args.out / "meta.json").read_text()))
    try:
        for name in to_redraw:
            redraw(name, args.out, keys[name])
        ran = run_studies(todo, args.out, args.quick, args.quiet, args.jobs, keys) if todo else {}
    finally:   # what finished is kept, in REPORT.md too, even when a study failed
        why = {name: changes(stored_key(args.out, name), with_reads_now(name, keys[name], args.out))
               for name in STUDIES}   # a study that ran stored the reads it started with, not the planned ones
        meta = provenance() | {"started_utc": started_utc, "quick": args.quick,
                               "seconds": round(time.perf_counter() - start, 1),
                               "studies": sorted(name for name in todo if not why[name]), "registry": list(STUDIES),
                               "redrawn": to_redraw}
        (args.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        log_run(args.out, meta)
        path = render_pages(args.out)
    if not args.quiet:
        print(summary(names, ran, why, args.out, tuple(to_redraw)))
        print(f"wrote {path} ({meta['seconds']:.0f} s; {len(ran)} of {len(STUDIES)} studies run now"
              + (f", {len(to_redraw)} redrawn from their tables: {', '.join(to_redraw)}" if to_redraw else "") + ")")
    return {"report": path, "meta": meta, "ran": sorted(ran), "redrawn": to_redraw}


if __name__ == "__main__":
    main()
