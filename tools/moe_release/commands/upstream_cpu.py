# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""`upstream-cpu`: upstream's unit tests on CPU ranks (:mod:`moe_release.upstream_tests.run`, which
parses its own arguments and hands the rest to pytest); ``scripts/upstream_cpu/run.py`` is its
alias."""

from __future__ import annotations

import argparse

from moe_release.commands.registry import Command, register


def run(args: argparse.Namespace) -> int:
    """The tool's own ``main`` on the words after the command's name."""
    from moe_release.upstream_tests.run import main

    return main(args.argv, prog=args.prog)


register(
    Command(
        name="upstream-cpu",
        help="run upstream Megatron-LM unit tests in a checkout on CPU ranks over gloo",
        run=run,
        aliases=('upstream_cpu',),
        own_parser=True,
    )
)
