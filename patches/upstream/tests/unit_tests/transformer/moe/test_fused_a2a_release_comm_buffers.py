# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""The flex dispatcher's communication buffers have a lifecycle: released collectively by
fused_a2a.reset_fused_a2a_buffers(), DeepEP's destroyed explicitly, NCCL EP's context released
with them (HybridEP's buffer per process group: test_hybrid_ep_buffer_per_group.py).

The HybridEP and DeepEP buffers are module globals allocated outside PyTorch's caching
allocator, so torch.cuda.empty_cache() cannot return their memory:

* reset_fused_a2a_buffers() drops them (destroy_model_parallel() calls it): after a barrier on
  every buffer's group, and not while a CUDA graph that captured a dispatch may still replay
  (unless graphs_released=True); the next dispatch re-creates the buffer it needs and gives the
  same results.
* DeepEP's buffer is built with explicitly_destroy where deep_ep supports it and destroyed at
  known points: before get_buffer() allocates a larger replacement, and on release.
* NCCL EP's process-wide context (TransformerEngine serves one EP group per process) is
  released by the same call, and a model on another EP group is refused until then instead of
  dispatching over the bootstrapped group's communicator.
"""

import copy
import functools
import gc
import inspect
import logging
import time
import weakref

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.transformer.moe import fused_a2a
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from tests.unit_tests.test_utilities import Utils
from tests.unit_tests.transformer.moe.test_hybrid_ep_buffer_per_group import (
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
        buffers = list(fused_a2a._hybrid_ep_buffers.values())
        assert len(buffers) <= 1, f"{len(buffers)} HybridEP buffers for one EP group"
        return buffers[0] if buffers else None
    return fused_a2a._buffer


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


class _CompletedWork:
    """What torch.distributed.barrier(async_op=True) returns once every peer arrived."""

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout=None) -> bool:
        return True


class _PendingWork(_CompletedWork):
    """A barrier whose peers never arrive."""

    def is_completed(self) -> bool:
        return False

    def wait(self, timeout=None) -> bool:
        raise AssertionError("waited for a barrier that cannot complete")


def test_reset_fused_a2a_buffers_is_idempotent_without_buffers():
    """Safe before any dispatch, and any number of times."""
    fused_a2a.reset_fused_a2a_buffers()
    fused_a2a.reset_fused_a2a_buffers()
    assert not fused_a2a._hybrid_ep_buffers
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

        fused_a2a.reset_fused_a2a_buffers()
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
        fused_a2a.reset_fused_a2a_buffers()

        forward_backward(layers["A"], inputs["A"])
        with pytest.raises(RuntimeError, match="reset_fused_a2a_buffers"):
            run_forward(layers["B"], inputs["B"])
        fused_a2a.reset_fused_a2a_buffers()
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
    def test_reset_barriers_every_group_before_freeing(self, monkeypatch):
        """reset_fused_a2a_buffers() is collective: it runs a barrier on every held buffer's
        group while all of them are still held, then frees them."""
        group_a, group_b = self._hold_buffers_on_two_groups()
        held = [*fused_a2a._hybrid_ep_buffers.values(), fused_a2a._buffer]
        held = [b for b in held if b is not None]
        groups = {"A": group_a, "B": group_b}
        groups = {k: g for k, g in groups.items() if any(b.group is g for b in held)}
        refs = [weakref.ref(b) for b in held]
        del held

        def still_held() -> int:
            return len(fused_a2a._hybrid_ep_buffers) + (fused_a2a._buffer is not None)

        barriers = []
        real_barrier = torch.distributed.barrier

        def recording_barrier(*args, **kwargs):
            barriers.append((kwargs.get("group", args[0] if args else None), still_held()))
            return real_barrier(*args, **kwargs)

        with monkeypatch.context() as m:
            m.setattr(torch.distributed, "barrier", recording_barrier)
            fused_a2a.reset_fused_a2a_buffers()
        gc.collect()
        assert groups, "no buffer held"
        for name, group in groups.items():
            assert (group, len(refs)) in barriers, (
                f"no barrier on group {name} while all {len(refs)} buffers were held: "
                f"{[(g is group_a, g is group_b, n) for g, n in barriers]}"
            )
        assert still_held() == 0 and all(r() is None for r in refs), "buffers left after reset"

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_reset_barriers_in_one_order_on_every_rank(self, monkeypatch):
        """The barriers run in one order on every rank (by the groups' ranks), not in the
        rank's order of its buffers, which is rank-local (a buffer re-made or restored on one
        rank moves to the end): two ranks sharing two groups must not wait on different ones.
        Odd ranks hold their buffers in the opposite order here."""
        if not fused_a2a.HAVE_HYBRIDEP:
            pytest.skip("needs HybridEP (a buffer per group)")
        self._hold_buffers_on_two_groups()
        rank = torch.distributed.get_rank()
        if rank % 2:
            buffers = fused_a2a._hybrid_ep_buffers
            first = next(iter(buffers))
            buffers[first] = buffers.pop(first)
        barriers = []

        def recording_barrier(group=None, async_op=False, **kwargs):
            barriers.append(group)
            return _CompletedWork() if async_op else None

        with monkeypatch.context() as m:
            m.setattr(torch.distributed, "barrier", recording_barrier)
            fused_a2a.reset_fused_a2a_buffers()
        ranks = [torch.distributed.get_process_group_ranks(g) for g in barriers]
        assert len(ranks) == 2 and ranks == sorted(
            ranks
        ), f"rank {rank} ran its barriers in its buffers' order: {ranks}"

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_destroy_model_parallel_bounds_its_wait(self, monkeypatch, caplog):
        """A peer that never reaches the release (stuck in a collective, or a test that failed
        on its rank) does not hang destroy_model_parallel(): it gives up at its bound, takes the
        buffers out of use without freeing them, and logs why."""
        Utils.initialize_model_parallel(expert_model_parallel_size=4)
        self._hold_buffers(parallel_state.get_expert_model_parallel_group())
        held = [*fused_a2a._hybrid_ep_buffers.values(), fused_a2a._buffer]
        refs = [weakref.ref(b) for b in held if b is not None]
        del held

        def barrier_never_met(group=None, async_op=False, **kwargs):
            assert async_op, "an unbounded barrier: a peer that never arrives hangs it"
            return _PendingWork()

        with monkeypatch.context() as m:
            m.setattr(torch.distributed, "barrier", barrier_never_met)
            m.setattr(parallel_state, "_COMM_BUFFER_RELEASE_TIMEOUT", 1.0, raising=False)
            start = time.monotonic()
            parallel_state.destroy_model_parallel()
            elapsed = time.monotonic() - start
        Utils.inited = False  # torn down here, without Utils' barrier
        gc.collect()
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert any("TimeoutError" in w for w in warnings), f"logged no warning: {warnings}"
        assert elapsed < 10.0, f"destroy_model_parallel() took {elapsed:.1f} s"
        # Out of use, but kept alive and unfreed: freeing one could free memory a peer's kernels
        # still write, and its destructor would wait for the device or the peers.
        assert not fused_a2a._hybrid_ep_buffers and fused_a2a._buffer is None
        parked = fused_a2a._abandoned_comm_buffers
        assert refs and all(any(r() is b for b in parked) for r in refs), "buffers freed"
        parked.clear()

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_destroy_model_parallel_leaves_nccl_ep_after_a_failed_wait(self, monkeypatch, caplog):
        """After a wait that gave up on a peer, destroy_model_parallel() does not finalize NCCL
        EP: TransformerEngine's ep_finalize deregisters symmetric memory and destroys NCCL EP's
        group, which waits for that peer too. The context is left as it is, with a warning."""
        skip_unless("ncclep")
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        forward_backward(build_moe_layer("ncclep"), make_input())
        assert _nccl_ep_group() is not None, "no NCCL EP context after a dispatch"
        finalized = []

        def barrier_never_met(group=None, async_op=False, **kwargs):
            assert async_op, "an unbounded barrier: a peer that never arrives hangs it"
            return _PendingWork()

        with monkeypatch.context() as m:
            m.setattr(torch.distributed, "barrier", barrier_never_met)
            m.setattr(fused_a2a.te_ep, "ep_finalize", lambda: finalized.append(True))
            m.setattr(parallel_state, "_COMM_BUFFER_RELEASE_TIMEOUT", 1.0, raising=False)
            parallel_state.destroy_model_parallel()
        Utils.inited = False  # torn down here, without Utils' barrier
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert any("TimeoutError" in w for w in warnings), f"logged no warning: {warnings}"
        assert not finalized, "finalized NCCL EP after a failed wait"
        fused_a2a.nccl_ep_finalize()  # every peer is here in this test

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    @pytest.mark.parametrize("moe_flex_dispatcher_backend", ["deepep", "hybridep", "ncclep"])
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
            fused_a2a.reset_fused_a2a_buffers()
        buffer = _held_buffer(backend)
        assert buffer is not None, f"the refused release dropped the {backend} buffer"
        buffer_ref = weakref.ref(buffer) if backend != "ncclep" else lambda: None
        del buffer

        fused_a2a.reset_fused_a2a_buffers(graphs_released=True)
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
        fused_a2a.reset_fused_a2a_buffers()
        assert fused_a2a._buffer is None
        assert events == [
            "create 0",
            "destroy 0",
        ], f"reset_fused_a2a_buffers() did not destroy() the DeepEP buffer: {events}"
        del buffer

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_deep_ep_v2_buffers_are_destroyed_by_the_release_not_at_exit(self):
        """DeepEP v2's ElasticBuffers (where the branch has them): no finalizer is one that
        Python's exit runs on its own (it would run the collective destroy() after an uncaught
        exception too), and reset_fused_a2a_buffers() destroys every v2 buffer still alive,
        also one the dispatcher's manager still references."""
        if not getattr(fused_a2a, "HAVE_DEEP_EP_V2", False):
            pytest.skip("Deep EP v2 is not available")
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        layer = build_moe_layer("deepepv2")
        forward_backward(layer, make_input())
        buffer = fused_a2a._elastic_buffer
        assert buffer is not None, "no DeepEP v2 buffer after a dispatch"
        finalizers = getattr(fused_a2a, "_elastic_buffer_finalizers", {}).values()
        assert not any(f.atexit for f in finalizers), "a DeepEP v2 finalizer runs at exit"
        fused_a2a.reset_fused_a2a_buffers()
        assert fused_a2a._elastic_buffer is None
        # ElasticBuffer.destroy() drops its runtime (deep_ep/buffers/elastic.py); the layer's
        # manager still references the buffer.
        assert buffer.runtime is None, "a DeepEP v2 buffer outlives the release"
