# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""The flex dispatcher's communication buffers have a lifecycle: released collectively by
fused_a2a.reset_fused_a2a_buffers(), without waiting on any peer by destroy_model_parallel(),
DeepEP's destroyed explicitly, NCCL EP's context released with them (HybridEP's buffer per
process group: test_hybrid_ep_buffer_per_group.py).

The HybridEP and DeepEP buffers are module globals allocated outside PyTorch's caching
allocator, so torch.cuda.empty_cache() cannot return their memory:

* reset_fused_a2a_buffers() frees them after a barrier on every buffer's group (in one order on
  every rank), not while a CUDA graph that captured a dispatch may still replay (unless
  graphs_released=True); the next dispatch re-creates the buffer it needs and gives the same
  results.
* destroy_model_parallel() waits on no peer: it drops the HybridEP buffers and takes DeepEP's
  out of use; the next dispatch destroys it (collective) before allocating its replacement.
* DeepEP's buffer is built with explicitly_destroy where deep_ep supports it and destroyed only
  where every rank of its group arrives together.
* NCCL EP's process-wide context (TransformerEngine serves one EP group per process) is
  released by the collective call, and a model on another EP group is refused until then
  instead of dispatching over the bootstrapped group's communicator.
"""

import copy
import functools
import gc
import inspect
import weakref

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.transformer.moe import fused_a2a
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from tests.unit_tests.test_utilities import Utils
from tests.unit_tests.transformer.moe.flex_buffer_utils import (
    HIDDEN_SIZE,
    MICRO_BATCH,
    NUM_EXPERTS,
    SEQ_LEN,
    TwoEPGroups,
    assert_bitwise_equal,
    build_moe_layer,
    forward_backward,
    make_input,
    run_forward,
    skip_unless,
)


def _nccl_ep_group():
    """The EP group NCCL EP is bootstrapped on (as fused_a2a recorded it), or None."""
    if not getattr(fused_a2a, "HAVE_TE_EP", False) or not hasattr(fused_a2a, "_nccl_ep_group"):
        return None
    return fused_a2a._nccl_ep_group if fused_a2a.is_nccl_ep_bootstrapped() else None


def _held_buffer(backend: str):
    """This rank's HybridEP buffer (of its one EP group), DeepEP buffer, or NCCL EP's group
    (while its context is bootstrapped), or None."""
    if backend == "ncclep":
        return _nccl_ep_group()
    if backend == "hybridep":
        return fused_a2a.get_hybrid_ep_buffer(None)  # the only one; raises if there are several
    return fused_a2a._buffer


def _held_buffers() -> list:
    """Every HybridEP buffer and the DeepEP buffer this rank holds in use."""
    held = [fused_a2a._hybrid_ep_buffer, *fused_a2a._hybrid_ep_buffers.values(), fused_a2a._buffer]
    return [b for b in held if b is not None]


class _CapturingCuda:
    """torch.cuda as fused_a2a sees it while a CUDA graph capture is (said to be) in progress."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_current_stream_capturing() -> bool:
        return True


class _CapturingTorch:
    """torch for fused_a2a during a simulated capture: only its torch.cuda answers differ, so
    the rest of megatron-core runs as usual."""

    cuda = _CapturingCuda()

    def __getattr__(self, name):
        return getattr(torch, name)


def test_reset_fused_a2a_buffers_is_idempotent_without_buffers():
    """The release that waits on nobody: safe before any dispatch, any number of times, with no
    process group."""
    fused_a2a.reset_fused_a2a_buffers()
    fused_a2a.reset_fused_a2a_buffers()
    assert fused_a2a.get_hybrid_ep_buffer(None) is None
    assert fused_a2a._buffer is None


