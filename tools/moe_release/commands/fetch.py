# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""`fetch`: download the pinned sdist(s) into the cache and verify their sha256 (a commit base:
read it from the configured Megatron-LM checkout and verify its commit and tree)."""

from __future__ import annotations

import argparse

from moe_release import settings
from moe_release.commands.registry import Command, register
from moe_release.series.pins import load_pins
from moe_release.series.sdist import fetch_sdist
from moe_release.series.source import add_base_options, available, not_configured, read_base_files


def configure(parser: argparse.ArgumentParser) -> None:
    """``--base``, ``--checkout`` and ``--all``."""
    add_base_options(parser)
    parser.add_argument("--all", action="store_true", help="every pinned base")


def run(args: argparse.Namespace) -> int:
    """Fetch and verify each base named, one line each."""
    pins = load_pins()
    bases = pins.bases.values() if args.all else [pins.get(args.base)]
    for base in bases:
        if base.is_commit:
            if not available(base):
                print(f"{base.name}: skipped ({not_configured(base)})")
                continue
            files = read_base_files(base)
            print(f"{base.name}: {settings.megatron_lm()} (commit {base.commit[:12]}, tree "
                  f"{base.tree[:12]}… verified; {len(files)} files)")  # fmt: skip
            continue
        path = fetch_sdist(base)
        print(f"{base.version}: {path} (sha256 {base.sha256[:12]}… verified)")
    return 0


register(
    Command(
        name="fetch",
        help="download the pinned sdist into the cache and verify its sha256",
        configure=configure,
        run=run,
    )
)
