# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The merge of a whole series onto one commit's files, as ``apply`` and ``sweep`` run it.

Per patch, in order: ``not applicable`` where REF already has upstream's own form of its topic
(its ``stands-aside`` text in patches/topics.toml: #7029's teardown stages for the overlay's
teardown patch); ``landed`` if REF already holds it (``hunkstate``); else the 3-way merge
(:func:`moe_release.series.merge.merge_patch`) onto REF's files with the earlier patches
applied; where it conflicts, in this order, the resolution stored for REF itself, a resolution
recorded at another commit that resolves every conflict of this merge (a record is the diff
from the merge, conflict markers and both sides included, to what a person made of it: it
applies only where the same conflict appears, whichever commit that is), and the import block
merged as a set (:mod:`moe_release.series.imports`) and deletions beside insertions
(:mod:`moe_release.series.settle`). What is left is a conflict, or ``not
applicable`` where no file the patch modifies exists at REF. A whole series whose result
fails a probe (:mod:`moe_release.series.probes`: a clean merge that is still wrong) is a
conflict of the patch that last changed the probed file; :func:`merge_right` then takes the
probe's patch from the next nearest series that has one (in its place, or where the primary
series has it when the chosen series carries no such patch) while that makes the merge whole
and the probe pass.

Nothing here reads git: the caller gives the files, the records and REF's isort.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

from moe_release.common import UserError
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
from moe_release.series.patches import Patch, patch_stem, primary_name
from moe_release.series.probes import failures
from moe_release.series.topics import load_topics

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
    probe: str = ""  # a probe the whole series' result fails: "<topic>/<name>: what is wrong"
    probe_patch: str = ""  # the primary patch that keeps that probe's promise
    borrowed: str = ""  # the series this patch was taken from, when not the chosen one


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
    probe_files: Optional[Files] = None,
) -> list[Step]:
    """Merge each patch of ``states`` (patch, its files before and after) in turn onto
    ``at_ref`` (REF's files, by their path at the base); the module docstring says how. With
    ``probe_files`` (REF's files the probes read), a whole series is probed."""
    if probe_files is not None:  # the probes' files too: a borrowed patch may change them
        at_ref = {**{p: d for p, d in probe_files.items() if p not in at_ref}, **at_ref}
    landed = files_series_states(at_ref, [p for p, _, _ in states])
    ours: Files = dict(at_ref)
    steps: list[Step] = []
    failed: dict[str, str] = {}  # file -> the patch that conflicted there
    topics = load_topics()
    for (patch, before, after), state in zip(states, landed, strict=True):
        out = Outcome(patch.name, APPLIED)
        steps.append(Step(out, {}))
        name = record_name(patch.name)
        aside = topics.stands_aside(primary_name(patch), ours)
        if aside is not None:  # REF has upstream's own form of the change
            out.verdict, out.note = NOT_APPLICABLE, aside
            continue
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
    if probe_files is not None and all(s.outcome.verdict != CONFLICT for s in steps):
        for probe, msg in failures({**probe_files, **ours}):
            touched = [s for s in steps if set(s.changed) & set(probe.paths)] or steps
            out = touched[-1].outcome
            if out.probe:
                continue
            out.verdict, out.probe = CONFLICT, f"{probe.topic}/{probe.name}: {msg}"
            out.probe_patch = probe.patch
            out.note = f"merged cleanly, but {msg}"
    return steps


State = tuple[Patch, Files, Files]


def carries_all(states: Sequence[State], nearest: Sequence[State]) -> bool:
    """Whether ``states`` carry every patch of ``nearest`` (by the primary series' patch each
    is): a farther series stands in for the nearest only where it leaves none of its changes
    out."""
    return {primary_name(p) for p, _, _ in nearest} <= {primary_name(p) for p, _, _ in states}


def whole(steps: Sequence[Step]) -> bool:
    """Whether a merge needs no person: no patch conflicts or fails a probe."""
    return all(s.outcome.verdict != CONFLICT for s in steps)


def first_whole(
    nearest: Sequence[State],
    candidates: Iterable[tuple[str, Callable[[], tuple[list[State], list[Step]]]]],
) -> Optional[tuple[str, list[State], list[Step]]]:
    """Where the nearest series' merge is not whole: the first of ``candidates`` (its name and
    how to merge it: the states merged and their steps; nearer first) whose merge is whole and
    carries every patch of ``nearest`` (the nearest's own states); None if none does."""
    for name, merge in candidates:
        states, steps = merge()
        if whole(steps) and carries_all(states, nearest):
            return name, states, steps
    return None


def merge_right(
    states: list[State],
    others: list[tuple[str, list[State]]],
    merge: Callable[[list[State]], list[Step]],
    primary: Sequence[str],
) -> tuple[list[State], list[Step]]:
    """``states`` merged by ``merge``; while the result fails a probe, the probe's patch taken
    from the first of ``others`` (series name, its states; nearest first) with which the merge
    is whole and that probe passes, in the place of the series' own or, where it has none, in
    the primary series' order (``primary``). Returns the states merged and their steps (each
    borrowed patch's outcome names its series)."""
    steps = merge(states)
    tried: set[str] = set()
    lent: dict[int, tuple[str, str]] = {}  # id(patch) -> (its series, why it was taken)
    while True:
        failing = next((s.outcome for s in steps if s.outcome.probe), None)
        if failing is None or failing.probe_patch in tried:
            return states, steps
        target = failing.probe_patch
        tried.add(target)
        names = [primary_name(p) for p, _, _ in states]
        rank = {n: i for i, n in enumerate(primary)}
        for series, alt in others:
            taken = [st for st in alt if primary_name(st[0]) == target]
            if not taken:
                continue
            if target in names:
                i = names.index(target)
                trial = [*states[:i], *taken, *states[i + 1 :]]
            else:
                i = next((k for k, n in enumerate(names)
                          if rank.get(n, len(rank)) > rank.get(target, len(rank))),
                         len(names))  # fmt: skip
                trial = [*states[:i], *taken, *states[i:]]
            got = merge(trial)
            if any(s.outcome.verdict == CONFLICT and not s.outcome.probe for s in got) or any(
                s.outcome.probe_patch == target for s in got
            ):
                continue
            for patch, _, _ in taken:
                lent[id(patch)] = (series, f"from the {series} series; without it, {failing.probe}")
            for (patch, _, _), step in zip(trial, got, strict=True):
                if id(patch) in lent:
                    step.outcome.borrowed, why = lent[id(patch)]
                    step.outcome.note = f"{why}; {step.outcome.note}" if step.outcome.note else why
            states, steps = trial, got
            break
