# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""`landed`: which patches of a series a newer checkout already contains.

The test is hunkstate.py's, which ``port`` and ``apply`` share: each hunk is looked for
anywhere in its file, its new side present meaning "applied", its old side "pending", neither
"conflict"; a patch whose hunks are all applied has landed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moe_release.commands.registry import Command, register
from moe_release.common import UserError
from moe_release.series.hunkstate import PatchState, dir_series_states
from moe_release.series.patches import Patch, parse_patch
from moe_release.series.pins import load_pins
from moe_release.series.repo import read_series
from moe_release.series.source import add_base_options
from moe_release.series.targets import target_series


def landed_states(checkout: Path, patches: list[Patch]) -> list[PatchState]:
    """The state of every patch in ``checkout`` (a Megatron-LM checkout or a megatron-core
    tree: any directory holding ``megatron/core``).

    The series is read as a whole: landed patches are peeled off from the end first (a later
    patch may rewrite lines an earlier one added), then the rest are judged in order, each
    applied in memory once it is found to apply, so that later patches see it."""
    if not checkout.exists():
        raise UserError(f"{checkout}: checkout does not exist")
    if not checkout.is_dir():
        raise UserError(f"{checkout}: checkout is not a directory")
    if not (checkout / "megatron" / "core").is_dir():
        raise UserError(f"{checkout}: not a checkout (no megatron/core in it)")
    return dir_series_states(checkout, patches)


def configure(parser: argparse.ArgumentParser) -> None:
    """``--base``, ``--checkout``, the checkout looked at and the exported series' target."""
    add_base_options(parser)
    parser.add_argument("checkout", metavar="CHECKOUT", help="a tree holding megatron/core")
    parser.add_argument("--target", help="check the series `upstream TARGET` exports (e.g. dev)")


def run(args: argparse.Namespace) -> int:
    """Print each patch's verdict and how many landed."""
    if args.target:
        series, what = target_series(args.target), f"upstream {args.target} series"
    else:
        base = load_pins().get(args.base)
        series, what = read_series(base), f"series for {base.version}"
    patches = [parse_patch(data, name) for name, data in series]
    checkout = Path(args.checkout)
    states = landed_states(checkout, patches)
    print(f"{what} against {checkout}:")
    for state in states:
        print(f"  {state.verdict:22} {state.name} ({state.counts()})")
    landed = [s.name for s in states if s.verdict == "landed"]
    print(f"{len(landed)} of {len(states)} landed" + (": drop them on rebase" if landed else ""))
    return 0


register(
    Command(
        name="landed",
        help="report which patches a newer checkout already contains (rebase aid)",
        configure=configure,
        run=run,
    )
)
