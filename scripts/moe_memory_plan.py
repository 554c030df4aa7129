#!/usr/bin/env python3
# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The MoE memory planner's command from this repository: the overlay module
``megatron/core/transformer/moe/moe_memory_planner.py`` (standard library only), loaded by path,
so it runs without a materialized tree. Installed, the same command is
``python -m megatron.core.transformer.moe.moe_memory_planner``. ``--help`` says what each
argument (Megatron's names) is, its default and its unit, and marks the required ones."""

import importlib.util
import sys
from pathlib import Path

MODULE = Path(__file__).resolve().parents[1] / "megatron/core/transformer/moe/moe_memory_planner.py"


def load_planner():
    """The planner module, by file path."""
    spec = importlib.util.spec_from_file_location("moe_memory_planner", MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    sys.exit(load_planner().main())
