"""Fixtures for the patch-series tooling tests: the real pinned sdist and scratch repo copies."""

import shutil
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import moe_release as mr  # noqa: E402


@pytest.fixture(scope="session")
def pins() -> mr.Pins:
    """The repository's pins."""
    return mr.load_pins()


@pytest.fixture(scope="session")
def base(pins: mr.Pins) -> mr.Base:
    """The primary base (megatron-core 0.19.2)."""
    return pins.get(None)


@pytest.fixture(scope="session")
def sdist(base: mr.Base) -> Path:
    """The real 0.19.2 sdist, fetched into the cache and verified."""
    return mr.fetch_sdist(base)


@pytest.fixture(scope="session")
def base_files(sdist: Path) -> dict[str, bytes]:
    """The sdist's files."""
    return mr.read_sdist(sdist)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A scratch copy of what the tooling reads: patches/ and the overlay modules."""
    root = tmp_path / "repo"
    shutil.copytree(REPO_ROOT / "patches", root / "patches")
    for rel in mr.OVERLAY_DIRS:
        src = REPO_ROOT / rel
        if src.is_dir():
            shutil.copytree(src, root / rel, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def run_git(repo: Path, *args: str, **env: str) -> str:
    """git in an edit repo with the tooling's reproducible environment."""
    return mr.git(repo, *args, env=mr.git_env(env)).decode()


TRAILERS = (
    "Signed-off-by: Test Maintainer <test@moe-release.invalid>\n"
    "Forwarded: no\n"
    "Origin: vendor, moe-release\n"
)
AUTHOR = dict(
    GIT_AUTHOR_NAME="Test Maintainer",
    GIT_AUTHOR_EMAIL="test@moe-release.invalid",
    GIT_AUTHOR_DATE="2026-11-29T12:00:00+00:00",
)
