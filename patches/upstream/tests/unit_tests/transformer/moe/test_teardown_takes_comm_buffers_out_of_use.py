# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""destroy_model_parallel() takes the flex dispatcher's communication buffers out of use with
reset_fused_a2a_buffers() (no arguments), as NVIDIA/Megatron-LM#7029's RELEASE_COMMUNICATION
stage does: no collective, nothing freed, so a peer that never reaches the teardown cannot hold
it. The overlay's own patch until #7029 lands; no upstream PR carries it.
"""

import weakref

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.transformer.moe import fused_a2a
from tests.unit_tests.test_utilities import Utils
from tests.unit_tests.transformer.moe.flex_buffer_utils import (
    build_moe_layer,
    forward_backward,
    make_input,
    skip_unless,
)


class TestTeardownTakesCommBuffersOutOfUse:
    def teardown_method(self, method):
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        world = torch.distributed.group.WORLD
        fused_a2a.reset_fused_a2a_buffers(collective=True, group=world, graphs_released=True)
        Utils.destroy_model_parallel()

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    @pytest.mark.parametrize("moe_flex_dispatcher_backend", ["deepep", "hybridep"])
    def test_destroy_model_parallel_waits_on_no_peer(
        self, moe_flex_dispatcher_backend, monkeypatch
    ):
        backend = moe_flex_dispatcher_backend
        skip_unless(backend)
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        forward_backward(build_moe_layer(backend), make_input())
        alias = "_hybrid_ep_buffer" if backend == "hybridep" else "_buffer"
        buffer = getattr(fused_a2a, alias)
        assert buffer is not None, f"no {backend} buffer after a dispatch"
        buffer_ref = weakref.ref(buffer)
        del buffer

        def no_collective(*args, **kwargs):
            raise AssertionError("destroy_model_parallel() waited for its peers")

        with monkeypatch.context() as m:
            m.setattr(torch.distributed, "barrier", no_collective)
            m.setattr(torch.distributed, "all_gather_object", no_collective)
            parallel_state.destroy_model_parallel()
        Utils.inited = False  # torn down here, without Utils' barrier
        assert getattr(fused_a2a, alias) is None, f"the {backend} buffer is still in use"
        held = buffer_ref()
        assert held is not None and getattr(held, "runtime", True) is not None, "it was freed"
