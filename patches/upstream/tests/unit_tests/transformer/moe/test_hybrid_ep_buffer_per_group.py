# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""HybridEP keeps one communication buffer per process group (fused_a2a.get_hybrid_ep_buffer and
set_hybrid_ep_buffer), and every backward runs on its forward's buffer, so two models on
different EP groups (an RL policy and its reference model) can interleave their forwards and
backwards. The module global fused_a2a._hybrid_ep_buffer still holds the first group's buffer,
as code outside megatron-core reads and assigns it. A buffer lives as long as its group: a
re-initialization of model parallelism keeps no buffer of the groups it replaced.

The layer, its runs and the two EP groups are flex_buffer_utils.py's (shared with
test_fused_a2a_release_comm_buffers.py).
"""

import copy
import weakref

import pytest
import torch

from megatron.core.transformer.moe import fused_a2a
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from tests.unit_tests.test_utilities import Utils
from tests.unit_tests.transformer.moe.flex_buffer_utils import (
    TwoEPGroups,
    assert_bitwise_equal,
    build_moe_layer,
    forward_backward,
    make_input,
    release_buffers,
    run_backward,
    run_forward,
    skip_unless,
)


@pytest.mark.skipif(not fused_a2a.HAVE_HYBRIDEP, reason="Hybrid EP is not available")
class TestHybridEPBufferPerGroup(TwoEPGroups):
    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_hybridep_two_models_on_different_ep_groups(self):
        """Layer A on EP groups [0-3],[4-7], layer B on [0,2,4,6],[1,3,5,7], forwards and
        backwards interleaved (A's backward after B's forward): every dispatch, combine and
        backward runs on its own group's buffer, so the results are bitwise those of each layer
        run alone, and there is one buffer per group."""
        skip_unless("hybridep")
        _, group_b = self.two_ep_groups()
        pgc_b = copy.copy(get_default_pg_collection())
        pgc_b.ep = pgc_b.tp_ep = group_b
        layers = {"A": build_moe_layer("hybridep"), "B": build_moe_layer("hybridep", pgc_b)}
        inputs = {"A": make_input(1000), "B": make_input(2000)}

        alone = {}
        for k in "AB":  # each layer on buffers of its own group only
            release_buffers()
            alone[k] = forward_backward(layers[k], inputs[k])
        release_buffers()

        x_a, out_a = run_forward(layers["A"], inputs["A"])
        x_b, out_b = run_forward(layers["B"], inputs["B"])
        interleaved = {"A": run_backward(layers["A"], x_a, out_a)}
        interleaved["B"] = run_backward(layers["B"], x_b, out_b)
        for k in "AB":
            assert_bitwise_equal(interleaved[k], alone[k], f"layer {k} interleaved")
        # The flex dispatcher communicates over its TPxEP group (with TP 1, the EP ranks).
        groups = {layer.token_dispatcher.tp_ep_group for layer in layers.values()}
        assert len(groups) == 2
        buffers = [fused_a2a._hybrid_ep_buffer, *fused_a2a._hybrid_ep_buffers.values()]
        buffers = [b for b in buffers if b is not None]
        assert {b.group for b in buffers} == groups and len(
            buffers
        ) == 2, f"{len(buffers)} HybridEP buffers, not one for each of the two layers' groups"
        assert all(fused_a2a.get_hybrid_ep_buffer(g).group is g for g in groups)

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_hybridep_module_global_is_what_dispatches_use(self, monkeypatch):
        """fused_a2a._hybrid_ep_buffer, which code outside megatron-core reads and test
        fixtures save and restore: None before a dispatch, then the buffer the dispatch ran on;
        set to None, the next dispatch allocates a buffer and the global names it; restored,
        the saved buffer is the one the next dispatch runs on."""
        skip_unless("hybridep")
        used = []

        class RecordingBuffer(fused_a2a.HybridEPBuffer):
            def dispatch_with_permute(self, *args, **kwargs):
                used.append(self)
                return super().dispatch_with_permute(*args, **kwargs)

        monkeypatch.setattr(fused_a2a, "HybridEPBuffer", RecordingBuffer)
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        release_buffers()
        assert fused_a2a._hybrid_ep_buffer is None
        layer = build_moe_layer("hybridep")
        forward_backward(layer, make_input())
        saved = fused_a2a._hybrid_ep_buffer
        assert saved is not None and saved is used[-1]
        monkeypatch.setattr(fused_a2a, "_hybrid_ep_buffer", None)
        forward_backward(layer, make_input())
        assert used[-1] is not saved and fused_a2a._hybrid_ep_buffer is used[-1]
        fused_a2a._hybrid_ep_buffer = saved
        forward_backward(layer, make_input())
        assert used[-1] is saved

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_hybridep_reinitialization_keeps_no_buffer_of_old_groups(self, monkeypatch):
        """Model parallelism initialized, a step, torn down, five times over (as tests that
        re-initialize per test do): each round's dispatch runs on a buffer of its groups' ranks,
        and one buffer is alive, not one per round."""
        skip_unless("hybridep")
        made = []

        class RecordingBuffer(fused_a2a.HybridEPBuffer):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                made.append(weakref.ref(self))

        monkeypatch.setattr(fused_a2a, "HybridEPBuffer", RecordingBuffer)
        for round in range(5):
            Utils.initialize_model_parallel(expert_model_parallel_size=8)
            layer = build_moe_layer("hybridep")
            forward_backward(layer, make_input())
            ranks = torch.distributed.get_process_group_ranks(layer.token_dispatcher.tp_ep_group)
            alive = [r() for r in made if r() is not None]
            assert len(alive) == 1, f"round {round}: {len(alive)} HybridEP buffers alive, not one"
            assert torch.distributed.get_process_group_ranks(alive[0].group) == ranks
            del layer, alive
            Utils.destroy_model_parallel()
