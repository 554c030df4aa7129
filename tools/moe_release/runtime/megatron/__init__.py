# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""megatron-core's real MoE pieces on CPU ranks: the harness, the 1F1B A2A-overlap schedule,
the fault scenarios and what a rank records of them.
"""
