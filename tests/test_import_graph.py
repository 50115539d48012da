"""The layers, read from the imports themselves: no import cycle anywhere in the project, and the
core (zero_ref/core) imports nothing from the guard, io, analysis or the experiments."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("zero_ref", "triton_kernels", "experiments")
FORBIDDEN_TO_CORE = ("zero_ref.guard", "zero_ref.io", "zero_ref.analysis", "experiments")


def _modules() -> dict[str, Path]:
    """Every module of the project by dotted name (a package by its own name, from __init__.py)."""
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports, at any depth (inside functions too), relative ones
    resolved; `from package import module` counts as importing the module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:   # `import a.b.c` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the list of modules around it, or None."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_project_has_no_import_cycle():
    graph = _graph()
    assert len(graph) > 50   # the walk found the project
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_core_imports_no_guard_io_analysis_or_experiments():
    graph = _graph()
    core = {name: deps for name, deps in graph.items() if name.startswith("zero_ref.core")}
    assert "zero_ref.core.engine" in core and "zero_ref.core.stage3" in core
    wrong = {name: sorted(d for d in deps if d.startswith(FORBIDDEN_TO_CORE)) for name, deps in core.items()}
    assert not {k: v for k, v in wrong.items() if v}


def test_the_checker_sees_a_cycle_and_a_forbidden_import():
    """The two checks above can fail: a made-up graph with a cycle, and the core's real imports with
    one forbidden edge added."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    modules = _modules()
    assert "zero_ref.guard.strict" in _imports("zero_ref.engine", modules["zero_ref.engine"], modules)


def test_the_core_stays_small_enough_to_read_in_one_sitting():
    """Issue 37's budget for zero_ref/core: at most 2,500 lines of code, docstrings and comments
    (blank lines not counted, as cloc counts), and no file over 400 lines. experiments/core_size.py
    writes the same counts, and the reading list of one stage-3 step, to results/core/."""
    from experiments.core_size import file_sizes

    files = file_sizes()
    assert len(files) > 10 and "stage3.py" in set(files.file)
    assert files.non_blank.sum() <= 2500, files
    assert files.lines.max() <= 400, files.head(3)
