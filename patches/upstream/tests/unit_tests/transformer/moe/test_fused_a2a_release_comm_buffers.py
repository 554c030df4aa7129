# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""The flex dispatcher's communication buffers: one HybridEP buffer per process group, released
collectively by fused_a2a.reset_fused_a2a_buffers(), DeepEP's destroyed explicitly, NCCL EP's
context released with them.

The HybridEP and DeepEP buffers are module globals allocated outside PyTorch's caching
allocator, so torch.cuda.empty_cache() cannot return their memory:

* HybridEP keeps one buffer per process group, and every backward runs on its forward's buffer,
  so two models on different EP groups (an RL policy and its reference model) can interleave;
  the module global _hybrid_ep_buffer still names the first group's, as code outside
  megatron-core expects.
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
import dataclasses
import functools
import gc
import inspect
import logging
import time
import weakref

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.moe import fused_a2a
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils

try:
    from megatron.core.transformer.spec_utils import get_submodules
except ImportError:  # core_r0.16.0: an MoE spec is a ModuleSpec
    from operator import attrgetter

    get_submodules = attrgetter("submodules")

NUM_EXPERTS = 8
HIDDEN_SIZE = 1024
SEQ_LEN = 16
MICRO_BATCH = 2
# Two ways to split 8 ranks into EP groups of 4: parallel_state's, and a second model's.
OTHER_EP_GROUPS = ([0, 2, 4, 6], [1, 3, 5, 7])


def moe_submodules() -> MoESubmodules:
    """The MoE submodules of the local (non-TE) GPT layer spec."""
    spec = get_gpt_layer_local_spec(num_experts=NUM_EXPERTS, moe_grouped_gemm=False)
    submodules = get_submodules(spec.submodules.mlp)
    assert isinstance(submodules, MoESubmodules)
    return submodules


def _skip_unless(backend: str) -> None:
    if backend == "deepep" and not fused_a2a.HAVE_DEEP_EP:
        pytest.skip("Deep EP is not available")
    if backend == "hybridep" and not fused_a2a.HAVE_HYBRIDEP:
        pytest.skip("Hybrid EP is not available")
    if backend == "ncclep" and not getattr(fused_a2a, "HAVE_TE_EP", False):
        pytest.skip("NCCL EP is not available")


def _nccl_ep_group():
    """The EP group NCCL EP is bootstrapped on, or None."""
    if not getattr(fused_a2a, "HAVE_TE_EP", False) or not fused_a2a.te_ep._BOOTSTRAPPED:
        return None
    return fused_a2a.te_ep._EP_GROUP


def _build_moe_layer(backend: str, pg_collection=None, seed: int = 123) -> MoELayer:
    """A small bf16 MoELayer with local (non-TE) experts and the flex dispatcher on ``backend``,
    on parallel_state's groups or on ``pg_collection``'s. Every expert gets weights of its own,
    seeded by its global index, so the result depends on which rank's experts a token reaches."""
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    extra = {}
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    if backend == "ncclep" and "moe_ncclep_static_shape" in fields:
        # Static NCCL EP shapes need a receive capacity (EP 8, top-2: twice the even share).
        extra["moe_expert_rank_capacity_factor"] = 2.0
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN_SIZE,
        num_attention_heads=4,
        num_moe_experts=NUM_EXPERTS,
        use_cpu_initialization=True,
        moe_token_dispatcher_type="flex",
        moe_flex_dispatcher_backend=backend,
        moe_router_load_balancing_type="aux_loss",
        moe_router_topk=2,
        moe_aux_loss_coeff=0.01,
        moe_router_dtype="fp32",
        moe_grouped_gemm=False,
        moe_ffn_hidden_size=128,
        add_bias_linear=False,
        expert_model_parallel_size=ep_size,
        bf16=True,
        params_dtype=torch.bfloat16,
        **extra,
    )
    submodules = moe_submodules()
    layer = MoELayer(config, submodules, pg_collection=pg_collection)
    layer = layer.cuda().to(dtype=torch.bfloat16)
    layer.set_layer_number(0)
    with torch.no_grad():
        for index, expert in zip(layer.local_expert_indices, layer.experts.local_experts):
            for k, (_, param) in enumerate(sorted(expert.named_parameters())):
                gen = torch.Generator().manual_seed(seed + 100 * index + k)
                values = torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5
                param.copy_(values.to(device=param.device, dtype=param.dtype))
    return layer


def _make_input(seed: int = 1000) -> torch.Tensor:
    """A per-rank input."""
    gen = torch.Generator().manual_seed(seed + torch.distributed.get_rank())
    x = torch.randn(SEQ_LEN, MICRO_BATCH, HIDDEN_SIZE, generator=gen)
    return x.to(device=torch.cuda.current_device(), dtype=torch.bfloat16)


def _forward(layer: MoELayer, inp: torch.Tensor):
    layer.zero_grad(set_to_none=True)
    x = inp.detach().clone().requires_grad_(True)
    output, _ = layer(x)
    return x, output


