# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""`trees`: materialize the base and patched trees the tests run against, and print them as shell
exports; ``--list``: the bases run-tests runs; ``--from-checkout``: a checkout's trees."""

from __future__ import annotations

import argparse
import shlex
import tempfile
from pathlib import Path
from typing import Optional

from moe_release import settings
from moe_release.commands.registry import Command, register
from moe_release.common import UserError
from moe_release.series.checkout import build_checkout_trees
from moe_release.series.nearest import choose_series, history, open_checkout
from moe_release.series.source import BASES_ENV, CHECKOUT_ENV, add_base_options, listed_bases
from moe_release.series.trees import ensure_trees


def configure(parser: argparse.ArgumentParser) -> None:
    """``--base``, ``--checkout``, ``--list`` and a checkout's trees."""
    add_base_options(parser)
    parser.add_argument(
        "--list",
        action="store_true",
        help="print the bases whose release tests run-tests runs: the primary, then each base "
        f"with a series that can be read here (commit bases need ${CHECKOUT_ENV}; "
        f"${BASES_ENV} chooses)",
    )
    parser.add_argument(
        "--from-checkout",
        metavar="DIR",
        help="instead: the trees of a Megatron-LM git checkout carrying the series (apply's "
        "branch), under .build/trees/checkout-<commit12>: patched = DIR at --ref as committed, "
        "unpatched = the commit below its series commits (or --base-ref)",
    )
    parser.add_argument("--ref", help="with --from-checkout: the patched commit (default: HEAD)")
    parser.add_argument("--base-ref", metavar="REF0",
                        help="with --from-checkout: the commit without the series")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Print the trees' exports (or the bases, with ``--list``)."""
    if args.from_checkout:
        return _checkout_trees(args)
    if args.ref or args.base_ref:
        raise UserError("--ref and --base-ref go with --from-checkout")
    if args.list:
        print(" ".join(listed_bases()))
        return 0
    base, patched = ensure_trees(version=args.base)
    print(f"export MOE_RELEASE_BASE_TREE={shlex.quote(str(base))}")
    print(f"export MOE_RELEASE_TREE={shlex.quote(str(patched))}")
    return 0


def _checkout_trees(args: argparse.Namespace) -> int:
    """trees --from-checkout: a checkout's patched and unpatched trees, as shell exports."""
    co = open_checkout(Path(args.from_checkout))
    mirror = settings.megatron_lm()
    with tempfile.TemporaryDirectory(prefix="moe-trees-") as tmp:

        def line_of(commit: str) -> Optional[str]:
            try:
                hist = history(co, Path(mirror) if mirror else None, Path(tmp))
                return choose_series(hist, commit).line
            except UserError:
                return None  # no stored base in reach: the source names the commit only

        trees = build_checkout_trees(co, args.ref, args.base_ref, line_of=line_of)
    for key, value in (("MOE_RELEASE_BASE_TREE", trees.base), ("MOE_RELEASE_TREE", trees.patched),
                       ("MOE_RELEASE_RUN_NAME", trees.name),
                       ("MOE_RELEASE_RUN_SOURCE", trees.source)):  # fmt: skip
        print(f"export {key}={shlex.quote(str(value))}")
    return 0


register(
    Command(
        name="trees",
        help="materialize the base and patched trees the tests run against, under .build/trees",
        description="materialize a base's pristine and patched trees under .build/trees; prints "
        "shell exports of MOE_RELEASE_BASE_TREE and MOE_RELEASE_TREE",
        configure=configure,
        run=run,
    )
)
