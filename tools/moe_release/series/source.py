# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Where a base's files come from: the pinned PyPI sdist, or a Megatron-LM commit read from a
checkout the user points at, verified by commit id and tree hash (never stored here).

A commit base's source is named by ``$MOE_RELEASE_MEGATRON_LM`` (every verb's ``--checkout``
sets it): a Megatron-LM git repository (a clone, a bare mirror, a ``git worktree``), which is
read at the pinned commit from its object store (the work tree is not looked at: a dirty or
other checked-out HEAD does not matter), or the output of ``git archive <commit>``, as a tar
file or extracted into a directory. A repository must hold the commit and its tree must be the
pinned one; an archive's files must hash (as git hashes a tree) to the pinned tree, and a tar
file's commit id (``git get-tar-commit-id``) must be the pinned commit. The pinned ``tree`` is
the commit's whole tree (``git rev-parse <commit>^{tree}``), so an archive is checked in full.

From the verified source a tree takes what megatron-core's sdist holds: ``megatron/core/``,
``megatron/training/`` and the packaging files at the top (``pyproject.toml``, ``README.md``, ...).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import stat
import subprocess
import tarfile
from pathlib import Path
from typing import Optional

from moe_release import settings
from moe_release.common import UserError, log
from moe_release.series.pins import Base, load_pins
from moe_release.series.sdist import fetch_sdist, read_sdist

CHECKOUT_ENV = settings.MEGATRON_LM
SDIST_DIRS = ("megatron/core/", "megatron/training/")
PACKAGE_INFO = "megatron/core/package_info.py"
SDIST_TOP_FILES = ("pyproject.toml", "README.md", "MANIFEST.in", "setup.py", "LICENSE")

_CACHE: dict[tuple[str, str], dict[str, bytes]] = {}

Entries = dict[str, tuple[str, bytes]]  # path -> (git mode, bytes)


def configured_checkout() -> Optional[Path]:
    """The Megatron-LM source named by ``$MOE_RELEASE_MEGATRON_LM`` (None: not configured)."""
    value = (settings.megatron_lm() or "").strip()
    return Path(value) if value else None


def not_configured(base: Base) -> str:
    """Why a commit base is not available, in one line."""
    return (
        f"{base.name} is Megatron-LM {base.branch} {base.commit[:12]}: set {CHECKOUT_ENV} to a "
        f"Megatron-LM clone holding it, or to `git archive {base.commit[:12]}` (tar or extracted)"
    )


def available(base: Base) -> bool:
    """Whether the base's files can be read here: an sdist base always (it is downloaded), a
    commit base when a source is configured."""
    return not base.is_commit or configured_checkout() is not None


def read_base_files(base: Base, checkout: Optional[Path] = None) -> dict[str, bytes]:
    """The base's files (sdist layout, top directory stripped), verified."""
    if not base.is_commit:
        return read_sdist(fetch_sdist(base))
    source = checkout or configured_checkout()
    if source is None:
        raise UserError(f"base {not_configured(base)} (or give --checkout PATH)")
    key = (base.name, str(source.absolute()))
    if key not in _CACHE:
        _CACHE[key] = read_commit(base, source)
    files = _CACHE[key]
    found = package_version(files.get(PACKAGE_INFO, b""))
    if found != base.version:
        raise UserError(
            f"base {base.name}: pinned version {base.version}, but {PACKAGE_INFO} at "
            f"{base.commit[:12]} says {found or 'nothing'} (fix `version` in pins.toml)"
        )
    return files


def package_version(text: bytes) -> str:
    """The version megatron/core/package_info.py spells (MAJOR.MINOR.PATCH + PRE_RELEASE)."""
    parts = {}
    for key in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE"):
        match = re.search(rb"^%s = ['\"]?([^'\"\n]*)['\"]?\s*$" % key.encode(), text, re.M)
        if not match:
            return ""
        parts[key] = match.group(1).decode().strip()
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}{parts['PRE_RELEASE']}"


def wanted(path: str) -> bool:
    """Whether a path of the Megatron-LM tree belongs in megatron-core's sdist layout."""
    return path.startswith(SDIST_DIRS) or path in SDIST_TOP_FILES


