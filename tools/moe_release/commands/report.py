# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""`report`: the memory report (:mod:`moe_release.report.cli`, which parses its own arguments);
``scripts/memory_report.py`` is its alias."""

from __future__ import annotations

import argparse

from moe_release.commands.registry import Command, register


def run(args: argparse.Namespace) -> int:
    """The tool's own ``main`` on the words after the command's name."""
    from moe_release.report.cli import main

    return main(args.argv, prog=args.prog)


register(
    Command(
        name="report",
        help="the side-by-side memory report of the base and patched trees on CPU ranks",
        run=run,
        aliases=('memory_report',),
        own_parser=True,
    )
)
