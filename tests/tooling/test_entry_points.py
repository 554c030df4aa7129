"""The tooling's commands: one entry point (``moe-release``, ``tools/pyproject.toml``) over one
registry, and the scripts under ``scripts/`` are shims over the same ``main``, each naming its
command; a tool's own installed command runs the function its registered command runs, so every
spelling of a command agrees."""

import ast
import importlib
import os
import subprocess
import sys
import sysconfig
import tomllib
import venv
from pathlib import Path

from tests.helpers import REPO_ROOT

PYPROJECT = REPO_ROOT / "tools" / "pyproject.toml"
ENTRY_POINTS = tomllib.loads(PYPROJECT.read_text())["project"]["scripts"]
# The commands users' scripts call, by their path under scripts/: the installed command of the
# same tool, and the word the shim hands ``main`` (None: the whole command).
SHIMS = {
    "moe_release.py": ("moe-release", None),
    "moe_memory_plan.py": ("moe-memory-plan", "moe_memory_plan"),
    "memory_report.py": ("moe-memory-report", "memory_report"),
    "fault_matrix.py": ("moe-fault-matrix", "fault_matrix"),
    "production_shape_terms.py": ("moe-production-shape-terms", "production_shape_terms"),
    "upstream_cpu/run.py": ("moe-upstream-cpu", "upstream_cpu"),
    "upstream_cpu/per_patch.py": ("moe-upstream-per-patch", "per_patch"),
}


def _shim_target(path) -> str:
    (node,) = [
        n
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("moe_release")
    ]
    return f"{node.module}:{node.names[0].name}"


def _shim_word(path):
    """The command word the shim hands ``main`` (None: ``main()``, the whole command)."""
    (call,) = [
        n
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "main"
    ]
    return call.args[0].elts[0].value if call.args else None


def test_every_entry_point_is_a_function():
    for name, target in ENTRY_POINTS.items():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func)), name


def test_each_script_is_the_shim_of_its_entry_point():
    """Every shim imports moe-release's ``main`` and names its command; the registered command's
    module runs the function the tool's installed command names."""
    from moe_release.commands.registry import REGISTRY

    REGISTRY.load("moe_release.commands")
    scripts = {
        str(p.relative_to(REPO_ROOT / "scripts")) for p in (REPO_ROOT / "scripts").rglob("*.py")
    }
    assert scripts == set(SHIMS)
    for script, (installed, word) in SHIMS.items():
        path = REPO_ROOT / "scripts" / script
        assert _shim_target(path) == ENTRY_POINTS["moe-release"], script
        assert _shim_word(path) == word, script
        if word is None:
            continue
        module = REGISTRY.module_of(REGISTRY.words()[word])
        entry_module, func = ENTRY_POINTS[installed].split(":")
        source = Path(importlib.import_module(module).__file__).read_text()
        runs = entry_module == module or f"from {entry_module} import {func}" in source
        assert runs, (script, installed)


def test_a_shim_runs_from_anywhere(tmp_path):
    """The shim puts tools/ ahead of its own directory: ``scripts/moe_release.py`` does not shadow
    the package, whatever the working directory."""
    out = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "moe_release.py"), "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: moe_release.py")


def test_the_installed_commands_print_what_the_scripts_print(tmp_path):
    """``pip install -e tools`` into a fresh venv (the test venv's packages visible through a
    ``.pth``, nothing downloaded) installs each command; ``moe-release`` and ``moe-memory-plan``
    print what their shims print."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    (env_dir / "lib" / "python3.12" / "site-packages" / "test-venv.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n"
    )
    python = env_dir / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", "install", "--quiet",
         "--no-deps", "--no-build-isolation", "-e", str(REPO_ROOT / "tools")],
        check=True, capture_output=True, timeout=240,
        env={**os.environ, "PIP_NO_INDEX": "1"},
    )  # fmt: skip
    for command in ENTRY_POINTS:
        assert (env_dir / "bin" / command).exists(), command
    for script, command in (
        ("moe_release.py", "moe-release"),
        ("moe_memory_plan.py", "moe-memory-plan"),
    ):
        installed = subprocess.run(
            [str(env_dir / "bin" / command), "--help"], capture_output=True, text=True,
            cwd=tmp_path, timeout=120,
        )  # fmt: skip
        shim = subprocess.run(
            [sys.executable, str(REPO_ROOT / "scripts" / script), "--help"],
            capture_output=True, text=True, cwd=tmp_path, timeout=120,
        )  # fmt: skip
        assert installed.returncode == shim.returncode == 0, installed.stderr
        # argparse names the program by argv[0]; the rest is the same text.
        assert installed.stdout.split("\n", 1)[1] == shim.stdout.split("\n", 1)[1]
