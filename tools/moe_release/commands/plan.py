# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""`plan`: the MoE memory planner's command (:mod:`moe_release.plan.cli`, which parses its own
arguments); ``scripts/moe_memory_plan.py`` is its alias."""

from __future__ import annotations

import argparse

from moe_release.commands.registry import Command, register


def run(args: argparse.Namespace) -> int:
    """The tool's own ``main`` on the words after the command's name."""
    from moe_release.plan.cli import main

    return main(args.argv)


register(
    Command(
        name="plan",
        help="every MoE memory term of a configuration on one rank (the planner)",
        run=run,
        aliases=('moe_memory_plan',),
        own_parser=True,
    )
)
