# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""The MoE token dispatchers release their per-forward state once combine is done.

After a forward and backward through an MoELayer, the dispatcher, and for flex its
communication manager, must hold no tensor the forward made: the routing map, the router
probabilities, the permutation mappings, the token counts, the dispatch handle. The
probabilities are the router's differentiable output, so holding them keeps the layer's input
(with recompute, the recomputed input) and its gradient alive until the layer's next forward.

The tests do not list what the dispatchers cache. They compare the tensors a dispatcher
references through its attributes after a step with those it referenced once built: a tensor
that is new after the step was left behind by the forward. Tensors built at construction (the
all-to-all's expert index maps, HybridEP's over-budget flag) are the same objects after a step.

Releasing the state must not change a value: outputs and gradients are bitwise equal to those
of the same layer with the release switched off, also on the next forward, and a CUDA-graph
replay of the preprocess (cuda_graph_scope moe_preprocess) still finds what it reads. Run on
another stream, as under the 1F1B A2A overlap, the release records what it drops on that stream.
"""

import gc
import weakref
from typing import Dict, List, Optional, Sequence

import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.moe import fused_a2a
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_te_version, is_te_min_version
from tests.unit_tests.test_utilities import Utils

try:
    from megatron.core.transformer.spec_utils import get_submodules
except ImportError:  # core_r0.16.0: an MoE spec is a ModuleSpec
    from operator import attrgetter

    get_submodules = attrgetter("submodules")

SEQ_LEN = 16
MICRO_BATCH = 2
NUM_EXPERTS = 8

# What a HybridEP manager in drop-and-pad mode keeps on purpose: both come from static shapes,
# and a CUDA-graph replay of the preprocess reads them without re-running setup_metadata.
HYBRIDEP_DROP_AND_PAD_KEPT = ("tokens_per_expert", "num_permuted_tokens")

DROP_AND_PAD = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
SHARED_EXPERTS = dict(moe_shared_expert_intermediate_size=64)
SHARED_EXPERTS_OVERLAP = dict(
    moe_shared_expert_intermediate_size=64, moe_shared_expert_overlap=True
)


def moe_submodules() -> MoESubmodules:
    """The MoE submodules of the local (non-TE) GPT layer spec."""
    spec = get_gpt_layer_local_spec(num_experts=NUM_EXPERTS, moe_grouped_gemm=False)
    submodules = get_submodules(spec.submodules.mlp)
    assert isinstance(submodules, MoESubmodules)
    return submodules


def is_deep_ep_available() -> bool:
    """Whether the flex dispatcher's DeepEP backend can run (deep_ep is installed)."""
    return fused_a2a.HAVE_DEEP_EP


def is_hybrid_ep_available() -> bool:
    """Whether the flex dispatcher's HybridEP backend can run (deep_ep with HybridEP)."""
    return fused_a2a.HAVE_HYBRIDEP


