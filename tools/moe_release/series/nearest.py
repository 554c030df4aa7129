# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The Megatron-LM checkout ``apply`` works on, and the stored series nearest to a commit of it.

:class:`Checkout` reads the checkout's history (borrowing a mirror's objects for a shallow
clone); :func:`choose_series` picks, of the stored bases the checkout holds, the one whose files
the series change differ least from the commit's, then the one fewest commits apart, on the
commit's own line (``main``, ``dev`` or a release branch).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import subprocess
from pathlib import Path
from typing import Optional, Sequence

from moe_release.common import REPO_ROOT, UserError
from moe_release.series.git import git
from moe_release.series.merge import (
    Files,
)
from moe_release.series.patches import parse_patch
from moe_release.series.pins import Base, load_pins
from moe_release.series.repo import read_series

# The oldest series' line, core_r0.16.0 (0.16.1), forked from main on 2026-02-02 (f4502eb);
# a commit older than that is older than every series.
SERIES_START = datetime.date(2026, 2, 1)
# On ties between lines (a commit on two first-parent histories), the earlier kind wins.
LINE_ORDER = ("main", "release", "dev")


# ----------------------------------------------------------------------------- the checkout


@dataclasses.dataclass
class Checkout:
    """A Megatron-LM git repository the user named (a work tree or a bare repository)."""

    path: Path
    objects: Path  # its object directory, which the scratch repository borrows
    bare: bool
    names: tuple[Checkout, ...] = ()  # where names (branches, tags) are looked up instead

    def run(self, *args: str, input: Optional[bytes] = None) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
        env.update(GIT_CONFIG_NOSYSTEM="1", LC_ALL="C")
        return subprocess.run(
            ["git", "-C", str(self.path), *args], capture_output=True, input=input, env=env
        )

    def out(self, *args: str) -> str:
        done = self.run(*args)
        if done.returncode != 0:
            msg = done.stderr.decode(errors="replace").strip().splitlines()
            raise UserError(f"git {args[0]} failed in {self.path}: {msg[0] if msg else '?'}")
        return done.stdout.decode().strip()

    def has(self, rev: str) -> Optional[str]:
        """The commit ``rev`` names in the checkout (None: it has none)."""
        for where in self.names:
            commit = where.has(rev)
            if commit and self._has(commit):
                return commit
        return self._has(rev)

    def _has(self, rev: str) -> Optional[str]:
        done = self.run("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
        return done.stdout.decode().strip() if done.returncode == 0 else None

    def is_ancestor(self, a: str, b: str) -> bool:
        return self.run("merge-base", "--is-ancestor", a, b).returncode == 0

    def count(self, spec: str) -> int:
        return int(self.out("rev-list", "--count", spec))

    def first_parents(self, rev: str) -> set[str]:
        return set(self.out("rev-list", "--first-parent", rev).split())

    def describe(self, rev: str) -> str:
        """``abcdef123456 (2026-08-13, "subject")``."""
        text = self.out("log", "-1", "--format=%h%x00%cs%x00%s", "--abbrev=12", rev)
        short, date, subject = text.split("\0")
        return f'{short} ({date}, "{subject[:60]}")'

    def date(self, rev: str) -> datetime.date:
        return datetime.date.fromisoformat(self.out("log", "-1", "--format=%cs", rev))

    def files(self, rev: str, paths: Sequence[str]) -> Files:
        """The files at ``rev`` (None: absent)."""
        paths = sorted(set(paths))
        done = self.run(
            "cat-file", "--batch", input="".join(f"{rev}:{p}\n" for p in paths).encode()
        )
        if done.returncode != 0:
            raise UserError(f"{self.path}: git cat-file failed")
        out: Files = {}
        data, pos = done.stdout, 0
        for path in paths:
            end = data.index(b"\n", pos)
            head = data[pos:end].split()
            pos = end + 1
            if head[-1] == b"missing" or head[1] != b"blob":
                out[path] = None
                continue
            size = int(head[2])
            out[path] = data[pos : pos + size]
            pos += size + 1
        return out


def open_checkout(path: Path) -> Checkout:
    """The git repository at ``path``, refused (one line) if it is none."""
    if not path.is_dir():
        raise UserError(f"{path}: not a git checkout (no such directory)")
    probe = Checkout(path, Path(), False)
    done = probe.run("rev-parse", "--is-bare-repository", "--git-common-dir")
    if done.returncode != 0:
        raise UserError(f"{path}: not a git checkout")
    bare, common = done.stdout.decode().split("\n")[:2]
    common_dir = Path(common) if Path(common).is_absolute() else path / common
    if bare != "true":
        top = probe.run("rev-parse", "--show-toplevel").stdout.decode().strip()
        if Path(top).resolve() != path.resolve():
            raise UserError(f"{path}: not the top of a git checkout (that is {top})")
    return Checkout(path, (common_dir / "objects").resolve(), bare == "true")


def history(co: Checkout, mirror: Optional[Path], tmp: Path) -> Checkout:
    """Where the ancestry is read: the checkout or, where a Megatron-LM git mirror is
    configured (``--mirror``, ``$MOE_RELEASE_MEGATRON_LM``), a scratch repository that sees
    both object stores, and their branches and tags (the checkout's first), so that a checkout
    which has not fetched the stored bases since its pin still finds them."""
    if mirror is None or not mirror.is_dir():
        return co
    try:
        other = open_checkout(mirror)
    except UserError:
        return co  # an extracted archive: files for the bases, no history
    if other.objects == co.objects:
        return co
    path = tmp / "history.git"
    path.mkdir()
    git(path, "init", "--quiet", "--bare")
    (path / "objects" / "info" / "alternates").write_text(f"{co.objects}\n{other.objects}\n")
    return Checkout(path, path / "objects", True, (co, other))


def check_clean(co: Checkout) -> None:
    """Refuse a work tree with uncommitted changes to tracked files."""
    if co.bare:
        return
    done = co.run("status", "--porcelain", "--untracked-files=no")
    status = done.stdout.decode(errors="replace").splitlines()
    if status:
        raise UserError(f"{co.path}: work tree not clean ({len(status)} changed file(s), first: "
                        f"{status[0][3:]}); commit or stash them first")  # fmt: skip


def renames(co: Checkout, anchor: str, ref: str, paths: set[str]) -> dict[str, str]:
    """Files of the base at ``paths`` that REF has under another name (git's rename test)."""
    text = co.out("diff", "-M", "--diff-filter=R", "--name-status", "-z", anchor, ref)
    fields = text.split("\0")
    out = {}
    for i in range(0, len(fields) - 2, 3):
        if fields[i].startswith("R") and fields[i + 1] in paths:
            out[fields[i + 1]] = fields[i + 2]
    return out


# ----------------------------------------------------------------------------- the nearest series


@dataclasses.dataclass
class Choice:
    """The stored series nearest to REF, and why."""

    base: Base
    line: str  # the line REF is on: main, dev or a release branch
    anchor: str  # the commit in the checkout that stands for the base
    why: str
    candidates: list[str]  # the other stored bases, nearest first, with their distances
    missing: list[str]  # the stored bases the checkout has no commit for
    root: Path = REPO_ROOT
    order: tuple[str, ...] = ()  # every stored base's name, nearest first

    @property
    def series_dir(self) -> Path:
        return self.base.series_dir(self.root)


def _n(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _line_kind(base: Base) -> str:
    return base.branch if base.branch in ("main", "dev") else "release"


def anchors(co: Checkout, root: Path) -> tuple[list[tuple[Base, str, str]], list[str]]:
    """Per pinned base with a series: the commit standing for it in the checkout, and how;
    and the bases it has no commit for."""
    out, missing = [], []
    for base in load_pins(root / "patches" / "pins.toml").bases.values():
        if not (base.series_dir(root) / "series").exists():
            continue
        missing.append(base.name)
        if base.is_commit:
            commit = co.has(base.commit)
            if commit:
                out.append((base, commit, f"{base.branch} {base.commit[:12]}"))
                missing.pop()
            continue
        commit = co.has(f"refs/tags/{base.tag}")
        if commit:
            out.append((base, commit, f"tag {base.tag}"))
            missing.pop()
            continue
        if Path(base.series).name in (base.branch, "patches"):  # the branch's own series
            for ref in (f"refs/heads/{base.branch}", f"refs/remotes/origin/{base.branch}"):
                commit = co.has(ref)
                if commit:
                    out.append((base, commit, f"{ref} (tag {base.tag} not in the checkout)"))
                    missing.pop()
                    break
    return out, missing


def choose_series(
    co: Checkout, ref: str, root: Path = REPO_ROOT, series: Optional[str] = None
) -> Choice:
    """The stored series nearest to ``ref`` (or the pinned base named ``series``), and why.

    REF must be on a known line (main, dev, a release branch: see the module's docstring). Of
    the stored bases the checkout holds, the nearest is the one whose files the series change
    differ least from REF's (lines added and removed, ``git diff --numstat``), then the one
    fewest commits apart: commit counts alone would take main's base for a main commit two
    days after a release branch left main, or dev's for a dev commit from February, whose
    code is a release's."""
    if co.date(ref) < SERIES_START:
        raise UserError(f"{co.describe(ref)} is older than every series (the oldest line, "
                        f"core_r0.16.0, starts {SERIES_START}); use a newer commit")  # fmt: skip
    found, missing = anchors(co, root)
    if not found:
        raise UserError(f"{co.path}: holds none of the stored bases (main and dev commits, "
                        "release tags): git fetch origin --tags main dev")  # fmt: skip
    main = next((a for b, a, _ in found if b.branch == "main" and b.is_commit), None)
    ref_fp = co.first_parents(ref)
    apart: dict[str, tuple[int, int]] = {}  # pin -> (REF's commits not in it, its not in REF)
    on_line = []
    for base, anchor, _ in found:
        own, ahead = co.count(f"{anchor}..{ref}"), co.count(f"{ref}..{anchor}")
        apart[base.name] = (own, ahead)
        if own and ahead:
            continue  # REF left the line
        if own and anchor not in ref_fp:
            continue  # REF is newer, but reached the base through a merge, not along the line
        if not own and ref not in co.first_parents(anchor):
            continue  # the base holds REF only through a merge
        if _line_kind(base) != "main" and main is not None:
            if co.is_ancestor(ref, co.out("merge-base", anchor, main)):
                continue  # a main commit from before the line left main
        on_line.append((own + ahead, LINE_ORDER.index(_line_kind(base)), base, anchor, own))
    if not on_line:
        lines = ", ".join(sorted({b.branch for b, _, _ in found}))
        raise UserError(f"{co.describe(ref)} is on no known line (not on the first-parent "
                        f"history of {lines} from a stored base)")  # fmt: skip
    on_line.sort(key=lambda f: (f[0], f[1]))
    dist, _, lbase, lanchor, own = on_line[0]
    days = abs((co.date(lanchor) - co.date(ref)).days)
    when = "before" if own else "after"
    where = f"is {_n(dist, 'commit')} ({_n(days, 'day')}) {when} it" if dist else "is REF"
    line = f"REF is on {lbase.branch} ({lbase.branch} {lanchor[:12]} {where})"
    paths = sorted({
        fp.path for base, _, _ in found for n, d in read_series(base, root)
        for fp in parse_patch(d, n).files
    })  # fmt: skip
    ranked = []
    for base, anchor, how in found:
        stat = co.out("diff", "--numstat", anchor, ref, "--", *paths)
        lines = sum(
            int(f[0]) + int(f[1]) for f in (row.split() for row in stat.splitlines()) if f[0] != "-"
        )
        ranked.append((lines, sum(apart[base.name]), base, anchor, how))
    ranked.sort(key=lambda r: (r[0], r[1]))
    if series is not None:
        named = [r for r in ranked if r[2].name == series]
        if not named:
            known = ", ".join(r[2].name for r in ranked)
            raise UserError(f"--series {series}: not a stored base this checkout holds ({known})")
        ranked.remove(named[0])
        ranked.insert(0, named[0])
    lines, total, base, anchor, how = ranked[0]
    reason = "as --series says" if series is not None else "the nearest"
    why = (f"{line}; {base.name} ({how}) is {reason}: {lines} lines differ from REF in the "
           f"{len(paths)} files the series change, {_n(total, 'commit')} apart")  # fmt: skip
    if total:
        why += f" (merge-base {co.out('merge-base', ref, anchor)[:12]})"
    others = [f"{b.name} ({n} lines, {t} commits)" for n, t, b, *_ in ranked[1:]]
    order = tuple(r[2].name for r in ranked)
    return Choice(base, lbase.branch, anchor, why, others, missing, root, order)
