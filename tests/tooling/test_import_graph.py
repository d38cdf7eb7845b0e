"""The project's modules import one another without a circle: every import counts, those inside
functions too (a lazy import that dodges a circle at import time is still one in the design)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("bls_models", "tritonlocal", "modelgen", "bench", "ops", "reliability", "tests")
# bls_models' runtime (docs/orchestrator.md): triton_runtime wires the others, backend is the one
# boundary to pb_utils, and drive, group, isolation and metrics run without either.
RUNTIME = {f"bls_models.{name}" for name in ("triton_runtime", "backend", "drive", "group",
                                             "isolation", "metrics")}
# What pipelines are written against and configs are rendered from: no runtime but drive
# (pipelines' gather_all is drive's).
CONTRACT = {f"bls_models.{name}" for name in ("spec", "definition", "pipelines", "cascade",
                                              "params", "repository", "errors")}


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of PACKAGES."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports anywhere in its file. ``from package import x``
    counts as importing the submodule ``x`` when there is one, else the package itself."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in modules:
                    found.add(submodule)
                elif base in modules:
                    found.add(base)
    found.discard(name)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_of_the_project_is_in_an_import_circle():
    modules = module_files()
    assert {"bls_models.spec", "tritonlocal.launcher", "modelgen.export"} <= set(modules)
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert circles(graph) == []


def test_the_check_finds_a_circle_through_an_import_inside_a_function(tmp_path):
    package = tmp_path / "bench"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from bench import b\n")
    (package / "b.py").write_text("def later():\n    from bench.a import thing\n")
    (package / "c.py").write_text("from . import a\n")
    modules = module_files(tmp_path)
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert circles(graph) == [["bench.a", "bench.b"]]
    assert graph["bench.c"] == {"bench.a"}


def test_the_runtime_is_wired_by_triton_runtime_and_reaches_triton_through_backend():
    modules = module_files()
    assert {name for name in modules if name.startswith("bls_models.")} == RUNTIME | CONTRACT
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert RUNTIME - {"bls_models.triton_runtime"} <= graph["bls_models.triton_runtime"]
    within = {name: graph[name] & (RUNTIME | CONTRACT) for name in RUNTIME | CONTRACT}
    assert {name for name, imported in within.items() if "bls_models.backend" in imported} == \
        {"bls_models.triton_runtime"}
    for name in RUNTIME - {"bls_models.triton_runtime", "bls_models.backend"}:
        # Besides drive and errors, only the contract's data (spec: the metric families).
        assert within[name] <= {"bls_models.drive", "bls_models.errors", "bls_models.spec"}, \
            (name, within[name])
    for name in CONTRACT:
        assert within[name] & RUNTIME <= {"bls_models.drive"}, (name, within[name])
