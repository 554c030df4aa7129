#!/usr/bin/env python3
# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The MoE memory planner's command: every MoE memory term of a configuration on one rank,
unpatched megatron-core beside patched, as a table or ``--json``. Its logic is the
``memory_plan`` package beside this file; the pricing is the overlay module
``megatron/core/transformer/moe/moe_memory_planner.py`` (standard library only; it ships in the
patched megatron-core as a function, ``estimate``), loaded by path, so the command runs without
a materialized tree. ``--help`` says what each argument (Megatron's names) is, its default and
its unit, and marks the required ones."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory_plan.cli import main  # noqa: E402
from memory_plan.pricing import load_planner  # noqa: E402, F401 - the tests' route to the planner

if __name__ == "__main__":
    sys.exit(main())
