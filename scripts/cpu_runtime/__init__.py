# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""What the memory report and the tests need to run megatron-core's real MoE code without CUDA.

* ``compat`` - stand-ins for CUDA-only calls (RNG, device lookups, side streams, uneven NCCL
  collectives) and the loader of the ``deep_ep`` emulation
* ``deep_ep_emulation`` - the DeepEP / HybridEP kernels over ``torch.distributed`` (gloo works)
* ``launcher`` - spawns real torch.distributed ranks (gloo) and collects their results
* ``cpu_memory`` (+ ``cpu_memory_counter.cpp``) - allocator-level host memory counters
* ``moe_harness`` - parallel state and small MoE configs/layers on the host

Imported with ``scripts/`` on ``sys.path``; nothing here imports from ``tests/``.
"""
