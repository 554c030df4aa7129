# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""HybridEP keeps one communication buffer per process group's ranks (fused_a2a.
get_hybrid_ep_buffer), and every backward runs on its forward's buffer, so two models on
different EP groups (an RL policy and its reference model) can interleave their forwards and
backwards, and a dispatch never runs on a buffer bound to other peers (a destroyed group's).
Groups of the same ranks share a buffer while their group lives, so re-initializations reuse it.
Nothing frees a buffer here: one taken out of use stays referenced. The module global
fused_a2a._hybrid_ep_buffer names the buffer of the group that dispatched last, as code outside
megatron-core reads and assigns it.

The layer, its runs and the two EP groups are flex_buffer_utils.py's (shared with
test_fused_a2a_release_comm_buffers.py).
"""

import copy
import weakref
from types import SimpleNamespace

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.transformer.moe import fused_a2a
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from tests.unit_tests.test_utilities import Utils
from tests.unit_tests.transformer.moe.flex_buffer_utils import (
    TwoEPGroups,
    assert_bitwise_equal,
    build_moe_layer,
    forward_backward,
    make_input,
    run_backward,
    run_forward,
    skip_unless,
)


def test_hybridep_rebuilds_buffer_for_new_group(monkeypatch):
    """A dispatch on the group its buffer was made for reuses it, one on a new group makes its
    own, and fused_a2a._hybrid_ep_buffer names the buffer of the group that dispatched last;
    switching back reuses the first buffer (no new buffer per switch)."""
    created = []

    class Buffer:
        def __init__(self, group, **kwargs):
            self.group = group
            created.append(self)

        def dispatch_with_permute(self, **kwargs):
            return None, None, None, None, object()

    monkeypatch.setattr(fused_a2a, "HybridEPBuffer", Buffer, raising=False)
    monkeypatch.setattr(fused_a2a, "_hybrid_ep_buffer", None)
    # Tables of this test's own, so that no stand-in buffer outlives it in the module.
    table = copy.copy(fused_a2a._hybrid_ep_table)
    for name, value in vars(table).items():
        if isinstance(value, dict):
            setattr(table, name, {})
    table.aliased = None
    monkeypatch.setattr(fused_a2a, "_hybrid_ep_table", table)
    monkeypatch.setattr(fused_a2a, "_retired_buffers", [])
    first_group, second_group = object(), object()
    routing_map = torch.ones(2, 1, dtype=torch.bool)
    for group in (first_group, first_group, second_group, first_group):
        fused_a2a.HybridEPDispatch.forward(
            SimpleNamespace(), torch.ones(2, 4), routing_map, None, group, 1
        )
        assert fused_a2a._hybrid_ep_buffer.group is group
    assert [buffer.group for buffer in created] == [first_group, second_group]
    fused_a2a.reset_hybrid_ep_buffer()
    assert fused_a2a._hybrid_ep_buffer is None


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
        for k in "AB":  # each layer on a buffer of its own group only
            fused_a2a.reset_hybrid_ep_buffer()
            alone[k] = forward_backward(layers[k], inputs[k])
        fused_a2a.reset_hybrid_ep_buffer()

        x_a, out_a = run_forward(layers["A"], inputs["A"])
        x_b, out_b = run_forward(layers["B"], inputs["B"])
        interleaved = {"A": run_backward(layers["A"], x_a, out_a)}
        interleaved["B"] = run_backward(layers["B"], x_b, out_b)
        for k in "AB":
            assert_bitwise_equal(interleaved[k], alone[k], f"layer {k} interleaved")
        # The flex dispatcher communicates over its TPxEP group (with TP 1, the EP ranks).
        groups = [layer.token_dispatcher.tp_ep_group for layer in layers.values()]
        buffers = [fused_a2a.get_hybrid_ep_buffer(g) for g in groups]
        assert all(b.group is g for b, g in zip(buffers, groups))
        assert buffers[0] is not buffers[1], "the two layers' groups share one HybridEP buffer"

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
        fused_a2a.reset_hybrid_ep_buffer()
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
    def test_hybridep_reinitialization_reuses_the_buffer(self, monkeypatch):
        """Model parallelism initialized, a step, torn down, five times over (as tests that
        re-initialize per test do): each round's dispatch runs on a buffer of its groups' ranks,
        and one buffer is made, not one per round. destroy_model_parallel() forgets the groups
        and destroys none, so the buffer's group lives on; a teardown that destroys them (#7029)
        makes the next round allocate, and the old buffer waits for the explicit release."""
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
            assert len(alive) == 1, f"round {round}: {len(alive)} HybridEP buffers, not one"
            assert torch.distributed.get_process_group_ranks(alive[0].group) == ranks
            del layer, alive
            Utils.destroy_model_parallel()

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_hybridep_buffer_of_a_destroyed_group_serves_no_dispatch(self, monkeypatch):
        """After the groups are destroyed (an in-process restart's abort: the ranks may be other
        processes now) and model parallelism is initialized again, the next dispatch runs on a
        buffer made for the new group, bitwise as the first lifetime did: the old group's
        buffer serves no dispatch."""
        skip_unless("hybridep")
        made = []

        class RecordingBuffer(fused_a2a.HybridEPBuffer):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                made.append(weakref.ref(self))

        monkeypatch.setattr(fused_a2a, "HybridEPBuffer", RecordingBuffer)
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        first = forward_backward(build_moe_layer("hybridep"), make_input())
        world = torch.distributed.group.WORLD
        groups = {
            id(g): g
            for g in vars(parallel_state).values()
            if isinstance(g, torch.distributed.ProcessGroup) and g is not world
        }
        for group in groups.values():
            torch.distributed.destroy_process_group(group)
        Utils.destroy_model_parallel()
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        layer = build_moe_layer("hybridep")
        second = forward_backward(layer, make_input())
        assert_bitwise_equal(second, first, "after the groups were destroyed")
        assert len(made) == 2, f"{len(made)} HybridEP buffers made: the old group's was reused"
        assert fused_a2a._hybrid_ep_buffer is made[1]()
        assert made[1]().group is layer.token_dispatcher.tp_ep_group
