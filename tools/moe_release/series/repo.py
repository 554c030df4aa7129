# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""What the tooling reads from this repository: a base's series and the overlay modules."""

from __future__ import annotations

from pathlib import Path

from moe_release.common import REPO_ROOT, UserError
from moe_release.series.patches import parse_series
from moe_release.series.pins import Base

# New modules this repo adds to megatron-core live here, mirroring megatron-core's layout.
OVERLAY_DIRS = ("megatron/core/transformer/moe",)


def read_series(base: Base, root: Path = REPO_ROOT) -> list[tuple[str, bytes]]:
    """(name, mbox bytes) of a base's series, checked for missing and unlisted files."""
    sdir = base.series_dir(root)
    if not (sdir / "series").exists():
        raise UserError(f"{sdir / 'series'}: no series file for base {base.version}")
    return read_series_dir(sdir)


def read_series_dir(sdir: Path) -> list[tuple[str, bytes]]:
    """(name, mbox bytes) of the series in directory ``sdir`` (its ``series`` file and mboxes),
    checked for missing and unlisted files."""
    series_file = sdir / "series"
    if not series_file.exists():
        raise UserError(f"{series_file}: no series file")
    names = parse_series(series_file.read_text(), str(series_file))
    missing = [n for n in names if not (sdir / n).is_file()]
    if missing:
        raise UserError(f"{series_file}: lists {missing[0]}, which does not exist in {sdir}")
    unlisted = sorted(p.name for p in sdir.glob("*.patch") if p.name not in names)
    if unlisted:
        raise UserError(f"{sdir}/{unlisted[0]}: patch file is not listed in {series_file}")
    return [(n, (sdir / n).read_bytes()) for n in names]


def overlay_files(root: Path = REPO_ROOT) -> list[tuple[str, bytes]]:
    """(tree path, bytes) of the new modules this repo adds to megatron-core. An overlay
    directory (a megatron-core package) must hold no ``__init__.py``; a new subpackage of ours
    below it (the planner) has its own."""
    out = []
    for rel in OVERLAY_DIRS:
        directory = root / rel
        if not directory.is_dir():
            continue
        for path in sorted(directory.rglob("*")):
            if path.is_dir() or "__pycache__" in path.parts or path.name.startswith("."):
                continue
            if path.name == "__init__.py" and path.parent == directory:
                raise UserError(
                    f"{path.relative_to(root)}: the overlay must not contain __init__.py at "
                    f"{rel} (it would shadow megatron-core on sys.path)"
                )
            out.append((str(path.relative_to(root)), path.read_bytes()))
    return out
