"""experiments/ has no import cycles, zero_ref never imports it, and experiments/README.md's map
points at files that exist.

Read with `ast`, nothing is imported: every `import` and `from ... import` at any depth (inside
functions too) is an edge, and so is a string constant that names an experiments module
("experiments.memory_study"), which is how studies.STUDIES imports a study when it runs.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"


def _modules(package: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package in folder ``package`` and its subpackages."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(name: str, path: Path) -> tuple[set[str], set[str]]:
    """What module ``name`` (file ``path``) imports, at any depth, as dotted names; and its string
    constants, some of which may name modules."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found, strings = set(), set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}   # `from experiments import study`
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            strings.add(node.value)
    return found, strings


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (importing a name from a module counts
    as importing the module) or names in a string."""
    modules = _modules(package)
    graph = {}
    for name, path in modules.items():
        imports, strings = _imported(name, path)
        edges = {s for s in strings if s in modules}
        for target in imports:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            edges.add(target)
        graph[name] = edges - {name, ""}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_checker_finds_cycles_through_function_bodies_and_names(tmp_path):
    package = tmp_path / "experiments"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from experiments.b import g\n")
    (package / "b.py").write_text("from experiments import c\n")
    (package / "c.py").write_text("STUDY = 'experiments.a'\n")
    (package / "d.py").write_text("from . import a\n")
    (package / "e.py").write_text('"""Not an import: experiments.a, experiments.b."""\n')
    graph = import_graph(package)
    assert cycles(graph) == [["experiments.a", "experiments.b", "experiments.c"]]
    assert graph["experiments.d"] == {"experiments", "experiments.a"} and graph["experiments.e"] == set()


def test_no_import_cycle_among_the_experiments():
    found = cycles(import_graph(EXPERIMENTS))
    assert not found, f"import cycles in experiments/: {found}"


def test_zero_ref_never_imports_the_experiments():
    importers = {name: sorted(target for target in _imported(name, path)[0]
                              if target == "experiments" or target.startswith("experiments."))
                 for name, path in _modules(ROOT / "zero_ref").items()}
    assert not {name: targets for name, targets in importers.items() if targets}


def _studies() -> dict[str, tuple[str, str]]:
    """studies.STUDIES, read from the source: folder -> (title, module)."""
    tree = ast.parse((EXPERIMENTS / "studies.py").read_text(encoding="utf-8"))
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "STUDIES" for t in n.targets))
    return ast.literal_eval(node.value)


def test_every_study_in_the_registry_has_a_run_study():
    modules = _modules(EXPERIMENTS)
    for folder, (_, module) in _studies().items():
        assert module in modules, f"study {folder}: no module {module}"
        tree = ast.parse(modules[module].read_text(encoding="utf-8"))
        assert any(isinstance(n, ast.FunctionDef) and n.name == "run_study" for n in tree.body), \
            f"study {folder}: {module} defines no run_study"


def test_every_report_step_defines_render_and_never_imports_what_it_draws():
    """studies.REPORTS: each study's report step has ``render``, and does not import the module
    that measures (which may import it: the key's reach stops there)."""
    from experiments.studies import REPORTS

    modules, studies = _modules(EXPERIMENTS), _studies()
    for folder, module in REPORTS.items():
        tree = ast.parse(modules[module].read_text(encoding="utf-8"))
        assert any(isinstance(n, ast.FunctionDef) and n.name == "render" for n in tree.body), module
        assert studies[folder][1] not in _imported(module, modules[module])[0], module


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s#]+)[^)]*\)")


def _map_rows() -> list[list[str]]:
    """The cells of experiments/README.md's map (the table whose header starts "| Paper artifact")."""
    lines = (EXPERIMENTS / "README.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| Paper artifact"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def test_the_map_names_scripts_results_and_tests_that_exist():
    rows = _map_rows()
    assert len(rows) >= 10 and all(len(row) == 4 for row in rows), rows
    columns = ((1, EXPERIMENTS, "script"), (2, ROOT / "results", "results folder"), (3, ROOT / "tests", "test"))
    for row in rows:
        for column, home, what in columns:
            for target in _LINK.findall(row[column]):
                path = (EXPERIMENTS / target).resolve()
                assert path.exists(), f"{row[0]}: {what} {target} does not exist"
                assert path.is_relative_to(home), f"{row[0]}: {what} {target} is not under {home.name}/"
        assert _LINK.findall(row[1]) or row[1].startswith("not reproduced"), f"{row[0]}: no script named"
    named = {(EXPERIMENTS / target).resolve() for row in rows for target in _LINK.findall(row[1])}
    for folder, (_, module) in _studies().items():
        assert _modules(EXPERIMENTS)[module].resolve() in named, f"study {folder} ({module}) is not in the map"
