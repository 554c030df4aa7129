# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""`per-patch`: each patch's upstream tests on the base and with the patch
(:mod:`moe_release.upstream_tests.per_patch`, which parses its own arguments);
``scripts/upstream_cpu/per_patch.py`` is its alias."""

from __future__ import annotations

import argparse

from moe_release.commands.registry import Command, register


def run(args: argparse.Namespace) -> int:
    """The tool's own ``main`` on the words after the command's name."""
    from moe_release.upstream_tests.per_patch import main

    return main(args.argv, prog=args.prog)


register(
    Command(
        name="per-patch",
        help="each patch's upstream tests, failing on the base and passing with the patch",
        run=run,
        aliases=('per_patch',),
        own_parser=True,
    )
)
