"""The tooling's imports are layered and acyclic.

Every ``.py`` of the ``moe_release`` package (``tools/``) is parsed (no import runs); each
``import`` and ``from ... import`` in it, function-level and relative ones included, is an edge
to the module it names when that module is the package's. The rooms are layers, lowest first
(:data:`ROOMS`); a module's room is the longest room its name starts with. A module may import
its own room and lower rooms only; in a room of :data:`SIBLINGS_APART` (the series' verbs) no
module imports another; no module reaches itself through its imports. ``importlib.import_module``
of a name and subprocess targets are not edges: what they run is chosen by their caller. The
scripts under ``scripts/`` are entry shims: each imports one ``main`` and nothing else of ours.
"""

import ast
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, NamedTuple, Set

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
TOOLS = REPO_ROOT / "tools"

# Lowest first. The planner's command (plan) imports nothing from the runtime nor the reverse
# (the emulations size their buffers from their own reading of the kernels, never from the
# planner, so that the report's planner rows compare two readings); the report, above both,
# reaches each from below.
ROOMS = (
    "moe_release",
    "moe_release.common",
    "moe_release.settings",
    "moe_release.series",
    "moe_release.backends",
    "moe_release.series.verbs",
    "moe_release.series.cli",
    "moe_release.runtime",
    "moe_release.runtime.measure",
    "moe_release.runtime.cuda",
    "moe_release.runtime.kernels",
    "moe_release.runtime.ranks",
    "moe_release.runtime.megatron",
    "moe_release.runtime.shapes",
    "moe_release.plan",
    "moe_release.report",
    "moe_release.upstream_tests",
    "moe_release.commands",
)
SIBLINGS_APART = ("moe_release.series.verbs",)


class Edge(NamedTuple):
    source: str
    target: str
    path: Path
    line: int

    def where(self) -> str:
        return f"{self.path.relative_to(REPO_ROOT)}:{self.line}"


def modules(root: Path = TOOLS) -> Dict[str, Path]:
    """Every module under ``root`` by its import name (a package by its ``__init__.py``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, known: Dict[str, Path]) -> str | None:
    """The innermost known module that ``name`` (a module or a name in one) is in."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in known:
            return candidate
    return None


def edges(known: Dict[str, Path]) -> List[Edge]:
    """Every import of a known module by another, with where it is written."""
    out = []
    for module, path in known.items():
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module
                # ``from pkg import mod`` imports the submodule; ``from mod import name`` the
                # module.
                names = [
                    f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                    for alias in node.names
                ]
            else:
                continue
            targets = {_resolve(name, known) for name in names} - {None, module}
            out += [Edge(module, target, path, node.lineno) for target in sorted(targets)]
    return out


def room(module: str) -> str:
    """The longest room ``module`` is in."""
    return max((r for r in ROOMS if module == r or module.startswith(r + ".")), key=len)


def rank(module: str) -> int:
    return ROOMS.index(room(module))


@pytest.fixture(scope="module")
def graph():
    known = modules()
    return known, edges(known)


def test_the_graph_sees_the_imports(graph):
    """The parse finds absolute, relative and function-level imports (the checks below are not
    vacuous)."""
    known, found = graph
    pairs = {(e.source, e.target) for e in found}
    assert {"moe_release.report.cli", "moe_release.runtime.ranks.launcher"} <= set(known)
    assert ("moe_release.plan.cli", "moe_release.plan.compare") in pairs
    assert ("moe_release.report.cli", "moe_release.report.runtime") in pairs  # module level
    # inside a function
    assert ("moe_release.runtime.ranks.launcher", "moe_release.runtime.cuda.placement") in pairs


