"""The flex backend registry (``tools/moe_release/backends.py``): one spelling per backend, an
emulation for each, the planner's names, detection in a real tree, and no other list of them.

The list scan reads every ``.py`` under ``tools/`` with ``ast`` (nothing is imported): a
tuple, list or set literal holding two or more of the registry's names is a backend list
written out again, which a new backend would have to find and extend.
"""

import ast
import importlib
from pathlib import Path

from moe_release import backends
from tests.helpers import REPO_ROOT, TOOLS

REGISTRY_FILE = TOOLS / "moe_release" / "backends.py"
PLANNER = REPO_ROOT / "megatron/core/transformer/moe/moe_memory_planner/retained.py"
CONFIG = "megatron/core/transformer/transformer_config.py"


def written_out_lists(root: Path = TOOLS, names=backends.NAMES) -> list[str]:
    """``path:line: names`` of each tuple, list or set literal under ``root`` (the registry's
    own file aside) that holds two or more of ``names`` as string constants."""
    out = []
    for path in sorted(root.rglob("*.py")):
        if path.resolve() == REGISTRY_FILE:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                found = [
                    e.value
                    for e in node.elts
                    if isinstance(e, ast.Constant) and isinstance(e.value, str) and e.value in names
                ]
                if len(found) >= 2:
                    out.append(f"{path.relative_to(root)}:{node.lineno}: {', '.join(found)}")
    return out


def test_names_and_aliases_are_unique():
    spellings = [s for b in backends.REGISTRY for s in (b.name, *b.aliases)]
    assert len(spellings) == len(set(spellings)), spellings
    megatron = [b.megatron for b in backends.REGISTRY]
    assert len(megatron) == len(set(megatron)), megatron
    for b in backends.REGISTRY:
        assert backends.get(b.name) is b
        assert all(backends.get(a) is b for a in b.aliases)


def test_each_emulation_imports():
    for b in backends.REGISTRY:
        module = importlib.import_module(b.emulation)
        assert b.name in (module.__doc__ or ""), f"{b.emulation} does not name {b.name}"


def test_planner_names_are_the_planners():
    """The planner (in the wheel, no tooling imports) keeps its own ``FLEX_BACKENDS``."""
    (value,) = [
        node.value
        for node in ast.parse(PLANNER.read_text(encoding="utf-8")).body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "FLEX_BACKENDS" for t in node.targets)
    ]
    planner = set(ast.literal_eval(value))
    assert {b.planner for b in backends.REGISTRY if b.planner} == planner


def test_detection_on_the_primary_base(tmp_path, base_files):
    """0.19.2 (the real sdist's config) offers HybridEP, DeepEP and NCCL EP; no DeepEP v2."""
    path = tmp_path / CONFIG
    path.parent.mkdir(parents=True)
    path.write_bytes(base_files[CONFIG])
    assert backends.available(tmp_path) == {"hybridep", "deepep", "ncclep"}
    assert backends.available(tmp_path / "absent") == frozenset()


def test_no_other_module_writes_the_list_out():
    assert written_out_lists() == []


def test_the_scan_sees_a_written_out_list(tmp_path):
    (tmp_path / "a.py").write_text(
        'X = ("hybridep", "deepep")\n'
        'def f(b):\n    return b in ["deepepv2", "x", "ncclep"]\n'
        'Y = ("hybridep",)\n'
    )
    assert written_out_lists(tmp_path) == [
        "a.py:1: hybridep, deepep",
        "a.py:3: deepepv2, ncclep",
    ]
