# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""`edit`: the series as a git repository: the base commit (tag `base`) and one commit per
patch, to edit with git and write back with `export`."""

from __future__ import annotations

import argparse
from pathlib import Path

from moe_release.commands.registry import Command, register
from moe_release.series.git import create_edit_repo
from moe_release.series.pins import load_pins
from moe_release.series.repo import read_series
from moe_release.series.source import add_base_options, read_base_files
from moe_release.series.trees import check_target_dir


def configure(parser: argparse.ArgumentParser) -> None:
    """``--base``, ``--checkout`` and the target directory."""
    add_base_options(parser)
    parser.add_argument("dir", metavar="DIR", help="target directory (absent or empty)")


def run(args: argparse.Namespace) -> int:
    """Create the repository and say how to go on."""
    base = load_pins().get(args.base)
    check_target_dir(Path(args.dir))
    patches = read_series(base)
    create_edit_repo(Path(args.dir), base, read_base_files(base), patches)
    print(f"{args.dir}: {base.describe()} at tag `base`, {len(patches)} patch commit(s)")
    print("  edit with git (commit --fixup, rebase -i base), then run: export " + args.dir)
    return 0


register(
    Command(
        name="edit",
        help="create a git repo at DIR: base commit (tag `base`) + one commit per patch",
        configure=configure,
        run=run,
    )
)
