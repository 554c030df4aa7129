"""The patch tool's layers: its verbs never import each other; only ``cli`` imports verbs.

The verbs share one engine (``merge``, ``hunkstate``, ``patches``, ...); a verb that imports
another verb is engine code left inside a verb. Imports are read with ``ast``, those inside
functions included.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "scripts" / "patchtool"
VERBS = ("apply", "port", "upstream", "check", "landed", "drift", "matrix")


def imported_modules(path: Path) -> set[str]:
    """The ``patchtool`` modules a module imports (relative or absolute), anywhere in it."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                out.add(node.module.split(".")[0])
            elif node.level == 1:  # from . import x
                out.update(alias.name for alias in node.names)
            elif node.level == 0 and (node.module or "").startswith("patchtool."):
                out.add(node.module.split(".")[1])
            elif node.level == 0 and node.module == "patchtool":
                out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("patchtool."):
                    out.add(alias.name.split(".")[1])
    return out


def verb_imports(package: Path = PACKAGE) -> list[str]:
    """``importer -> imported`` for each import of a verb by a module other than ``cli``."""
    return [
        f"{path.stem} -> {name}"
        for path in sorted(package.glob("*.py"))
        if path.stem != "cli"
        for name in sorted(imported_modules(path))
        if name in VERBS and name != path.stem
    ]


def test_every_verb_is_a_module():
    assert {p.stem for p in PACKAGE.glob("*.py")} >= set(VERBS)


def test_no_module_but_cli_imports_a_verb():
    assert verb_imports() == []


def test_imports_inside_functions_are_seen(tmp_path):
    (tmp_path / "apply.py").write_text(
        "from .merge import merge_patch\n\ndef f():\n    from .port import x\n"
    )
    (tmp_path / "merge.py").write_text("import patchtool.landed\n")
    (tmp_path / "cli.py").write_text("from .apply import run_apply\n")
    assert verb_imports(tmp_path) == ["apply -> port", "merge -> landed"]
