# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The git round trip: `edit` imports the series as commits, `export` writes them back."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from moe_release.common import REPO_ROOT, UserError
from moe_release.series.patches import (
    NAME_TRAILER,
    check_trailers,
    name_of,
    parse_patch,
    parse_series,
    patch_stem,
    series_header,
)
from moe_release.series.pins import Base, load_pins
from moe_release.series.trees import atomic_directory, os_error, write_files

# Fixed identities and dates make `edit` reproducible and `export` byte-stable.
BASE_IDENT = ("megatron-core sdist", "sdist@moe-release.invalid", "2000-01-01T00:00:00+00:00")
COMMITTER_IDENT = ("moe-release import", "import@moe-release.invalid")
GIT_AM_FLAGS = (
    "am",
    "--quiet",
    "--keep",
    "--keep-cr",
    "--no-3way",
    "--committer-date-is-author-date",
    "--whitespace=nowarn",
)
FORMAT_PATCH_FLAGS = (
    "--keep-subject",
    "--no-stat",
    "--no-signature",
    "--zero-commit",
    "--full-index",
    "--no-renames",
    "--no-binary",
    "--no-numbered",
    "--no-thread",
    "--filename-max-length=64",
)


def git_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """An environment that ignores the user's git config, so output is reproducible."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        LC_ALL="C",
        TZ="UTC",
        GIT_COMMITTER_NAME=COMMITTER_IDENT[0],
        GIT_COMMITTER_EMAIL=COMMITTER_IDENT[1],
    )
    env.update(extra or {})
    return env


def git(
    repo: Path, *args: str, env: Optional[dict[str, str]] = None, input: Optional[bytes] = None
) -> bytes:
    """Run git in repo; raise UserError with git's message on failure."""
    result = subprocess.run(
        ["git", "-C", str(repo), *args], env=env or git_env(), input=input, capture_output=True
    )
    if result.returncode != 0:
        msg = result.stderr.decode(errors="replace").strip() or result.stdout.decode(
            errors="replace"
        )
        raise UserError(f"git {args[0]} failed in {repo}: {msg.splitlines()[0] if msg else '?'}")
    return result.stdout


def create_edit_repo(
    dest: Path, base: Base, base_files: dict[str, bytes], patches: Sequence[tuple[str, bytes]]
) -> None:
    """Git repo at dest (absent or empty, in an existing directory): the base as one commit
    tagged `base`, then one commit per patch."""
    with atomic_directory(dest, make_parents=False) as tmp:
        write_files(tmp, base_files)
        git(tmp, "init", "--quiet", "--initial-branch=main")
        git(tmp, "config", "moerelease.base", base.name)
        git(tmp, "config", "core.autocrlf", "false")
        git(tmp, "add", "--all")
        name, email, date = BASE_IDENT
        env = git_env(
            dict(
                GIT_AUTHOR_NAME=name, GIT_AUTHOR_EMAIL=email, GIT_AUTHOR_DATE=date,
                GIT_COMMITTER_NAME=name, GIT_COMMITTER_EMAIL=email, GIT_COMMITTER_DATE=date,
            )
        )  # fmt: skip
        if base.is_commit:
            msg = (
                f"Megatron-LM {base.branch} {base.commit[:12]} (megatron-core {base.version})\n\n"
                f"commit: {base.commit}\ntree: {base.tree}\npin: {base.name}\n"
            )
        else:
            msg = (
                f"megatron-core {base.version} (PyPI sdist)\n\n"
                f"sdist: {base.sdist}\nsha256: {base.sha256}\n"
                f"upstream: {base.tag} ({base.branch})\n"
            )
        git(tmp, "commit", "--quiet", "--no-verify", "-m", msg, env=env)
        git(tmp, "tag", "base")
        for patch_name, data in patches:
            parse_patch(data, patch_name)  # a clear error for malformed input before git sees it
            try:
                git(tmp, *GIT_AM_FLAGS, input=data)
            except UserError as exc:
                raise UserError(
                    f"{patch_name}: does not apply to {base.describe()}: {exc}"
                ) from None


