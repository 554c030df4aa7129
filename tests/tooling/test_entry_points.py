"""The tooling's commands: one entry point each (``tools/pyproject.toml``), and the scripts under
``scripts/`` are shims over the same functions, so both spellings of a command agree."""

import ast
import importlib
import os
import subprocess
import sys
import sysconfig
import tomllib
import venv

from conftest import REPO_ROOT

PYPROJECT = REPO_ROOT / "tools" / "pyproject.toml"
ENTRY_POINTS = tomllib.loads(PYPROJECT.read_text())["project"]["scripts"]
# The commands users' scripts call, by their path under scripts/.
SHIMS = {
    "moe_release.py": "moe-release",
    "moe_memory_plan.py": "moe-memory-plan",
    "memory_report.py": "moe-memory-report",
    "fault_matrix.py": "moe-fault-matrix",
    "production_shape_terms.py": "moe-production-shape-terms",
    "upstream_cpu/run.py": "moe-upstream-cpu",
    "upstream_cpu/per_patch.py": "moe-upstream-per-patch",
}


def _shim_target(path) -> str:
    (node,) = [
        n
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("moe_release")
    ]
    return f"{node.module}:{node.names[0].name}"


def test_every_entry_point_is_a_function():
    for name, target in ENTRY_POINTS.items():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func)), name


def test_each_script_is_the_shim_of_its_entry_point():
    scripts = {
        str(p.relative_to(REPO_ROOT / "scripts")) for p in (REPO_ROOT / "scripts").rglob("*.py")
    }
    assert scripts == set(SHIMS)
    for script, command in SHIMS.items():
        assert _shim_target(REPO_ROOT / "scripts" / script) == ENTRY_POINTS[command], script


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