@pytest.fixture
def deterministic():
    """Deterministic kernels (scatter_add and index_add included), so that two runs of the same
    layer on the same input can be compared bitwise."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def build_moe_layer(
    dispatcher_type: str,
    tp_size: int,
    ep_size: int,
    recompute: bool = False,
    flex_backend: Optional[str] = None,
    dtype: torch.dtype = torch.float32,
    hidden_size: int = 64,
    **config_kwargs,
) -> MoELayer:
    """A small MoELayer with local (non-TE) experts, as in test_moe_layer.py; config_kwargs go
    to TransformerConfig."""
    Utils.initialize_model_parallel(
        tensor_model_parallel_size=tp_size, expert_model_parallel_size=ep_size
    )
    torch.manual_seed(123)
    model_parallel_cuda_manual_seed(123)
    if recompute:
        config_kwargs.update(recompute_granularity="selective", recompute_modules=["moe"])
    if flex_backend is not None:
        config_kwargs.update(moe_flex_dispatcher_backend=flex_backend)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=hidden_size,
        num_attention_heads=4,
        num_moe_experts=NUM_EXPERTS,
        use_cpu_initialization=True,
        moe_token_dispatcher_type=dispatcher_type,
        moe_router_load_balancing_type="aux_loss",
        moe_router_topk=2,
        moe_aux_loss_coeff=0.01,
        moe_router_dtype="fp32",
        moe_grouped_gemm=False,
        moe_ffn_hidden_size=128,
        add_bias_linear=False,
        tensor_model_parallel_size=tp_size,
        expert_model_parallel_size=ep_size,
        sequence_parallel=tp_size > 1,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        **config_kwargs,
    )
    submodules = moe_submodules()
    layer = MoELayer(config, submodules).cuda().to(dtype=dtype)
    layer.set_layer_number(0)
    return layer


def build_flex_layer(backend: str, recompute: bool = False, **config_kwargs) -> MoELayer:
    """A flex-dispatcher MoELayer at EP8 on ``backend``; skips where that backend is missing."""
    if backend == "deepep" and not is_deep_ep_available():
        pytest.skip("Deep EP is not available")
    if backend == "hybridep" and not is_hybrid_ep_available():
        pytest.skip("Hybrid EP is not available")
    return build_moe_layer(
        "flex",
        tp_size=1,
        ep_size=8,
        recompute=recompute,
        flex_backend=backend,
        dtype=torch.bfloat16,
        hidden_size=1024,
        **config_kwargs,
    )


def make_input(layer: MoELayer) -> torch.Tensor:
    """A per-rank input (the local sequence shard under sequence parallelism)."""
    torch.manual_seed(1000 + torch.distributed.get_rank())
    return torch.randn(
        SEQ_LEN,
        MICRO_BATCH,
        layer.config.hidden_size,
        dtype=layer.config.params_dtype,
        device=torch.cuda.current_device(),
    )


def _tensors(value, depth: int = 0) -> List[torch.Tensor]:
    """The tensors in ``value``, also inside tuples, lists and dicts (a dispatch handle)."""
    if torch.is_tensor(value):
        return [value]
    if depth < 3 and isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v, depth + 1)]
    if depth < 3 and isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v, depth + 1)]
    return []


def tensor_state(dispatcher) -> Dict[str, List[torch.Tensor]]:
    """The tensors the dispatcher and, for flex, its communication manager reference through
    their attributes, by ``Class.attribute`` (modules such as the shared experts excluded)."""
    owners = [dispatcher]
    if getattr(dispatcher, "_comm_manager", None) is not None:
        owners.append(dispatcher._comm_manager)
    state = {}
    for owner in owners:
        for attr, value in vars(owner).items():
            if isinstance(value, torch.nn.Module):
                continue
            tensors = _tensors(value)
            if tensors:
                state[f"{type(owner).__name__}.{attr}"] = tensors
    return state


def left_by_forward(
    before: Dict[str, List[torch.Tensor]], dispatcher, kept: Sequence[str] = ()
) -> List[str]:
    """The attributes that reference a tensor they did not reference in ``before`` (the state
    after construction): what the forward left on the dispatcher. ``kept`` names attributes
    allowed to stay."""
    left = []
    for name, tensors in tensor_state(dispatcher).items():
        if name.split(".", 1)[1] in kept:
            continue
        built = {id(t) for t in before.get(name, ())}
        if any(id(t) not in built for t in tensors):
            left.append(name)
    return left


def check_release(layer: MoELayer, kept: Sequence[str] = ()) -> None:
    """After forward+backward the dispatcher holds no tensor of that forward, and the layer's
    input (and with it its gradient) is freed once the caller drops it."""
    before = tensor_state(layer.token_dispatcher)
    for step in range(2):
        x = make_input(layer).requires_grad_(True)
        x_ref = weakref.ref(x)
        output, _ = layer(x)
        output.backward(torch.ones_like(output))
        torch.cuda.synchronize()
        assert x.grad is not None
        del x, output
        gc.collect()

        left = left_by_forward(before, layer.token_dispatcher, kept)
        assert not left, f"step {step}: the dispatcher still holds the forward's tensors: {left}"
        assert x_ref() is None, f"step {step}: the layer's input is alive after forward+backward"


def forward_backward(layer: MoELayer, inp: torch.Tensor) -> tuple:
    """One forward and backward; returns the output, the input's and the parameters' grads."""
    layer.zero_grad(set_to_none=True)
    x = inp.detach().clone().requires_grad_(True)
    output, _ = layer(x)
    output.backward(torch.ones_like(output))
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    return output.detach(), x.grad.detach(), grads


def check_outputs_unchanged(layer: MoELayer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs and gradients are bitwise those of the same layer with the release switched off,
    and the forward after a release gives them again."""
    inp = make_input(layer)
    monkeypatch.setattr(
        type(layer.token_dispatcher),
        "reset_transient_forward_state",
        lambda self: None,
        raising=False,
    )
    ref_out, ref_dgrad, ref_wgrads = forward_backward(layer, inp)
    monkeypatch.undo()
    for step in range(2):
        out, dgrad, wgrads = forward_backward(layer, inp)
        assert torch.equal(out, ref_out), f"step {step}: output differs"
        assert torch.equal(dgrad, ref_dgrad), f"step {step}: input gradient differs"
        assert wgrads.keys() == ref_wgrads.keys()
        for name, grad in wgrads.items():
            assert torch.equal(grad, ref_wgrads[name]), f"step {step}: {name}.grad differs"


