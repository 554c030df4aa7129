"""The tooling's imports are layered and acyclic.

Every ``.py`` of the ``moe_release`` package (``tools/``) is parsed (no import runs); each
``import`` and ``from ... import`` in it, function-level and relative ones included, is an edge
to the module it names when that module is the package's. The rooms are layers, lowest first
(:data:`ROOMS`); a module's room is the longest room its name starts with. A module may import
its own room and lower rooms only; in a room of :data:`SIBLINGS_APART` (the commands) no module
imports another but what they all share (:data:`SHARED`: the registry); no module reaches itself
through its imports. ``importlib.import_module``
of a name and subprocess targets are not edges: what they run is chosen by their caller. The
scripts under ``scripts/`` are entry shims: each imports one ``main`` and nothing else of ours.

The commands' registry (:mod:`moe_release.commands.registry`): each module of the commands
package registers one command, named after it; names and aliases are unique; each script names a
registered command; every command answers ``--help``.
"""

import ast
import importlib
import re
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, NamedTuple, Set

import pytest

from tests.helpers import REPO_ROOT, TOOLS

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
# Rooms whose modules never import each other (a command importing a command is engine code
# left in a command), but for what they all share.
SIBLINGS_APART = ("moe_release.commands",)
SHARED = ("moe_release.commands.registry",)


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


def sibling_edges(found: List[Edge]) -> List[Edge]:
    """The imports of a module by its sibling in a room of :data:`SIBLINGS_APART`, but of what
    they share (:data:`SHARED`)."""
    return [
        e
        for e in found
        if room(e.source) in SIBLINGS_APART
        and room(e.target) == room(e.source)
        and e.target != room(e.source)
        and e.target not in SHARED
    ]


def test_commands_never_import_each_other(graph):
    _, found = graph
    bad = [f"{e.where()}: {e.source} imports {e.target}" for e in sibling_edges(found)]
    assert not bad, (
        "a command importing a command is engine code left in a command (move it under series/):\n"
        + "\n".join(bad)
    )


def test_a_command_importing_a_command_is_found():
    f = TOOLS / "x.py"
    found = [
        Edge("moe_release.commands.apply", "moe_release.commands.port", f, 1),
        Edge("moe_release.commands.apply", "moe_release.series.merge", f, 2),
        Edge("moe_release.commands.apply", "moe_release.commands.registry", f, 3),
        Edge("moe_release.commands.cli", "moe_release.commands.registry", f, 4),
    ]
    assert sibling_edges(found) == found[:1]


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


# --- the commands' registry -------------------------------------------------------------------


@pytest.fixture(scope="module")
def registry():
    from moe_release.commands import registry as reg

    return reg, reg.REGISTRY.load("moe_release.commands")


def test_every_command_module_registers_once(registry):
    """Each module of the commands package (but the registry and the entry point) registers one
    command, named after the module; every registered command comes from one of them."""
    reg, problems = registry
    assert not problems, "\n".join(problems)
    known = modules()
    command_modules = {
        m
        for m in known
        if m.startswith("moe_release.commands.") and m.rsplit(".", 1)[1] not in reg.INFRASTRUCTURE
    }
    registered = {reg.REGISTRY.module_of(c.name) for c in reg.REGISTRY.commands()}
    assert registered == command_modules
    assert len(reg.REGISTRY.commands()) == len(command_modules) >= 20


def test_names_and_aliases_are_unique(registry):
    reg, _ = registry
    words = [w for c in reg.REGISTRY.commands() for w in (c.name, *c.aliases)]
    assert len(words) == len(set(words))
    assert set(words) == set(reg.REGISTRY.words())


def _script_words(path: Path) -> List[str]:
    """The command words a script hands ``main`` (a Python shim), or names after
    ``moe_release.py`` (a shell script); a Python shim calling ``main()`` is the whole command."""
    text = path.read_text()
    if path.suffix != ".py":
        return re.findall(r"moe_release\.py\"?\s+([a-z][\w-]*)", text)
    calls = [
        n
        for n in ast.walk(ast.parse(text))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "main"
    ]
    assert len(calls) == 1, path
    if not calls[0].args:
        return []
    first = calls[0].args[0]
    assert isinstance(first, ast.List) and isinstance(first.elts[0], ast.Constant), path
    return [first.elts[0].value]


def test_each_script_names_a_registered_command(registry):
    reg, _ = registry
    words = reg.REGISTRY.words()
    scripts = sorted(p for p in (REPO_ROOT / "scripts").rglob("*") if p.is_file())
    named = {p: _script_words(p) for p in scripts}
    whole = [p.name for p in scripts if p.suffix == ".py" and not named[p]]
    assert whole == ["moe_release.py"], "only scripts/moe_release.py runs main() with no verb"
    assert (REPO_ROOT / "scripts" / "moe-release").resolve() == REPO_ROOT / "scripts/moe_release.py"
    for path, found in named.items():
        for word in found:
            assert word in words, f"{path.relative_to(REPO_ROOT)}: {word!r} is not registered"
    py = [p for p in scripts if p.suffix == ".py" and named[p]]
    assert len(py) >= 6


def test_every_command_answers_help(registry, capsys):
    """``main([WORD, "--help"])`` prints a usage and exits 0 (argparse's exit, or a tool's
    ``main`` returning the status) for each name and alias."""
    from moe_release.commands.cli import main

    reg, _ = registry
    for command in reg.REGISTRY.commands():
        for word in (command.name, *command.aliases):
            try:
                code = main([word, "--help"])
            except SystemExit as exc:
                code = exc.code
            assert code == 0, word
            assert capsys.readouterr().out.startswith("usage: "), word


def _fake_package(root: Path, name: str, modules: Dict[str, str]) -> None:
    """A commands package ``name`` under ``root``: its own registry, one module per entry."""
    pkg = root / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "from moe_release.commands.registry import Registry\nREG = Registry()\n"
    )
    for module, body in modules.items():
        (pkg / f"{module}.py").write_text(
            "from moe_release.commands.registry import Command\n"
            f"from {name} import REG\n\n"
            "def run(args):\n    return 0\n\n" + body
        )


def test_the_registry_check_can_fail(tmp_path, monkeypatch):
    """A module registering twice, none, a name not its own or a taken name is reported; one
    registering once under its name is not."""
    from moe_release.commands.registry import RegistryError

    monkeypatch.syspath_prepend(str(tmp_path))
    once = 'REG.register(Command("{}", "h", run, aliases={}))\n'
    _fake_package(
        tmp_path,
        "fake_commands",
        {
            "good_one": once.format("good-one", "('good',)"),
            "twice": once.format("twice", "()") + once.format("twice-again", "()"),
            "silent": "",
            "misnamed": once.format("other", "()"),
            "taken": once.format("taken", "('good',)"),
            "registry": "",  # infrastructure: not a command
        },
    )
    reg = importlib.import_module("fake_commands").REG
    problems = reg.load("fake_commands")
    text = "\n".join(problems)
    assert len(problems) == 4, text
    for bad in ("twice", "silent", "misnamed", "taken"):
        assert f"fake_commands.{bad}:" in text
    assert "fake_commands.good_one:" not in text and "fake_commands.registry" not in text
    assert [c.name for c in reg.commands()] == ["good-one", "other", "twice", "twice-again"]
    with pytest.raises(RegistryError, match="'good-one' is taken"):
        reg.register(reg.commands()[0])
