# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The upstream refs the series is exported for, and which of this repository's series each
takes: the primary series, a variant (patches/upstream/<target>/) or a backport series."""

from __future__ import annotations

from pathlib import Path

from moe_release.common import REPO_ROOT, UserError
from moe_release.series.pins import Base, load_pins
from moe_release.series.repo import read_series, read_series_dir

# Targets whose code the primary series (over the 0.19.2 sdist) applies to as it is.
PRIMARY_TARGETS = ("core_r0.19.0",)
# Targets whose code moved: a variant of the whole series, written for that ref, lives in
# patches/upstream/<target>/ (series + mboxes, subjects as in the primary series).
VARIANT_TARGETS = ("main", "dev")
VARIANTS_DIR = REPO_ROOT / "patches" / "upstream"
# Release branches: the backport series of the pinned base whose `branch` this is.
BACKPORT_TARGETS = ("core_r0.18.0", "core_r0.17.0", "core_r0.16.0")


def target_series(target: str, root: Path = REPO_ROOT) -> list[tuple[str, bytes]]:
    """The series that applies to upstream ``target``: the primary series, the target's variant
    (patches/upstream/<target>/) or the backport series of the base pinned to that branch."""
    pins = load_pins(root / "patches" / "pins.toml")
    if target in PRIMARY_TARGETS:
        return read_series(pins.get(None), root)
    if target in VARIANT_TARGETS:
        vdir = root / "patches" / "upstream" / target
        if not (vdir / "series").exists():
            raise UserError(f"upstream {target}: no variant series ({vdir / 'series'})")
        return read_series_dir(vdir)
    if target in BACKPORT_TARGETS:
        # The branch's own series (patches/backports/<branch>), not an exact release's copy.
        base = next(
            (
                b
                for b in pins.bases.values()
                if b.branch == target and Path(b.series).name == target
            ),
            None,
        )
        if base is None:
            raise UserError(f"upstream {target}: no base in patches/pins.toml has that branch")
        if not (base.series_dir(root) / "series").exists():
            raise UserError(f"upstream {target}: no backport series yet ({base.series})")
        return read_series(base, root)
    known = ", ".join(PRIMARY_TARGETS + VARIANT_TARGETS + BACKPORT_TARGETS)
    raise UserError(f"unknown target {target!r} (one of {known})")


def target_base(target: str, root: Path = REPO_ROOT) -> Base:
    """The pinned base whose series :func:`target_series` reads for ``target``."""
    pins = load_pins(root / "patches" / "pins.toml")
    if target in PRIMARY_TARGETS:
        return pins.get(None)
    want = f"patches/upstream/{target}" if target in VARIANT_TARGETS else None
    for b in pins.bases.values():
        if (want and b.series == want) or (not want and b.branch == target
                                           and Path(b.series).name == target):  # fmt: skip
            return b
    raise UserError(f"upstream {target}: no base in patches/pins.toml carries its series")