def format_patches(repo: Path) -> list[tuple[str, bytes]]:
    """(file name, mbox) for each commit after tag `base`, in order: each file is named after
    the commit's ``Patch-Name:`` trailer, never its subject."""
    with tempfile.TemporaryDirectory() as tmp:
        out = git(repo, "-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false",
                  "-c", "diff.algorithm=myers", "-c", "diff.indentHeuristic=true",
                  "format-patch",
                  *FORMAT_PATCH_FLAGS, "--output-directory", tmp, "base..HEAD")  # fmt: skip
        result = []
        for line in out.decode().splitlines():
            path = Path(line)
            data = path.read_bytes()
            patch = parse_patch(data, re.sub(r"^\d{4}-", "", path.name))
            name = name_of(patch)
            if name is None:
                raise UserError(
                    f"commit {patch.subject!r} lacks a {NAME_TRAILER}: trailer (the patch's "
                    "name, its file <name>.patch in every series); add one to its message"
                )
            result.append((f"{name}.patch", data))
    names = [n for n, _ in result]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise UserError(f"two commits carry the same {NAME_TRAILER}: {patch_stem(dup)}; rename one")
    return result


def export_series(repo: Path, root: Path = REPO_ROOT) -> tuple[Base, list[str], list[str]]:
    """Write the edit repo's commits back into the series dir; returns (base, written, deleted)."""
    repo = repo.absolute()
    if not repo.exists():
        raise UserError(f"{repo}: does not exist (give the directory `edit` made)")
    if not repo.is_dir():
        raise UserError(f"{repo}: is not a directory (give the directory `edit` made)")
    try:
        version = git(repo, "config", "moerelease.base").decode().strip()
    except UserError:
        raise UserError(f"{repo}: not an edit repo made by `moe_release.py edit`") from None
    base = load_pins(root / "patches" / "pins.toml").get(version)
    if git(repo, "status", "--porcelain", "--untracked-files=no").strip():
        raise UserError(f"{repo}: has uncommitted changes; commit them first")
    patches = format_patches(repo)
    for name, data in patches:
        missing = check_trailers(parse_patch(data, name))
        if missing:
            raise UserError(f"{name}: commit lacks trailer(s) {', '.join(missing)}")
    sdir = base.series_dir(root)
    try:
        sdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise os_error(exc, str(sdir)) from None
    series_file = sdir / "series"
    old_text = series_file.read_text() if series_file.exists() else ""
    old_names = parse_series(old_text, str(series_file)) if old_text else []
    header = (
        series_header(old_text) or f"# Patch series over megatron-core {base.version}, in order.\n"
    )
    new_series = header + "".join(f"{n}\n" for n, _ in patches)
    written, deleted = [], []
    staged: list[tuple[Path, bytes]] = []
    for name, data in patches:
        path = sdir / name
        if not path.exists() or path.read_bytes() != data:
            staged.append((path, data))
            written.append(name)
    if old_text != new_series:
        staged.append((series_file, new_series.encode()))
    # Stage everything first, then move into place: a failure leaves the old series intact.
    tmp_paths = []
    try:
        for path, data in staged:
            tmp_path = path.with_name(f".{path.name}.tmp")
            tmp_paths.append((tmp_path, path))
            tmp_path.write_bytes(data)
    except BaseException as exc:
        for tmp_path, _ in tmp_paths:
            tmp_path.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise os_error(exc, str(sdir)) from None
        raise
    for tmp_path, path in tmp_paths:
        os.replace(tmp_path, path)
    keep = {n for n, _ in patches}
    for name in old_names + [p.name for p in sdir.glob("*.patch")]:
        if name not in keep and (sdir / name).exists():
            (sdir / name).unlink()
            deleted.append(name)
    return base, written, deleted
