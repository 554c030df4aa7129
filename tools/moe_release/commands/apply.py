# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""`apply`: carry the nearest stored series onto a Megatron-LM git checkout at any commit.

Most users pin a Megatron-LM commit, not a release. ``apply CHECKOUT [--ref REF]`` finds the
stored series nearest to REF. REF must be on a known line: ``main``, ``dev`` or a release
branch ``core_r*`` (REF on the first-parent history of the line's stored base, or the base on
REF's; a release branch's commits from before its fork from main are main's), and not older
than every series. Of the stored bases the checkout holds (a commit base such as
``main-d98e8a6``, or a release whose tag it has), the nearest is the one whose files the
series change differ least from REF's, then the one fewest commits apart; ``--series PIN``
names another. Each patch of that series is then merged onto REF, file by file,
as ``port`` merges (``git merge-file``: base = the stored base's file before the patch,
theirs = after it, ours = REF's file with the earlier patches applied); a file the checkout
has under another name (a rename between the base and REF) is merged where REF has it. Per
patch the result is

- ``applied``: the merge is clean;
- ``applied, resolution replayed``: a person's resolution for this commit, stored as
  ``<series dir>/apply/<commit12>/<patch stem>.diff`` (port's resolution format: the diff
  from the mechanical merge, conflict markers included, to the resolved files), is replayed;
  ``--record RESOLVED`` stores them from a commit on REF with one commit per patch to apply.
  One record serves an era: where the merge conflicts and REF has no resolution of its own,
  the one recorded for the patch at the nearest commit REF descends from (of the same series)
  is replayed, if it resolves every conflict; a merge that is clean is never changed by
  another commit's record, and ``--record`` stores only what differs from that replay;
- ``landed``: REF already holds the change (``landed``'s test over the whole series);
- ``not applicable``: no file it changes exists at REF (where it went is the evidence);
- ``conflict``: file, line, the patch's hunk, both sides and where a resolution would go.

The commits are built in a scratch repository that borrows the checkout's objects; only when
every patch is applied or landed is a new branch fetched into the checkout (its HEAD, index
and work tree are never touched), or, with ``--out``, ``git format-patch --full-index`` files
written whose ``index`` lines name REF's blobs, so ``git am -3`` can fall back to a 3-way merge.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Optional

from moe_release import settings
from moe_release.commands.registry import Command, register
from moe_release.common import REPO_ROOT, UserError, log
from moe_release.series.applying import (
    APPLIED,
    CONFLICT,
    NOT_APPLICABLE,
    REPLAYED,
    VERDICTS,
    Outcome,
    Records,
    Step,
    first_whole,
    merge_right,
    merge_series,
    replay,
    replay_other,
    whole,
)
from moe_release.series.checkout import (
    APPLY_DIR,
    LABEL_SUBJECT,
    LOG_FORMAT,
    is_series_commit,
    label_files,
    series_subjects,
)
from moe_release.series.git import COMMITTER_IDENT, FORMAT_PATCH_FLAGS, git, git_env
from moe_release.series.hunkstate import files_series_states
from moe_release.series.imports import isort_style
from moe_release.series.merge import (
    MARK_OURS,
    MARK_THEIRS,
    Files,
    Resolution,
    file_diff,
    merge_for_person,
    merge_patch,
    parse_diff,
    series_states,
)
from moe_release.series.nearest import (
    Checkout,
    Choice,
    check_clean,
    choose_series,
    history,
    open_checkout,
    renames,
)
from moe_release.series.patches import Patch, parse_patch, patch_author, patch_stem
from moe_release.series.pins import Base, load_pins
from moe_release.series.probes import PATHS as PROBE_PATHS
from moe_release.series.probes import failures as probe_failures
from moe_release.series.probes import releases_line
from moe_release.series.repo import read_series
from moe_release.series.source import read_base_files
from moe_release.series.topics import load_topics
from moe_release.series.trees import PACKAGE_INFO, atomic_directory, check_target_dir, os_error

BRANCH_PREFIX = "moe-release/"
PYPROJECT = "pyproject.toml"  # where REF keeps its isort settings


# ----------------------------------------------------------------------------- the merge


@dataclasses.dataclass
class ApplyResult:
    ref: str
    choice: Choice
    outcomes: list[Outcome]
    commit: Optional[str]  # the last commit built in the scratch repository (None: none)
    ok: bool
    version: Optional[str] = None  # the label commit's megatron-core version (None: none)
    releases: str = ""  # what the result releases and leaves unreleased (probes.releases_line)


def resolution_path(choice: Choice, ref: str, patch_name: str) -> Path:
    """Where a person's resolution of ``patch_name`` at commit ``ref`` is stored."""
    return choice.series_dir / APPLY_DIR / ref[:12] / f"{patch_stem(patch_name)}.diff"


def _evidence(co: Checkout, ref: str, anchor: str, path: str) -> str:
    """Why ``path`` is absent at REF: the commit that removed it, or the one that added it."""
    gone = co.out("log", "-1", "--format=%h %cs %s", "--abbrev=12", ref, "--", path)
    if gone:
        return f"{path}: removed at REF by {gone[:90]}"
    added = co.out("log", "-1", "--diff-filter=A", "--format=%h %cs %s", "--abbrev=12",
                   anchor, "--", path)  # fmt: skip
    if added:
        return f"{path}: not at REF; added later by {added[:90]}"
    return f"{path}: not at REF"


class _Scratch:
    """A scratch repository borrowing the checkout's objects, where the commits are built."""

    def __init__(self, path: Path, co: Checkout):
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        git(path, "init", "--quiet", "--bare")
        (path / "objects" / "info" / "alternates").write_text(f"{co.objects}\n")
        self.env = git_env({"GIT_INDEX_FILE": str(path / "apply-index")})

    def commit(self, parent: str, files: dict[str, Optional[bytes]], patch: Patch) -> str:
        git(self.path, "read-tree", parent, env=self.env)
        entries = []
        for path, data in sorted(files.items()):
            if data is None:
                entries.append(f"0 {'0' * 40}\t{path}\n")
                continue
            blob = git(self.path, "hash-object", "-w", "--stdin", input=data).decode().strip()
            mode = self._mode(parent, path)
            entries.append(f"{mode} {blob}\t{path}\n")
        git(self.path, "update-index", "--index-info", env=self.env,
            input="".join(entries).encode())  # fmt: skip
        tree = git(self.path, "write-tree", env=self.env).decode().strip()
        name, email, date = patch_author(patch)
        env = git_env(dict(GIT_AUTHOR_NAME=name, GIT_AUTHOR_EMAIL=email, GIT_AUTHOR_DATE=date,
                           GIT_COMMITTER_DATE=date))  # fmt: skip
        msg = patch.subject + "\n\n" + patch.message.strip("\n") + "\n"
        return (
            git(self.path, "commit-tree", tree, "-p", parent, "-F", "-", env=env,
                input=msg.encode()).decode().strip()
        )  # fmt: skip

    def _mode(self, rev: str, path: str) -> str:
        done = subprocess.run(["git", "-C", str(self.path), "ls-tree", rev, "--", path],
                              capture_output=True, env=git_env())  # fmt: skip
        line = done.stdout.decode().split()
        return line[0] if line else "100644"


@dataclasses.dataclass
class _Prepared:
    """What a merge onto REF starts from."""

    choice: Choice
    states: list[tuple[Patch, Files, Files]]  # per patch: it, its files before and after
    records: Records  # REF's resolutions and those recorded at other commits
    at_ref: Files  # REF's files, by their path at the base
    moved: dict[str, str]  # base path -> REF's path, for files renamed since the base
    style: Optional[Callable[[str], str]] = None  # REF's isort, for import blocks


def _prepare(
    co: Checkout,
    ref: str,
    mirror: Optional[Path],
    root: Path,
    series_name: Optional[str],
    announce: bool = True,
) -> _Prepared:
    choice = choose_series(co, ref, root, series_name)
    base = choice.base
    if announce:
        log(f"{co.describe(ref)}: series {base.series}")
    source = co.path if base.is_commit and co.has(base.commit) else mirror
    states = series_states(read_base_files(base, source), read_series(base, root))
    adir = choice.series_dir / APPLY_DIR / ref[:12]
    stems = {patch_stem(p.name) for p, _, _ in states}
    stored = _read_resolutions(adir, stems, base.series)
    eras = []
    for rdir in sorted(adir.parent.iterdir()) if adir.parent.is_dir() else []:
        if not rdir.is_dir() or rdir == adir:
            continue
        records = {p.name: p.read_bytes() for p in sorted(rdir.glob("*.diff"))
                   if p.name[: -len(".diff")] in stems}  # fmt: skip
        if records:
            eras.append((*_record_distance(co, rdir.name, ref), rdir.name, records))
    eras.sort(key=lambda e: e[:3])
    paths = {fp.path for p, _, _ in states for fp in p.files}
    for n, d in [*stored.items(), *(i for *_, r in eras for i in r.items())]:
        paths |= {fp.path for fp in parse_diff(Resolution.parse(d).diff, n)}
    at_ref = co.files(ref, sorted(paths | {PYPROJECT}))
    style = isort_style(at_ref.pop(PYPROJECT))
    moved = renames(co, choice.anchor, ref, {p for p in paths if at_ref.get(p) is None})
    records = Records(stored, [(c12, r) for *_, c12, r in eras])
    return _Prepared(choice, states, records, _by_base_path(co, ref, paths, moved), moved,
                     style)  # fmt: skip


def _record_distance(co: Checkout, c12: str, ref: str) -> tuple[int, int]:
    """How near the commit a record was made at is to REF, for trying records in order: (0,
    commits) for one REF descends from, (1, commits) for a later one, (2, 0) for one the
    checkout does not have. A record serves any commit whose merge has the same conflict;
    the commit is its provenance."""
    commit = co.has(c12)
    if commit is None:
        return 2, 0
    if co.is_ancestor(commit, ref):
        return 0, co.count(f"{commit}..{ref}")
    return 1, co.count(f"{ref}..{commit}")


def _read_resolutions(rdir: Path, stems: set[str], series: str) -> dict[str, bytes]:
    """The resolutions stored in ``rdir`` (file name -> bytes); one for no patch of the
    series is refused."""
    stored = {p.name: p.read_bytes() for p in sorted(rdir.glob("*.diff"))} if rdir.is_dir() else {}
    stale = [n for n in stored if n[: -len(".diff")] not in stems]
    if stale:
        raise UserError(f"{rdir / stale[0]}: a resolution for no patch of {series}")
    return stored


def _by_base_path(co: Checkout, rev: str, paths: set[str], moved: dict[str, str]) -> Files:
    """The files at ``rev``, a renamed one under its path at the base."""
    files = co.files(rev, sorted(paths | set(moved.values())))
    for old, new in moved.items():
        files[old] = files.pop(new)
    return files


def probe_failure(steps: list[Step]) -> str:
    """The first probe the whole series' result fails ("" if none)."""
    return next((s.outcome.probe for s in steps if s.outcome.probe), "")


def _merge_nearest_right(
    co: Checkout, ref: str, mirror: Optional[Path], root: Path, series_name: Optional[str]
) -> tuple[_Prepared, list[Step]]:
    """The nearest series merged onto ``ref`` (applying.merge_right: a probe's patch, a
    release of a backend or path REF has included, borrowed from the next nearest series that
    has it, where that makes the result whole and right); if that still conflicts or fails a
    probe and no --series names the series, the next nearest series that merges whole and
    right and carries every patch of the nearest (applying.first_whole), so merged; a person
    is asked only where none does, with the nearest."""
    probe_files = co.files(ref, list(PROBE_PATHS))
    primary = list(load_topics(root).of_patch)
    own: dict[str, list] = {}  # each series' own states (merge_right replaces prep.states)

    def prepare(name: Optional[str]) -> _Prepared:
        prep = _prepare(co, ref, mirror, root, name, announce=not own)
        own.setdefault(prep.choice.base.name, list(prep.states))
        return prep

    def merged(prep: _Prepared) -> list[Step]:
        where = str(prep.choice.series_dir / APPLY_DIR)
        merge = lambda st: merge_series(  # noqa: E731
            st, prep.at_ref, prep.records, prep.style, where, probe_files
        )
        steps = merge(prep.states)
        if not probe_failure(steps):
            return steps
        others = []
        for name in prep.choice.order:
            if name == prep.choice.base.name:
                continue
            try:
                others.append((name, own[name] if name in own else prepare(name).states))
            except UserError:
                continue
        prep.states, steps = merge_right(prep.states, others, merge, primary)
        return steps

    first = prepare(series_name)
    steps = merged(first)
    if series_name is not None or whole(steps):
        return first, steps
    found: dict[str, _Prepared] = {}

    def candidates():
        for name in first.choice.order[1:]:
            try:
                found[name] = prepare(name)
            except UserError:
                continue
            yield name, lambda prep=found[name]: _merged_states(prep, merged)

    taken = first_whole(own[first.choice.base.name], candidates())
    if taken is None:
        return first, steps
    name, _, alt = taken
    failed = probe_failure(steps)
    why = (f"merges cleanly, but leaves {failed}" if failed else
           f"conflicts in {_first_conflict(steps)}")  # fmt: skip
    prep = found[name]
    prep.choice.why = (
        f"{name} is the nearest whose merge is whole, carries every patch of the nearest and "
        f"releases every backend and path REF has; the nearest, {first.choice.base.name}, "
        f"{why} (its choice: {first.choice.why})"
    )
    return prep, alt


def _merged_states(
    prep: _Prepared, merged: Callable[[_Prepared], list[Step]]
) -> tuple[list, list[Step]]:
    steps = merged(prep)  # may replace prep.states (a patch borrowed)
    return prep.states, steps


def _first_conflict(steps: list[Step]) -> str:
    out = next(s.outcome for s in steps if s.outcome.verdict == CONFLICT)
    return f"{out.patch} ({out.conflicts[0].path})" if out.conflicts else out.patch


def apply_series(
    co: Checkout,
    ref: str,
    scratch: Path,
    mirror: Optional[Path] = None,
    root: Path = REPO_ROOT,
    series_name: Optional[str] = None,
    label: bool = True,
) -> ApplyResult:
    """Merge the nearest series onto ``ref``, building one commit per applied patch in a
    scratch repository at ``scratch`` (an empty directory); the checkout is only read. With
    ``label``, a last commit makes ``pip install`` build ``<version>+moerelease...``
    (checkout.label_files)."""
    prep, steps = _merge_nearest_right(co, ref, mirror, root, series_name)
    choice, moved = prep.choice, prep.moved
    outcomes = [s.outcome for s in steps]
    repo = _Scratch(scratch, co)
    head = ref
    replayed: dict[str, bytes] = {}  # the resolutions replayed (Outcome.replayed -> bytes)
    for (patch, _, _), step in zip(prep.states, steps, strict=True):
        out = step.outcome
        out.resolution = resolution_path(choice, ref, patch.name)
        if out.replayed:
            replayed[out.replayed] = prep.records.data(out.replayed)
        if out.verdict == NOT_APPLICABLE:
            modified = [fp.path for fp in patch.files if not fp.new_file]
            out.note = "; ".join(_evidence(co, ref, choice.anchor, p) for p in modified)
        if not step.changed:
            continue
        head = repo.commit(head, {moved.get(p, p): d for p, d in step.changed.items()}, patch)
        if moved.keys() & step.changed.keys():
            renamed = ", ".join(f"{p} merged as {moved[p]}" for p in moved if p in step.changed)
            out.note = f"{out.note}; {renamed}" if out.note else renamed
    ok = all(o.verdict != CONFLICT for o in outcomes)
    final = co.files(ref, list(PROBE_PATHS))
    for step in steps:
        final.update({p: d for p, d in step.changed.items() if p in final})
    version = None
    if ok and head != ref and label:
        head, version = _label_commit(repo, ref, head, choice.base, outcomes, replayed, root)
    if ok and head != ref:
        git(scratch, "update-ref", "refs/heads/apply", head)
    return ApplyResult(ref, choice, outcomes, head if head != ref else None, ok, version,
                       releases_line(final) if ok else "")  # fmt: skip


def _label_commit(
    repo: _Scratch,
    ref: str,
    head: str,
    base: Base,
    outcomes: list[Outcome],
    replayed: dict[str, bytes],
    root: Path,
) -> tuple[str, str]:
    """The label commit on ``head`` (checkout.label_files), dated as the last patch."""
    applied = [o.patch for o in outcomes if o.verdict in (APPLIED, REPLAYED)]
    changed = git(repo.path, "diff", "--name-only", "--no-renames", ref, head).decode().split()
    scratch = Checkout(repo.path, repo.path / "objects", True)
    version, files = label_files(ref, head, base, applied, scratch.files, changed, replayed, root)
    date = git(repo.path, "log", "-1", "--format=%aI", head).decode().strip()
    git(repo.path, "read-tree", head, env=repo.env)
    entries = []
    for path, data in sorted(files.items()):
        blob = git(repo.path, "hash-object", "-w", "--stdin", input=data).decode().strip()
        entries.append(f"{repo._mode(head, path)} {blob}\t{path}\n")
    git(repo.path, "update-index", "--add", "--index-info", env=repo.env,
        input="".join(entries).encode())  # fmt: skip
    tree = git(repo.path, "write-tree", env=repo.env).decode().strip()
    msg = (
        f"{LABEL_SUBJECT}{version}\n\n`pip install` of this checkout builds megatron-core "
        f"{version}: the series of\n{base.name} ({len(applied)} commits below) applied on "
        f"{ref[:12]} by moe-release's `apply`.\nThis commit stamps {PACKAGE_INFO}, adds "
        "moe-release's new modules and the\nmanifest `moe_release.py verify` reads.\n"
    )
    env = git_env(dict(GIT_AUTHOR_NAME=COMMITTER_IDENT[0], GIT_AUTHOR_EMAIL=COMMITTER_IDENT[1],
                       GIT_AUTHOR_DATE=date, GIT_COMMITTER_DATE=date))  # fmt: skip
    commit = git(repo.path, "commit-tree", tree, "-p", head, "-F", "-", env=env,
                 input=msg.encode()).decode().strip()  # fmt: skip
    return commit, version


def record_resolutions(
    co: Checkout,
    ref: str,
    resolved: str,
    mirror: Optional[Path] = None,
    root: Path = REPO_ROOT,
    series_name: Optional[str] = None,
) -> tuple[Choice, list[str]]:
    """Store what a person did at ``ref``: ``resolved`` is a commit on it whose first-parent
    commits since ``ref`` are the patches to apply there (the landed and not applicable ones
    left out), in order, found by their trailer (checkout.is_series_commit), and any fixes of
    the person's own (commits without it, e.g. what a probe asked for). Per patch, the
    difference from the mechanical merge (conflict markers included) to that commit's files,
    with the fixes it needs folded in, is stored as its resolution, unless the record of an
    earlier commit REF descends from gives those files (then nothing is: apply replays that
    one), and an old one with nothing left to store deleted. A fix is folded into the last
    patch before it that changes one of its files, or else recorded beside the last patch
    before it (files no patch changes). Returns the files written and deleted, and where each
    fix went, in words."""
    if not co.is_ancestor(ref, resolved):
        raise UserError(f"--record {resolved}: not a descendant of REF {ref[:12]}")
    prep = _prepare(co, ref, mirror, root, series_name)
    choice, moved = prep.choice, prep.moved
    commits, fixes = _series_and_fixes(co, ref, resolved, root)
    base_path = {new: old for old, new in moved.items()}  # a fix's files are REF's paths
    # A file the person changed that no patch of the series touches (a fix the series has no
    # patch for at REF) is stored too; apply then reads it from the stored diff.
    touched = set(co.out("diff", "--name-only", "--no-renames", ref, resolved).split())
    extra = sorted(touched - set(prep.at_ref) - set(moved.values()))
    if extra:
        prep.at_ref.update(co.files(ref, extra))
    paths = set(prep.at_ref)
    landed = files_series_states(prep.at_ref, [p for p, _, _ in prep.states])
    ours, k = dict(prep.at_ref), 0
    changes: dict[Path, Optional[bytes]] = {}
    for (patch, before, after), state in zip(prep.states, landed, strict=True):
        path = resolution_path(choice, ref, patch.name)
        changes[path] = None
        if state.verdict == "landed":
            continue
        merged, conflicts = merge_patch(ours, before, after, patch)
        modified = [fp.path for fp in patch.files if not fp.new_file]
        if conflicts and modified and all(ours.get(p) is None for p in modified):
            continue  # not applicable
        if k == len(commits):
            raise UserError(f"--record {resolved}: {len(commits)} series commit(s) on REF, but "
                            f"{patch.name} and maybe more are still to apply")  # fmt: skip
        done = _by_base_path(co, commits[k], paths, moved)
        done.update({base_path.get(p, p): d for p, d in fixes.folded.get(k, {}).items()})
        for i in fixes.named.get(k, []):
            fixes.patch[i] = patch.name
        k += 1
        result: Files = dict(ours)
        result.update(merged)
        where = str(choice.series_dir / APPLY_DIR)
        other = None
        if conflicts:
            other = replay_other(prep.records, path.name, result, conflicts, where)
        if other is None and conflicts:
            settled_merge, left = merge_patch(ours, before, after, patch, True, prep.style)
            other = None if left else ("", {**ours, **settled_merge})
        if other is not None and all(other[1].get(p) == done.get(p) for p in paths):
            ours = done  # another commit's record, or the import merge, does it: store nothing
            continue
        diff = b"".join(
            file_diff(p, result.get(p), done.get(p))
            for p in sorted(paths) if result.get(p) != done.get(p)
        )  # fmt: skip
        absent = sorted({c.path for c in conflicts if c.absent})
        if diff or absent:
            head = (f"# Resolution of {patch.name} at {ref}, replayed by `moe_release.py apply`:\n"
                    "# the change from the 3-way merge of the series' patch onto that commit\n"
                    f"# (conflict markers '{MARK_OURS.decode()}' / '{MARK_THEIRS.decode()}') to "
                    "what it carries there. Recorded by `apply --record`.\n")  # fmt: skip
            head += "".join(f"# absent: {p}\n" for p in absent)  # as Resolution.parse reads
            changes[path] = head.encode() + diff
        ours = done
    if k != len(commits):
        raise UserError(f"--record {resolved}: {len(commits)} series commit(s) on REF, but only "
                        f"{k} patch(es) to apply there")  # fmt: skip
    words = _write_changes(changes, choice.root)
    return choice, words + [fixes.describe(i) for i in range(len(fixes.commits))]


@dataclasses.dataclass
class _Fixes:
    """A person's own commits on a resolved branch, and the series commit each is folded into."""

    commits: list[tuple[str, str, list[str], bool]]  # (commit, subject, its files, folded)
    folded: dict[int, Files] = dataclasses.field(default_factory=dict)  # series index -> files
    named: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # series i -> fixes
    patch: dict[int, str] = dataclasses.field(default_factory=dict)  # fix -> the patch

    def describe(self, i: int) -> str:
        commit, subject, files, folded = self.commits[i]
        patch = self.patch.get(i, "?")
        what = f"{commit[:12]} (\"{subject[:60]}\")"
        if folded:
            return f"folded: {what} into the resolution of {patch}, which changes its files"
        return (f"recorded beside: {what} with the resolution of {patch} (it changes "
                f"{', '.join(files)}, which no patch changes)")  # fmt: skip


def _series_and_fixes(co: Checkout, ref: str, resolved: str, root: Path) -> tuple[list, _Fixes]:
    """The series commits on ``resolved`` since ``ref`` (oldest first; the label left out) and
    the person's fixes among them (commits without the series' trailer, where some have it),
    each folded into the last series commit before it that changes one of its files (else the
    last before it): its files, at the fix, override that series commit's and those up to the
    fix (the later ones descend from it)."""
    text = co.out("log", "--reverse", "--first-parent", f"--format={LOG_FORMAT}",
                  f"{ref}..{resolved}")  # fmt: skip
    subjects = series_subjects(root)
    rows = [(row.split("\0") + ["", ""])[:3] for row in text.splitlines()]
    rows = [r for r in rows if not r[1].startswith(LABEL_SUBJECT)]
    # A branch none of whose commits is marked as the series' (a resolution made with plain
    # git and messages of one's own) is read as one commit per patch, in order.
    plain = not any(is_series_commit(subject, origin, subjects) for _, subject, origin in rows)
    series: list[str] = []
    fixes = _Fixes([])
    for commit, subject, origin in rows:
        if plain or is_series_commit(subject, origin, subjects):
            series.append(commit)
            continue
        files = co.out("diff-tree", "--no-commit-id", "--name-only", "-r", "--no-renames",
                       f"{commit}^", commit).split()  # fmt: skip
        if not series:
            raise UserError(f"--record {resolved}: {commit[:12]} (\"{subject[:60]}\") is not a "
                            "series commit and comes before every patch: commit fixes after "
                            "the patch they complete")  # fmt: skip
        target = len(series) - 1
        for j in range(len(series) - 1, -1, -1):
            changed = set(co.out("diff-tree", "--no-commit-id", "--name-only", "-r",
                                 "--no-renames", f"{series[j]}^", series[j]).split())  # fmt: skip
            if changed & set(files):
                target = j
                break
        else:
            j = -1
        at_fix = co.files(commit, files)
        for k in range(target, len(series)):
            fixes.folded.setdefault(k, {}).update(at_fix)
        fixes.named.setdefault(target, []).append(len(fixes.commits))
        fixes.commits.append((commit, subject, files, j >= 0))
    return series, fixes


def _write_changes(changes: dict[Path, Optional[bytes]], root: Path) -> list[str]:
    """Write (bytes) or delete (None) files, staged first so a failure leaves them as they were."""
    staged, words = [], []
    try:
        for path, data in changes.items():
            if data is not None and (not path.exists() or path.read_bytes() != data):
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{path.name}.tmp")
                tmp.write_bytes(data)
                staged.append((tmp, path))
        for tmp, path in staged:
            os.replace(tmp, path)
            words.append(f"written: {path.relative_to(root)}")
    except OSError as exc:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise os_error(exc, str(root)) from None
    for path, data in changes.items():
        if data is None and path.exists():
            path.unlink()
            words.append(f"deleted: {path.relative_to(root)}")
            if not any(path.parent.iterdir()):
                path.parent.rmdir()
    return words


def report_lines(co: Checkout, result: ApplyResult) -> list[str]:
    """Per patch its verdict; a conflict with its file, hunk, both sides and where a stored
    resolution would go."""
    choice = result.choice
    out = [
        f"REF {co.describe(result.ref)}",
        f"series: {choice.base.series} over {choice.base.describe()}",
        f"  why: {choice.why}",
    ]
    if choice.candidates:
        out.append(f"  farther: {', '.join(choice.candidates)}")
    if choice.missing:
        out.append(f"  not in the checkout (git fetch origin --tags main dev, or --mirror): "
                   f"{', '.join(choice.missing)}")  # fmt: skip
    for o in result.outcomes:
        note = f" ({o.note})" if o.note else ""
        out.append(f"  {o.verdict:30} {o.patch}{note}")
        for c in o.conflicts:
            out.append(f"      {c.describe()}")
            if not c.absent:
                for side, lines in (("REF", c.ours), ("series", c.theirs)):
                    out.append(f"        {side}:")
                    shown = (line.decode(errors="replace").rstrip("\n") for line in lines[:12])
                    out.extend("          | " + line for line in shown)
                    if len(lines) > 12:
                        out.append(f"          | ... ({len(lines) - 12} more lines)")
        if o.probe:
            out.append("      merged cleanly but wrong, and no stored series has a patch that "
                       "merges right here")  # fmt: skip
        elif o.verdict == CONFLICT and o.resolution is not None:
            rel = o.resolution.relative_to(choice.root) if o.resolution.is_relative_to(
                choice.root) else o.resolution  # fmt: skip
            out.append(f"      needs a stored resolution: {rel}")
    counts = {v: sum(o.verdict == v for o in result.outcomes)
              for v in VERDICTS}  # fmt: skip
    out.append(", ".join(f"{n} {v}" for v, n in counts.items() if n))
    if result.releases:
        out.append(f"the branch {result.releases}")
    return out


# ----------------------------------------------------------------------------- the verb


def already_has_series(co: Checkout, ref: str, root: Path = REPO_ROOT) -> Optional[str]:
    """A commit among REF's last first-parent commits whose subject is a stored series
    patch's (what `apply` commits, or `git am` of its files without ``-k``, which drops a
    leading ``[MoE]``), described; None if there is none."""
    subjects = set()
    for base in load_pins(root / "patches" / "pins.toml").bases.values():
        if (base.series_dir(root) / "series").exists():
            subjects |= {_bare(parse_patch(d, n).subject) for n, d in read_series(base, root)}
    log_text = co.out("log", "--first-parent", "-n", "64", "--format=%h%x00%s", "--abbrev=12", ref)
    for line in log_text.splitlines():
        short, _, subject = line.partition("\0")
        if _bare(subject) in subjects:
            return f'{short} ("{subject[:60]}")'
    return None


def _bare(subject: str) -> str:
    """A subject without the leading ``[...]`` tags ``git am`` strips."""
    return re.sub(r"^(\[[^]]*\]\s*)+", "", subject)


def _megatron_commit(co: Checkout, rev: str) -> str:
    commit = co.has(rev)
    if commit is None:
        raise UserError(f"{co.path}: unknown ref {rev!r}")
    if co.run("cat-file", "-e", f"{commit}:{PACKAGE_INFO}").returncode != 0:
        raise UserError(f"{co.path}: {rev} is not a Megatron-LM commit (no {PACKAGE_INFO}); "
                        "give a Megatron-LM clone")  # fmt: skip
    return commit


def run_record(
    checkout: Path,
    ref: Optional[str],
    resolved: str,
    mirror: Optional[Path] = None,
    root: Optional[Path] = None,
    series_name: Optional[str] = None,
) -> list[str]:
    """``apply --record RESOLVED``: store the resolutions RESOLVED's commits make at REF (see
    :func:`record_resolutions`); the checkout is only read. Returns what was done, in lines."""
    co = open_checkout(checkout)
    commit = _megatron_commit(co, ref or "HEAD")
    done = co.has(resolved)
    if done is None:
        raise UserError(f"{checkout}: unknown ref {resolved!r} (--record)")
    with tempfile.TemporaryDirectory(prefix="moe-apply-") as tmp:
        hist = history(co, mirror, Path(tmp))
        choice, words = record_resolutions(hist, commit, done, mirror, root or REPO_ROOT,
                                           series_name)  # fmt: skip
    where = choice.series_dir / APPLY_DIR / commit[:12]
    head = f"resolutions of {choice.base.series} at {commit[:12]} from {resolved}: {where}"
    return [head] + (words or ["unchanged"])


RESOLVE_SUFFIX = "-resolve"  # the branch apply --resolve makes: moe-release/<commit12>-resolve
MESSAGE_FILE = "moe-release-message"  # in the work tree's git directory: the stopped patch's


def _label_worktree(
    co: Checkout, worktree: Path, ref: str, base: Base, applied: list[str], root: Path
) -> str:
    """The label commit (checkout.label_files) on a finished --resolve branch, so that ``pip
    install`` builds ``<version>+moerelease...`` and ``verify`` knows it; nothing is written
    into the tool's repository. Returns what was done, in a line."""
    head = git(worktree, "rev-parse", "HEAD").decode().strip()
    changed = git(worktree, "diff", "--name-only", "--no-renames", ref, head).decode().split()
    try:
        version, files = label_files(ref, head, base, applied, co.files, changed, None, root)
    except UserError as exc:
        return f"not labelled: {exc}"
    for path, data in files.items():
        dest = worktree / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
    git(worktree, "add", "--", *sorted(files))
    date = git(worktree, "log", "-1", "--format=%aI", head).decode().strip()
    env = git_env(dict(GIT_AUTHOR_NAME=COMMITTER_IDENT[0], GIT_AUTHOR_EMAIL=COMMITTER_IDENT[1],
                       GIT_AUTHOR_DATE=date))  # fmt: skip
    msg = (
        f"{LABEL_SUBJECT}{version}\n\n`pip install` of this checkout builds megatron-core "
        f"{version}: the series of\n{base.name} ({len(applied)} commits below) applied on "
        f"{ref[:12]} by moe-release's `apply --resolve`.\nThis commit stamps {PACKAGE_INFO}, "
        "adds moe-release's new modules and the\nmanifest `moe_release.py verify` reads.\n"
    )
    git(worktree, "commit", "--quiet", "--no-verify", "-F", "-", env=env, input=msg.encode())
    return f"labelled: pip install of the branch builds megatron-core {version} (--no-label: not)"


def run_resolve(
    checkout: Path,
    ref: Optional[str],
    worktree: Path,
    mirror: Optional[Path] = None,
    root: Optional[Path] = None,
    series_name: Optional[str] = None,
    label: bool = True,
) -> tuple[bool, list[str]]:
    """``apply --resolve DIR``: a work tree where a person resolves what conflicts at REF. The
    first call adds the work tree DIR on a new branch ``moe-release/<commit12>-resolve`` at REF
    (the checkout's own HEAD, index and work tree are not touched); each call commits the
    patches that merge (or whose stored resolution replays) in turn, with their messages and
    authors, and stops at the first conflict with the 3-way merge, conflict markers included,
    written into DIR. The person resolves it, commits (``git commit -a -F`` the message file
    named) and runs the same command again, which goes on from the commits on the branch.
    Returns (all patches are on the branch, what was done in lines); then ``--record BRANCH``
    stores the resolutions."""
    root = root or REPO_ROOT
    co = open_checkout(checkout)
    commit = _megatron_commit(co, ref or "HEAD")
    branch = f"{BRANCH_PREFIX}{commit[:12]}{RESOLVE_SUFFIX}"
    worktree = worktree.absolute()
    words: list[str] = []
    if worktree.exists():
        top = subprocess.run(
            ["git", "-C", str(worktree), "rev-parse", "--show-toplevel", "--abbrev-ref", "HEAD"],
            capture_output=True,
            env=git_env(),
        )
        found = top.stdout.decode().split() if top.returncode == 0 else []
        if found != [str(worktree.resolve()), branch]:
            raise UserError(f"--resolve {worktree}: exists and is not the work tree of branch "
                            f"{branch} (give a new directory)")  # fmt: skip
        status = git(worktree, "status", "--porcelain", "--untracked-files=no").decode()
        if status.strip():
            first = status.splitlines()[0][3:]
            raise UserError(f"--resolve {worktree}: uncommitted changes ({first}); commit the "
                            "resolution first (git commit -a -F the message file)")  # fmt: skip
    else:
        if co.has(f"refs/heads/{branch}"):
            raise UserError(f"{checkout}: branch {branch} exists without the work tree "
                            f"{worktree}; delete it or give its work tree")  # fmt: skip
        if co.bare:
            raise UserError(f"{checkout}: a bare repository; --resolve needs a work tree")
        git(co.path, "worktree", "add", "--quiet", "-b", branch, str(worktree), commit)
        words.append(f"work tree {worktree} on new branch {branch} at {commit[:12]}")
    with tempfile.TemporaryDirectory(prefix="moe-apply-") as tmp:
        hist = history(co, mirror, Path(tmp))
        prep = _prepare(hist, commit, mirror, root, series_name)
        head = git(worktree, "rev-parse", "HEAD").decode().strip()
        labelled = hist.out("log", "-1", "--format=%s", head).startswith(LABEL_SUBJECT)
        commits, fixes = _series_and_fixes(hist, commit, head, root) if head != commit else (
            [], _Fixes([]))  # fmt: skip
        applied: list[str] = []  # the patches on the branch, in order
        paths = set(prep.at_ref)
        landed = files_series_states(prep.at_ref, [p for p, _, _ in prep.states])
        ours, k = dict(prep.at_ref), 0
        for (patch, before, after), state in zip(prep.states, landed, strict=True):
            if state.verdict == "landed":
                continue
            merged, conflicts = merge_patch(ours, before, after, patch)
            modified = [fp.path for fp in patch.files if not fp.new_file]
            if conflicts and modified and all(ours.get(p) is None for p in modified):
                continue  # not applicable
            applied.append(patch.name)
            if k < len(commits):  # done on the branch already (by this command or the person)
                k += 1
                at = commits[k - 1] if k < len(commits) or not fixes.commits else head
                ours = _by_base_path(hist, at, paths, prep.moved)  # the last: with the fixes
                continue
            result: Files = dict(ours)
            result.update(merged)
            name = resolution_path(prep.choice, commit, patch.name).name
            if conflicts:
                data, other = prep.records.own.get(name), None
                if data is None:
                    other = replay_other(prep.records, name, result, conflicts, name)
                try:
                    if other is not None:
                        result, conflicts = other[1], []
                    elif data is not None and not replay(replayed := dict(result), conflicts,
                                                         data, name):  # fmt: skip
                        result, conflicts = replayed, []
                except UserError:
                    pass
            if conflicts:
                settled, left = merge_patch(ours, before, after, patch, True, prep.style)
                if len(left) < len(conflicts):  # fewer conflicts for the person to resolve
                    result, conflicts = {**ours, **settled}, left
            labels = (f"REF {commit[:12]}", f"the series' base ({prep.choice.base.name})",
                      f"the series ({patch.name})")  # fmt: skip
            for path in {c.path for c in conflicts if not c.absent}:
                sides = (ours[path] or b"", before.get(path) or b"", after.get(path) or b"")
                result[path] = merge_for_person(*sides, labels, prep.style)
            changed = {p: d for p, d in result.items() if d != ours.get(p)}
            for path, data in changed.items():
                dest = worktree / prep.moved.get(path, path)
                if data is None:
                    dest.unlink(missing_ok=True)
                else:
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(data)
            msg = patch.subject + "\n\n" + patch.message.strip("\n") + "\n"
            name_, email, date = patch_author(patch)
            env = git_env(dict(GIT_AUTHOR_NAME=name_, GIT_AUTHOR_EMAIL=email,
                               GIT_AUTHOR_DATE=date))  # fmt: skip
            if conflicts:
                msg_path = Path(git(worktree, "rev-parse", "--git-path", MESSAGE_FILE).decode()
                                .strip())  # fmt: skip
                msg_path = msg_path if msg_path.is_absolute() else worktree / msg_path
                msg_path.write_text(msg)
                words.append(f"CONFLICT in {patch.name}:")
                words += [f"  {c.describe()}" for c in conflicts]
                words.append(f"resolve the conflict markers in {worktree}, then `git -C "
                             f"{worktree} commit -a -F {msg_path}` (the patch's message and "
                             "trailers) and run this command again")  # fmt: skip
                return False, words
            if changed:
                git(
                    worktree, "add", "--all", "--", *sorted({prep.moved.get(p, p) for p in changed})
                )
                git(worktree, "commit", "--quiet", "--no-verify", "-F", "-", env=env,
                    input=msg.encode())  # fmt: skip
                words.append(f"committed {patch.name}")
            ours = result
    on_disk = {p: (worktree / p).read_bytes() if (worktree / p).is_file() else None
               for p in PROBE_PATHS}  # fmt: skip
    wrong = probe_failures(on_disk)  # what the branch holds, the person's fixes included
    if wrong:
        words += [f"the result merges, but {msg} ({probe.topic}/{probe.name})"
                  for probe, msg in wrong]  # fmt: skip
        words.append(f"fix that in {worktree} and commit it (git -C {worktree} commit -a), "
                     "then --record the branch")  # fmt: skip
        return False, words
    if label and not labelled:
        words.append(_label_worktree(co, worktree, commit, prep.choice.base, applied, root))
    words.append(f"every patch is on {branch}: store the resolutions with `moe_release.py "
                 f"apply {checkout} --ref {commit[:12]} --record {branch}`; apply then replays "
                 "them")  # fmt: skip
    return True, words


def run_apply(
    checkout: Path,
    ref: Optional[str] = None,
    dry_run: bool = False,
    out_dir: Optional[Path] = None,
    branch: Optional[str] = None,
    mirror: Optional[Path] = None,
    root: Optional[Path] = None,
    series_name: Optional[str] = None,
    label: bool = True,
) -> tuple[Checkout, ApplyResult, list[str]]:
    """The verb: bad input refused (UserError) before anything is written; then the merge, and
    on full success the branch (or the --out files), with the label commit unless ``label`` is
    false. Returns what was done, in lines."""
    root = root or REPO_ROOT
    co = open_checkout(checkout)
    rev = ref or "HEAD"
    commit = _megatron_commit(co, rev)
    if not dry_run and out_dir is None:
        check_clean(co)  # the new branch is a ref of this checkout; --dry-run and --out read it
    if out_dir is not None and branch is not None:
        raise UserError("--out and --branch exclude each other (--out writes files, no branch)")
    if out_dir is not None and not dry_run:
        check_target_dir(out_dir)
    name = branch or f"{BRANCH_PREFIX}{commit[:12]}"
    if out_dir is None and not dry_run:
        if co.run("check-ref-format", "--branch", name).returncode != 0:
            raise UserError(f"--branch {name!r}: not a valid branch name")
        if co.has(f"refs/heads/{name}"):
            raise UserError(f"{checkout}: branch {name} exists; delete it or give --branch NAME")
    have = already_has_series(co, commit, root)
    if have:
        raise UserError(f"{rev} already has the series: its history has {have}, one of its "
                        "patches (apply to the commit before them)")  # fmt: skip
    done: list[str] = []
    with tempfile.TemporaryDirectory(prefix="moe-apply-") as tmp:
        scratch = Path(tmp) / "scratch.git"
        result = apply_series(history(co, mirror, Path(tmp)), commit, scratch, mirror, root,
                              series_name, label)  # fmt: skip
        if not result.ok or dry_run:
            return co, result, ["(dry run: nothing written)"] if dry_run and result.ok else []
        if result.commit is None:
            return co, result, ["nothing to apply: every patch is already at REF"]
        if out_dir is not None:
            with atomic_directory(out_dir, make_parents=False) as dest:
                git(scratch, "-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false",
                    "-c", "diff.algorithm=myers", "format-patch", *FORMAT_PATCH_FLAGS,
                    "--output-directory", str(dest), f"{commit}..refs/heads/apply")  # fmt: skip
            files = sorted(p.name for p in out_dir.iterdir())
            done.append(f"wrote {len(files)} patch(es) to {out_dir} for git am -3 at "
                        f"{commit[:12]}")  # fmt: skip
            done.extend(f"  {f}" for f in files)
        else:
            fetched = co.run("fetch", "--quiet", "--no-tags", "--no-write-fetch-head",
                             str(scratch), f"refs/heads/apply:refs/heads/{name}")  # fmt: skip
            if fetched.returncode != 0:
                msg = fetched.stderr.decode(errors="replace").strip().splitlines()
                raise UserError(f"{checkout}: could not create branch {name}: "
                                f"{msg[0] if msg else '?'}")  # fmt: skip
            done.append(f"branch {name} at {result.commit[:12]}: "
                        f"{co.count(f'{commit}..{name}')} commit(s) on {commit[:12]}; "
                        f"git switch {name}")  # fmt: skip
    if result.version:
        done.append(f"pip install of it builds megatron-core {result.version} (its last "
                    "commit labels the build; --no-label leaves it out)")  # fmt: skip
    return co, result, done


def configure(parser: argparse.ArgumentParser) -> None:
    """The checkout and ref, the series, where to write, and the resolving workflow."""
    parser.add_argument("checkout", metavar="CHECKOUT", help="a Megatron-LM git checkout (clean)")
    parser.add_argument("--ref", help="the commit to apply to (default: HEAD)")
    parser.add_argument("--dry-run", action="store_true", help="report only, write nothing")
    parser.add_argument("--series", metavar="PIN",
                        help="take this pinned base's series (e.g. main-d98e8a6, 0.18.0) instead "
                        "of the nearest")  # fmt: skip
    parser.add_argument(
        "--out", metavar="DIR", help="write git am-able files here instead of a branch"
    )
    parser.add_argument("--branch", metavar="NAME",
                        help="the new branch (default: moe-release/<commit12>)")  # fmt: skip
    parser.add_argument("--no-label", action="store_true",
                        help="leave out the last commit, which makes pip install of the checkout "
                        "build <version>+moerelease.N.HASH (stamps package_info.py, adds the new "
                        "modules and the manifest verify reads)")  # fmt: skip
    parser.add_argument(
        "--record",
        metavar="RESOLVED",
        help="store what a person did: RESOLVED is a commit of CHECKOUT on REF with one "
        "commit per patch to apply there, in order; per patch its difference from the 3-way "
        "merge is stored in <series>/apply/<commit12>/ (nothing else is written)",
    )
    parser.add_argument(
        "--resolve",
        metavar="DIR",
        help="a work tree DIR (added on branch moe-release/<commit12>-resolve) where a person "
        "resolves the conflicts: the patches are committed in turn up to the first conflict, "
        "whose 3-way merge (conflict markers included) is left in DIR; commit the resolution "
        "and run the same command again. A finished branch gets the label commit (not with "
        "--no-label), so pip install and verify know it; --record it to store the resolutions "
        "for others (exit 1 while a conflict or a failed probe is left)",
    )
    parser.add_argument(
        "--mirror",
        metavar="CHECKOUT",
        default=settings.megatron_lm(),
        help="a Megatron-LM git mirror whose history and bases' files count too, for a "
        "CHECKOUT that has not fetched the stored bases (default: $MOE_RELEASE_MEGATRON_LM)",
    )


def run(args: argparse.Namespace) -> int:
    """Apply, record or resolve; exit status 1 on a conflict."""
    mirror = Path(args.mirror) if args.mirror else None
    if args.record:
        if args.dry_run or args.out or args.branch:
            raise UserError("--record writes resolutions only: no --dry-run, --out or --branch")
        for line in run_record(Path(args.checkout), args.ref, args.record, mirror,
                               series_name=args.series):  # fmt: skip
            print(line)
        return 0
    if args.resolve:
        if args.dry_run or args.out or args.branch:
            raise UserError("--resolve makes its own branch: no --dry-run, --out or --branch")
        done_all, lines = run_resolve(Path(args.checkout), args.ref, Path(args.resolve), mirror,
                                      series_name=args.series,
                                      label=not args.no_label)  # fmt: skip
        for line in lines:
            print(line)
        return 0 if done_all else 1
    co, result, done = run_apply(
        Path(args.checkout), args.ref, args.dry_run,
        Path(args.out) if args.out else None, args.branch,
        mirror, series_name=args.series, label=not args.no_label,
    )  # fmt: skip
    for line in report_lines(co, result):
        print(line)
    if not result.ok:
        ref = f" --ref {result.ref[:12]}"
        print(f"CONFLICT: nothing written; the checkout is as it was. To resolve it by hand: "
              f"`moe_release.py apply {args.checkout}{ref} --resolve DIR` (a work tree for you, "
              "then --record stores what you did), or apply at another --ref")  # fmt: skip
        return 1
    for line in done:
        print(line)
    return 0


register(
    Command(
        name="apply",
        help="carry the nearest series onto a Megatron-LM git checkout at any commit (3-way)",
        description="find the stored series nearest to REF (REF on main, dev or a release "
        "branch; of the stored bases, the one whose files the series change differ least from "
        "REF's, then the fewest commits apart), merge each of its patches onto REF (3-way, "
        "replaying resolutions stored in <series>/apply/<commit12>/) and commit each on a new "
        "branch, or write git am -3-able files to --out. Reports per patch: applied, landed, "
        "not applicable (with the evidence) or conflict (file, hunk, both sides). Exit status "
        "1 on a conflict (nothing is written), 2 on bad input; HEAD, the index and the work "
        "tree are never touched.",
        configure=configure,
        run=run,
    )
)
