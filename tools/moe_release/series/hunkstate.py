# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Where a series' patches stand in a set of files: the hunk test ``landed``, ``port`` and
``apply`` share.

Against a newer base, line numbers move, so each hunk is looked for anywhere in its file: its
new side (context and added lines) present means the change is there ("applied"); otherwise its
old side present means it would still apply ("pending"); neither means the code around it
changed ("conflict"). A patch whose hunks are all applied has landed and a rebase drops it; all
pending, it still applies; anything else needs a look.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

from moe_release.series.patches import Hunk, Patch

APPLIED, PENDING, CONFLICT = "applied", "pending", "conflict"


@dataclass
class PatchState:
    """What a checkout holds of one patch: a verdict and the state of every hunk."""

    name: str
    subject: str
    hunks: list[tuple[str, int, str]] = field(default_factory=list)  # (path, number, state)

    @property
    def verdict(self) -> str:
        states = {state for _, _, state in self.hunks}
        if states == {APPLIED}:
            return "landed"
        if states == {PENDING}:
            return "not landed (applies)"
        if CONFLICT in states:
            return "conflicts"
        return "partly landed"

    def counts(self) -> str:
        n = {
            s: sum(1 for *_, state in self.hunks if state == s)
            for s in (APPLIED, PENDING, CONFLICT)
        }
        return ", ".join(f"{v} {k}" for k, v in n.items() if v)


def _contains(lines: list[bytes], block: list[bytes]) -> bool:
    if not block:
        return True
    first, size = block[0], len(block)
    return any(
        lines[i] == first and lines[i : i + size] == block for i in range(len(lines) - size + 1)
    )


def hunk_state(lines: list[bytes], hunk: Hunk) -> str:
    """Whether a file's lines hold the hunk's change (applied), its original (pending), or
    neither (conflict), wherever in the file."""
    new = [line[1:] for line in hunk.lines if line[:1] in (b" ", b"+")]
    old = [line[1:] for line in hunk.lines if line[:1] in (b" ", b"-")]
    if _contains(lines, new):
        return APPLIED
    if _contains(lines, old):
        return PENDING
    return CONFLICT


def _replace(lines: list[bytes], block: list[bytes], by: list[bytes]) -> list[bytes]:
    """``lines`` with the first occurrence of ``block`` replaced by ``by``."""
    size = len(block)
    for i in range(len(lines) - size + 1):
        if lines[i : i + size] == block:
            return lines[:i] + by + lines[i + size :]
    return lines


def _sides(hunk: Hunk) -> tuple[list[bytes], list[bytes]]:
    old = [line[1:] for line in hunk.lines if line[:1] in (b" ", b"-")]
    new = [line[1:] for line in hunk.lines if line[:1] in (b" ", b"+")]
    return old, new


class _Files:
    """The checkout's files as line lists, edited in memory (never written)."""

    def __init__(self, root: Path, files: Optional[Mapping[str, Optional[bytes]]] = None):
        self.root = root
        self.lines: dict[str, list[bytes] | None] = {
            rel: None if data is None else data.splitlines(keepends=True)
            for rel, data in (files or {}).items()
        }
        self.in_memory = files is not None

    def get(self, rel: str) -> list[bytes] | None:
        if rel not in self.lines:
            if self.in_memory:
                return None
            path = self.root / rel
            self.lines[rel] = path.read_bytes().splitlines(keepends=True) if path.exists() else None
        return self.lines[rel]

    def state(self, patch: Patch) -> PatchState:
        state = PatchState(patch.name, patch.subject)
        for fp in patch.files:
            lines = self.get(fp.path)
            if fp.deleted:
                state.hunks.append((fp.path, 1, APPLIED if lines is None else PENDING))
            elif lines is None:
                kind = PENDING if fp.new_file else CONFLICT
                state.hunks.extend((fp.path, i, kind) for i in range(1, len(fp.hunks) + 1))
            else:
                state.hunks.extend(
                    (fp.path, i, hunk_state(lines, h)) for i, h in enumerate(fp.hunks, 1)
                )
        return state

    def move(self, patch: Patch, forward: bool) -> None:
        """Apply (or, backward, un-apply) the patch's hunks wherever they are."""
        for fp in patch.files:
            lines = self.get(fp.path)
            if lines is None and forward and fp.new_file:
                lines = []
            if lines is None:
                continue
            for hunk in fp.hunks:
                old, new = _sides(hunk)
                lines = _replace(lines, old, new) if forward else _replace(lines, new, old)
            self.lines[fp.path] = lines


def dir_series_states(root: Path, patches: list[Patch]) -> list[PatchState]:
    """The state of every patch in the files under ``root``, read as they are needed (see
    :func:`landed.landed_states`, which checks ``root`` is a checkout first)."""
    return _series_states(_Files(root), patches)


def files_series_states(
    files: Mapping[str, Optional[bytes]], patches: list[Patch]
) -> list[PatchState]:
    """:func:`landed.landed_states` over in-memory files (path -> bytes, None or not given:
    absent)."""
    return _series_states(_Files(Path(), files), patches)


def _series_states(files: _Files, patches: list[Patch]) -> list[PatchState]:
    landed = set()
    for patch in reversed(patches):
        if files.state(patch).verdict != "landed":
            break
        landed.add(patch.name)
        files.move(patch, forward=False)
    out = []
    for patch in patches:
        state = files.state(patch)
        if patch.name in landed:
            state.hunks = [(path, i, APPLIED) for path, i, _ in state.hunks]
        if patch.name in landed or state.verdict == "not landed (applies)":
            files.move(patch, forward=True)
        out.append(state)
    return out


def files_state(files: Mapping[str, Optional[bytes]], patch: Patch) -> PatchState:
    """The state of one patch in in-memory files (path -> bytes, None: absent; a path not
    given is absent), judged as :func:`landed.landed_states` judges a checkout's."""
    return _Files(Path(), files).state(patch)
