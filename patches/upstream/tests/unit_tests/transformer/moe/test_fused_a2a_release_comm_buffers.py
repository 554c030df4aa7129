# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""The flex dispatcher's communication buffers are freed only by an explicit, agreed call:
fused_a2a.reset_fused_a2a_buffers(collective=True, group=G), made by every rank of G on its main
thread between steps. The ranks first exchange what each holds, then every rank takes the same
decision: a buffer every peer holds is freed, whoever else references it (DeepEP's by its
destroy(), HybridEP's by dropping its C++ buffer), one a peer no longer holds is leaked, and while
an autograd graph still uses a buffer every rank raises and nothing is freed. Nothing else frees a buffer: DeepEP's are built
with explicitly_destroy, a buffer replaced by a larger one stays referenced, and
reset_fused_a2a_buffers() with no arguments (what a teardown calls) takes the buffers out of use
and waits on nobody. NCCL EP's process-wide context is released the same way (TransformerEngine
serves one EP group per process; a model on another group is refused until then).
"""

import copy
import functools
import inspect
import threading
import weakref

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.transformer.moe import fused_a2a
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from tests.unit_tests.test_utilities import Utils
from tests.unit_tests.transformer.moe.flex_buffer_utils import (
    HIDDEN_SIZE,
    TwoEPGroups,
    assert_bitwise_equal,
    build_moe_layer,
    forward_backward,
    make_input,
    run_backward,
    run_forward,
    skip_unless,
)


def _in_use(backend: str):
    """This rank's HybridEP buffer (of its one EP group), DeepEP buffer, or NCCL EP's group
    (while its context is bootstrapped), or None."""
    if backend == "ncclep":
        bootstrapped = fused_a2a.is_nccl_ep_bootstrapped()
        return fused_a2a._nccl_ep_group if bootstrapped else None
    if backend == "hybridep":
        return fused_a2a.get_hybrid_ep_buffer(None)  # the only one; raises if there are several
    return fused_a2a._buffer


def _freed(buffer) -> bool:
    """Whether ``buffer`` (a HybridEP or DeepEP buffer, still referenced) gave its memory back:
    its C++ runtime is gone."""
    return buffer.runtime is None


def _holding(rank: int, *identities, **state) -> tuple:
    """One rank's entry of the release's exchange: the buffers it holds, each with ``state``."""
    fields = {"graphs": 0, "captured": False, "destroyed": False, "group_gone": False}
    return rank, {identity: {**fields, **state} for identity in identities}


# Identities as the release exchanges them: backend, the group's global ranks, the token the
# group's ranks exchanged when they made the buffer.
A = ("hybridep", (0, 1), "token-a")
B = ("deepep", (1, 2), "token-b")


@pytest.mark.parametrize(
    "holdings, members, expected",
    [
        # Every peer holds it: freed.
        ([_holding(0, A), _holding(1, A)], None, ("free", None)),
        # Rank 1 is a fresh process (a replaced peer): leaked, never destroyed.
        ([_holding(0, A), _holding(1)], None, ("leak", "peer rank(s) [1] no longer hold it")),
        # Rank 1 destroyed it outside the release: leaked on every rank, not freed on rank 0.
        (
            [_holding(0, A), _holding(1, A, destroyed=True)],
            None,
            ("leak", "rank(s) [1] destroyed it outside this call"),
        ),
        # A peer outside the group that releases: left.
        ([_holding(1, B)], [0, 1], ("leave", "peer rank(s) [2] are not in group")),
        # No identity its peers share (made outside fused_a2a): left.
        ([_holding(0, A[:2] + (None,))], None, ("leave", "made outside fused_a2a")),
    ],
    ids=["every-peer", "replaced-peer", "destroyed-on-one-rank", "peer-outside", "no-token"],
)
def test_every_rank_takes_the_same_decision(holdings, members, expected):
    """The decision is a function of what every rank sent, the same on every rank."""
    if members is not None:  # ranks of the group that hold nothing still send an entry
        holdings = holdings + [_holding(r) for r in members if r not in {h[0] for h in holdings}]
    actions, blocked = fused_a2a._agree(holdings, graphs_released=False)
    assert blocked == [], blocked
    (action,) = actions.values()
    assert action[0] == expected[0] and (expected[1] or "") in (action[1] or ""), action


@pytest.mark.skipif(
    not hasattr(fused_a2a, "ensure_nccl_ep_bootstrapped"), reason="no NCCL EP on this branch"
)
def test_nccl_ep_context_of_a_destroyed_group_is_not_finalized():
    """ep_finalize runs on the communicator TransformerEngine borrowed from the EP group: once
    that group is destroyed, no rank finalizes the context (its free needs the group)."""
    context = ("ncclep", (0, 1), "token-c")
    holdings = [_holding(r, context, group_gone=True) for r in (0, 1)]
    actions, blocked = fused_a2a._agree(holdings, graphs_released=False)
    assert blocked == [] and actions[context][0] == "leak", actions
    assert "process group is gone" in actions[context][1], actions


def test_a_live_graph_or_capture_blocks_every_free():
    """A graph whose backward has not run, on any rank, blocks the whole release; a CUDA graph
    capture blocks it unless the caller says the graphs were released."""
    holdings = [_holding(0, A, graphs=1), _holding(1, A), _holding(2, B, captured=True)]
    _, blocked = fused_a2a._agree(holdings, graphs_released=False)
    assert len(blocked) == 2, blocked
    (graph,) = [why for why in blocked if "autograd graph" in why]
    (capture,) = [why for why in blocked if "CUDA graph" in why]
    assert "rank(s) [0]" in graph and "graphs_released=True" in capture, blocked
    _, blocked = fused_a2a._agree(holdings[:2] + [_holding(2, B, captured=True)], True)
    assert len(blocked) == 1 and "autograd graph" in blocked[0], blocked


def _record_deep_ep_buffers(monkeypatch) -> list:
    """deep_ep's Buffer in fused_a2a replaced by a subclass logging "create <n>" and
    "destroy <n>" for the n-th buffer."""
    real_buffer = fused_a2a.Buffer
    events = []

    class RecordingBuffer(real_buffer):
        @functools.wraps(real_buffer.__init__)  # get_buffer() inspects the signature
        def __init__(self, *args, **kwargs):
            self.test_index = sum(e.startswith("create") for e in events)
            events.append(f"create {self.test_index}")
            super().__init__(*args, **kwargs)

        def destroy(self):
            events.append(f"destroy {self.test_index}")
            super().destroy()

    monkeypatch.setattr(fused_a2a, "Buffer", RecordingBuffer)
    return events


def test_no_argument_release_is_idempotent_without_buffers():
    """The release that waits on nobody: safe before any dispatch, any number of times, with no
    process group."""
    assert fused_a2a.reset_fused_a2a_buffers() is None
    assert fused_a2a.reset_fused_a2a_buffers() is None
    assert fused_a2a.get_hybrid_ep_buffer(None) is None
    assert fused_a2a._buffer is None


@pytest.mark.skipif(
    not fused_a2a.HAVE_DEEP_EP
    and not fused_a2a.HAVE_HYBRIDEP
    and not getattr(fused_a2a, "HAVE_TE_EP", False),
    reason="Deep EP, Hybrid EP and NCCL EP are not available",
)
class TestFusedA2ACommBuffers(TwoEPGroups):
    def setup_method(self, method):
        super().setup_method(method)
        # What earlier tests left allocated is freed first: each test counts only its own.
        Utils.initialize_distributed()
        self.release_buffers()

    def release_buffers(self):
        fused_a2a.reset_fused_a2a_buffers(
            collective=True, group=torch.distributed.group.WORLD, graphs_released=True
        )

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    @pytest.mark.parametrize("moe_flex_dispatcher_backend", ["deepep", "hybridep", "ncclep"])
    def test_release_and_recreate(self, moe_flex_dispatcher_backend):
        """The explicit release between steps frees the buffer and says so; the next step
        re-creates it and gives bitwise the same outputs and gradients."""
        backend = moe_flex_dispatcher_backend
        skip_unless(backend)
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        layer = build_moe_layer(backend)
        inp = make_input()
        first = forward_backward(layer, inp)
        # Code outside fused_a2a may hold the buffer (ART reads _hybrid_ep_buffer): it is freed
        # all the same. NCCL EP's "buffer" is its group, which parallel_state keeps.
        buffer = _in_use(backend)
        assert buffer is not None, f"no {backend} buffer after a dispatch"

        release = fused_a2a.reset_fused_a2a_buffers(
            collective=True, group=torch.distributed.group.WORLD
        )
        assert release.freed == {backend: 1}, f"the release says it freed {release.freed}"
        assert release.leaked == [] and release.left == [], release
        assert _in_use(backend) is None, f"the {backend} buffer outlives the release"
        if backend == "ncclep":
            assert not fused_a2a.is_nccl_ep_bootstrapped(), "NCCL EP's context outlives it"
        else:
            assert _freed(buffer), f"the released {backend} buffer was not freed"
        del buffer

        second = forward_backward(layer, inp)
        assert _in_use(backend) is not None, "the next dispatch did not re-create the buffer"
        # Deterministic kernels on the same inputs: bitwise equal, not merely close.
        assert_bitwise_equal(second, first, "after a release")

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    @pytest.mark.parametrize("moe_flex_dispatcher_backend", ["deepep", "hybridep"])
    def test_release_refuses_while_a_graph_uses_a_buffer(self, moe_flex_dispatcher_backend):
        """Between a forward and its backward the release raises on every rank and frees
        nothing; the backward then runs bitwise as without the attempt."""
        backend = moe_flex_dispatcher_backend
        skip_unless(backend)
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        layer = build_moe_layer(backend)
        inp = make_input()
        expected = forward_backward(layer, inp)
        x, out = run_forward(layer, inp)
        buffer = _in_use(backend)
        with pytest.raises(RuntimeError, match="autograd graph"):
            fused_a2a.reset_fused_a2a_buffers(collective=True, group=torch.distributed.group.WORLD)
        assert _in_use(backend) is buffer and not _freed(buffer)
        assert_bitwise_equal(run_backward(layer, x, out), expected, "after a refused release")
        del x, out
        release = fused_a2a.reset_fused_a2a_buffers(
            collective=True, group=torch.distributed.group.WORLD
        )
        assert release.freed == {backend: 1} and _freed(buffer), release

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_release_needs_a_group_and_the_main_thread(self):
        """Without a group, or on another thread, the release raises before any collective."""
        skip_unless("hybridep")
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        forward_backward(build_moe_layer("hybridep"), make_input())
        with pytest.raises(ValueError, match="needs group="):
            fused_a2a.reset_fused_a2a_buffers(collective=True)
        errors = []

        def release():
            try:
                fused_a2a.reset_fused_a2a_buffers(
                    collective=True, group=torch.distributed.group.WORLD
                )
            except RuntimeError as exc:
                errors.append(str(exc))

        thread = threading.Thread(target=release)
        thread.start()
        thread.join()
        assert errors and "main thread" in errors[0], errors
        assert _in_use("hybridep") is not None

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_no_argument_release_waits_on_nobody_and_frees_nothing(self, monkeypatch):
        """reset_fused_a2a_buffers() runs no collective and frees no buffer, so a peer that never
        gets there cannot hold it: the buffers are taken out of use; the next dispatch of a group
        of the same ranks takes its buffer back."""
        skip_unless("hybridep")
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        layer = build_moe_layer("hybridep")
        first = forward_backward(layer, make_input())
        buffer_ref = weakref.ref(_in_use("hybridep"))  # the module's references only

        def no_collective(*args, **kwargs):
            raise AssertionError("reset_fused_a2a_buffers() waited for its peers")

        with monkeypatch.context() as m:
            m.setattr(torch.distributed, "barrier", no_collective)
            m.setattr(torch.distributed, "all_gather_object", no_collective)
            fused_a2a.reset_fused_a2a_buffers()
        assert _in_use("hybridep") is None and not _freed(buffer_ref())
        assert_bitwise_equal(forward_backward(layer, make_input()), first, "taken back")
        assert _in_use("hybridep") is buffer_ref(), "the next dispatch did not take it back"

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_release_frees_what_each_rank_holds(self):
        """HybridEP buffers on two EP groups per rank and the DeepEP buffer (each backend where
        installed): ranks holding buffers of different groups take one decision and free all."""
        if not fused_a2a.HAVE_HYBRIDEP and not fused_a2a.HAVE_DEEP_EP:
            pytest.skip("needs Hybrid EP or Deep EP (buffers to hold)")
        group_a, group_b = self.two_ep_groups()
        made = {}
        if fused_a2a.HAVE_HYBRIDEP:
            for group in (group_a, group_b):
                # By keyword: core_r0.17.0 requires these three, later branches default them.
                fused_a2a.init_hybrid_ep_buffer(
                    group, HIDDEN_SIZE, 32, 2,
                    num_sms_dispatch_api=16, num_sms_combine_api=16, fp8_dispatch=False,
                )  # fmt: skip
            made["hybridep"] = 2
        if fused_a2a.HAVE_DEEP_EP:
            fused_a2a.get_buffer(group_a, HIDDEN_SIZE * 2)
            made["deepep"] = 1
        release = fused_a2a.reset_fused_a2a_buffers(
            collective=True, group=torch.distributed.group.WORLD
        )
        assert release.freed == made and release.leaked == [] and release.left == [], release

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_deep_ep_buffer_built_with_explicitly_destroy(self):
        skip_unless("deepep")
        if "explicitly_destroy" not in inspect.signature(fused_a2a.Buffer.__init__).parameters:
            pytest.skip("deep_ep's Buffer has no explicitly_destroy")
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        group = parallel_state.get_expert_model_parallel_group()
        buffer = fused_a2a.get_buffer(group, HIDDEN_SIZE * 2)
        assert getattr(
            buffer, "explicitly_destroy", False
        ), "get_buffer() built the DeepEP buffer without explicitly_destroy=True"

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_deep_ep_growth_keeps_the_old_buffer_for_the_release(self, monkeypatch):
        """A larger buffer needed destroys nothing inside the dispatch (destroy() is
        collective); the explicit release destroys both, each exactly once."""
        skip_unless("deepep")
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        group = parallel_state.get_expert_model_parallel_group()
        events = _record_deep_ep_buffers(monkeypatch)
        old = weakref.ref(fused_a2a.get_buffer(group, HIDDEN_SIZE))
        fused_a2a.get_buffer(group, HIDDEN_SIZE * 2)  # larger: a replacement
        assert events == ["create 0", "create 1"], f"the replacement destroyed a buffer: {events}"
        # Upstream drops the old one here, so its destructor frees it wherever it dies.
        assert old() is not None and not _freed(old()), "the replaced buffer was freed"
        release = fused_a2a.reset_fused_a2a_buffers(
            collective=True, group=torch.distributed.group.WORLD
        )
        assert sorted(events[2:]) == ["destroy 0", "destroy 1"], events
        assert release.freed == {"deepep": 2}, release

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_release_destroys_deep_ep_buffer_while_referenced(self, monkeypatch):
        """The release frees the DeepEP buffer by destroy(), not whenever its last reference
        goes (here one is still alive)."""
        skip_unless("deepep")
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        group = parallel_state.get_expert_model_parallel_group()
        events = _record_deep_ep_buffers(monkeypatch)
        buffer = fused_a2a.get_buffer(group, HIDDEN_SIZE * 2)
        fused_a2a.reset_fused_a2a_buffers(collective=True, group=torch.distributed.group.WORLD)
        assert fused_a2a._buffer is None
        assert events == ["create 0", "destroy 0"], f"no destroy() of the DeepEP buffer: {events}"
        assert buffer.runtime is None

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
        fused_a2a.reset_fused_a2a_buffers(collective=True, group=torch.distributed.group.WORLD)

        forward_backward(layers["A"], inputs["A"])
        with pytest.raises(RuntimeError, match="reset_fused_a2a_buffers"):
            run_forward(layers["B"], inputs["B"])
        fused_a2a.reset_fused_a2a_buffers(collective=True, group=torch.distributed.group.WORLD)
        after = forward_backward(layers["B"], inputs["B"])
        assert_bitwise_equal(after, alone, "layer B after the release")
        assert _in_use("ncclep") is layers["B"].token_dispatcher.tp_ep_group

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_destroy_model_parallel_finalizes_nccl_ep(self):
        """Upstream's teardown finalizes NCCL EP's context; the series keeps that."""
        skip_unless("ncclep")
        Utils.initialize_model_parallel(expert_model_parallel_size=8)
        forward_backward(build_moe_layer("ncclep"), make_input())
        assert _in_use("ncclep") is not None, "no NCCL EP context after a dispatch"
        Utils.destroy_model_parallel()
        assert not fused_a2a.is_nccl_ep_bootstrapped(), "the NCCL EP context outlives teardown"
