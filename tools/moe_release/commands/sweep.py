# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""`sweep`: what ``apply --dry-run`` does on every first-parent commit of main and dev.

For each commit of a line (``--since``, default 2026-02-01; ``--every N`` keeps every Nth) the
sweep chooses the series as ``apply`` does (the stored base whose files the series change
differ least from the commit's, then the fewest commits apart) and merges it as ``apply``
merges it (:func:`moe_release.series.applying.merge_series`: stored resolutions, then the
import block as a set), without a work tree or a commit. Commits whose files the series touch
are the same blobs share one merge: a line of 1,500 commits has a few hundred distinct states.

Per commit it reports the series and each patch's verdict; the summary counts the commits that
take the whole series with no person (merged, landed or not applicable, a stored resolution
replayed, an import block merged) and groups the others by the first conflicting hunk. It reads
a local Megatron-LM checkout or mirror and needs no network.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import time
from pathlib import Path
from typing import Callable, Optional

from moe_release.commands.registry import Command, register
from moe_release.common import REPO_ROOT, UserError, log
from moe_release.series.applying import (
    APPLIED,
    CONFLICT,
    LANDED,
    NOT_APPLICABLE,
    REPLAYED,
    Records,
    Step,
    first_whole,
    merge_right,
    merge_series,
    whole,
)
from moe_release.series.checkout import APPLY_DIR
from moe_release.series.imports import isort_style
from moe_release.series.merge import Files, Resolution, parse_diff, series_states
from moe_release.series.nearest import SERIES_START, Checkout, anchors, open_checkout, renames
from moe_release.series.patches import parse_patch, patch_stem
from moe_release.series.pins import Base
from moe_release.series.probes import PATHS as PROBE_PATHS
from moe_release.series.repo import read_series
from moe_release.series.source import read_base_files
from moe_release.series.topics import load_topics

PYPROJECT = "pyproject.toml"
LINES = ("main", "dev")
# One letter per patch verdict, in the per-commit column.
CODES = {APPLIED: "A", REPLAYED: "R", LANDED: "L", NOT_APPLICABLE: "N", CONFLICT: "C"}
SETTLED = "S"  # applied with a conflict the tool settled (series.settle, series.imports)
BORROWED = "B"  # a probe's patch taken from another series (applying.merge_right)


@dataclasses.dataclass
class Row:
    """One commit of the sweep."""

    line: str
    commit: str
    date: str
    series: str  # the pinned base whose series was chosen
    codes: str  # one letter per patch (CODES, SETTLED)
    conflict: str  # the first conflict: "patch: file (hunk)"; "" if none
    replayed: list[str]  # the records replayed (<commit12>/<file>)
    farther: bool = False  # a farther series than the nearest (which conflicts or is wrong)

    @property
    def whole(self) -> bool:
        return CODES[CONFLICT] not in self.codes

    @property
    def kind(self) -> str:
        """conflict, record (a stored resolution replayed), borrowed (a probe's patch from
        another series), settled (by the tool) or whole."""
        if not self.whole:
            return "conflict"
        if CODES[REPLAYED] in self.codes:
            return "record"
        if BORROWED in self.codes:
            return "borrowed"
        return "settled" if SETTLED in self.codes else "whole"


@dataclasses.dataclass
class _Base:
    base: Base
    anchor: str
    states: list
    changed: list[str]  # the files its series change (what the choice compares)
    paths: list[str]  # those and the files its records change (what the merge reads)
    records: list[tuple[str, dict[str, bytes]]]  # (commit12, {file: bytes})


def line_commits(
    co: Checkout, line: str, since: str, until: Optional[str]
) -> list[tuple[str, str]]:
    """(commit, date) of ``line``'s first-parent commits since ``since``, oldest first."""
    for ref in (f"refs/heads/{line}", f"refs/remotes/origin/{line}"):
        if co.has(ref):
            break
    else:
        raise UserError(f"{co.path}: has no branch {line} (git fetch origin {line})")
    # A bare date would be read with the current time of day: the whole of each day, in UTC.
    args = ["log", "--first-parent", f"--since={since}T00:00:00Z", "--format=%H %cs"]
    if until:
        args.append(f"--until={until}T23:59:59Z")
    rows = [line.split() for line in co.out(*args, ref).splitlines()]
    return [(c, d) for c, d in reversed(rows)]


def _load_bases(co: Checkout, mirror: Optional[Path], root: Path) -> list[_Base]:
    out = []
    found, _ = anchors(co, root)
    for base, anchor, _ in found:
        source = co.path if base.is_commit and co.has(base.commit) else mirror
        series = read_series(base, root)
        stems = {patch_stem(n) for n, _ in series}
        adir = base.series_dir(root) / APPLY_DIR
        records = []
        for rdir in sorted(adir.iterdir()) if adir.is_dir() else []:
            stored = {p.name: p.read_bytes() for p in sorted(rdir.glob("*.diff"))
                      if p.name[: -len(".diff")] in stems}  # fmt: skip
            if stored:
                records.append((rdir.name, stored))
        states = series_states(read_base_files(base, source), series)
        changed = sorted({fp.path for n, d in series for fp in parse_patch(d, n).files})
        paths = set(changed)
        for _, stored in records:  # a record may change a file no patch touches
            paths |= {fp.path for n, d in stored.items()
                      for fp in parse_diff(Resolution.parse(d).diff, n)}  # fmt: skip
        paths = sorted(paths)
        out.append(_Base(base, anchor, states, changed, paths, records))
    if not out:
        raise UserError(f"{co.path}: holds none of the stored bases (main and dev commits, "
                        "release tags): git fetch origin --tags main dev")  # fmt: skip
    return out


class Sweep:
    """The sweep over one checkout, with its caches."""

    def __init__(self, co: Checkout, mirror: Optional[Path] = None, root: Path = REPO_ROOT):
        self.co, self.root = co, root
        self.bases = _load_bases(co, mirror, root)
        self.changed = sorted({p for b in self.bases for p in b.changed})
        self.paths = sorted({p for b in self.bases for p in b.paths} | set(PROBE_PATHS))
        self._lines: dict[tuple[str, tuple], int] = {}
        self._merges: dict[tuple, list[Step]] = {}
        self.merges = 0  # merges run (cache misses)
        self.primary = list(load_topics(root).of_patch)

    def _blobs(self, commit: str) -> tuple:
        text = self.co.out("ls-tree", commit, "--", *self.paths, PYPROJECT)
        blobs = {}
        for row in text.splitlines():
            meta, path = row.split("\t", 1)
            blobs[path] = meta.split()[2]
        return tuple(blobs.get(p) for p in [*self.paths, PYPROJECT])

    def _distance(self, b: _Base, commit: str, blobs: tuple) -> int:
        key = (b.base.name, blobs)
        if key not in self._lines:
            stat = self.co.out("diff", "--numstat", b.anchor, commit, "--", *self.changed)
            rows = (row.split() for row in stat.splitlines())
            self._lines[key] = sum(int(f[0]) + int(f[1]) for f in rows if f[0] != "-")
        return self._lines[key]

    def ranked(self, commit: str, blobs: tuple, full: bool = False) -> list[_Base]:
        """The bases, nearest first, as apply ranks them (nearest.choose_series): fewest lines
        differing, then fewest commits apart (counted for ties at the top, or all with
        ``full``)."""
        dist = {i: self._distance(b, commit, blobs) for i, b in enumerate(self.bases)}
        near = min(dist.values())
        shared = [i for i in dist if list(dist.values()).count(dist[i]) > 1
                  and (full or dist[i] == near)]  # fmt: skip
        apart = {i: self.co.count(f"{self.bases[i].anchor}...{commit}") for i in shared}
        order = sorted(dist, key=lambda i: (dist[i], apart.get(i, 0), i))
        return [self.bases[i] for i in order]

    def choose(self, commit: str, blobs: tuple) -> _Base:
        """The base apply chooses for ``commit`` (nearest.choose_series's ranking)."""
        return self.ranked(commit, blobs)[0]

    def _merge(self, chosen: _Base, commit: str, blobs: tuple) -> tuple[list, list[Step]]:
        own = next((r for c12, r in chosen.records if c12 == commit[:12]), {})
        key = (chosen.base.name, blobs, commit[:12] if own else "")
        absent = {p for p in chosen.paths if blobs[self.paths.index(p)] is None}
        moved = renames(self.co, chosen.anchor, commit, absent) if absent else {}
        key += tuple(sorted(moved.items()))
        if key not in self._merges:
            self.merges += 1
            files: Files = self.co.files(commit, [*chosen.paths, *moved.values(), PYPROJECT])
            for old, new in moved.items():
                files[old] = files.pop(new)
            style = isort_style(files.pop(PYPROJECT))
            others = [(c12, r) for c12, r in chosen.records if c12 != commit[:12]]
            probe_files = self.co.files(commit, list(PROBE_PATHS))

            def merge(states: list) -> list[Step]:
                return merge_series(states, files, Records(own, others), style,
                                    probe_files=probe_files)  # fmt: skip

            states, steps = chosen.states, merge(chosen.states)
            if any(s.outcome.probe for s in steps):  # a probe's patch from another series
                alts = [(b.base.name, b.states) for b in self.ranked(commit, blobs, full=True)
                        if b is not chosen]  # fmt: skip
                states, steps = merge_right(chosen.states, alts, merge, self.primary)
            self._merges[key] = (states, steps)
        return self._merges[key]

    def run_commit(self, line: str, commit: str, date: str) -> Row:
        blobs = self._blobs(commit)
        ranked = self.ranked(commit, blobs)
        chosen, (_, steps) = ranked[0], self._merge(ranked[0], commit, blobs)
        if not whole(steps):  # apply takes the next whole, right series (first_whole)
            farther = self.ranked(commit, blobs, full=True)[1:]
            taken = first_whole(
                chosen.states,
                ((b.base.name, lambda b=b: self._merge(b, commit, blobs)) for b in farther),
            )
            if taken is not None:
                name, _, steps = taken
                chosen = next(b for b in farther if b.base.name == name)
        row = _row(line, commit, date, chosen.base.name, steps)
        row.farther = chosen is not ranked[0]
        return row


def _row(line: str, commit: str, date: str, series: str, steps: list[Step]) -> Row:
    codes, conflict, replayed = "", "", []
    for step in steps:
        o = step.outcome
        if o.borrowed and o.verdict != CONFLICT:
            codes += BORROWED
        else:
            codes += SETTLED if o.verdict == APPLIED and o.settled else CODES[o.verdict]
        if o.replayed:
            replayed.append(o.replayed if "/" in o.replayed else f"{commit[:12]}/{o.replayed}")
        if o.verdict == CONFLICT and not conflict:
            c = o.conflicts[0] if o.conflicts else None
            where = f"{c.path} ({c.hunk or 'no hunk'})" if c else (o.probe or o.note)
            conflict = f"{o.patch}: {where}"
    return Row(line, commit, date, series, codes, conflict, replayed)


def sweep(
    co: Checkout,
    lines: tuple[str, ...] = LINES,
    since: str = str(SERIES_START),
    until: Optional[str] = None,
    every: int = 1,
    mirror: Optional[Path] = None,
    root: Optional[Path] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> tuple[list[Row], dict]:
    """The rows of every ``every``-th first-parent commit of ``lines``, and the run's facts
    (seconds, merges run)."""
    root = root or REPO_ROOT
    if every < 1:
        raise UserError(f"--every {every}: must be 1 or more")
    for flag, value in (("--since", since), ("--until", until)):
        try:
            if value is not None:
                datetime.date.fromisoformat(value)
        except ValueError:
            raise UserError(f"{flag} {value}: not a date (YYYY-MM-DD)") from None
    start = time.monotonic()
    s = Sweep(co, mirror, root)
    rows = []
    for line in lines:
        commits = line_commits(co, line, since, until)[::every]
        for i, (commit, date) in enumerate(commits):
            rows.append(s.run_commit(line, commit, date))
            if progress and i % 100 == 0:
                progress(f"{line}: {i}/{len(commits)}")
    facts = {"seconds": round(time.monotonic() - start, 1), "merges": s.merges,
             "commits": len(rows)}  # fmt: skip
    return rows, facts


def summary_lines(rows: list[Row], facts: dict) -> list[str]:
    """Per line: commits, how many take the whole series with no person, and the conflicts
    grouped by their first conflicting hunk."""
    out = []
    for line in dict.fromkeys(r.line for r in rows):
        mine = [r for r in rows if r.line == line]
        kinds = {k: sum(r.kind == k for r in mine)
                 for k in ("whole", "settled", "borrowed", "record")}  # fmt: skip
        bad = [r for r in mine if not r.whole]
        ok = len(mine) - len(bad)
        share = 100.0 * ok / len(mine) if mine else 0.0
        farther = sum(r.farther and r.whole for r in mine)
        how = (f"{kinds['whole']} merge cleanly, {kinds['settled']} with a conflict the tool "
               f"settles, {kinds['borrowed']} with a patch from another series, "
               f"{kinds['record']} through a stored resolution; {farther} of them with a "
               "farther series, the nearest conflicting or leaving a release out")  # fmt: skip
        out.append(f"{line}: {len(mine)} commits ({mine[0].date} .. {mine[-1].date}): {ok} "
                   f"({share:.1f}%) take the whole series with no person ({how}), "
                   f"{len(bad)} conflict")  # fmt: skip
        groups: dict[str, list[Row]] = {}
        for r in bad:
            groups.setdefault(r.conflict, []).append(r)
        for where, rs in sorted(groups.items(), key=lambda g: -len(g[1])):
            first, last = rs[0], rs[-1]
            out.append(f"  {len(rs):4} x {where} ({first.date} {first.commit[:12]} .. "
                       f"{last.date} {last.commit[:12]})")  # fmt: skip
    out.append(f"{facts['commits']} commits in {facts['seconds']} s ({facts['merges']} distinct "
               "merges; a commit whose files are another's shares its merge)")  # fmt: skip
    return out


def markdown(rows: list[Row], facts: dict, command: str) -> str:
    """The sweep as a markdown page: the summary, then a table of every commit."""
    legend = ", ".join(f"{c} {v}" for v, c in CODES.items())
    legend += (
        f", {SETTLED} applied with a conflict the tool settled, {BORROWED} the series' "
        "patch for a failed probe, taken from the next nearest series that has one"
    )
    text = [
        "# `apply` on every first-parent commit of main and dev",
        "",
        f"Written by `{command}`; do not edit by hand. Per commit: the series `apply` chooses and",
        f"one letter per patch in series order ({legend}).",
        "",
        "```",
        *summary_lines(rows, facts),
        "```",
    ]
    for line in dict.fromkeys(r.line for r in rows):
        text += ["", f"## {line}", "", "| date | commit | series | patches | first conflict |",
                 "|---|---|---|---|---|"]  # fmt: skip
        for r in (r for r in rows if r.line == line):
            series = f"{r.series} (farther)" if r.farther else r.series
            text.append(f"| {r.date} | `{r.commit[:12]}` | {series} | `{r.codes}` | "
                        f"{r.conflict.replace('|', '/')} |")  # fmt: skip
    return "\n".join(text) + "\n"


def configure(parser: argparse.ArgumentParser) -> None:
    """The checkout, the dates, the lines, the mirror and what to write."""
    parser.add_argument("checkout", metavar="CHECKOUT", help="a Megatron-LM clone or mirror")
    parser.add_argument("--since", default=str(SERIES_START),
                        help="first date (default %(default)s)")  # fmt: skip
    parser.add_argument("--until", help="last date (default: the line's head)")
    parser.add_argument("--line", action="append", choices=LINES,
                        help="main or dev (repeatable; default both)")  # fmt: skip
    parser.add_argument("--every", type=int, default=1,
                        help="keep every Nth commit (default 1)")  # fmt: skip
    parser.add_argument("--mirror", metavar="CHECKOUT",
                        help="a Megatron-LM mirror to read the stored bases from")  # fmt: skip
    parser.add_argument("--write", metavar="FILE",
                        help="write the table of every commit (markdown)")  # fmt: skip
    parser.add_argument("--quiet", action="store_true", help="print the summary only")


def run(args: argparse.Namespace) -> int:
    """Sweep and summarize; exit status 1 if a commit does not take the whole series."""
    co = open_checkout(Path(args.checkout))
    lines = tuple(args.line or LINES)
    rows, facts = sweep(co, lines, args.since, args.until, args.every,
                        Path(args.mirror) if args.mirror else None,
                        progress=lambda m: log(m))  # fmt: skip
    if not args.quiet:
        for r in rows:
            print(f"{r.line:4} {r.date} {r.commit[:12]} {r.series:14} {r.codes}"
                  + (f"  {r.conflict}" if r.conflict else ""))  # fmt: skip
    for line in summary_lines(rows, facts):
        print(line)
    if args.write:
        command = "moe_release.py sweep CHECKOUT " + " ".join(
            f"--{k} {v}" for k, v in (("since", args.since), ("until", args.until),
                                      ("every", args.every)) if v not in (None, 1))  # fmt: skip
        out = Path(args.write)
        tmp = out.with_name(f".{out.name}.tmp")
        try:
            tmp.write_text(markdown(rows, facts, command.strip()))
            os.replace(tmp, out)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise UserError(f"--write {out}: {exc.strerror or exc}") from None
        print(f"written: {args.write}")
    return 0 if all(r.whole for r in rows) else 1


register(
    Command(
        name="sweep",
        help="apply --dry-run on every first-parent commit of main and dev since a date",
        description="Choose and merge the series as apply --dry-run does on every first-parent "
        "commit of main and dev since --since (every Nth with --every), with no work tree: per "
        "commit the series and each patch's verdict, then per line how many take the whole "
        "series with no person and the conflicts grouped by hunk. Exit status 1 if a commit "
        "conflicts, 2 on bad input.",
        configure=configure,
        run=run,
    )
)
