#!/usr/bin/env python3
# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The MoE memory planner's command: every MoE memory term of a configuration on one rank.

The command is ``moe_release.py plan``, whose alias ``moe_memory_plan`` this script names
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
    sys.exit(main(["moe_memory_plan", *sys.argv[1:]]))
