"""Commit bases: a pin naming a Megatron-LM commit, read from a clone or a `git archive` the user
points at, verified by commit id and tree hash. Tested on a small synthetic Megatron-LM made
here (CI has no Megatron-LM clone): materialize, edit/export, check, the refusals, the wheel."""

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from moe_release.commands.check import check_base
from moe_release.common import UserError
from moe_release.series.git import create_edit_repo, export_series
from moe_release.series.pins import load_pins
from moe_release.series.source import (
    CHECKOUT_ENV,
    _read_dir,
    git_tree_hash,
    read_base_files,
    read_commit,
)
from moe_release.series.trees import MANIFEST_PATH, load_tree
from tests.helpers import REPO_ROOT
from tests.helpers.series import AUTHOR, run_git, trailers

SCRIPT = str(REPO_ROOT / "scripts" / "moe_release.py")
FILES = {
    "megatron/core/__init__.py": "from .package_info import __version__  # noqa: F401\n",
    "megatron/core/package_info.py": (
        "MAJOR = 0\nMINOR = 99\nPATCH = 0\nPRE_RELEASE = ''\n"
        "VERSION = (MAJOR, MINOR, PATCH, PRE_RELEASE)\n"
        "__version__ = '.'.join(map(str, VERSION[:3])) + ''.join(VERSION[3:])\n"
    ),
    "megatron/core/release_me.py": "def combine(state):\n    return state\n",
    "pyproject.toml": '[project]\nname = "megatron-core"\ndependencies = []\n'
    'description = "synthetic"\n',
    "README.md": "# synthetic Megatron-LM\n",
    "docs/not-in-the-sdist.md": "outside megatron/core\n",
}
OLD, NEW = b"    return state\n", b"    state = None  # released after combine\n    return state\n"


def _git(cwd: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull, **AUTHOR,
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@x.invalid",
               GIT_COMMITTER_DATE=AUTHOR["GIT_AUTHOR_DATE"])  # fmt: skip
    done = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode().strip()


def _megatron_lm(path: Path, files: dict) -> tuple[str, str]:
    """A git repository holding ``files`` (plus an executable and a symlink) in one commit:
    (commit id, tree id)."""
    path.mkdir()
    _git(path, "init", "-q", "--initial-branch=main")
    for rel, text in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    (path / "tools").mkdir()
    (path / "tools" / "run.sh").write_text("#!/bin/sh\n")
    (path / "tools" / "run.sh").chmod(0o755)
    (path / "AGENTS.md").symlink_to("README.md")
    _git(path, "add", "-A")
    _git(path, "commit", "-q", "-m", "synthetic")
    return _git(path, "rev-parse", "HEAD"), _git(path, "rev-parse", "HEAD^{tree}")


@pytest.fixture
def fake(tmp_path, repo, monkeypatch):
    """(scratch repo with a commit base `fake` and its one-patch series, the synthetic clone,
    its commit, its tree)."""
    clone = tmp_path / "Megatron-LM"
    commit, tree = _megatron_lm(clone, FILES)
    pins = repo / "patches" / "pins.toml"
    pins.write_text(
        pins.read_text()
        + f'\n[bases."fake"]\ncommit = "{commit}"\ntree = "{tree}"\nversion = "0.99.0"\n'
        'branch = "main"\nseries = "patches/fake"\n'
    )
    monkeypatch.setenv(CHECKOUT_ENV, str(clone))
    base = load_pins(pins).get("fake")
    edit = tmp_path / "edit"
    create_edit_repo(edit, base, read_base_files(base), [])
    target = edit / "megatron/core/release_me.py"
    target.write_bytes(target.read_bytes().replace(OLD, NEW))
    run_git(
        edit,
        "commit",
        "-q",
        "-am",
        f"[MoE] Release the state\n\nBody.\n\n{trailers('flex-dispatcher-state')}",
        **AUTHOR,
    )
    export_series(edit, root=repo)
    return repo, clone, commit, tree


def _archive(clone: Path, out: Path, commit: str = "HEAD") -> None:
    _git(clone, "archive", "--format=tar", "-o", str(out), commit)


def test_tree_hash_is_gits(tmp_path, fake):
    _, clone, _, tree = fake
    _archive(clone, tmp_path / "a.tar")
    extracted = tmp_path / "extracted"
    extracted.mkdir()
    with tarfile.open(tmp_path / "a.tar") as tar:
        tar.extractall(extracted, filter="tar")
    assert git_tree_hash(_read_dir(extracted)) == tree
    assert git_tree_hash(_read_dir(clone)) == tree  # .git is not part of the tree


