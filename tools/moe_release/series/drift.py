# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The release code, compared across series: one implementation on every branch.

The *release code* is what the primary series adds to megatron-core: every function, method and
class attribute present in the patched primary tree and absent from its base. Each other series
(backports, the main/dev variants) must end with the same definitions, compared as code (the
AST with docstrings, so comments may differ where a branch lacks what they mention), or name
the ones it does not carry, with the reason, in the ``not-carried`` tables of the patch they
belong to (``[[patch.<name>.not-carried]]`` in patches/topics.toml). On dev, which already has
part of the API (#5869), the definitions the series modifies count as well: after the series
they must equal the primary's.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterable, Mapping, Optional

from moe_release.series.patches import apply_file_patch, parse_patch
from moe_release.series.topics import load_topics

Files = Mapping[str, Optional[bytes]]


def definitions(source: bytes, path: str) -> dict[str, str]:
    """``qualname -> ast.dump`` of the module's top-level functions and classes' methods and
    attributes (one level of nesting: megatron's layout)."""
    tree = ast.parse(source, filename=path)
    out: dict[str, str] = {}

    def add(name: str, node: ast.AST) -> None:
        out[name] = ast.dump(node, include_attributes=False)

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            add(node.name, node)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    add(f"{node.name}.{item.name}", item)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    for target in targets:
                        if isinstance(target, ast.Name):
                            add(f"{node.name}.{target.id}", item)
    return out


def apply_series(files: Files, series: Iterable[tuple[str, bytes]]) -> dict[str, Optional[bytes]]:
    """The files a series touches, after it (``files`` holds the base's)."""
    out: dict[str, Optional[bytes]] = {}
    for name, data in series:
        for fp in parse_patch(data, name).files:
            old = out[fp.path] if fp.path in out else files.get(fp.path)
            out[fp.path] = apply_file_patch(old, fp, name)
    return out


def python_defs(files: Files) -> dict[str, str]:
    """``path::qualname -> dump`` over the Python files in ``files``."""
    out: dict[str, str] = {}
    for path, data in files.items():
        if data is None or not path.endswith(".py"):
            continue
        for name, dump in definitions(data, path).items():
            out[f"{path}::{name}"] = dump
    return out


def release_code(base: Files, patched: Files) -> dict[str, str]:
    """The definitions the primary series adds: in ``patched``, not in ``base``."""
    before = python_defs({p: base.get(p) for p in patched})
    after = python_defs(patched)
    return {k: v for k, v in after.items() if k not in before}


def not_carried(root: Optional[Path] = None) -> dict[tuple[str, str], str]:
    """(series directory, "path::qualname") -> why that series does not end with that
    definition, or ends with a different one: patches/topics.toml's ``not-carried`` tables."""
    topics = load_topics(root) if root else load_topics()
    return {key: why for key, (_, why) in topics.not_carried.items()}


def drift(
    release: Mapping[str, str],
    target_base: Files,
    target_patched: Files,
    sdir: str,
    skip: Optional[Mapping[tuple[str, str], str]] = None,
) -> list[str]:
    """One line per release definition the target series does not end with as the primary
    does (absent, or different), unless ``skip`` (default: :func:`not_carried`) names it for
    ``sdir``."""
    skip = not_carried() if skip is None else skip
    paths = {key.split("::", 1)[0] for key in release} | set(target_patched)
    files = {p: target_patched.get(p, target_base.get(p)) for p in paths}
    have = python_defs(files)
    by_name: dict[str, list[str]] = {}
    for key, dump in have.items():  # a module that moved on this branch (dev's
        by_name.setdefault(key.split("::", 1)[1], []).append(dump)  # fine_grained_callables)
    problems = []
    for key, dump in sorted(release.items()):
        if (sdir, key) in skip:
            continue
        found = [have[key]] if key in have else by_name.get(key.split("::", 1)[1], [])
        if not found:
            problems.append(f"{sdir}: {key} is missing (the primary series adds it)")
        elif dump not in found:
            problems.append(f"{sdir}: {key} differs from the primary series' code")
    return problems


def compare_all(
    checkout: Optional[Path] = None, root: Optional[Path] = None
) -> tuple[list[str], list[str]]:
    """Compare every series that can be read here with the primary series: (names of the bases
    compared, problems). Commit bases need a Megatron-LM checkout (``checkout`` or
    ``$MOE_RELEASE_MEGATRON_LM``); without one they are not compared."""
    from moe_release.common import REPO_ROOT
    from moe_release.series.pins import load_pins
    from moe_release.series.repo import read_series
    from moe_release.series.source import available, read_base_files

    root = root or REPO_ROOT
    pins = load_pins(root / "patches" / "pins.toml")
    primary = pins.get(None)
    files = read_base_files(primary)
    release = release_code(files, apply_series(files, read_series(primary, root)))
    compared, problems = [], []
    for base in pins.bases.values():
        if base is primary or not (base.series_dir(root) / "series").exists():
            continue
        if base.is_commit and checkout is None and not available(base):
            continue
        theirs = read_base_files(base, checkout)
        patched = apply_series(theirs, read_series(base, root))
        problems += drift(release, theirs, patched, base.series, not_carried(root))
        compared.append(base.name)
    return compared, problems
