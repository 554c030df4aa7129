# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""What the series hands upstream passes upstream's pinned formatters, as its
tools/autoformat.sh runs them: black 26.3.0 and isort 5.13.2 (Megatron-LM pyproject.toml at main
d98e8a6: ``[tool.black]`` line length 100, no string normalization, no magic trailing comma;
``[tool.isort]`` black profile, line length 100, Python 3.12, megatron first party)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from moe_release.common import REPO_ROOT
from moe_release.series.patches import parse_patch
from moe_release.series.repo import read_series
from moe_release.series.trees import build_tree

BLACK = [
    sys.executable, "-m", "black", "--check", "-q", "--line-length", "100",
    "--skip-string-normalization", "--skip-magic-trailing-comma", "--target-version", "py312",
]  # fmt: skip
ISORT = [
    sys.executable, "-m", "isort", "--check-only", "-q", "--profile", "black",
    "--line-length", "100", "--py", "312", "-p", "megatron",
    # tests: a top-level package of the checkout, which isort finds first party there
    "-p", "tests",
]  # fmt: skip
UPSTREAM_TESTS = sorted((REPO_ROOT / "patches" / "upstream" / "tests").rglob("*.py"))


def _formatted(tool: list, path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*tool, str(path)], capture_output=True, text=True)


def test_black_and_isort_are_upstreams_pins():
    versions = subprocess.run(
        [sys.executable, "-c", "import black, isort; print(black.__version__, isort.__version__)"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert versions == ["26.3.0", "5.13.2"], versions


@pytest.mark.parametrize("path", UPSTREAM_TESTS, ids=lambda p: p.name)
def test_upstream_layout_tests_pass_black_and_isort(path):
    for tool in (BLACK, ISORT):
        done = _formatted(tool, path)
        assert done.returncode == 0, f"{tool[2]} would change {path}:\n{done.stderr}"


def test_files_the_series_changes_stay_as_black_found_them(tmp_path, base, base_files):
    """Every Python file of megatron/core the primary series changes passes black after it,
    where upstream's file passed before it (files upstream leaves unformatted are not ours to
    reformat)."""
    series = read_series(base)
    tree = build_tree(base, base_files, series, [], stamp=False)
    paths = sorted({fp.path for n, d in series for fp in parse_patch(d, n).files})
    checked = 0
    for rel in (p for p in paths if p.endswith(".py") and p in base_files):
        before, after = tmp_path / "before.py", tmp_path / "after.py"
        before.write_bytes(base_files[rel])
        after.write_bytes(tree.files[rel])
        if _formatted(BLACK, before).returncode != 0:
            continue
        checked += 1
        done = _formatted(BLACK, after)
        assert done.returncode == 0, f"black would reformat {rel} after the series"
    assert checked >= 3, "upstream's files were not black-clean: nothing was checked"


@pytest.mark.parametrize(
    "target,shims",
    [("main", 0), ("dev", 0), ("core_r0.19.0", 0), ("core_r0.18.0", 0), ("core_r0.16.0", 5)],
)
def test_exported_tests_carry_only_their_branchs_shims(tmp_path, target, shims):
    """The export writes the shared upstream-layout tests without the shims of older release
    branches (main's and dev's PRs name no release branch), and what it writes still passes
    black and isort."""
    from moe_release.commands.upstream import export_test_files, topic_series
    from moe_release.series.targets import target_series

    series = topic_series(target_series(target), "memory")
    files = export_test_files("memory", series, target=target)
    assert files
    found = 0
    for rel, data in files.items():
        text = data.decode()
        found += len(re.findall(r"core_r0\.1\d", text))
        path = tmp_path / rel.rsplit("/", 1)[-1]
        path.write_text(text)
        for tool in (BLACK, ISORT):
            done = _formatted(tool, path)
            assert done.returncode == 0, f"{target}: {tool[2]} would change {rel}:\n{done.stderr}"
    assert found == shims, f"{target}: {found} mentions of a release branch in its tests"
