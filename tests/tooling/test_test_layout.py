"""The tooling's tests mirror ``tools/moe_release/``: a test of ``tools/moe_release/<room>/<x>.py``
(or of the package ``<x>/``) is ``tests/tooling/<room>/test_<x>.py`` or
``test_<x>_<aspect>.py``; at ``tests/tooling/`` itself only tests of the package as a whole or of
a package-root module. Shared helpers are modules under ``tests/helpers/``, never a
``conftest`` imported as a module, and the repository's root is defined once."""

import re
from pathlib import Path

from tests.helpers import REPO_ROOT, TOOLS

TESTS = REPO_ROOT / "tests"
TOOLING = TESTS / "tooling"
PACKAGE = TOOLS / "moe_release"
# Tests of the package as a whole (tests/tooling/test_<name>.py).
WHOLE_PACKAGE = {"import_layers", "entry_points", "cli", "dropin_wheel", "test_layout"}


def _modules(room: Path) -> set:
    if not room.is_dir():
        return set()
    return {p.stem for p in room.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in room.iterdir() if (p / "__init__.py").is_file()
    }


def misfiled(test: Path, package: Path = PACKAGE) -> bool:
    """Whether ``test`` (under tests/tooling/) names no module of its room."""
    room = test.parent.relative_to(TOOLING)
    name = test.stem[len("test_") :]
    if room == Path("."):
        known = WHOLE_PACKAGE | _modules(package) - {
            p.name for p in package.iterdir() if p.is_dir()
        }
    else:
        known = _modules(package / room)
    return not any(name == m or name.startswith(m + "_") for m in known)


def test_each_tooling_test_sits_beside_what_it_tests():
    tests = sorted(TOOLING.rglob("test_*.py"))
    assert len(tests) > 40
    assert [str(t.relative_to(REPO_ROOT)) for t in tests if misfiled(t)] == []


def test_the_layout_check_refuses_a_misfiled_test(tmp_path):
    assert misfiled(TOOLING / "runtime" / "cuda" / "test_report.py")
    assert misfiled(TOOLING / "nowhere" / "test_x.py")
    assert misfiled(TOOLING / "test_placement.py")
    assert not misfiled(TOOLING / "runtime" / "kernels" / "test_ncclep_emulation.py")
    assert not misfiled(TOOLING / "commands" / "test_sweep.py")


def test_helpers_are_modules_and_the_root_is_defined_once():
    conftest_import = re.compile(r"^\s*(from conftest import|import conftest\b)", re.M)
    root_defined = re.compile(r"^\s*REPO_ROOT\s*=", re.M)
    sources = {p: p.read_text() for p in TESTS.rglob("*.py")}
    assert [str(p) for p, s in sources.items() if conftest_import.search(s)] == []
    assert [
        str(p.relative_to(REPO_ROOT)) for p, s in sources.items() if root_defined.search(s)
    ] == ["tests/helpers/__init__.py"]
