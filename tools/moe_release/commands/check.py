# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""`check`: every series applies with zero fuzz, compiles, round-trips byte-for-byte and has
its trailers."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from moe_release.commands.registry import Command, register
from moe_release.common import REPO_ROOT, UserError, log
from moe_release.series.git import create_edit_repo, format_patches
from moe_release.series.patches import check_trailers, name_problems, parse_patch, parse_series
from moe_release.series.pins import Base, load_pins
from moe_release.series.repo import overlay_files, read_series
from moe_release.series.source import (
    add_base_options,
    available,
    not_configured,
    read_base_files,
)
from moe_release.series.trees import build_tree

# What `patch`/`git apply --reject`/editors leave behind; a patch adding one vendors a copy.
LEFTOVER_SUFFIXES = (".orig", ".rej", ".porig", "~")


def check_base(base: Base, root: Path = REPO_ROOT) -> list[str]:
    """Problems with one base's series (empty when it is good)."""
    problems: list[str] = []
    try:
        patches = read_series(base, root)
    except UserError as exc:
        return [str(exc)]
    primary_file = root / "patches" / "series"
    primary = parse_series(primary_file.read_text(), str(primary_file))
    for name, _ in patches:
        if name not in primary:
            problems.append(
                f"{base.series_dir(root) / name}: names no patch of {primary_file} (a backport "
                "or upstream variant carries its primary patch's Patch-Name:)"
            )
    for name, data in patches:
        try:
            patch = parse_patch(data, name)
        except UserError as exc:
            problems.append(str(exc))
            continue
        missing = check_trailers(patch)
        if missing:
            problems.append(f"{name}: lacks trailer(s) {', '.join(missing)}")
        problems += name_problems(patch)
        for fp in patch.files:
            if fp.path.endswith(LEFTOVER_SUFFIXES):
                problems.append(f"{name}: adds {fp.path}, a leftover of patch/merge (remove it)")
    if problems:
        return problems
    base_files = read_base_files(base)
    try:
        build_tree(base, base_files, patches, overlay_files(root), compile_check=True)
    except UserError as exc:
        return [str(exc)]
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "edit"
        try:
            create_edit_repo(repo, base, base_files, patches)
            exported = format_patches(repo)
        except UserError as exc:
            return [str(exc)]
    if [n for n, _ in exported] != [n for n, _ in patches]:
        problems.append(
            f"series order/names do not round-trip: {[n for n, _ in patches]} -> "
            f"{[n for n, _ in exported]}"
        )
    for (name, data), (_, again) in zip(patches, exported):
        if data != again:
            problems.append(f"{name}: import+export changes the file (run edit, then export)")
    return problems


def run(args: argparse.Namespace) -> int:
    """Check each series (``--base``: one), the primary first; exit status 1 if one fails."""
    pins = load_pins()
    versions = [args.base] if args.base else sorted(pins.bases, key=lambda v: v != pins.primary)
    failed = False
    for version in versions:
        base = pins.get(version)
        if not (base.series_dir() / "series").exists():
            if version == pins.primary:
                print(f"{version}: FAIL no series file in {base.series}")
                failed = True
            else:
                print(f"{version}: no series yet ({base.series})")
            continue
        if not available(base):
            if args.base:
                read_base_files(base)  # named: refused, saying what to set
            print(f"{version}: skipped ({not_configured(base)})")
            continue
        log(f"checking the series for {version}")
        problems = check_base(base)
        n = len(read_series(base)) if not problems else None
        if problems:
            failed = True
            print(f"{version}: FAIL")
            for problem in problems:
                print(f"  {problem}")
        else:
            print(f"{version}: OK ({n} patches apply with zero fuzz, round-trip, trailers present)")
    return 1 if failed else 0


register(
    Command(
        name="check",
        help="apply every series with zero fuzz, round-trip it, check trailers",
        configure=add_base_options,
        run=run,
    )
)
