"""Helpers of the patch-series tests: git in an edit repo with the tooling's reproducible
environment, the trailers (a name among them) and author every test commit carries, and
``scripts/moe_release.py`` run as a user runs it."""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from moe_release.series.git import create_edit_repo, format_patches, git, git_env
from moe_release.series.patches import parse_series
from tests.helpers import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "moe_release.py"
PRINT_VERSION = "import runpy, sys; print(runpy.run_path(sys.argv[1])['__version__'])"


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
# A sign-off identity git reads before any config, so that `upstream` gets past it on any
# machine (its own refusals are tested in tests/tooling/commands/test_upstream.py).
IDENTITY_ENV = dict(
    GIT_COMMITTER_NAME="Test Exporter", GIT_COMMITTER_EMAIL="exporter@users.noreply.github.com"
)


def run_git(repo: Path, *args: str, **env: str) -> str:
    """git in an edit repo with the tooling's reproducible environment."""
    return git(repo, *args, env=git_env(env)).decode()


def cli(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess:
    """``scripts/moe_release.py ARGS`` in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=dict(os.environ, **IDENTITY_ENV),
    )


def series_patches(root: Path) -> list[Path]:
    """The primary series' patch files of the repository (copy) at ``root``, in order."""
    sdir = root / "patches"
    return [sdir / n for n in parse_series((sdir / "series").read_text())]


def leftovers(parent: Path) -> list[str]:
    """The temporary directories a write left beside its target."""
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name]


def edit_repo(tmp_path: Path, repo: Path, base, base_files) -> Path:
    """An edit repo of ``repo``'s primary series under ``tmp_path``."""
    edit = tmp_path / "edit"
    patches = [(p.name, p.read_bytes()) for p in series_patches(repo)]
    create_edit_repo(edit, base, base_files, patches)
    return edit


def commit_patch(repo, base, base_files, rel, change, subject, tail=None):
    """A one-commit patch on top of the series, as format-patch writes it."""
    with tempfile.TemporaryDirectory() as tmp:
        edit = Path(tmp) / "edit"
        patches = [(p.name, p.read_bytes()) for p in series_patches(repo)]
        create_edit_repo(edit, base, base_files, patches)
        path = edit / rel
        path.write_text(change(path.read_text()))
        msg = f"{subject}\n\nBody.\n\n{tail or trailers(name_for(subject))}"
        run_git(edit, "commit", "-q", "-am", msg, **AUTHOR)
        return format_patches(edit)[-1]
