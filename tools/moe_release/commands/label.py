# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""`label`: the overlay version label (base+label) of a base's series."""

from __future__ import annotations

import argparse

from moe_release.commands.registry import Command, register
from moe_release.series.patches import overlay_label
from moe_release.series.pins import load_pins
from moe_release.series.repo import overlay_files, read_series
from moe_release.series.source import add_base_options


def configure(parser: argparse.ArgumentParser) -> None:
    """``--base``, ``--checkout`` and ``--no-series``."""
    add_base_options(parser)
    parser.add_argument(
        "--no-series", action="store_true", help="label of the base + new modules only"
    )


def run(args: argparse.Namespace) -> int:
    """Print the label."""
    base = load_pins().get(args.base)
    patches = read_series(base) if not args.no_series else []
    print(f"{base.version}+{overlay_label(base, patches, overlay_files())}")
    return 0


register(
    Command(
        name="label",
        help="print the overlay version (base+label) of the series",
        configure=configure,
        run=run,
    )
)
