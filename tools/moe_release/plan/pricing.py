# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The pricing: the overlay module ``megatron/core/transformer/moe/moe_memory_planner.py``
(standard library only), loaded once by file path, so the command runs without a materialized
tree or an installed megatron-core."""

import importlib.util
from pathlib import Path
from types import ModuleType

MODULE = Path(__file__).resolve().parents[3] / "megatron/core/transformer/moe/moe_memory_planner.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("moe_memory_planner", MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


planner = _load()


def load_planner() -> ModuleType:
    """The pricing module (the overlay's ``moe_memory_planner``, loaded by path once)."""
    return planner
