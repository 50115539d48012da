"""Real text that needs no download: the Python standard library's own source files, as bytes.

A byte-level language model (vocabulary 256: one token per byte) can train on any text, and every
Python installation carries tens of megabytes of it: the standard library's ``*.py`` files under
``sysconfig.get_paths()["stdlib"]``. The corpus is built deterministically:

* files: every ``*.py`` below the stdlib folder except third-party packages installed into it
  (``site-packages``, ``dist-packages``), sorted by their path relative to that folder;
* split by file, so validation text is never seen in training: every ``VAL_EVERY``-th file of the
  sorted list (index 0, 10, 20, ...) is held out for validation, the rest is training text;
* each split is the concatenation of its files' bytes, each file followed by a NUL byte (a
  document separator that never occurs in source).

The text is whatever this interpreter ships, so it differs across Python versions (and between
builds that patch the stdlib): ``Corpus.info`` records the version, the file counts, the bytes and a
SHA-256 of each split, and a study writes it into its meta.json so a reader can tell which text a
result was trained on.

Batches are random windows drawn from a generator seeded by (seed, step), so a step's global batch
is the same in every process and every run, whatever ran before it; each data-parallel rank keeps
its own contiguous slice, exactly as `zero_ref.models.token_batches` does for synthetic data.
Validation uses fixed, evenly spaced windows of the held-out text, also split across the ranks.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

VAL_EVERY = 10
"""Every VAL_EVERY-th file (by sorted relative path) is held out for validation."""
SEPARATOR = b"\0"
EXCLUDED_TOP = ("site-packages", "dist-packages")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The stdlib's *.py files (third-party packages installed into it excluded), sorted by path
    relative to the stdlib folder (as a POSIX string, so the order is the same on every OS)."""
    root = root or stdlib_root()
    files = []
    for folder, subfolders, names in os.walk(root):
        if Path(folder) == root:   # not into third-party packages (thousands of files: seconds to walk)
            subfolders[:] = [d for d in subfolders if d not in EXCLUDED_TOP]
        subfolders[:] = [d for d in subfolders if d != "__pycache__"]
        files += [Path(folder) / n for n in names if n.endswith(".py") and os.path.isfile(os.path.join(folder, n))]
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


@dataclass(frozen=True)
class Corpus:
    """Training and validation bytes (uint8 tensors) and a record of where they came from."""

    train: torch.Tensor
    val: torch.Tensor
    info: dict


def load_corpus(max_files: int | None = None) -> Corpus:
    """The corpus described in the module docstring; `max_files` keeps only the first files of the
    sorted list (a small slice for tests), before the split."""
    root = stdlib_root()
    files = stdlib_files(root)[:max_files]
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    for i, path in enumerate(files):
        parts["val" if i % VAL_EVERY == 0 else "train"].append(path.read_bytes() + SEPARATOR)
    data = {name: b"".join(chunks) for name, chunks in parts.items()}
    info = {"source": "Python standard library *.py files (sysconfig.get_paths()['stdlib'])",
            "note": "the text differs across Python versions and builds: compare runs on the same interpreter",
            "python": sys.version.split()[0], "implementation": platform.python_implementation(),
            "stdlib": str(root), "files_total": len(files), "max_files": max_files,
            "excluded": list(EXCLUDED_TOP), "split": f"every {VAL_EVERY}th file by sorted relative path -> validation",
            **{f"{name}_files": len(parts[name]) for name in parts},
            **{f"{name}_bytes": len(data[name]) for name in data},
            **{f"{name}_sha256": hashlib.sha256(data[name]).hexdigest() for name in data},
            "first_files": [f.relative_to(root).as_posix() for f in files[:3]],
            "last_file": files[-1].relative_to(root).as_posix() if files else None}
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)
    return Corpus(as_tensor(data["train"]), as_tensor(data["val"]), info)


def train_batch(text: torch.Tensor, step: int, global_batch: int, seq_len: int, rank: int, world_size: int,
                seed: int = 0) -> torch.Tensor:
    """This rank's slice of step `step`'s global batch: `global_batch` random windows of `seq_len`
    bytes (int64 token ids), drawn from a generator seeded by (seed, step)."""
    if global_batch % world_size:
        raise ValueError(f"global_batch={global_batch} must be divisible by world_size={world_size}")
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(text) - seq_len, (global_batch,), generator=generator)
    local = global_batch // world_size
    return windows(text, starts[rank * local:(rank + 1) * local], seq_len)


def val_batches(text: torch.Tensor, count: int, seq_len: int, rank: int, world_size: int,
                batch: int) -> list[torch.Tensor]:
    """This rank's share of `count` evenly spaced validation windows (count divisible by the world
    size), in batches of at most `batch`."""
    if count % world_size:
        raise ValueError(f"count={count} validation windows must be divisible by world_size={world_size}")
    starts = torch.linspace(0, len(text) - seq_len - 1, count).long()
    local = count // world_size
    mine = starts[rank * local:(rank + 1) * local]
    return [windows(text, chunk, seq_len) for chunk in mine.split(batch)]


def windows(text: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Rows text[s:s + seq_len] for each start s, as int64 token ids."""
    return text[starts[:, None] + torch.arange(seq_len)].long()
