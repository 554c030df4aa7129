# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Conflicts a tool can settle without judgement, region by region.

``git merge-file`` reports a conflict wherever both sides change lines that touch, even where
the changes cannot overlap: REF dropped lines of the patch's context (the patch's base has code
the commit lacks, or REF removed it) right beside lines the patch inserts, or REF inserted a
line right above lines the patch rewrites. In a region of a ``--diff3`` merge where no change
of one side touches a change of the other (no base line changed by both, no insertion inside
lines the other changes, not both inserting at one point), both apply, each where it was made.
A region where they touch is left as a conflict (two-way markers, as
:func:`moe_release.series.merge.merge_file` writes them) for a person, except one: where the
base has no line in the region and both sides insert only whole new ``def``/``class``
statements (and, in a module, ``NAME = literal`` constants), no name in common, at one
indentation: both are kept, REF's first (their order does not matter).
"""

from __future__ import annotations

import ast
import difflib
import itertools
import textwrap
from typing import Optional

OURS_MARK, BASE_MARK, SEP_MARK, THEIRS_MARK = b"<<<<<<< ", b"||||||| ", b"=======", b">>>>>>> "


def _ops(base: list[bytes], side: list[bytes]) -> list[tuple[int, int, list[bytes]]]:
    """The side's changes to the base: ``(i1, i2, lines)`` replaces ``base[i1:i2]`` (an
    insertion where ``i1 == i2``, a deletion where ``lines`` is empty)."""
    matcher = difflib.SequenceMatcher(None, base, side, autojunk=False)
    return [(i1, i2, side[j1:j2]) for tag, i1, i2, j1, j2 in matcher.get_opcodes()
            if tag != "equal"]  # fmt: skip


def _touch(a: tuple[int, int, list], b: tuple[int, int, list]) -> bool:
    """Whether two changes cannot both apply: they change a base line in common, one inserts
    strictly inside the lines the other changes, or both insert at one point."""
    (a1, a2, _), (b1, b2, _) = a, b
    if a1 == a2 and b1 == b2:
        return a1 == b1
    if a1 == a2:
        return b1 < a1 < b2
    if b1 == b2:
        return a1 < b1 < a2
    return a1 < b2 and b1 < a2


def _definitions(lines: list[bytes]) -> Optional[set[str]]:
    """The names a block of whole ``def``/``class`` statements (and a module's ``NAME =
    literal`` constants) defines (decorators, comments and blank lines allowed, at one
    indentation); None if it is anything else."""
    text = b"".join(lines)
    if not text.strip():
        return None
    indent = min(len(x) - len(x.lstrip(b" ")) for x in lines if x.strip())
    try:
        tree = ast.parse(textwrap.dedent(text.decode()))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif indent == 0 and _constant(node):  # a module's constant: NAME = literal
            names.add(node.targets[0].id)
        else:
            return None
    if any(x.strip() and len(x) - len(x.lstrip(b" ")) < indent for x in lines):
        return None
    return names


def _constant(node: ast.stmt) -> bool:
    if not (isinstance(node, ast.Assign) and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)):  # fmt: skip
        return False
    try:
        ast.literal_eval(node.value)
    except ValueError:
        return False
    return True


def _both_define(ours: list[bytes], theirs: list[bytes]) -> Optional[list]:
    """REF and the patch each insert new definitions at the same point (no name in common):
    REF's, a blank line as the patch's block ends with, then the patch's."""
    o, t = _definitions(ours), _definitions(theirs)
    if o is None or t is None or o & t:
        return None
    gap = [b"\n"] * max(1, len(theirs) - len(list(itertools.dropwhile(
        lambda x: not x.strip(), reversed(theirs)))))  # fmt: skip
    if ours[-1].strip():
        return [*ours, *gap, *theirs]
    return [*ours, *theirs]


def settle_region(ours: list[bytes], base: list[bytes], theirs: list[bytes]) -> Optional[list]:
    """The region's lines with both sides' changes where no change of one touches a change of
    the other (an insertion right before or after lines the other changes goes before or after
    them), or where both only insert whole new definitions at one point with no base line
    between; None otherwise."""
    if not base:
        return _both_define(ours, theirs)
    o, t = _ops(base, ours), _ops(base, theirs)
    if not o or not t or any(_touch(a, b) for a in o for b in t):
        return None
    changes = sorted(o + t, key=lambda c: (c[0], c[1] != c[0]))  # an insertion first
    out: list[bytes] = []
    i = 0
    for i1, i2, lines in changes:
        out.extend(base[i:i1])
        out.extend(lines)
        i = max(i, i2)
    out.extend(base[i:])
    return out


def settle_adjacent(merged: bytes, keep_base: bool = False) -> tuple[bytes, int]:
    """A ``--diff3`` merge with each region :func:`settle_region` settles merged, the others
    written with two-way markers (with ``keep_base``, as they were: diff3 markers); and the
    number of conflicts left."""
    lines = merged.splitlines(keepends=True)
    out: list[bytes] = []
    left, i = 0, 0
    while i < len(lines):
        if not lines[i].startswith(OURS_MARK):
            out.append(lines[i])
            i += 1
            continue
        head, base_head = lines[i], BASE_MARK + b"base\n"
        sides: list[list[bytes]] = [[], [], []]
        part, i = 0, i + 1
        while i < len(lines) and not lines[i].startswith(THEIRS_MARK):
            if lines[i].startswith(BASE_MARK) and part == 0:
                part, base_head = 1, lines[i]
            elif lines[i].rstrip(b"\n") == SEP_MARK and part in (0, 1):
                part = 2
            else:
                sides[part].append(lines[i])
            i += 1
        tail = lines[i] if i < len(lines) else b""
        i += 1
        ours, base, theirs = sides
        settled = settle_region(ours, base, theirs)
        if settled is not None:
            out.extend(settled)
        else:
            left += 1
            middle = [base_head, *base] if keep_base else []
            out += [head, *ours, *middle, SEP_MARK + b"\n", *theirs, tail]
    return b"".join(out), left
