"""The tooling's imports are layered and acyclic.

Every ``.py`` under ``scripts/`` is parsed (no import runs); each ``import`` and ``from ...
import`` in it, function-level and relative ones included, is an edge to the module it names
when that module lives under ``scripts/``. The packages are layers, lowest first
(:data:`LAYERS`); the entry scripts (``scripts/*.py``) sit above them all. A module may import
its own package and lower layers only, nothing imports an entry script, and no module reaches
itself through its imports. ``importlib.import_module`` of a name and subprocess targets are
not edges: what they run is chosen by their caller.
"""

import ast
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Set

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"

# Lowest first. memory_plan imports nothing from cpu_runtime nor the reverse (the emulations size
# their buffers from their own reading of the kernels, never from the planner, so that the
# report's planner rows compare two readings); the planner sits above the runtime so that the
# report, above both, reaches each from below.
LAYERS = ("patchtool", "cpu_runtime", "memory_plan", "report", "upstream_cpu")
ENTRY = "entry script"


class Edge(NamedTuple):
    source: str
    target: str
    path: Path
    line: int

    def where(self) -> str:
        return f"{self.path.relative_to(SCRIPTS.parent)}:{self.line}"


def modules() -> Dict[str, Path]:
    """Every module under scripts/ by its import name (a package by its ``__init__.py``)."""
    out = {}
    for path in sorted(SCRIPTS.rglob("*.py")):
        parts = list(path.relative_to(SCRIPTS).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, known: Dict[str, Path]) -> Optional[str]:
    """The innermost module under scripts/ that ``name`` (a module or a name in one) is in."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in known:
            return candidate
    return None


def edges(known: Dict[str, Path]) -> List[Edge]:
    """Every import of a scripts/ module by another, with where it is written."""
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


def layer(module: str) -> str:
    top = module.split(".")[0]
    return top if top in LAYERS else ENTRY


def rank(module: str) -> int:
    name = layer(module)
    return LAYERS.index(name) if name in LAYERS else len(LAYERS)


@pytest.fixture(scope="module")
def graph():
    known = modules()
    return known, edges(known)


def test_the_graph_sees_the_imports(graph):
    """The parse finds absolute, relative and function-level imports (the checks below are not
    vacuous)."""
    known, found = graph
    pairs = {(e.source, e.target) for e in found}
    assert {"report.cli", "memory_plan.cli", "cpu_runtime.launcher"} <= set(known)
    assert ("memory_plan.cli", "memory_plan.compare") in pairs  # relative
    assert ("report.cli", "report.runtime") in pairs  # module level
    assert ("cpu_runtime.launcher", "cpu_runtime.placement") in pairs  # inside a function


def test_every_top_level_package_has_a_layer(graph):
    known, _ = graph
    packages = {m for m, p in known.items() if "." not in m and p.name == "__init__.py"}
    assert packages == set(LAYERS), "give each package under scripts/ its place in LAYERS"


def test_no_module_imports_an_entry_script(graph):
    _, found = graph
    bad = [f"{e.where()}: {e.source} imports {e.target}" for e in found if layer(e.target) == ENTRY]
    assert not bad, "entry scripts are imported by nothing:\n" + "\n".join(bad)


def test_no_import_reaches_up_a_layer(graph):
    _, found = graph
    bad = [
        f"{e.where()}: {e.source} ({layer(e.source)}) imports {e.target} ({layer(e.target)})"
        for e in found
        if rank(e.target) > rank(e.source)
    ]
    assert not bad, f"layers, lowest first: {' < '.join(LAYERS)} < {ENTRY}s\n" + "\n".join(bad)


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
    f = SCRIPTS / "x.py"
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
