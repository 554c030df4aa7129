# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The MoE memory planner's command (``scripts/moe_memory_plan.py``), one module per concern:
``pricing`` (the overlay's ``moe_memory_planner`` package, which ships in the patched megatron-core,
loaded by path), ``inputs`` (Megatron's flags and a Megatron-Bridge YAML to a configuration),
``compare`` (the unpatched base beside the patched tree, and the table) and ``cli`` (the
command)."""
