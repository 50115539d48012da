"""What a study's results depend on, as one key: `zero-ref reproduce` reruns a study only when it changed.

A study's key has three parts:

- ``files``: the SHA-256 of every project file the study's module can reach. The reach is read
  from the source, not from a running interpreter: every ``import`` and ``from ... import`` anywhere
  in a file (inside functions too), every string that names a project module (``python -m
  zero_ref.analysis.at_scale`` run in a subprocess), followed through ``zero_ref/``, ``experiments/``
  and ``triton_kernels/``, plus the data each module is known to read (``DATA``) and the results of
  other studies it reads (``READS``).
- ``args``: how reproduce ran it (``quick``).
- ``env``: what ran it: torch's version, the GPU's name or "cpu", the number of CPU cores; for
  a timed study also the CPU's model and its instruction sets (``cpu_speed``).
- ``report``: for a study with a report step of its own (``studies.REPORTS``), the files that step
  reaches; the study's ``files`` stop there. A change there alone redraws the study from its tables.

``digest`` hashes them, and each study's ``headline.json`` stores its key; ``changes`` compares a
stored key with ``study_key`` now and says what differs (which files, which argument, which part of
the environment): reproduce reruns a study when anything does.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
from functools import lru_cache
from pathlib import Path

from experiments.provenance import ROOT

PACKAGES = ("zero_ref", "experiments", "triton_kernels")
"""Top-level packages whose files are part of a key; imports of anything else (torch, pandas) are not."""

DATA = {
    "experiments/paper_values.py": ("experiments/paper_data",),
    "experiments/bench.py": ("benchmarks",),   # runs pytest on benchmarks/
}
"""module -> folders (or files) it reads besides code, hashed into the key of every study that reaches it."""

READS = {"scaling_curves": ("benchmarks",), "gpu": ("throughput",), "throughput": ("fragmentation",), "memory_gap": ("fragmentation", "gpu"),
         "zero_r": ("fragmentation",)}
"""study -> the studies whose results it reads: their stored keys and run dates enter its key, so a
rerun of one marks the other stale, and reproduce runs it after them."""

_MODULE_NAME = re.compile(r"(?:%s)(?:\.\w+)+" % "|".join(PACKAGES))


def _module_file(name: str) -> Path | None:
    """The file of project module ``name`` (a package's ``__init__.py``), or None outside the project."""
    if name.split(".")[0] not in PACKAGES:
        return None
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imported_names(path: Path) -> frozenset[str]:
    stat = path.stat()
    return _names_in(path, (stat.st_size, stat.st_mtime_ns))


@lru_cache(maxsize=None)
def _names_in(path: Path, stamp: tuple[int, int]) -> frozenset[str]:
    """Every module name ``path`` may import: its import statements (resolved when relative, with
    ``from a import b`` giving both ``a`` and ``a.b``) and the module names in its strings."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    prose = {id(node.value) for node in ast.walk(tree)   # docstrings and bare strings name modules, not run them
             if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            names.update(_MODULE_NAME.findall(node.value))
    return frozenset(names)


def _parents(name: str) -> list[str]:
    """``a.b.c`` -> ``a``, ``a.b``: importing a module runs its packages' ``__init__`` first."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def reach(module: str, stop: tuple[str, ...] = ()) -> list[Path]:
    """The project files ``module`` can import, itself first, then sorted by path; the modules in
    ``stop`` (a study's report step) are neither included nor followed."""
    start = _module_file(module)
    if start is None:
        raise ValueError(f"{module!r} is not a module of {', '.join(PACKAGES)}")
    stopped = {_module_file(name) for name in stop}
    seen, todo = {start, *stopped}, [start]
    while todo:
        path = todo.pop()
        for name in _imported_names(path):
            for candidate in (*_parents(name), name):
                found = _module_file(candidate)
                if found is not None and found not in seen:
                    seen.add(found)
                    todo.append(found)
    return [start, *sorted(seen - {start} - stopped)]


def _data_files(relative: str) -> list[Path]:
    path = ROOT / relative
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


@lru_cache(maxsize=None)
def _sha256(path: Path, stamp: tuple[int, int]) -> str:
    """The file's hash, cached by (size, mtime) so that one reproduce hashes each file once."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def file_hashes(module: str, stop: tuple[str, ...] = ()) -> dict[str, str]:
    """``{relative path: hash}`` of every file ``module`` reaches (short of ``stop``), its data included."""
    files = reach(module, stop)
    for path in list(files):
        files += [data for folder in DATA.get(path.relative_to(ROOT).as_posix(), ()) for data in _data_files(folder)]
    out = {}
    for path in files:
        stat = path.stat()
        out[path.relative_to(ROOT).as_posix()] = _sha256(path, (stat.st_size, stat.st_mtime_ns))
    return dict(sorted(out.items()))


SPEED_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
"""The CPU's instruction sets that set how fast torch's CPU kernels run (bf16 matmuls slow down by
an order of magnitude without AVX-512): part of a timed study's environment."""


def cpu_speed() -> dict:
    """The CPU's model name and which of ``SPEED_FLAGS`` it has (from /proc/cpuinfo; on other
    systems the processor's name and no flags)."""
    import platform

    name, flags = platform.processor() or "unknown", set()
    if os.path.exists("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    return {"cpu": name, "cpu_flags": " ".join(f for f in SPEED_FLAGS if f in flags) or "none of " + "/".join(SPEED_FLAGS)}


def environment(timed: bool = False) -> dict:
    """What ran a study, as far as its numbers depend on it: torch, the device, the CPU cores; for
    a study that times (``timed``), also the CPU's model and instruction sets."""
    import platform

    import torch

    env = {"torch": torch.__version__, "python": platform.python_version(),
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "cores": os.cpu_count()}
    return env | (cpu_speed() if timed else {})


def stored_key(out: Path, study: str) -> dict | None:
    """The key saved in ``out/study/headline.json`` by the run that made it (None: no run, or one
    made before keys existed)."""
    path = out / study / "headline.json"
    if not path.exists():
        return None
    return json.loads(path.read_text()).get("key")


def study_key(study: str, module: str, quick: bool, out: Path, env: dict | None = None,
              report: str | None = None) -> dict:
    """The key ``study`` (run by ``module``, its tables drawn and reported by ``report`` when it has
    a report step of its own) would have if it ran now with ``quick`` into ``out``."""
    key = {"files": file_hashes(module, (report,) if report else ()), "args": {"quick": quick},
           "env": env or environment(), "reads": reads(study, out), "report": file_hashes(report) if report else {}}
    key["digest"] = digest(key)
    return key


def reads(study: str, out: Path) -> dict:
    """The key's "reads" part: for each study ``study`` reads (``READS``), the digest and date of
    the results now in ``out``. Taken when ``study`` starts, after what it reads has run."""
    inputs = {}
    for other in READS.get(study, ()):
        path = out / other / "headline.json"
        record = json.loads(path.read_text()) if path.exists() else {}
        inputs[other] = {"digest": (record.get("key") or {}).get("digest"), "date_utc": record.get("date_utc")}
    return inputs


def with_reads_now(study: str, key: dict, out: Path) -> dict:
    """``key`` with its "reads" part (and digest) as the results in ``out`` are now."""
    fresh = key | {"reads": reads(study, out)}
    return fresh | {"digest": digest(fresh)}


def digest(key: dict) -> str:
    """A short hash of every part of ``key`` (its own ``digest`` left out)."""
    parts = {part: value for part, value in key.items() if part != "digest"}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


MEASURED = ("files", "args", "env", "reads")
"""The parts of a key that change what a study measures: a difference reruns it."""


def changes(stored: dict | None, current: dict, parts: tuple[str, ...] = MEASURED) -> list[str]:
    """Why results made under ``stored`` do not describe ``current``, one phrase per difference in
    ``parts`` (REPORT.md leaves out "env": a study made on another machine is not stale, it is
    that machine's; "report": a change to the report step alone redraws the study from its
    tables); an empty list when they agree."""
    if stored is None:
        return ["no key stored (made before reproduce kept keys, or never run)"]
    why = []
    for part, prefix in (("files", ""), ("report", "report ")):
        if part not in parts:
            continue
        old, new = stored.get(part, {}), current[part]
        edited = sorted(f for f in new if f in old and old[f] != new[f])
        added, removed = sorted(set(new) - set(old)), sorted(set(old) - set(new))
        for label, files in (("changed", edited), ("now imported", added), ("no longer imported", removed)):
            if files:
                shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
                why.append(f"{prefix}{label}: {shown}")
    for part in ("args", "env", "reads"):
        if part in parts and stored.get(part) != current[part]:
            diff = {k: v for k, v in current[part].items() if stored.get(part, {}).get(k) != v}
            why.append(f"{part}: " + ", ".join(f"{k}={v if part != 'reads' else 'rerun'}" for k, v in diff.items()))
    return why
