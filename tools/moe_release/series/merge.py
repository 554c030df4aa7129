# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The 3-way merge engine that ``port`` and ``apply`` share.

A patch is merged onto another tree file by file, as ``git apply --3way`` merges: base = the
files before the patch, theirs = after it, ours = the other tree (``git merge-file``). What a
person did on top of the mechanical merge is a :class:`Resolution`: a diff from the merge
(conflict markers included) to the resolved files, replayed with :func:`apply_with_offset`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Optional

from moe_release.common import UserError
from moe_release.series.git import git_env
from moe_release.series.imports import lost_imports, merge_imports
from moe_release.series.patches import FilePatch, Patch, apply_file_patch, parse_patch
from moe_release.series.settle import settle_adjacent

Files = dict[str, Optional[bytes]]

OURS, THEIRS = "target", "primary"
MARK_OURS, MARK_SEP, MARK_THEIRS = (
    b"<<<<<<< " + OURS.encode(),
    b"=======",
    b">>>>>>> " + THEIRS.encode(),
)


# ----------------------------------------------------------------------------- merging


@dataclasses.dataclass
class Conflict:
    """One conflict of a 3-way merge: where, and both sides."""

    path: str
    line: int  # in the merged file
    hunk: str  # the primary patch's hunk header it belongs to ("" if none matches)
    ours: list[bytes]
    theirs: list[bytes]
    absent: bool = False  # the file is absent on the target

    def describe(self) -> str:
        if self.absent:
            return f"{self.path}: absent on the target ({self.hunk})"
        return f"{self.path}:{self.line} ({self.hunk or 'no primary hunk'})"


def merge_file(
    ours: bytes,
    base: bytes,
    theirs: bytes,
    diff3: bool = False,
    labels: tuple[str, str, str] = (OURS, "base", THEIRS),
) -> tuple[bytes, int]:
    """``git merge-file``: (merged bytes with conflict markers, number of conflicts); with
    ``diff3`` each conflict also shows the base's lines (``||||||| base``). ``labels`` name
    the sides on the markers (records are made against the default ones)."""
    with tempfile.TemporaryDirectory(prefix="moe-port-") as tmp:
        paths = []
        for name, data in (("ours", ours), ("base", base), ("theirs", theirs)):
            path = Path(tmp) / name
            path.write_bytes(data)
            paths.append(str(path))
        done = subprocess.run(
            ["git", "merge-file", "-p", *(["--diff3"] if diff3 else []), "-L", labels[0], "-L",
             labels[1], "-L", labels[2], *paths],
            capture_output=True, env=git_env(),
        )  # fmt: skip
    if done.returncode < 0 or done.returncode > 127:
        raise UserError(f"git merge-file failed: {done.stderr.decode()[:200]}")
    return done.stdout, done.returncode


def conflicts_in(path: str, data: bytes, patch: FilePatch) -> list[Conflict]:
    """The conflict regions of a merged file, each with both sides."""
    out: list[Conflict] = []
    lines = data.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        if lines[i].rstrip(b"\n") == MARK_OURS:
            start = i
            j = i + 1
            while j < len(lines) and lines[j].rstrip(b"\n") != MARK_SEP:
                j += 1
            k = j + 1
            while k < len(lines) and lines[k].rstrip(b"\n") != MARK_THEIRS:
                k += 1
            ours, theirs = lines[start + 1 : j], lines[j + 1 : k]
            out.append(Conflict(path, start + 1, _hunk_of(patch, theirs), ours, theirs))
            i = k + 1
        else:
            i += 1
    return out


def _hunk_of(patch: FilePatch, theirs: list[bytes]) -> str:
    """The patch's hunk whose added lines the conflict's series side holds most of (a blank
    line or a lone bracket names no hunk); "" if none."""
    added = {line for line in theirs if len(line.strip()) > 1}
    best, header = 0, ""
    for hunk in patch.hunks:
        score = sum(1 for line in hunk.lines if line[:1] == b"+" and line[1:] in added)
        if score > best:
            best, header = score, hunk.header
    return header


def has_markers(data: Optional[bytes]) -> bool:
    if not data:
        return False
    return any(
        line.rstrip(b"\n") in (MARK_OURS, MARK_THEIRS) for line in data.splitlines(keepends=True)
    )