def check_release_records_on_current_stream(
    layer: MoELayer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """reset_transient_forward_state() run on another stream than the forward's (under the 1F1B
    A2A overlap combine runs on the communication stream) records every device tensor it drops
    on that stream first, so that the caching allocator does not hand the memory back to the
    stream that made it while work queued on the other may still read it. Host tensors are not
    recorded: record_stream is a CUDA-only kernel."""
    dispatcher = layer.token_dispatcher
    before = tensor_state(dispatcher)
    # Keep the forward's state past combine, to drop it on another stream below.
    monkeypatch.setattr(
        type(dispatcher), "reset_transient_forward_state", lambda self: None, raising=False
    )
    output, _ = layer(make_input(layer).requires_grad_(True))
    output.backward(torch.ones_like(output))
    monkeypatch.undo()
    built = {id(t) for tensors in before.values() for t in tensors}
    held = {
        id(t): (name, t)
        for name, tensors in tensor_state(dispatcher).items()
        for t in tensors
        if id(t) not in built
    }
    recorded = []
    record_stream = torch.Tensor.record_stream

    def record(tensor, stream):
        recorded.append((id(tensor), stream))
        return record_stream(tensor, stream)

    monkeypatch.setattr(torch.Tensor, "record_stream", record)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dispatcher.reset_transient_forward_state()
    torch.cuda.current_stream().wait_stream(side)
    monkeypatch.undo()

    left = left_by_forward(before, dispatcher)
    assert not left, f"the dispatcher still holds the forward's tensors after the reset: {left}"
    on_side = {i for i, stream in recorded if stream == side}
    missing = sorted({held[i][0] for i, (_, t) in held.items() if t.is_cuda and i not in on_side})
    assert not missing, f"dropped on another stream without a record_stream: {missing}"


def check_preprocess_graph_replay(layer: MoELayer) -> None:
    """A partial CUDA graph over the router and the preprocess (cuda_graph_scope moe_router
    and moe_preprocess), as TransformerLayer uses it: the capture returns the tensors named in
    the dispatcher's cudagraph_attrs and records them in valid_cudagraph_attrs; a replay writes
    them back and runs dispatch, experts and combine eagerly, reading whatever else the
    preprocess left, after the previous forward's combine released its state. Here the
    'replay' returns the captured forward's tensors themselves; its output must be bitwise the
    eager forward's."""
    dispatcher = layer.token_dispatcher
    x = make_input(layer)
    with torch.no_grad():
        eager, _ = layer(x)
        # Capture: the router and the preprocess; the dispatcher attributes as outputs.
        probs, routing_map = layer.route(x)
        hidden, probs = layer.preprocess(x, probs, routing_map)
        captured = {}
        for attr_name in dispatcher.cudagraph_attrs:
            owner = dispatcher
            for part in attr_name.split("."):
                owner = getattr(owner, part, None)
            if torch.is_tensor(owner):
                captured[attr_name] = owner
        dispatcher.valid_cudagraph_attrs = list(captured)
        try:
            out, _ = layer.dispatch(hidden, probs)
            out, _ = layer.routed_experts_compute(out, _)
            layer.postprocess(layer.combine(out), None)  # releases the forward's state
            # Replay: the captured attributes written back, then the eager rest of the layer.
            for attr_name, value in captured.items():
                owner = dispatcher
                *path, leaf = attr_name.split(".")
                for part in path:
                    owner = getattr(owner, part)
                setattr(owner, leaf, value)
            out, _ = layer.dispatch(hidden, probs)
            out, _ = layer.routed_experts_compute(out, _)
            replayed = layer.postprocess(layer.combine(out), None)
        finally:
            dispatcher.valid_cudagraph_attrs = None
    assert torch.equal(replayed, eager), "the preprocess replay after a release differs"


class TestDispatcherStateRelease:
    def setup_method(self, method):
        pass

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.internal
    @pytest.mark.parametrize("moe_token_dispatcher_type", ["allgather", "alltoall"])
    @pytest.mark.parametrize("tp_size,ep_size", [(1, 8), (2, 4)])
    @pytest.mark.parametrize("recompute", [False, True])
    def test_state_released_after_backward(
        self, moe_token_dispatcher_type, tp_size, ep_size, recompute
    ):
        layer = build_moe_layer(moe_token_dispatcher_type, tp_size, ep_size, recompute)
        check_release(layer)

    @pytest.mark.internal
    @pytest.mark.parametrize(
        "moe_token_dispatcher_type,variant",
        [
            ("alltoall", DROP_AND_PAD),
            ("alltoall", SHARED_EXPERTS),
            ("alltoall", SHARED_EXPERTS_OVERLAP),
            ("allgather", DROP_AND_PAD),
            ("allgather", SHARED_EXPERTS),
        ],
        ids=[
            "alltoall-drop_and_pad",
            "alltoall-shared_experts",
            "alltoall-shared_experts_overlap",
            "allgather-drop_and_pad",
            "allgather-shared_experts",
        ],
    )
    def test_state_released_with_variant(self, moe_token_dispatcher_type, variant):
        layer = build_moe_layer(moe_token_dispatcher_type, 2, 4, recompute=True, **variant)
        check_release(layer)

    @pytest.mark.skipif(
        # core_r0.16.0's is_te_min_version raises without Transformer Engine
        get_te_version() is None or not is_te_min_version("2.1.0"),
        reason="moe_permute_fusion needs TE 2.1",
    )
    @pytest.mark.internal
    @pytest.mark.parametrize("moe_token_dispatcher_type", ["allgather", "alltoall"])
    def test_state_released_with_permute_fusion(self, moe_token_dispatcher_type):
        layer = build_moe_layer(moe_token_dispatcher_type, 1, 8, moe_permute_fusion=True)
        check_release(layer)

    @pytest.mark.internal
    @pytest.mark.parametrize("moe_token_dispatcher_type", ["allgather", "alltoall"])
    @pytest.mark.parametrize("tp_size,ep_size", [(1, 8), (2, 4)])
    def test_release_keeps_outputs_and_grads(
        self, moe_token_dispatcher_type, tp_size, ep_size, monkeypatch, deterministic
    ):
        layer = build_moe_layer(moe_token_dispatcher_type, tp_size, ep_size, recompute=True)
        check_outputs_unchanged(layer, monkeypatch)

    @pytest.mark.internal
    @pytest.mark.parametrize("moe_token_dispatcher_type", ["allgather", "alltoall"])
    def test_release_records_on_current_stream(self, moe_token_dispatcher_type, monkeypatch):
        layer = build_moe_layer(moe_token_dispatcher_type, 2, 4)
        check_release_records_on_current_stream(layer, monkeypatch)

    @pytest.mark.internal
    @pytest.mark.parametrize(
        "moe_token_dispatcher_type,variant",
        [("alltoall", {}), ("alltoall", DROP_AND_PAD), ("allgather", {})],
        ids=["alltoall", "alltoall-drop_and_pad", "allgather"],
    )
    def test_preprocess_graph_replay_after_release(
        self, moe_token_dispatcher_type, variant, deterministic
    ):
        layer = build_moe_layer(moe_token_dispatcher_type, 2, 4, **variant)
        check_preprocess_graph_replay(layer)


@pytest.mark.skipif(
    not is_deep_ep_available() and not is_hybrid_ep_available(),
    reason="Deep EP and Hybrid EP are not available",
)
class TestFlexDispatcherStateRelease:
    def setup_method(self, method):
        pass

    def teardown_method(self, method):
        fused_a2a.reset_hybrid_ep_buffer()
        Utils.destroy_model_parallel()

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    @pytest.mark.parametrize("moe_flex_dispatcher_backend", ["deepep", "hybridep"])
    @pytest.mark.parametrize("recompute", [False, True])
    def test_state_released_after_backward(self, moe_flex_dispatcher_backend, recompute):
        layer = build_flex_layer(moe_flex_dispatcher_backend, recompute=recompute)
        check_release(layer)

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_hybridep_drop_and_pad_keeps_only_static_counts(self):
        layer = build_flex_layer("hybridep", recompute=True, **DROP_AND_PAD)
        check_release(layer, kept=HYBRIDEP_DROP_AND_PAD_KEPT)

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_hybridep_state_released_with_shared_experts_overlap(self):
        try:
            layer = build_flex_layer("hybridep", recompute=True, **SHARED_EXPERTS_OVERLAP)
        except ValueError as exc:
            # Up to core_r0.17.0 the shared-expert overlap is the all-to-all dispatcher's only.
            if "only works with alltoall token dispatcher" not in str(exc):
                raise
            pytest.skip(f"this branch has no flex shared-expert overlap ({exc})")
        check_release(layer)

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    @pytest.mark.parametrize("moe_flex_dispatcher_backend", ["deepep", "hybridep"])
    def test_release_keeps_outputs_and_grads(
        self, moe_flex_dispatcher_backend, monkeypatch, deterministic
    ):
        layer = build_flex_layer(moe_flex_dispatcher_backend, recompute=True)
        check_outputs_unchanged(layer, monkeypatch)

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    @pytest.mark.parametrize("moe_flex_dispatcher_backend", ["deepep", "hybridep"])
    def test_release_records_on_current_stream(self, moe_flex_dispatcher_backend, monkeypatch):
        layer = build_flex_layer(moe_flex_dispatcher_backend)
        check_release_records_on_current_stream(layer, monkeypatch)

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    def test_hybridep_drop_and_pad_preprocess_graph_replay(self, deterministic):
        layer = build_flex_layer("hybridep", **DROP_AND_PAD)
        check_preprocess_graph_replay(layer)
