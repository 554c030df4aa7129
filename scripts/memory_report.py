#!/usr/bin/env python3
# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Side-by-side memory report: unpatched megatron-core against the moe-release series.

The command is ``moe_release.py report``, whose alias ``memory_report`` this script names
(:func:`moe_release.commands.cli.main`, tools/moe_release); this script runs it from a checkout
without installing the package: ``tools/`` goes on ``sys.path`` in place of this script's directory.
"""

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parents[0] / "tools")] + [
    p for p in sys.path if Path(p or ".").resolve() != _HERE
]

from moe_release.commands.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["memory_report", *sys.argv[1:]]))
