# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""fused_a2a.reset_fused_a2a_buffers() drops the flex dispatcher's HybridEP and DeepEP buffers.

The buffers are module globals (HybridEP's one per process group) allocated outside PyTorch's
caching allocator, so torch.cuda.empty_cache() cannot return their memory.
reset_fused_a2a_buffers() releases them, collectively (destroy_model_parallel() calls it); the
next dispatch re-creates the buffer it needs and gives the same results.
"""

import gc
import weakref

import pytest
import torch

from megatron.core.transformer.moe import fused_a2a
from tests.unit_tests.test_utilities import Utils
from tests.unit_tests.transformer.moe.test_token_dispatcher_state_release import (
    build_moe_layer,
    forward_backward,
    is_deep_ep_available,
    is_hybrid_ep_available,
    make_input,
)

def _buffer(backend: str):
    """This rank's HybridEP buffer (of its one EP group) or DeepEP buffer, or None."""
    if backend == "hybridep":
        return next(iter(fused_a2a._hybrid_ep_buffers.values()), None)
    return fused_a2a._buffer


def test_reset_fused_a2a_buffers_is_idempotent_without_buffers():
    """Safe before any dispatch, and any number of times."""
    fused_a2a.reset_fused_a2a_buffers()
    fused_a2a.reset_fused_a2a_buffers()
    assert not fused_a2a._hybrid_ep_buffers
    assert fused_a2a._buffer is None


@pytest.mark.skipif(
    not is_deep_ep_available() and not is_hybrid_ep_available(),
    reason="Deep EP and Hybrid EP are not available",
)
class TestResetFusedA2ABuffers:
    def setup_method(self, method):
        pass

    def teardown_method(self, method):
        fused_a2a.reset_fused_a2a_buffers()
        Utils.destroy_model_parallel()

    @staticmethod
    def _flex_layer(backend: str):
        if backend == "deepep" and not is_deep_ep_available():
            pytest.skip("Deep EP is not available")
        if backend == "hybridep" and not is_hybrid_ep_available():
            pytest.skip("Hybrid EP is not available")
        return build_moe_layer(
            "flex",
            tp_size=1,
            ep_size=8,
            recompute=False,
            flex_backend=backend,
            dtype=torch.bfloat16,
            hidden_size=1024,
        )

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    @pytest.mark.parametrize("moe_flex_dispatcher_backend", ["deepep", "hybridep"])
    def test_release_and_recreate(self, moe_flex_dispatcher_backend):
        layer = self._flex_layer(moe_flex_dispatcher_backend)
        name = moe_flex_dispatcher_backend
        inp = make_input(layer)
        out_1, dgrad_1, _ = forward_backward(layer, inp)
        buffer = _buffer(name)
        assert buffer is not None, f"no {name} buffer after a dispatch"
        buffer_ref = weakref.ref(buffer)
        del buffer

        fused_a2a.reset_fused_a2a_buffers()
        gc.collect()
        assert _buffer(name) is None
        assert buffer_ref() is None, f"the released {name} buffer is still referenced"

        out_2, dgrad_2, _ = forward_backward(layer, inp)
        assert _buffer(name) is not None, f"the next dispatch did not re-create the {name} buffer"
        # Deterministic kernels on the same inputs: bitwise equal, not merely close.
        assert torch.equal(out_2, out_1)
        assert torch.equal(dgrad_2, dgrad_1)

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    @pytest.mark.parametrize("moe_flex_dispatcher_backend", ["deepep", "hybridep"])
    def test_destroy_model_parallel_releases(self, moe_flex_dispatcher_backend):
        layer = self._flex_layer(moe_flex_dispatcher_backend)
        name = moe_flex_dispatcher_backend
        forward_backward(layer, make_input(layer))
        assert _buffer(name) is not None, f"no {name} buffer after a dispatch"
        del layer
        Utils.destroy_model_parallel()
        assert _buffer(name) is None, f"the {name} buffer outlives destroy_model_parallel()"