@pytest.mark.skipif(
    not fused_a2a.HAVE_DEEP_EP
    and not fused_a2a.HAVE_HYBRIDEP
    and not getattr(fused_a2a, "HAVE_TE_EP", False),
    reason="Deep EP, Hybrid EP and NCCL EP are not available",
)
class TestFusedA2ACommBuffers(TwoEPGroups):
    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    @pytest.mark.parametrize("moe_flex_dispatcher_backend", ["deepep", "hybridep", "ncclep"])
    def test_release_and_recreate(self, moe_flex_dispatcher_backend):
        """A release between steps frees the buffer; the next step re-creates it and gives
        bitwise the same outputs and gradients."""
        backend = moe_flex_dispatcher_backend
        skip_unless(backend)
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        layer = build_moe_layer(backend)
        inp = make_input()
        first = forward_backward(layer, inp)
        buffer = _held_buffer(backend)
        assert buffer is not None, f"no {backend} buffer after a dispatch"
        # NCCL EP's "buffer" is its group, which parallel_state keeps.
        buffer_ref = weakref.ref(buffer) if backend != "ncclep" else lambda: None
        del buffer

        fused_a2a.reset_fused_a2a_buffers(collective=True)
        gc.collect()
        assert _held_buffer(backend) is None, f"the {backend} buffer outlives the release"
        assert buffer_ref() is None, f"the released {backend} buffer is still referenced"

        second = forward_backward(layer, inp)
        assert _held_buffer(backend) is not None, "the next dispatch did not re-create the buffer"
        # Deterministic kernels on the same inputs: bitwise equal, not merely close.
        assert_bitwise_equal(second, first, "after a release")

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    @pytest.mark.parametrize("moe_flex_dispatcher_backend", ["deepep", "hybridep", "ncclep"])
    def test_destroy_model_parallel_releases(self, moe_flex_dispatcher_backend):
        backend = moe_flex_dispatcher_backend
        skip_unless(backend)
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        layer = build_moe_layer(backend)
        forward_backward(layer, make_input())
        assert _held_buffer(backend) is not None, f"no {backend} buffer after a dispatch"
        del layer
        Utils.destroy_model_parallel()
        assert _held_buffer(backend) is None, f"the {backend} buffer outlives its groups"

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_nccl_ep_second_ep_group_is_refused_until_released(self):
        """TransformerEngine serves one NCCL EP group per process: while it is bootstrapped on
        layer A's EP group, layer B (on another group) is refused, naming the release, instead
        of dispatching over A's communicator; after the release B runs on its own group and
        gives bitwise the results of B alone."""
        skip_unless("ncclep")
        _, group_b = self.two_ep_groups()
        pgc_b = copy.copy(get_default_pg_collection())
        pgc_b.ep = pgc_b.tp_ep = group_b
        layers = {"A": build_moe_layer("ncclep"), "B": build_moe_layer("ncclep", pgc_b)}
        inputs = {"A": make_input(1000), "B": make_input(2000)}
        alone = forward_backward(layers["B"], inputs["B"])
        fused_a2a.reset_fused_a2a_buffers(collective=True)

        forward_backward(layers["A"], inputs["A"])
        with pytest.raises(RuntimeError, match="reset_fused_a2a_buffers"):
            run_forward(layers["B"], inputs["B"])
        fused_a2a.reset_fused_a2a_buffers(collective=True)
        after = forward_backward(layers["B"], inputs["B"])
        assert_bitwise_equal(after, alone, "layer B after the release")
        assert _nccl_ep_group() is layers["B"].token_dispatcher.tp_ep_group

    def _hold_buffers_on_two_groups(self):
        """HybridEP buffers on this rank's two EP groups and the DeepEP buffer on the first
        (each backend where installed); returns the two groups."""
        group_a, group_b = self.two_ep_groups()
        self._hold_buffers(group_a, group_b)
        return group_a, group_b

    @staticmethod
    def _hold_buffers(group_a, *others):
        """HybridEP buffers on each group and the DeepEP buffer on the first."""
        if not fused_a2a.HAVE_HYBRIDEP and not fused_a2a.HAVE_DEEP_EP:
            pytest.skip("needs Hybrid EP or Deep EP (buffers to hold)")
        num_tokens = SEQ_LEN * MICRO_BATCH
        if fused_a2a.HAVE_HYBRIDEP:
            for group in (group_a, *others):
                # By keyword: core_r0.17.0 requires these three, later branches default them.
                fused_a2a.init_hybrid_ep_buffer(
                    group,
                    HIDDEN_SIZE,
                    num_tokens,
                    NUM_EXPERTS // 4,
                    num_sms_dispatch_api=16,
                    num_sms_combine_api=16,
                    fp8_dispatch=False,
                )
        if fused_a2a.HAVE_DEEP_EP:
            fused_a2a.get_buffer(group_a, HIDDEN_SIZE * 2)

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_collective_reset_barriers_before_freeing(self, monkeypatch):
        """reset_fused_a2a_buffers(collective=True) is a collective over the world (or the group
        given): one barrier, while every buffer is still held, then it frees them all. One
        barrier on one group, whatever each rank holds: ranks holding buffers of different groups
        cannot wait for each other on different ones."""
        self._hold_buffers_on_two_groups()
        refs = [weakref.ref(b) for b in _held_buffers()]
        barriers = []
        real_barrier = torch.distributed.barrier

        def recording_barrier(*args, **kwargs):
            barriers.append((kwargs.get("group", args[0] if args else None), len(_held_buffers())))
            return real_barrier(*args, **kwargs)

        with monkeypatch.context() as m:
            m.setattr(torch.distributed, "barrier", recording_barrier)
            fused_a2a.reset_fused_a2a_buffers(collective=True)
        gc.collect()
        assert refs, "no buffer held"
        assert barriers == [(None, len(refs))], f"barriers (group, buffers held): {barriers}"
        assert not _held_buffers() and all(r() is None for r in refs), "buffers left after reset"

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_destroy_model_parallel_waits_on_no_peer(self, monkeypatch):
        """destroy_model_parallel() runs no collective for the buffers and frees none, so a peer
        that never reaches the teardown (stuck in a collective, or a test that failed on its
        rank) cannot hold it: the buffers are taken out of use, for the next dispatch to free."""
        Utils.initialize_model_parallel(expert_model_parallel_size=4)
        events = self._record_deep_ep_buffers(monkeypatch) if fused_a2a.HAVE_DEEP_EP else []
        self._hold_buffers(parallel_state.get_expert_model_parallel_group())
        refs = [weakref.ref(b) for b in _held_buffers()]

        def no_barrier(*args, **kwargs):
            raise AssertionError("destroy_model_parallel() waited for its peers")

        with monkeypatch.context() as m:
            m.setattr(torch.distributed, "barrier", no_barrier)
            parallel_state.destroy_model_parallel()
        Utils.inited = False  # torn down here, without Utils' barrier
        gc.collect()
        assert not _held_buffers() and refs, "a buffer is still in use after the teardown"
        assert all(r() is not None for r in refs), "the teardown freed a buffer"
        assert "destroy 0" not in events, f"the teardown destroyed the DeepEP buffer: {events}"
        fused_a2a.reset_fused_a2a_buffers(collective=True)  # every peer is here in this test

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_next_dispatch_destroys_what_the_teardown_left(self, monkeypatch):
        """The DeepEP buffer a teardown took out of use is destroyed by the next dispatch, on the
        new groups, before its replacement is allocated: a re-initialization (or an in-process
        restart) never holds two."""
        skip_unless("deepep")
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        events = self._record_deep_ep_buffers(monkeypatch)
        fused_a2a.get_buffer(parallel_state.get_expert_model_parallel_group(), HIDDEN_SIZE)
        Utils.destroy_model_parallel()
        assert events == ["create 0"], events
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        fused_a2a.get_buffer(parallel_state.get_expert_model_parallel_group(), HIDDEN_SIZE)
        want = ["create 0", "destroy 0", "create 1"]
        if not self._explicitly_destroy_supported():  # dropped: its destructor destroys it
            want = ["create 0", "create 1"]
        assert events == want, f"the buffer the teardown left, before its replacement: {events}"

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    # DeepEP's normal-mode dispatch waits on the host: a CUDA graph never captures it.
    @pytest.mark.parametrize("moe_flex_dispatcher_backend", ["hybridep", "ncclep"])
    def test_reset_refuses_while_a_captured_dispatch_may_replay(
        self, moe_flex_dispatcher_backend, monkeypatch
    ):
        """A CUDA graph that captured a dispatch keeps raw pointers into the buffer: the release
        raises, naming the fix, and keeps the buffer; graphs_released=True frees it."""
        backend = moe_flex_dispatcher_backend
        skip_unless(backend)
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        layer = build_moe_layer(backend)
        inp = make_input()
        with torch.no_grad():
            layer(inp)  # warm-up, outside any capture
            with monkeypatch.context() as m:
                m.setattr(fused_a2a, "torch", _CapturingTorch())
                layer(inp)  # "captured"
        with pytest.raises(RuntimeError, match="graphs_released=True"):
            fused_a2a.reset_fused_a2a_buffers(collective=True)
        buffer = _held_buffer(backend)
        assert buffer is not None, f"the refused release dropped the {backend} buffer"
        buffer_ref = weakref.ref(buffer) if backend != "ncclep" else lambda: None
        del buffer

        fused_a2a.reset_fused_a2a_buffers(collective=True, graphs_released=True)
        gc.collect()
        assert _held_buffer(backend) is None and buffer_ref() is None

    @staticmethod
    def _record_deep_ep_buffers(monkeypatch) -> list:
        """Replace deep_ep's Buffer in fused_a2a by a subclass that logs "create <n>" as the n-th
        buffer's construction starts (with "(old live)" while the previous buffer is neither
        destroyed nor collected) and "destroy <n>" as its destroy() starts."""
        real_buffer = fused_a2a.Buffer
        events, refs = [], []

        class RecordingBuffer(real_buffer):
            @functools.wraps(real_buffer.__init__)  # get_buffer() inspects the signature
            def __init__(self, *args, **kwargs):
                old = refs[-1]() if refs else None
                old_live = old is not None and not old.test_destroyed
                del old
                self.test_index, self.test_destroyed = len(refs), False
                events.append(f"create {self.test_index}" + (" (old live)" if old_live else ""))
                refs.append(weakref.ref(self))
                super().__init__(*args, **kwargs)

            def destroy(self):
                events.append(f"destroy {self.test_index}")
                self.test_destroyed = True
                super().destroy()

        monkeypatch.setattr(fused_a2a, "Buffer", RecordingBuffer)
        return events

    @staticmethod
    def _explicitly_destroy_supported() -> bool:
        return "explicitly_destroy" in inspect.signature(fused_a2a.Buffer.__init__).parameters

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_deep_ep_buffer_built_with_explicitly_destroy(self):
        skip_unless("deepep")
        if not self._explicitly_destroy_supported():
            pytest.skip("deep_ep's Buffer has no explicitly_destroy")
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        group = parallel_state.get_expert_model_parallel_group()
        buffer = fused_a2a.get_buffer(group, HIDDEN_SIZE * 2)
        assert getattr(
            buffer, "explicitly_destroy", False
        ), "get_buffer() built the DeepEP buffer without explicitly_destroy=True"

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_deep_ep_buffer_destroyed_before_its_replacement(self, monkeypatch):
        """Growth frees the old buffer (by destroy(), where deep_ep has explicitly_destroy)
        before the larger one is allocated, so the two are never held at once."""
        skip_unless("deepep")
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        group = parallel_state.get_expert_model_parallel_group()
        events = self._record_deep_ep_buffers(monkeypatch)
        fused_a2a.get_buffer(group, HIDDEN_SIZE)
        fused_a2a.get_buffer(group, HIDDEN_SIZE * 2)  # larger: a replacement
        assert events[0] == "create 0" and events[-1].startswith("create 1"), events
        assert (
            events[-1] == "create 1"
        ), f"the old DeepEP buffer was still live when its replacement was created: {events}"
        if self._explicitly_destroy_supported():
            assert events == ["create 0", "destroy 0", "create 1"], events

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_reset_destroys_deep_ep_buffer_while_referenced(self, monkeypatch):
        """The release frees the DeepEP buffer by destroy(), not whenever its last reference
        goes (here one is still alive)."""
        skip_unless("deepep")
        if not self._explicitly_destroy_supported():
            pytest.skip("deep_ep's Buffer has no explicitly_destroy")
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        group = parallel_state.get_expert_model_parallel_group()
        events = self._record_deep_ep_buffers(monkeypatch)
        buffer = fused_a2a.get_buffer(group, HIDDEN_SIZE * 2)
        fused_a2a.reset_fused_a2a_buffers(collective=True)
        assert fused_a2a._buffer is None
        assert events == [
            "create 0",
            "destroy 0",
        ], f"reset_fused_a2a_buffers() did not destroy() the DeepEP buffer: {events}"
        del buffer

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_deep_ep_v2_buffers_are_destroyed_by_the_release(self):
        """DeepEP v2's ElasticBuffers (where the branch has them): reset_fused_a2a_buffers()
        destroys every v2 buffer still alive, also one the dispatcher's manager still
        references."""
        if not getattr(fused_a2a, "HAVE_DEEP_EP_V2", False):
            pytest.skip("Deep EP v2 is not available")
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        layer = build_moe_layer("deepepv2")
        forward_backward(layer, make_input())
        buffer = fused_a2a._elastic_buffer
        assert buffer is not None, "no DeepEP v2 buffer after a dispatch"
        fused_a2a.reset_fused_a2a_buffers(collective=True)
        assert fused_a2a._elastic_buffer is None
        # ElasticBuffer.destroy() drops its runtime (deep_ep/buffers/elastic.py); the layer's
        # manager still references the buffer.
        assert buffer.runtime is None, "a DeepEP v2 buffer outlives the release"