def merge_patch(
    ours: Files,
    before: Files,
    after: Files,
    patch: Patch,
    settle: bool = False,
    style: Optional[Callable[[str], str]] = None,
    settled: Optional[list[str]] = None,
) -> tuple[Files, list[Conflict]]:
    """Merge one primary patch (``before`` -> ``after``, the files it touches) onto ``ours``.
    With ``settle``, a file whose merge conflicts has what a tool can settle settled
    (:func:`settle_file`; ``style`` is REF's isort for import blocks), each in words appended
    to ``settled``."""
    merged: Files = {}
    conflicts: list[Conflict] = []
    for fp in patch.files:
        path = fp.path
        o, b, t = ours.get(path), before.get(path), after.get(path)
        if o == t:
            merged[path] = o
        elif o is None and b is None:
            merged[path] = t  # a new file
        elif o is None:
            merged[path] = None
            hunks = ", ".join(h.header for h in fp.hunks) or "the whole file"
            conflicts.append(Conflict(path, 0, hunks, [], [], absent=True))
        elif t is None:
            if o == b:
                merged[path] = None
            else:
                merged[path] = o
                conflicts.append(Conflict(path, 0, "deleted by the primary", [], [], absent=True))
        else:
            data, n = merge_file(o, b or b"", t)
            if n and settle:
                data, n, how = settle_file(o, b or b"", t, data, n, style)
                if how and settled is not None:
                    settled.append(f"{path}: {how}")
            merged[path] = data
            if n:
                conflicts.extend(conflicts_in(path, data, fp))
    return merged, conflicts


def _adjacent(ours: bytes, base: bytes, theirs: bytes) -> tuple[bytes, int]:
    return settle_adjacent(merge_file(ours, base, theirs, diff3=True)[0])


def settle_file(
    ours: bytes,
    base: bytes,
    theirs: bytes,
    data: bytes,
    n: int,
    style: Optional[Callable[[str], str]] = None,
) -> tuple[bytes, int, str]:
    """The merge ``data`` (``n`` conflicts) with fewer conflicts where a tool can settle them:
    a deletion beside an insertion (:mod:`moe_release.series.settle`), then the import block
    as a set (:mod:`moe_release.series.imports`, with REF's isort ``style``). Returns (bytes,
    conflicts left, what was settled in words; "" if nothing)."""
    how = ""
    done, left = _adjacent(ours, base, theirs)
    # Side by side, REF's side of an import block can drop an import the patch's code needs
    # (REF predates it): that settle is refused, and the block is merged as a set below.
    if left < n and not lost_imports(theirs, done):
        data, n, how = done, left, "changes side by side, both applied"
    if n and style is not None:
        imported = merge_imports(ours, base, theirs, _adjacent, style)
        if imported is not None and imported[1] < n and not lost_imports(theirs, imported[0]):
            data, n = imported
            how = "import block merged as a set" + (f"; {how}" if how else "")
    return data, n, how


def merge_for_person(
    ours: bytes,
    base: bytes,
    theirs: bytes,
    labels: tuple[str, str, str],
    style: Optional[Callable[[str], str]] = None,
) -> bytes:
    """What ``apply --resolve`` leaves for a person: the merge with what a tool settles settled
    and each other conflict in diff3 style, the base's lines between REF's and the series' (so
    that the patch's own change shows as the difference from the base), the sides named by
    ``labels``."""

    def view(o: bytes, b: bytes, t: bytes) -> tuple[bytes, int]:
        merged = merge_file(o, b, t, diff3=True, labels=labels)[0]
        return settle_adjacent(merged, keep_base=True)

    data, n = view(ours, base, theirs)
    if lost_imports(theirs, data):  # as settle_file: not side by side, a person decides
        data = merge_file(ours, base, theirs, diff3=True, labels=labels)[0]
        n = 1
    if n and style is not None:
        imported = merge_imports(ours, base, theirs, view, style)
        if imported is not None and imported[1] < n and not lost_imports(theirs, imported[0]):
            data = imported[0]
    return data


# ----------------------------------------------------------------------------- resolutions


@dataclasses.dataclass
class Resolution:
    """What a person did on top of the mechanical merge of one patch onto one target."""

    diff: bytes  # a diff (git diff format) from the merge to the resolved files
    absent: list[str]  # files absent on the target whose primary hunks it accounts for

    def to_bytes(self, patch: str, target: str) -> bytes:
        head = (
            f"# Resolution of {patch} on {target}, replayed by `moe_release.py port`:\n"
            f"# the change from the 3-way merge of the primary patch onto the target (conflict\n"
            f"# markers '<<<<<<< {OURS}' / '>>>>>>> {THEIRS}') to what the target carries.\n"
            "# Recorded by `port --record`: edit the target's series, then record it again.\n"
        )
        head += "".join(f"# absent: {p}\n" for p in self.absent)
        return head.encode() + self.diff

    @classmethod
    def parse(cls, data: bytes) -> Resolution:
        absent, pos = [], 0
        for line in data.splitlines(keepends=True):
            if not line.startswith(b"#"):
                break
            match = re.match(rb"# absent: (\S+)$", line.rstrip(b"\n"))
            if match:
                absent.append(match.group(1).decode())
            pos += len(line)
        return cls(data[pos:], absent)


