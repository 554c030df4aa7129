# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""``python -m megatron.core.transformer.moe.moe_memory_planner``: the planner is a library."""

import sys

sys.exit(
    "moe_memory_planner: a library, not a command: call estimate(config, tokens_per_rank); "
    "the base-versus-patched table is moe-release's scripts/moe_memory_plan.py"
)
