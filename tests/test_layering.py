"""Who may import whom (docs/architecture.md, "Who may import whom"), checked on the source.

Every ``import`` counts, those inside functions included (a function-level import that
dodges a cycle at import time is still a cycle in the design); ``if TYPE_CHECKING:``
blocks are exempt, since they never run, except inside ``api/`` and ``frontends/``, where a
cycle through one (an annotation that names a module which imports this one) is a cycle too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("disagg", "slurm", "orchestrator", "frontends", "api", "workers", "common")

# Data flows one way: the CLI drives the deployment launchers, which start orchestrators and
# workers; the orchestrator and a worker's frontends are two HTTP servers over the one API package
# (schemas, validation, errors, SSE, limits, server plumbing), neither knowing the other; the API
# speaks the workers' protocol; what every role shares sits in common. Nothing below imports
# anything above it.
ALLOWED = {
    "disagg": {"slurm", "orchestrator", "frontends", "api", "workers", "common"},
    "slurm": {"orchestrator", "api", "workers", "common"},
    "orchestrator": {"api", "workers", "common"},
    "frontends": {"api", "workers", "common"},
    "api": {"workers", "common"},
    "workers": {"common"},
    "common": set(),
}
# The packages whose modules import one way even for annotations (``if TYPE_CHECKING:`` counts).
STRICT = ("api", "frontends")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for package in PACKAGES for p in (REPO / package).rglob("*.py")}


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"))


def _imports(module: str, path: Path, modules: dict[str, Path], type_checking: bool = False) -> set[str]:
    """The project modules ``module`` imports (resolved to the most specific known module);
    ``type_checking``: those under ``if TYPE_CHECKING:`` too."""
    found: set[str] = set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    stack: list[ast.AST] = [ast.parse(path.read_text(encoding="utf-8"))]
    while stack:
        node = stack.pop()
        if not type_checking and _is_type_checking_block(node):
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] in PACKAGES)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - (node.level - 1)] + ([base] if base else []))
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.add(name if name in modules else base)
        stack.extend(ast.iter_child_nodes(node))
    return {name for name in found if name.split(".")[0] in PACKAGES}


def _graph(modules: dict[str, Path], type_checking: bool = False) -> dict[str, set[str]]:
    return {name: {m for m in _imports(name, path, modules, type_checking)
                   if m in modules or m.split(".")[0] in PACKAGES}
            for name, path in modules.items()}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return _graph(_modules())


@pytest.fixture(scope="module")
def strict_graph() -> dict[str, set[str]]:
    """The modules of api/ and frontends/ and every project import of theirs, ``TYPE_CHECKING`` ones included."""
    modules = _modules()
    return {name: imported for name, imported in _graph(modules, type_checking=True).items()
            if name.split(".")[0] in STRICT}


def test_no_upward_import(graph):
    wrong = sorted(f"{src} imports {dst}" for src, dsts in graph.items() for dst in dsts
                   if (a := src.split(".")[0]) != (b := dst.split(".")[0]) and b not in ALLOWED[a])
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components over the module graph larger than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycle(graph):
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_import_cycle_inside_api_and_frontends(strict_graph):
    """No module of api/ or frontends/ imports itself back, nor a package above it, not even for an
    annotation: ``api.prepare`` imports ``serving``, ``disaggregation`` and ``generation``, none of
    which knows it, so each reads alone; ``api.generation`` names the engine client's pushed request
    by a protocol of its own, not by ``frontends.engine_client``."""
    test_no_upward_import(strict_graph)
    cycles = _cycles(strict_graph)
    assert not cycles, "import cycles in api/ or frontends/:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_check_sees_a_cycle_and_an_upward_import(tmp_path, monkeypatch):
    """The checks can fail: a planted cycle and a planted upward import are both found."""
    modules = {"workers.a": tmp_path / "a.py", "workers.b": tmp_path / "b.py"}
    modules["workers.a"].write_text("from workers.b import x\nimport frontends.app\n")
    modules["workers.b"].write_text("def f():\n    from workers.a import y\n")
    planted = {name: _imports(name, path, {**modules, "frontends.app": Path()}) for name, path in modules.items()}
    assert planted["workers.a"] == {"workers.b", "frontends.app"}
    assert planted["workers.b"] == {"workers.a"}
    with pytest.raises(AssertionError, match="workers.a imports frontends.app"):
        test_no_upward_import(planted)
    with pytest.raises(AssertionError, match="workers.a <-> workers.b"):
        test_no_import_cycle(planted)


def test_the_strict_check_sees_a_cycle_through_type_checking(tmp_path):
    """A cycle closed only by an ``if TYPE_CHECKING:`` import: exempt in general, found in frontends/."""
    modules = {"frontends.a": tmp_path / "a.py", "frontends.b": tmp_path / "b.py"}
    modules["frontends.a"].write_text("from frontends.b import x\n")
    modules["frontends.b"].write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from frontends.a import y\n")
    assert not _cycles(_graph(modules))
    with pytest.raises(AssertionError, match="frontends.a <-> frontends.b"):
        test_no_import_cycle_inside_api_and_frontends(_graph(modules, type_checking=True))


def test_the_strict_check_sees_an_upward_import_through_type_checking(tmp_path):
    """api/ may not name a frontends module even for an annotation (the worker's engine client
    sits above the API both servers share)."""
    modules = {"api.a": tmp_path / "a.py", "frontends.b": tmp_path / "b.py"}
    modules["api.a"].write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                "    from frontends.b import y\n")
    modules["frontends.b"].write_text("")
    assert not _graph(modules)["api.a"]
    with pytest.raises(AssertionError, match="api.a imports frontends.b"):
        test_no_import_cycle_inside_api_and_frontends(_graph(modules, type_checking=True))