def read_commit(base: Base, source: Path) -> dict[str, bytes]:
    """The sdist-layout files of a commit base from ``source``; refuses (one line naming the
    pin, what was expected and what was found) a source that is not that commit."""
    if not source.exists():
        raise UserError(f"base {base.name}: {source}: Megatron-LM source does not exist")
    if source.is_file():
        entries, commit_id = _read_tar(base, source)
        if commit_id is not None and commit_id != base.commit:
            raise _mismatch(base, source, f"commit {commit_id}")
        return _verified(base, source, entries)
    if not source.is_dir():
        raise UserError(f"base {base.name}: {source}: not a directory, a git repository or a tar")
    if _is_git_repo(source):
        return _read_git(base, source)
    return _verified(base, source, _read_dir(source))


def _mismatch(base: Base, source: Path, found: str) -> UserError:
    return UserError(
        f"base {base.name}: {source} is not the pinned Megatron-LM commit: expected commit "
        f"{base.commit} (tree {base.tree}), found {found}"
    )


def _verified(base: Base, source: Path, entries: Entries) -> dict[str, bytes]:
    found = git_tree_hash(entries)
    if found != base.tree:
        raise _mismatch(base, source, f"tree {found}")
    return {p: data for p, (mode, data) in entries.items() if wanted(p) and mode != "120000"}


# ----------------------------------------------------------------------------- git trees