def test_relative_imports_are_edges(tmp_path):
    pkg = tmp_path / "moe_release" / "series"
    pkg.mkdir(parents=True)
    (tmp_path / "moe_release" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\nfrom .b import x\n")
    (pkg / "b.py").write_text("def f():\n    from ..series import a\n")
    known = modules(tmp_path)
    pairs = {(e.source, e.target) for e in edges(known)}
    assert pairs == {
        ("moe_release.series.a", "moe_release.series.b"),
        ("moe_release.series.b", "moe_release.series.a"),
    }


def test_every_module_has_a_room(graph):
    known, _ = graph
    packages = {m for m, p in known.items() if p.name == "__init__.py"}
    modules_not_packages = {
        "moe_release.common",
        "moe_release.settings",
        "moe_release.backends",
        "moe_release.series.cli",
    }
    assert set(ROOMS) - modules_not_packages <= packages
    for name in ROOMS:
        assert name in known, f"{name} is in ROOMS but not in tools/"


def test_no_import_reaches_up_a_room(graph):
    _, found = graph
    bad = [
        f"{e.where()}: {e.source} ({room(e.source)}) imports {e.target} ({room(e.target)})"
        for e in found
        if rank(e.target) > rank(e.source)
    ]
    assert not bad, "rooms, lowest first: " + " < ".join(ROOMS) + "\n" + "\n".join(bad)


def test_verbs_never_import_each_other(graph):
    _, found = graph
    bad = [
        f"{e.where()}: {e.source} imports {e.target}"
        for e in found
        if room(e.source) in SIBLINGS_APART
        and room(e.target) == room(e.source)
        and e.target != room(e.source)
    ]
    assert not bad, "a verb importing a verb is engine code left in a verb:\n" + "\n".join(bad)


def test_a_verb_importing_a_verb_is_found():
    f = TOOLS / "x.py"
    found = [
        Edge("moe_release.series.verbs.apply", "moe_release.series.verbs.port", f, 1),
        Edge("moe_release.series.verbs.apply", "moe_release.series.merge", f, 2),
    ]
    bad = [
        e for e in found if room(e.source) in SIBLINGS_APART and room(e.target) == room(e.source)
    ]
    assert bad == found[:1]


def test_entry_scripts_are_shims():
    """Each ``scripts/*.py`` imports one ``main`` from the package and holds no other code of
    ours; nothing under tools/ sets ``sys.path`` (the shims and the test configuration do)."""
    shims = sorted((REPO_ROOT / "scripts").rglob("*.py"))
    assert len(shims) >= 5
    for path in shims:
        tree = ast.parse(path.read_text(), str(path))
        ours = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("moe_release")
        ]
        assert [[a.name for a in n.names] for n in ours] == [["main"]], path
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        assert not functions, f"{path}: logic belongs in the package"
    setters = [
        f"{path.relative_to(REPO_ROOT)}:{line}"
        for path in sorted(TOOLS.rglob("*.py"))
        for line in sys_path_writes(path.read_text())
    ]
    assert not setters, "sys.path set outside the entry points:\n" + "\n".join(setters)


def sys_path_writes(source: str) -> List[int]:
    """Lines that change ``sys.path``: a call of one of its methods, or an assignment to it or to
    a slice of it."""

    def is_sys_path(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "path"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        )

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if is_sys_path(node.func.value):
                lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if is_sys_path(target) or (
                    isinstance(target, ast.Subscript) and is_sys_path(target.value)
                ):
                    lines.append(node.lineno)
    return sorted(lines)


def test_sys_path_writes_are_found():
    source = (
        '"""sys.path in prose."""\nimport sys\nsys.path.insert(0, "x")\n'
        'sys.path[:0] = ["y"]\nsys.path = []\nprint(sys.path)\n'
    )
    assert sys_path_writes(source) == [3, 4, 5]


def _cycles(found: List[Edge]) -> List[List[Edge]]:
    """One cycle through each strongly connected set of modules (Tarjan's algorithm)."""
    succ: Dict[str, List[Edge]] = defaultdict(list)
    for e in found:
        succ[e.source].append(e)
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components: List[Set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for e in succ[v]:
            if e.target not in index:
                visit(e.target)
                low[v] = min(low[v], low[e.target])
            elif e.target in on_stack:
                low[v] = min(low[v], index[e.target])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(succ):
        if v not in index:
            visit(v)
    out = []
    for component in components:
        start = min(component)
        # Breadth-first from start back to start inside the component: a shortest cycle.
        paths: Dict[str, List[Edge]] = {start: []}
        queue = [start]
        cycle = None
        while queue and cycle is None:
            v = queue.pop(0)
            for e in succ[v]:
                if e.target == start:
                    cycle = paths[v] + [e]
                    break
                if e.target in component and e.target not in paths:
                    paths[e.target] = paths[v] + [e]
                    queue.append(e.target)
        out.append(cycle)
    return out


def test_a_cycle_is_found_with_its_lines():
    """The cycle check itself: a three-module circle behind a tail, each step where written."""
    f = TOOLS / "x.py"
    found = [Edge("t", "a", f, 1), Edge("a", "b", f, 2), Edge("b", "c", f, 3)]
    assert _cycles(found) == []
    found.append(Edge("c", "a", f, 4))
    assert _cycles(found) == [found[1:]]


def test_no_import_cycles(graph):
    _, found = graph
    cycles = _cycles(found)
    text = [
        " -> ".join([c[0].source] + [e.target for e in c])
        + "".join(f"\n    {e.where()}: {e.source} imports {e.target}" for e in c)
        for c in cycles
    ]
    assert not text, "import cycles:\n" + "\n".join(text)
