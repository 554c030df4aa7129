# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""`export`: write the commits of an `edit` repository back into the series (churn-free)."""

from __future__ import annotations

import argparse
from pathlib import Path

from moe_release.commands.registry import Command, register
from moe_release.series.git import export_series


def configure(parser: argparse.ArgumentParser) -> None:
    """The repository `edit` made."""
    parser.add_argument("dir", metavar="DIR", help="a repo made by `edit`")


def run(args: argparse.Namespace) -> int:
    """Write the series; name each file written or deleted."""
    base, written, deleted = export_series(Path(args.dir))
    if not written and not deleted:
        print(f"{base.series}: unchanged")
    for name in written:
        print(f"{base.series}/{name}: written")
    for name in deleted:
        print(f"{base.series}/{name}: deleted")
    return 0


register(
    Command(
        name="export",
        help="write an edit repo's commits back into the series",
        configure=configure,
        run=run,
    )
)
