# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""What the memory report and the tests need to run megatron-core's real MoE code without CUDA.

One room per layer, lowest first: :mod:`.cuda` (CUDA's rules and CUDA-only calls on the host),
:mod:`.measure` (allocator counters, peaks, retained origins), :mod:`.kernels` (the
expert-parallel kernels' emulations), :mod:`.ranks` (spawning gloo ranks), :mod:`.megatron`
(megatron-core's MoE pieces, the A2A-overlap schedule, the fault scenarios) and :mod:`.shapes`
(the production-shape mode). Nothing here imports from ``tests/`` or from the planner.
"""
