"""Fixtures for the patch-series tooling tests: the real pinned sdist and scratch repo copies;
the ``needs_env`` marker (deselected where the variable is unset)."""

import os
import re
import shutil
from pathlib import Path

import pytest

from moe_release.series.git import git, git_env
from moe_release.series.pins import Base, Pins, load_pins
from moe_release.series.repo import OVERLAY_DIRS
from moe_release.series.sdist import fetch_sdist, read_sdist

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def pins() -> Pins:
    """The repository's pins."""
    return load_pins()


@pytest.fixture(scope="session")
def base(pins: Pins) -> Base:
    """The primary base (megatron-core 0.19.2)."""
    return pins.get(None)


@pytest.fixture(scope="session")
def sdist(base: Base) -> Path:
    """The real 0.19.2 sdist, fetched into the cache and verified."""
    return fetch_sdist(base)


@pytest.fixture(scope="session")
def base_files(sdist: Path) -> dict[str, bytes]:
    """The sdist's files."""
    return read_sdist(sdist)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A scratch copy of what the tooling reads: patches/ and the overlay modules."""
    root = tmp_path / "repo"
    shutil.copytree(REPO_ROOT / "patches", root / "patches")
    for rel in OVERLAY_DIRS:
        src = REPO_ROOT / rel
        if src.is_dir():
            shutil.copytree(src, root / rel, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def run_git(repo: Path, *args: str, **env: str) -> str:
    """git in an edit repo with the tooling's reproducible environment."""
    return git(repo, *args, env=git_env(env)).decode()


def name_for(subject: str) -> str:
    """A test patch's name: its subject's words, lower case, joined by ``-`` (the fixtures'
    convention; a real patch's name is chosen once and kept)."""
    return "-".join(re.findall(r"[a-z0-9]+", re.sub(r"^\[MoE\]", "", subject).lower()))


def trailers(name: str) -> str:
    """The trailers every series patch carries, its name among them."""
    return (
        "Signed-off-by: Test Maintainer <test@moe-release.invalid>\n"
        f"Patch-Name: {name}\n"
        "Forwarded: no\n"
        "Origin: vendor, moe-release\n"
    )


AUTHOR = dict(
    GIT_AUTHOR_NAME="Test Maintainer",
    GIT_AUTHOR_EMAIL="test@moe-release.invalid",
    GIT_AUTHOR_DATE="2026-11-29T12:00:00+00:00",
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "needs_env(name): reads what the environment variable ``name`` points at (a Megatron-LM "
        "checkout CI does not have); deselected, not skipped, where it is unset",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    # Deselected, not skipped: under CI a skip fails the run (tests/conftest.py).
    here = Path(__file__).parent
    lacking = [
        item
        for item in items
        if here in Path(str(item.fspath)).parents
        and any(not os.environ.get(m.args[0]) for m in item.iter_markers("needs_env"))
    ]
    if lacking:
        config.hook.pytest_deselected(items=lacking)
        items[:] = [item for item in items if item not in lacking]
