"""The tooling's settings (``tools/moe_release/settings.py``): one place reads the environment.

The scan reads every ``.py`` under ``tools/`` with ``ast`` (nothing is imported). Outside
``settings.py`` a module may *write* the environment (``os.environ[k] = v``, ``setdefault``,
``update``, ``clear``) and copy it whole for a child (``dict(os.environ)``,
``os.environ.items()``), but a keyed read (``os.environ[k]``, ``os.environ.get(k)``,
``os.getenv(k)``, ``k in os.environ``) is allowed only for :data:`ALLOWED`: torch's launch
variables, read in rank processes as torch's ``env://`` rendezvous reads them, and the search
paths extended for a child. Every other variable is a setting, read through an accessor.
"""

import ast
from pathlib import Path

import pytest

from moe_release import settings
from tests.helpers import TOOLS

SETTINGS_FILE = TOOLS / "moe_release" / "settings.py"

# torchrun (or the CPU launcher) sets these per rank; ranks read them as torch's env:// does.
TORCH_LAUNCH = set("RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT".split())
# Extended (never replaced) for a child process.
CHILD_PATHS = {"PATH", "PYTHONPATH"}
ALLOWED = TORCH_LAUNCH | CHILD_PATHS


def _is_environ(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "environ"
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


def _key(node: ast.AST) -> str:
    """The variable a read names: its string, or the source of the expression naming it."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return ast.unparse(node)


def environment_reads(root: Path = TOOLS) -> list[str]:
    """``path:line: variable`` of each keyed read of the environment under ``root`` (the
    settings module aside) that is not of a variable in :data:`ALLOWED`."""
    out = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root) == SETTINGS_FILE.relative_to(TOOLS):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            keys = []
            if isinstance(node, ast.Subscript) and _is_environ(node.value):
                if isinstance(node.ctx, ast.Load):
                    keys.append(node.slice)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                func = node.func
                reads = (func.attr == "get" and _is_environ(func.value)) or (
                    func.attr == "getenv"
                    and isinstance(func.value, ast.Name)
                    and func.value.id == "os"
                )
                if reads and node.args:
                    keys.append(node.args[0])
            elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
                keys.append(node.left)
            elif isinstance(node, ast.ImportFrom) and node.module == "os":
                keys += [ast.Constant(f"from os import {a.name}") for a in node.names
                         if a.name in ("environ", "getenv")]  # fmt: skip
            for key in keys:
                if _key(key) not in ALLOWED:
                    out.append(f"{path.relative_to(root)}:{node.lineno}: {_key(key)}")
    return out


def test_only_settings_reads_the_environment():
    reads = environment_reads()
    assert not reads, (
        "read these through tools/moe_release/settings.py (an accessor per variable):\n"
        + "\n".join(reads)
    )


def test_scan_sees_a_read(tmp_path):
    (tmp_path / "m.py").write_text(
        "import os\n"
        "a = os.environ.get('MOE_RELEASE_TREE')\n"
        "b = os.environ['UPSTREAM_CPU_TE']\n"
        "c = os.getenv('CXX')\n"
        "d = 'MOE_RELEASE_FORK' in os.environ\n"
        "os.environ['MOE_RELEASE_PLACEMENT'] = '0'\n"  # a write: allowed
        "e = dict(os.environ)\n"  # a copy for a child: allowed
        "f = int(os.environ['RANK'])\n"  # torch's launch protocol: allowed
    )
    assert environment_reads(tmp_path) == [
        "m.py:2: MOE_RELEASE_TREE",
        "m.py:3: UPSTREAM_CPU_TE",
        "m.py:4: CXX",
        "m.py:5: MOE_RELEASE_FORK",
    ]


def test_docstring_lists_every_accessor():
    """The module docstring's table names each public accessor."""
    doc = settings.__doc__
    accessors = [
        name
        for name, value in vars(settings).items()
        if callable(value)
        and not name.startswith("_")
        and getattr(value, "__module__", None) == settings.__name__
        and name not in ("SettingError", "override")
    ]
    assert accessors
    missing = [name for name in accessors if f":func:`{name}`" not in doc]
    assert not missing, missing


def test_defaults(monkeypatch):
    for name in ("MOE_RELEASE_TREE", "MOE_RELEASE_FORK", "MOE_RELEASE_DEVICE_BARRIER_TIMEOUT",
                 "UPSTREAM_CPU_PG_TIMEOUT", "MOE_RELEASE_BASES", "UPSTREAM_CPU_TE"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    assert settings.tree() is None
    assert settings.fork() is True
    assert settings.device_barrier_timeout() == 30.0
    assert settings.upstream_cpu_pg_timeout() == 180.0
    assert settings.bases() == []
    assert settings.upstream_cpu_te() == ""


def test_read_at_call_time(monkeypatch):
    monkeypatch.setenv("MOE_RELEASE_TREE", "/some/tree")
    monkeypatch.setenv("MOE_RELEASE_FORK", "0")
    monkeypatch.setenv("MOE_RELEASE_DEVICE_BARRIER_TIMEOUT", "1.5")
    monkeypatch.setenv("MOE_RELEASE_BASES", "a, b c")
    assert settings.tree() == "/some/tree"
    assert settings.fork() is False
    assert settings.device_barrier_timeout() == 1.5
    assert settings.bases() == ["a", "b", "c"]


def test_ranks_per_node(monkeypatch):
    monkeypatch.delenv("MOE_RELEASE_RANKS_PER_NODE", raising=False)
    assert settings.ranks_per_node() is None
    monkeypatch.setenv("MOE_RELEASE_RANKS_PER_NODE", "2")
    assert settings.ranks_per_node() == 2
    for bad in ("0", "-2", "two"):
        monkeypatch.setenv("MOE_RELEASE_RANKS_PER_NODE", bad)
        with pytest.raises(settings.SettingError, match="MOE_RELEASE_RANKS_PER_NODE"):
            settings.ranks_per_node()


def test_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("MOE_RELEASE_DEVICE_BARRIER_TIMEOUT", "soon")
    with pytest.raises(settings.SettingError, match="MOE_RELEASE_DEVICE_BARRIER_TIMEOUT"):
        settings.device_barrier_timeout()
    monkeypatch.delenv("MOE_RELEASE_TREE", raising=False)
    with pytest.raises(settings.SettingError, match="MOE_RELEASE_TREE is not set"):
        settings.tree(required=True)


def test_override_restores(monkeypatch):
    monkeypatch.delenv("MOE_RELEASE_PLACEMENT", raising=False)
    with settings.override("MOE_RELEASE_PLACEMENT", "0"):
        assert settings.placement() is False
    assert settings.placement() is True
    monkeypatch.setenv("MOE_RELEASE_PLACEMENT", "1")
    with settings.override("MOE_RELEASE_PLACEMENT", "0"):
        assert settings.placement() is False
    assert settings.placement() is True