def blob_id(data: bytes) -> bytes:
    """A blob's git object id (binary sha1)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).digest()


def git_tree_hash(entries: Entries) -> str:
    """The git tree id of files {path: (mode, bytes)}, as ``git write-tree`` computes it (modes
    100644, 100755 or 120000 for a symbolic link, whose bytes are its target)."""
    root: dict = {}
    for path, entry in entries.items():
        node = root
        *dirs, leaf = path.split("/")
        for part in dirs:
            node = node.setdefault(part, {})
        node[leaf] = entry

    def write(node: dict) -> bytes:
        items = []
        for name, child in node.items():
            if isinstance(child, dict):
                items.append(((name + "/").encode(), b"40000", name, write(child)))
            else:
                items.append((name.encode(), child[0].encode(), name, blob_id(child[1])))
        items.sort(key=lambda item: item[0])
        body = b"".join(mode + b" " + name.encode() + b"\0" + sha for _, mode, name, sha in items)
        return hashlib.sha1(b"tree %d\0" % len(body) + body).digest()

    return write(root).hex()


def _read_dir(root: Path) -> Entries:
    entries: Entries = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir == ".":
            dirnames[:] = [d for d in dirnames if d != ".git"]
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                if name in dirnames:
                    dirnames.remove(name)
                entries[rel.replace(os.sep, "/")] = ("120000", os.readlink(path).encode())
            elif stat.S_ISREG(st.st_mode):
                mode = "100755" if st.st_mode & stat.S_IXUSR else "100644"
                entries[rel.replace(os.sep, "/")] = (mode, path.read_bytes())
    return entries


def _read_tar(base: Base, path: Path) -> tuple[Entries, Optional[str]]:
    try:
        tar = tarfile.open(path)
    except (tarfile.TarError, OSError):
        raise UserError(
            f"base {base.name}: {path}: not a tar archive (nor a directory or git repository)"
        ) from None
    entries: Entries = {}
    with tar:
        comment = tar.pax_headers.get("comment")
        for member in tar.getmembers():
            name = member.name[2:] if member.name.startswith("./") else member.name
            if member.issym():
                entries[name] = ("120000", member.linkname.encode())
            elif member.isfile():
                f = tar.extractfile(member)
                assert f is not None
                entries[name] = ("100755" if member.mode & 0o100 else "100644", f.read())
    tops = {p.split("/", 1)[0] for p in entries}
    if len(tops) == 1 and all("/" in p for p in entries):  # git archive --prefix=DIR/
        (top,) = tops
        entries = {p[len(top) + 1 :]: e for p, e in entries.items()}
    commit = comment.strip() if comment and len(comment.strip()) == 40 else None
    return entries, commit


def _git(source: Path, *args: str, input: Optional[bytes] = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_CONFIG_NOSYSTEM="1", LC_ALL="C")
    return subprocess.run(
        ["git", "-C", str(source), *args], capture_output=True, input=input, env=env
    )


def _is_git_repo(source: Path) -> bool:
    if (source / ".git").exists():
        return True
    if (source / "HEAD").is_file() and (source / "objects").is_dir():  # a bare repository
        return _git(source, "rev-parse", "--is-bare-repository").stdout.strip() == b"true"
    return False


def _read_git(base: Base, source: Path) -> dict[str, bytes]:
    done = _git(source, "rev-parse", "--verify", "--quiet", f"{base.commit}^{{commit}}")
    if done.returncode != 0:
        head = _git(source, "rev-parse", "--verify", "--quiet", "HEAD").stdout.decode().strip()
        found = f"no such commit (HEAD is {head or 'unset'}; git fetch origin {base.commit})"
        raise _mismatch(base, source, found)
    tree = _git(source, "rev-parse", f"{base.commit}^{{tree}}").stdout.decode().strip()
    if tree != base.tree:
        raise _mismatch(base, source, f"tree {tree}")
    listing = _git(source, "ls-tree", "-r", "-z", "--full-tree", base.commit)
    if listing.returncode != 0:
        raise UserError(f"base {base.name}: {source}: git ls-tree failed: "
                        f"{listing.stderr.decode(errors='replace').strip()[:200]}")  # fmt: skip
    paths = []
    for record in listing.stdout.split(b"\0"):
        if not record:
            continue
        meta, _, path = record.partition(b"\t")
        mode, kind, _ = meta.split(b" ")
        name = path.decode()
        if kind == b"blob" and mode != b"120000" and wanted(name):
            paths.append(name)
    spec = "".join(f"{base.commit}:{p}\n" for p in paths).encode()
    done = _git(source, "cat-file", "--batch", input=spec)
    if done.returncode != 0:
        raise UserError(f"base {base.name}: {source}: git cat-file failed")
    files: dict[str, bytes] = {}
    data, pos = done.stdout, 0
    for path in paths:
        end = data.index(b"\n", pos)
        size = int(data[pos:end].split()[2])
        pos = end + 1
        files[path] = data[pos : pos + size]
        pos += size + 1
    return files


def add_base_options(parser: argparse.ArgumentParser) -> None:
    """The options of every verb that reads a base: ``--base`` and ``--checkout`` (which the
    command's ``main`` puts in ``$MOE_RELEASE_MEGATRON_LM``)."""
    parser.add_argument("--base", help="base from patches/pins.toml (default: primary)")
    parser.add_argument(
        "--checkout",
        dest="megatron_lm",
        metavar="PATH",
        help="Megatron-LM clone or `git archive` (tar or extracted) of a commit base "
        f"(default: ${CHECKOUT_ENV})",
    )


BASES_ENV = settings.BASES


def listed_bases() -> list[str]:
    """What `trees --list` prints (and `run-tests` loops over): the primary base first, then
    every base with a series whose files can be read here, in pins.toml order; a base pinned
    with ``ci = false`` only when ``$MOE_RELEASE_BASES`` asks for it. ``$MOE_RELEASE_BASES``
    (names, space- or comma-separated, or ``all``) replaces the default selection."""
    pins = load_pins()
    chosen = settings.bases()
    for name in chosen:
        if name != "all":
            pins.get(name)  # an unknown name is an error, not an empty loop
    out = [pins.primary]
    for name, base in pins.bases.items():
        if name == pins.primary or not (base.series_dir() / "series").exists():
            continue
        if chosen and "all" not in chosen and name not in chosen:
            continue
        if not chosen and not base.ci:
            log(f"skipping {name}: ci = false in patches/pins.toml ({BASES_ENV}={name} runs it)")
            continue
        if not available(base):
            log(f"skipping {name}: {not_configured(base)}")
            continue
        out.append(name)
    return out
