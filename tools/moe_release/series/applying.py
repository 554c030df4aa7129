# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The merge of a whole series onto one commit's files, as ``apply`` and ``sweep`` run it.

Per patch, in order: ``landed`` if REF already holds it (``hunkstate``); else the 3-way merge
(:func:`moe_release.series.merge.merge_patch`) onto REF's files with the earlier patches
applied; where it conflicts, in this order, the resolution stored for REF itself, a resolution
recorded at another commit that resolves every conflict of this merge (a record is the diff
from the merge, conflict markers and both sides included, to what a person made of it: it
applies only where the same conflict appears, whichever commit that is), and the import block
merged as a set (:mod:`moe_release.series.imports`) and deletions beside insertions
(:mod:`moe_release.series.settle`). What is left is a conflict, or ``not
applicable`` where no file the patch modifies exists at REF.

Nothing here reads git: the caller gives the files, the records and REF's isort.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Optional

from moe_release.series.common import UserError
from moe_release.series.hunkstate import files_series_states
from moe_release.series.merge import (
    Conflict,
    Files,
    Resolution,
    apply_with_offset,
    has_markers,
    merge_patch,
    parse_diff,
)
from moe_release.series.patches import Patch, patch_stem

APPLIED, REPLAYED, LANDED, NOT_APPLICABLE, CONFLICT = (
    "applied",
    "applied, resolution replayed",
    "landed",
    "not applicable",
    "conflict",
)
VERDICTS = (APPLIED, REPLAYED, LANDED, NOT_APPLICABLE, CONFLICT)


@dataclasses.dataclass
class Outcome:
    """What happened to one patch of the series at REF."""

    patch: str
    verdict: str
    note: str = ""
    conflicts: list[Conflict] = dataclasses.field(default_factory=list)
    resolution: Optional[Path] = None  # where a resolution for REF is (or would be) stored
    replayed: Optional[str] = None  # the replayed resolution: its file name, or
    # <commit12>/<file name> where it was recorded at another commit
    settled: list[str] = dataclasses.field(default_factory=list)  # what a tool settled


@dataclasses.dataclass
class Records:
    """The resolutions a merge may replay: REF's own (by file name) and those recorded at
    other commits, nearest first (``(commit12, {file name: bytes})``)."""

    own: dict[str, bytes] = dataclasses.field(default_factory=dict)
    others: list[tuple[str, dict[str, bytes]]] = dataclasses.field(default_factory=list)

    def data(self, replayed: str) -> bytes:
        """The bytes of a replayed resolution, named as :attr:`Outcome.replayed` names it."""
        c12, _, name = replayed.rpartition("/")
        return dict(self.others)[c12][name] if c12 else self.own[name]


def record_name(patch_name: str) -> str:
    """The file name a resolution of ``patch_name`` is stored under."""
    return f"{patch_stem(patch_name)}.diff"


def replay(result: Files, conflicts: list[Conflict], data: bytes, where: str) -> list[Conflict]:
    """Replay the resolution ``data`` (stored at ``where``) on the merge ``result`` in place;
    returns the conflicts it leaves unresolved (UserError: it does not apply)."""
    res = Resolution.parse(data)
    for fp in parse_diff(res.diff, where):
        result[fp.path] = apply_with_offset(result.get(fp.path), fp, where)
    unresolved = [c for c in conflicts if c.absent and c.path not in res.absent]
    unresolved += [c for c in conflicts if not c.absent and has_markers(result.get(c.path))]
    return unresolved


def replay_other(
    records: Records, name: str, merged: Files, conflicts: list[Conflict], where: str
) -> Optional[tuple[str, Files]]:
    """The merge ``merged`` (conflicting) with the first resolution of file ``name`` recorded
    at another commit that applies and resolves every conflict: (``<commit12>/<name>``, the
    files); None if none does. ``where`` is the records' directory, for messages."""
    for c12, stored in records.others:
        data = stored.get(name)
        if data is None:
            continue
        result = dict(merged)
        try:
            if not replay(result, conflicts, data, f"{where}/{c12}/{name}"):
                return f"{c12}/{name}", result
        except UserError:
            continue
    return None


@dataclasses.dataclass
class Step:
    """One patch merged: its outcome and, where it changes REF, the files it changes."""

    outcome: Outcome
    changed: Files


def merge_series(
    states: list[tuple[Patch, Files, Files]],
    at_ref: Files,
    records: Records,
    style: Optional[Callable[[str], str]] = None,
    where: str = "apply",
) -> list[Step]:
    """Merge each patch of ``states`` (patch, its files before and after) in turn onto
    ``at_ref`` (REF's files, by their path at the base); the module docstring says how."""
    landed = files_series_states(at_ref, [p for p, _, _ in states])
    ours: Files = dict(at_ref)
    steps: list[Step] = []
    failed: dict[str, str] = {}  # file -> the patch that conflicted there
    for (patch, before, after), state in zip(states, landed, strict=True):
        out = Outcome(patch.name, APPLIED)
        steps.append(Step(out, {}))
        name = record_name(patch.name)
        after_conflict = sorted({failed[fp.path] for fp in patch.files if fp.path in failed})
        if state.verdict == "landed":
            out.verdict, out.note = LANDED, state.counts()
            continue
        merged, conflicts = merge_patch(ours, before, after, patch)
        result: Files = {**ours, **merged}
        own = records.own.get(name)
        other = None
        if own is None and conflicts:
            other = replay_other(records, name, result, conflicts, where)
            if other is None:
                merged, conflicts = merge_patch(ours, before, after, patch, True, style,
                                                out.settled)  # fmt: skip
                result = {**ours, **merged}
        if own is not None:
            try:
                unresolved = replay(result, conflicts, own, f"{where}/{name}")
            except UserError as exc:
                out.verdict, out.note, out.conflicts = CONFLICT, str(exc), conflicts
                failed.update({fp.path: patch.name for fp in patch.files})
                continue
            if unresolved:
                out.verdict, out.conflicts = CONFLICT, unresolved
                out.note = "the stored resolution does not resolve these"
                failed.update({c.path: patch.name for c in unresolved})
                continue
            out.verdict, out.replayed = REPLAYED, name
        elif other is not None:
            out.replayed, result = other
            out.verdict = REPLAYED
            out.note = f"recorded at {out.replayed.partition('/')[0]} for the same conflict"
        elif conflicts:
            modified = [fp.path for fp in patch.files if not fp.new_file]
            if modified and all(ours.get(p) is None for p in modified):
                out.verdict = NOT_APPLICABLE
            else:
                out.verdict, out.conflicts = CONFLICT, conflicts
                if after_conflict:
                    out.note = f"after the conflict of {', '.join(after_conflict)}"
                failed.update({c.path: patch.name for c in conflicts})
            continue
        elif out.settled:
            out.note = "settled: " + "; ".join(out.settled)
        changed = {p: result.get(p) for p in result if result.get(p) != ours.get(p)}
        if not changed:
            out.verdict, out.note = LANDED, "nothing left to change"
            continue
        steps[-1].changed = changed
        ours = result
    return steps
