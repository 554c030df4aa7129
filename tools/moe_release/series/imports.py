# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Import blocks that a tool can merge: the conflicts where both sides only add, drop or
reorder the imports at the top of a module.

An import block is the run of top-level ``import``/``from ... import`` statements that starts
at a module's first import (blank lines between them allowed; a comment, a ``try`` or any other
statement ends it). Where the 3-way merge of a patch conflicts only inside that block,
:func:`merge_imports` merges the three blocks as sets of bound names, the rest of the file with
``git merge-file``, and writes the block as upstream's isort settings (the ``[tool.isort]``
table of REF's ``pyproject.toml``) write it:

* every import REF has stays, unless the patch drops it and nothing in the merged file uses it;
* every import the patch adds is added;
* an import the patch's side has from its base but REF has not (REF predates it, or dropped
  it) is added only if the merged file uses the name it binds.

It refuses (returns None, the conflict stays for a person) what is not that: a conflict outside
the block, a block with a comment or a ``# noqa``, a REF whose block isort would rewrite, a
file that does not parse, and any host without isort (``pip install isort``; upstream pins
5.13.2).
"""

from __future__ import annotations

import ast
import dataclasses
import re
import tomllib
from typing import Callable, Optional

# A line that stands for the block while the rest of the file is merged.
PLACEHOLDER = b"# moe-release: the import block, merged as a set\n"

Key = tuple[str, str, str]  # (module of a from-import or "", imported name, bound name)


@dataclasses.dataclass(frozen=True)
class Block:
    """A module's import block: its byte span and the imports in it."""

    start: int  # byte offsets of the block's first and past its last line
    end: int
    keys: frozenset[Key]


def find_block(data: bytes) -> Optional[Block]:
    """The import block of ``data`` (None: no import, a syntax error, or a comment in it)."""
    try:
        tree = ast.parse(data)
    except (SyntaxError, ValueError):
        return None
    body = tree.body
    first = next((i for i, n in enumerate(body) if isinstance(n, (ast.Import, ast.ImportFrom))),
                 None)  # fmt: skip
    if first is None:
        return None
    last = first
    while last + 1 < len(body) and isinstance(body[last + 1], (ast.Import, ast.ImportFrom)):
        last += 1
    lines = data.splitlines(keepends=True)
    lo, hi = body[first].lineno - 1, body[last].end_lineno
    text = b"".join(lines[lo:hi])
    if b"#" in text or b";" in text or b"\\\n" in text:
        return None  # a comment or a noqa would be lost; several statements on a line
    keys: set[Key] = set()
    for node in body[first : last + 1]:
        if isinstance(node, ast.Import):
            keys |= {("", a.name, a.asname or a.name.split(".")[0]) for a in node.names}
        else:
            module = "." * node.level + (node.module or "")
            keys |= {(module, a.name, a.asname or a.name) for a in node.names}
    start = sum(len(line) for line in lines[:lo])
    return Block(start, start + len(text), frozenset(keys))


def _statement(key: Key) -> str:
    module, name, bound = key
    alias = "" if bound == (name if module else name.split(".")[0]) else f" as {bound}"
    if module:
        return f"from {module} import {name}{alias}\n"
    if alias:
        return f"import {name}{alias}\n"
    return f"import {name}\n"


def isort_style(pyproject: Optional[bytes]) -> Optional[Callable[[str], str]]:
    """isort's ``code`` with the ``[tool.isort]`` settings of ``pyproject`` (REF's); None if
    isort is not installed or REF has no such table."""
    try:
        import isort
    except ImportError:
        return None
    if not pyproject:
        return None
    try:
        table = tomllib.loads(pyproject.decode()).get("tool", {}).get("isort")
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        return None
    if not table:
        return None
    settings = {k: (str(v) if k == "py_version" else v) for k, v in table.items()
                if k not in ("skip", "extend_skip", "skip_glob", "extend_skip_glob")}  # fmt: skip
    try:
        config = isort.Config(**settings)
    except Exception:  # isort refuses a setting: no mechanical merge on this REF
        return None
    return lambda text: isort.code(text, config=config)


def _uses(name: str, body: bytes) -> bool:
    return re.search(rb"(?<![\w.])" + re.escape(name.encode()) + rb"\b", body) is not None


def _module_bindings(tree: ast.Module) -> set[str]:
    """The names a module's own top-level imports bind (those in a top-level ``try`` or ``if``
    too: the optional imports), not those a function imports for itself."""
    names: set[str] = set()
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, (ast.Try, ast.If)):
            todo += node.body + node.orelse + getattr(node, "finalbody", [])
            todo += [n for h in getattr(node, "handlers", []) for n in h.body]
    return names


def lost_imports(theirs: bytes, merged: bytes) -> list[str]:
    """Names the patched file (``theirs``) binds by a module-level import that ``merged`` uses
    but no longer binds at module level: a settle that kept REF's side of an import block where
    REF predates an import the patch's code needs. Empty where either does not parse."""
    try:
        want, have = _module_bindings(ast.parse(theirs)), _module_bindings(ast.parse(merged))
    except (SyntaxError, ValueError):
        return []
    body = b"\n".join(
        line for line in merged.splitlines() if not re.match(rb"\s*(import|from)\s", line)
    )
    return sorted(n for n in want - have if _uses(n, body))


def merge_imports(
    ours: bytes,
    base: bytes,
    theirs: bytes,
    merge_file: Callable[[bytes, bytes, bytes], tuple[bytes, int]],
    style: Callable[[str], str],
) -> Optional[tuple[bytes, int]]:
    """(merged bytes, conflicts left outside the block) with the import block merged as a set;
    None where that is not mechanical (the module docstring says when)."""
    blocks = [find_block(x) for x in (ours, base, theirs)]
    if any(b is None for b in blocks):
        return None
    bo, bb, bt = blocks
    cut = [x[: b.start] + PLACEHOLDER + x[b.end :] for x, b in zip((ours, base, theirs), blocks)]
    rest, n = merge_file(*cut)
    if rest.count(PLACEHOLDER) != 1 or _in_conflict(rest):
        return None
    ours_text = ours[bo.start : bo.end].decode()
    if style(ours_text) != ours_text:
        return None  # REF's block is not as isort writes it: a person decides
    body = rest.replace(PLACEHOLDER, b"")
    keys = set(bo.keys) | (bt.keys - bb.keys)
    keys -= {k for k in (bb.keys - bt.keys) & bo.keys if not _uses(k[2], body)}
    keys |= {k for k in (bt.keys & bb.keys) - bo.keys if _uses(k[2], body)}
    block = style("".join(_statement(k) for k in sorted(keys))).encode()
    return rest.replace(PLACEHOLDER, block), n


def _in_conflict(data: bytes) -> bool:
    """Whether the placeholder line sits inside a conflict region."""
    inside = False
    for line in data.splitlines(keepends=True):
        if line.startswith(b"<<<<<<< "):
            inside = True
        elif line.startswith(b">>>>>>> "):
            inside = False
        elif inside and line == PLACEHOLDER:
            return True
    return False