def file_diff(path: str, old: Optional[bytes], new: Optional[bytes]) -> bytes:
    """A ``git diff`` of one file (``a/path`` -> ``b/path``), no index line."""
    with tempfile.TemporaryDirectory(prefix="moe-port-") as tmp:
        a, b = Path(tmp) / "a", Path(tmp) / "b"
        a.write_bytes(old or b"")
        b.write_bytes(new or b"")
        done = subprocess.run(
            ["git", "diff", "--no-index", "--no-color", "--no-renames", "-U3",
             "--diff-algorithm=myers", str(a if old is not None else os.devnull),
             str(b if new is not None else os.devnull)],
            capture_output=True, env=git_env(),
        )  # fmt: skip
    if done.returncode not in (0, 1):
        raise UserError(f"git diff failed: {done.stderr.decode()[:200]}")
    body = done.stdout
    if not body:
        return b""
    body = body[body.index(b"\n@@ ") + 1 :]
    head = f"diff --git a/{path} b/{path}\n"
    if old is None:
        head += f"new file mode 100644\n--- /dev/null\n+++ b/{path}\n"
    elif new is None:
        head += f"deleted file mode 100644\n--- a/{path}\n+++ /dev/null\n"
    else:
        head += f"--- a/{path}\n+++ b/{path}\n"
    return head.encode() + body


def parse_diff(data: bytes, name: str) -> list[FilePatch]:
    """The file patches of a plain diff (patches.parse_patch reads mboxes)."""
    if not data.strip():
        return []
    fake = b"From 0 Mon Sep 17 00:00:00 2001\nFrom: x\nDate: x\nSubject: x\n\n" + data
    return parse_patch(fake, name).files


def apply_with_offset(old: Optional[bytes], fp: FilePatch, name: str) -> Optional[bytes]:
    """Apply one file's hunks exactly (no fuzz), each where its old side is found nearest to
    its line number (as ``git apply`` does); raises UserError naming the hunk."""
    if fp.new_file or fp.deleted:
        return apply_file_patch(old, fp, name)
    if old is None:
        raise UserError(f"{name}: modifies {fp.path}, which the merge does not have")
    src = old.splitlines(keepends=True)
    out: list[bytes] = []
    pos, drift = 0, 0
    for number, hunk in enumerate(fp.hunks, 1):
        want = [line[1:] for line in hunk.lines if line[:1] in (b" ", b"-")]
        new = [line[1:] for line in hunk.lines if line[:1] in (b" ", b"+")]
        guess = (hunk.old_start - 1 if hunk.old_len else hunk.old_start) + drift
        found = None
        for delta in range(0, len(src) + 1):
            for at in (guess - delta, guess + delta) if delta else (guess,):
                if pos <= at <= len(src) - len(want) and src[at : at + len(want)] == want:
                    found = at
                    break
            if found is not None:
                break
        if found is None:
            raise UserError(
                f"{name}: hunk #{number} ({hunk.header}) of {fp.path} no longer applies"
            )
        drift = found - (hunk.old_start - 1 if hunk.old_len else hunk.old_start)
        out.extend(src[pos:found])
        out.extend(new)
        pos = found + len(want)
    out.extend(src[pos:])
    return b"".join(out)


# ----------------------------------------------------------------------------- a series' states


def series_states(
    base_files: Files, series: list[tuple[str, bytes]]
) -> list[tuple[Patch, Files, Files]]:
    """Per patch of ``series`` applied in turn on ``base_files``: (patch, the files it changes
    before it, after it)."""
    files: Files = dict(base_files)
    out = []
    for name, data in series:
        patch = parse_patch(data, name)
        before = {fp.path: files.get(fp.path) for fp in patch.files}
        for fp in patch.files:
            files[fp.path] = apply_file_patch(files.get(fp.path), fp, name)
        out.append((patch, before, {fp.path: files.get(fp.path) for fp in patch.files}))
    return out