def _backward(layer: MoELayer, x: torch.Tensor, output: torch.Tensor) -> dict:
    """Backward of a ``_forward``; its output, the input's and the parameters' gradients."""
    output.backward(torch.ones_like(output))
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    return {"out": output.detach().clone(), "x_grad": x.grad.detach().clone(), "grads": grads}


def _forward_backward(layer: MoELayer, inp: torch.Tensor) -> dict:
    return _backward(layer, *_forward(layer, inp))


def _assert_bitwise_equal(actual: dict, expected: dict, what: str) -> None:
    rank = torch.distributed.get_rank()
    assert torch.equal(actual["out"], expected["out"]), f"rank {rank}: {what}: output differs"
    assert torch.equal(actual["x_grad"], expected["x_grad"]), f"rank {rank}: {what}: input grad"
    assert expected["grads"] and actual["grads"].keys() == expected["grads"].keys()
    for name, grad in expected["grads"].items():
        assert torch.equal(actual["grads"][name], grad), f"rank {rank}: {what}: {name}.grad"


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


def _release_buffers() -> None:
    """Teardown on any tree: release the buffers, or where reset_fused_a2a_buffers() does not
    exist yet, synchronize and drop the references."""
    reset = getattr(fused_a2a, "reset_fused_a2a_buffers", None)
    if reset is not None:
        reset(graphs_released=True)
        return
    torch.cuda.synchronize()
    torch.distributed.barrier()
    fused_a2a.reset_hybrid_ep_buffer()
    fused_a2a._buffer = None
    if hasattr(fused_a2a, "nccl_ep_finalize"):
        fused_a2a.nccl_ep_finalize()


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
    not fused_a2a.HAVE_DEEP_EP and not fused_a2a.HAVE_HYBRIDEP,
    reason="Deep EP and Hybrid EP are not available",
)
class TestFusedA2ACommBuffers:
    def setup_method(self, method):
        self.groups = []

    def teardown_method(self, method):
        _release_buffers()
        for group in self.groups:
            torch.distributed.destroy_process_group(group)
        Utils.destroy_model_parallel()

    def _two_ep_groups(self):
        """EP 4 on 8 ranks: parallel_state's EP group ([0-3] or [4-7]) and this rank's group in
        OTHER_EP_GROUPS."""
        if Utils.world_size != 8:
            pytest.skip("needs 8 ranks")
        Utils.initialize_model_parallel(expert_model_parallel_size=4)
        rank = torch.distributed.get_rank()
        other = None
        for ranks in OTHER_EP_GROUPS:  # every rank creates every group
            group = torch.distributed.new_group(ranks)
            if rank in ranks:
                other = group
        self.groups.append(other)  # destroyed in teardown, after the buffers bound to it
        return parallel_state.get_expert_model_parallel_group(), other

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    @pytest.mark.parametrize("moe_flex_dispatcher_backend", ["deepep", "hybridep", "ncclep"])
    def test_release_and_recreate(self, moe_flex_dispatcher_backend):
        """A release between steps frees the buffer; the next step re-creates it and gives
        bitwise the same outputs and gradients."""
        backend = moe_flex_dispatcher_backend
        _skip_unless(backend)
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        layer = _build_moe_layer(backend)
        inp = _make_input()
        first = _forward_backward(layer, inp)
        buffer = _held_buffer(backend)
        assert buffer is not None, f"no {backend} buffer after a dispatch"
        # NCCL EP's "buffer" is its group, which parallel_state keeps.
        buffer_ref = weakref.ref(buffer) if backend != "ncclep" else lambda: None
        del buffer

        fused_a2a.reset_fused_a2a_buffers()
        gc.collect()
        assert _held_buffer(backend) is None, f"the {backend} buffer outlives the release"
        assert buffer_ref() is None, f"the released {backend} buffer is still referenced"

        second = _forward_backward(layer, inp)
        assert _held_buffer(backend) is not None, "the next dispatch did not re-create the buffer"
        # Deterministic kernels on the same inputs: bitwise equal, not merely close.
        _assert_bitwise_equal(second, first, "after a release")

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    @pytest.mark.parametrize("moe_flex_dispatcher_backend", ["deepep", "hybridep", "ncclep"])
    def test_destroy_model_parallel_releases(self, moe_flex_dispatcher_backend):
        backend = moe_flex_dispatcher_backend
        _skip_unless(backend)
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        layer = _build_moe_layer(backend)
        _forward_backward(layer, _make_input())
        assert _held_buffer(backend) is not None, f"no {backend} buffer after a dispatch"
        del layer
        Utils.destroy_model_parallel()
        assert _held_buffer(backend) is None, f"the {backend} buffer outlives its groups"

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_hybridep_two_models_on_different_ep_groups(self):
        """Layer A on EP groups [0-3],[4-7], layer B on [0,2,4,6],[1,3,5,7], forwards and
        backwards interleaved (A's backward after B's forward): every dispatch, combine and
        backward runs on its own group's buffer, so the results are bitwise those of each layer
        run alone, and there is one buffer per group."""
        _skip_unless("hybridep")
        _, group_b = self._two_ep_groups()
        pgc_b = copy.copy(get_default_pg_collection())
        pgc_b.ep = pgc_b.tp_ep = group_b
        layers = {"A": _build_moe_layer("hybridep"), "B": _build_moe_layer("hybridep", pgc_b)}
        inputs = {"A": _make_input(1000), "B": _make_input(2000)}

        alone = {}
        for k in "AB":  # each layer on buffers of its own group only
            _release_buffers()
            alone[k] = _forward_backward(layers[k], inputs[k])
        _release_buffers()

        x_a, out_a = _forward(layers["A"], inputs["A"])
        x_b, out_b = _forward(layers["B"], inputs["B"])
        interleaved = {"A": _backward(layers["A"], x_a, out_a)}
        interleaved["B"] = _backward(layers["B"], x_b, out_b)
        for k in "AB":
            _assert_bitwise_equal(interleaved[k], alone[k], f"layer {k} interleaved")
        # The flex dispatcher communicates over its TPxEP group (with TP 1, the EP ranks).
        groups = {layer.token_dispatcher.tp_ep_group for layer in layers.values()}
        assert len(groups) == 2
        buffers = fused_a2a._hybrid_ep_buffers
        assert (
            set(buffers) == groups
        ), f"{len(buffers)} HybridEP buffers, not one for each of the two layers' groups"

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_hybridep_module_global_is_what_dispatches_use(self, monkeypatch):
        """fused_a2a._hybrid_ep_buffer, which code outside megatron-core reads and test
        fixtures save and restore: None before a dispatch, then the buffer the dispatch ran on;
        set to None, the next dispatch allocates a buffer and the global names it; restored,
        the saved buffer is the one the next dispatch runs on."""
        _skip_unless("hybridep")
        used = []

        class RecordingBuffer(fused_a2a.HybridEPBuffer):
            def dispatch_with_permute(self, *args, **kwargs):
                used.append(self)
                return super().dispatch_with_permute(*args, **kwargs)

        monkeypatch.setattr(fused_a2a, "HybridEPBuffer", RecordingBuffer)
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        _release_buffers()
        assert fused_a2a._hybrid_ep_buffer is None
        layer = _build_moe_layer("hybridep")
        _forward_backward(layer, _make_input())
        saved = fused_a2a._hybrid_ep_buffer
        assert saved is not None and saved is used[-1]
        monkeypatch.setattr(fused_a2a, "_hybrid_ep_buffer", None)
        _forward_backward(layer, _make_input())
        assert used[-1] is not saved and fused_a2a._hybrid_ep_buffer is used[-1]
        fused_a2a._hybrid_ep_buffer = saved
        _forward_backward(layer, _make_input())
        assert used[-1] is saved

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_nccl_ep_second_ep_group_is_refused_until_released(self):
        """TransformerEngine serves one NCCL EP group per process: while it is bootstrapped on
        layer A's EP group, layer B (on another group) is refused, naming the release, instead
        of dispatching over A's communicator; after the release B runs on its own group and
        gives bitwise the results of B alone."""
        _skip_unless("ncclep")
        _, group_b = self._two_ep_groups()
        pgc_b = copy.copy(get_default_pg_collection())
        pgc_b.ep = pgc_b.tp_ep = group_b
        layers = {"A": _build_moe_layer("ncclep"), "B": _build_moe_layer("ncclep", pgc_b)}
        inputs = {"A": _make_input(1000), "B": _make_input(2000)}
        alone = _forward_backward(layers["B"], inputs["B"])
        fused_a2a.reset_fused_a2a_buffers()

        _forward_backward(layers["A"], inputs["A"])
        with pytest.raises(RuntimeError, match="reset_fused_a2a_buffers"):
            _forward(layers["B"], inputs["B"])
        fused_a2a.reset_fused_a2a_buffers()
        after = _forward_backward(layers["B"], inputs["B"])
        _assert_bitwise_equal(after, alone, "layer B after the release")
        assert _nccl_ep_group() is layers["B"].token_dispatcher.tp_ep_group

    def _hold_buffers_on_two_groups(self):
        """HybridEP buffers on this rank's two EP groups and the DeepEP buffer on the first
        (each backend where installed); returns the two groups."""
        group_a, group_b = self._two_ep_groups()
        self._hold_buffers(group_a, group_b)
        return group_a, group_b

    @staticmethod
    def _hold_buffers(group_a, *others):
        """HybridEP buffers on each group and the DeepEP buffer on the first."""
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
    @pytest.mark.parametrize("moe_flex_dispatcher_backend", ["deepep", "hybridep", "ncclep"])
    def test_reset_refuses_while_a_captured_dispatch_may_replay(
        self, moe_flex_dispatcher_backend, monkeypatch
    ):
        """A CUDA graph that captured a dispatch keeps raw pointers into the buffer: the release
        raises, naming the fix, and keeps the buffer; graphs_released=True frees it."""
        backend = moe_flex_dispatcher_backend
        _skip_unless(backend)
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        layer = _build_moe_layer(backend)
        inp = _make_input()
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
        _skip_unless("deepep")
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
        _skip_unless("deepep")
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
        _skip_unless("deepep")
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
