"""Fixtures for the patch-series tooling tests: the real pinned sdist and scratch repo copies
(the ``needs_env`` marker is the trees plugin's, tests/helpers/trees.py)."""

import shutil
from pathlib import Path

import pytest

from moe_release.commands import apply as apply_mod
from moe_release.series.pins import Base, Pins, load_pins
from moe_release.series.repo import OVERLAY_DIRS
from moe_release.series.sdist import fetch_sdist, read_sdist
from moe_release.series.source import CHECKOUT_ENV
from tests.helpers import REPO_ROOT
from tests.helpers.megatron_repo import megatron_lm


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


@pytest.fixture
def mlm(tmp_path, repo, monkeypatch):
    """A Megatron-shaped repository (main: c0 .. c5, dev forked at c1) and the tooling's
    ``repo`` copy with main's and dev's pinned bases and series replaced by synthetic ones
    (tests/helpers/megatron_repo.py): ``(checkout, commits, repo)``."""
    m, c = megatron_lm(tmp_path, repo)
    monkeypatch.setattr(apply_mod, "REPO_ROOT", repo)
    monkeypatch.delenv(CHECKOUT_ENV, raising=False)  # the real mirror is no --mirror here
    return m, c, repo