def test_materialize_from_a_clone_a_tar_and_an_extracted_archive(tmp_path, fake, monkeypatch):
    repo, clone, commit, tree = fake
    _archive(clone, tmp_path / "a.tar")
    extracted = tmp_path / "x"
    extracted.mkdir()
    with tarfile.open(tmp_path / "a.tar") as tar:
        tar.extractall(extracted, filter="tar")
    (clone / "megatron/core/release_me.py").write_text("dirty work tree, not read\n")
    trees = []
    for source in (clone, tmp_path / "a.tar", extracted):
        monkeypatch.setenv(CHECKOUT_ENV, str(source))
        trees.append(load_tree("fake", root=repo))
    assert all(t.files == trees[0].files for t in trees)
    t = trees[0]
    assert t.version.startswith("0.99.0+moerelease.1.") and t.version.count("+") == 1
    assert t.files["megatron/core/release_me.py"] == b"def combine(state):\n" + NEW
    assert "docs/not-in-the-sdist.md" not in t.files and "pyproject.toml" in t.files
    assert b"__version__ = '0.99.0+moerelease.1." in t.files["megatron/core/package_info.py"]
    manifest = t.files[MANIFEST_PATH].decode()
    assert f'"commit": "{commit}"' in manifest and f'"tree": "{tree}"' in manifest
    assert check_base(load_pins(repo / "patches" / "pins.toml").get("fake"), repo) == []


def test_a_source_that_is_not_the_pinned_commit_is_refused(tmp_path, fake):
    repo, clone, commit, tree = fake
    base = load_pins(repo / "patches" / "pins.toml").get("fake")
    other = tmp_path / "other"
    _megatron_lm(other, {**FILES, "README.md": "# another commit\n"})
    expected = f"base fake: {{}} is not the pinned Megatron-LM commit: expected commit {commit} "
    expected += f"(tree {tree}), found "
    with pytest.raises(UserError) as err:
        read_commit(base, other)
    assert str(err.value).startswith(expected.format(other) + "no such commit (HEAD is ")
    _archive(other, tmp_path / "other.tar")
    with pytest.raises(UserError) as err:
        read_commit(base, tmp_path / "other.tar")
    assert str(err.value).startswith(expected.format(tmp_path / "other.tar") + "commit ")
    edited = tmp_path / "edited"
    shutil.copytree(clone, edited, symlinks=True, ignore=shutil.ignore_patterns(".git"))
    (edited / "megatron/core/release_me.py").write_text("changed\n")
    with pytest.raises(UserError) as err:
        read_commit(base, edited)
    found = git_tree_hash(_read_dir(edited))
    assert str(err.value) == expected.format(edited) + f"tree {found}"
    with pytest.raises(UserError, match="Megatron-LM source does not exist"):
        read_commit(base, tmp_path / "missing")


def test_pinned_version_must_be_package_info_s(fake):
    repo, *_ = fake
    pins = repo / "patches" / "pins.toml"
    pins.write_text(pins.read_text().replace('version = "0.99.0"', 'version = "0.98.0"'))
    with pytest.raises(UserError, match="pinned version 0.98.0, but .* says 0.99.0"):
        load_tree("fake", root=repo)


def _cli(*args, env=None):
    env = {k: v for k, v in (env or os.environ).items()}
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env)


def test_cli_refuses_a_wrong_checkout_in_one_line(tmp_path, fake):
    _, clone, *_ = fake
    pin = load_pins().get("main-d98e8a6")
    result = _cli("materialize", "--base", "main-d98e8a6", "--checkout", str(clone),
                  str(tmp_path / "out"))  # fmt: skip
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"moe_release.py materialize: error: base main-d98e8a6: {clone} is not")
    assert f"expected commit {pin.commit} (tree {pin.tree}), found no such commit" in line
    assert not (tmp_path / "out").exists()


def test_trees_list_skips_commit_bases_without_a_checkout(monkeypatch):
    monkeypatch.delenv(CHECKOUT_ENV, raising=False)
    monkeypatch.delenv("MOE_RELEASE_BASES", raising=False)
    result = _cli("trees", "--list")
    assert result.returncode == 0, result.stderr
    listed = result.stdout.split()
    assert listed[0] == "0.19.2" and "0.18.2" in listed and "main-d98e8a6" not in listed
    skips = [line for line in result.stderr.splitlines() if "main-d98e8a6" in line]
    assert len(skips) == 1 and f"set {CHECKOUT_ENV}" in skips[0]
    monkeypatch.setenv("MOE_RELEASE_BASES", "0.18.2")
    assert _cli("trees", "--list").stdout.split() == ["0.19.2", "0.18.2"]
    monkeypatch.setenv("MOE_RELEASE_BASES", "9.9")
    assert _cli("trees", "--list").returncode == 2


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs to run in a venv")
def test_wheel_of_a_commit_base(tmp_path, fake):
    """`pip wheel .` with MOE_RELEASE_BASE=<commit base> builds `<version>+moerelease...`,
    which a requirement pinned to the commit's version accepts."""
    repo, clone, *_ = fake
    for rel in ("setup.py", "pyproject.toml", "tools/"):
        src = REPO_ROOT / rel
        if src.is_dir():
            shutil.copytree(src, repo / rel, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, repo / rel)
    version = load_tree("fake", root=repo).version
    env = dict(os.environ, MOE_RELEASE_BASE="fake", **{CHECKOUT_ENV: str(clone)})
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(tmp_path / "w"), str(repo)],
        capture_output=True, text=True, env=env, cwd="/",
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (wheel,) = (tmp_path / "w").glob("megatron_core-*.whl")
    assert wheel.name.startswith(f"megatron_core-{version}-")
    assert Requirement("megatron-core==0.99.0").specifier.contains(version)
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read("megatron/core/release_me.py") == b"def combine(state):\n" + NEW
