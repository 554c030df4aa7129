# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The expert-parallel kernels emulated over torch.distributed: one module per buffer API.

:mod:`.deepep_module` is the ``deep_ep`` package megatron-core imports (HybridEP and DeepEP v1),
:mod:`.deepepv2_emulation` DeepEP v2's ``ElasticBuffer``, :mod:`.ncclep_emulation`
TransformerEngine's NCCL EP; :mod:`.emulation_common` is what they share. Each sizes its buffers
from its own reading of the kernels, never from the planner.
"""
