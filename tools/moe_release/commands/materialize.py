# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""`materialize`: base sdist + series + this repository's new modules -> a complete patched
tree."""

from __future__ import annotations

import argparse
from pathlib import Path

from moe_release.commands.registry import Command, register
from moe_release.common import UserError
from moe_release.series.source import add_base_options
from moe_release.series.trees import materialize


def configure(parser: argparse.ArgumentParser) -> None:
    """``--base``, ``--checkout``, the target directory, and how much of the series."""
    add_base_options(parser)
    parser.add_argument("dir", metavar="DIR", help="target directory (absent or empty)")
    parser.add_argument("--no-series", action="store_true", help="base and new modules only")
    parser.add_argument(
        "--through",
        metavar="PATCH",
        help="apply the series only up to the patch whose name contains PATCH (bisecting, "
        "measuring one patch's effect)",
    )


def run(args: argparse.Namespace) -> int:
    """Write the tree and say what it holds."""
    if args.through and args.no_series:
        raise UserError("--through and --no-series exclude each other")
    tree = materialize(Path(args.dir), args.base, series=not args.no_series, through=args.through)
    print(f"{args.dir}: megatron-core {tree.version}")
    if tree.base.is_commit:
        print(f"  base: Megatron-LM {tree.base.branch} {tree.base.commit} (pin {tree.base.name}), "
              "commit and tree verified")  # fmt: skip
    else:
        print(f"  base: {tree.base.sdist} ({tree.base.tag}), sha256 verified")
    print(f"  patches: {len(tree.patches)}" + "".join(f"\n    {p}" for p in tree.patches))
    print(f"  new modules: {len(tree.overlay)}" + "".join(f"\n    {p}" for p in tree.overlay))
    return 0


register(
    Command(
        name="materialize",
        help="write base + series + new modules as a complete tree to DIR",
        configure=configure,
        run=run,
    )
)
