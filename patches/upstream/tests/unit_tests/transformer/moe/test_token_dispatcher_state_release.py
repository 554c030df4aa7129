# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""The MoE token dispatchers release their per-forward state once combine is done.

After a forward and backward through an MoELayer, neither the dispatcher nor the flex
dispatcher's communication manager may hold the routing map, the router probabilities, the
permutation mappings or the dispatch handle of that forward: the probabilities are the router's
differentiable output, so holding them keeps the layer's input (with recompute, the recomputed
input) and its gradient alive until the layer's next forward. Releasing them must not change
outputs or gradients.
"""

import gc
import weakref

import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.moe import fused_a2a
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.spec_utils import get_submodules
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils

# What each dispatcher (for flex: its communication manager) sets per forward and reads for the
# last time in combine. Only tensors (or tuples of tensors) count as held.
TRANSIENT_ATTRS = {
    "MoEAllGatherTokenDispatcher": (
        "routing_map",
        "local_map",
        "local_probs",
        "reversed_local_input_permutation_mapping",
    ),
    "MoEAlltoAllTokenDispatcher": (
        "probs",
        "routing_map",
        "reversed_local_input_permutation_mapping",
        "tokens_per_expert",
        "num_global_tokens_per_local_expert",
    ),
    "_HybridEPManager": (
        "routing_map",
        "token_probs",
        "dispatched_probs",
        "tokens_per_expert",
        "handle",
    ),
    "_DeepepManager": (
        "token_probs",
        "token_indices",
        "dispatched_indices",
        "dispatched_probs",
        "dispatched_routing_map",
        "reversed_mapping_for_combine",
        "handle",
    ),
}

SEQ_LEN = 16
MICRO_BATCH = 2


def is_deep_ep_available() -> bool:
    """Whether the flex dispatcher's DeepEP backend can run (deep_ep is installed)."""
    return fused_a2a.HAVE_DEEP_EP


def is_hybrid_ep_available() -> bool:
    """Whether the flex dispatcher's HybridEP backend can run (deep_ep with HybridEP)."""
    return fused_a2a.HAVE_HYBRIDEP


def _holds_tensor(value) -> bool:
    if torch.is_tensor(value):
        return True
    if isinstance(value, (tuple, list)):
        return any(_holds_tensor(v) for v in value)
    return False


def held_state(dispatcher) -> list:
    """The per-forward attributes still holding a tensor on the dispatcher and its manager."""
    holders = [dispatcher]
    if hasattr(dispatcher, "_comm_manager"):
        holders.append(dispatcher._comm_manager)
    held = []
    for obj in holders:
        attrs = TRANSIENT_ATTRS.get(type(obj).__name__, ())
        held += [f"{type(obj).__name__}.{a}" for a in attrs if _holds_tensor(getattr(obj, a, None))]
    return held


def build_moe_layer(
    dispatcher_type: str,
    tp_size: int,
    ep_size: int,
    recompute: bool,
    flex_backend: str = None,
    dtype: torch.dtype = torch.float32,
    hidden_size: int = 64,
) -> MoELayer:
    """A small MoELayer with local (non-TE) experts, as in test_moe_layer.py."""
    Utils.initialize_model_parallel(
        tensor_model_parallel_size=tp_size, expert_model_parallel_size=ep_size
    )
    torch.manual_seed(123)
    model_parallel_cuda_manual_seed(123)
    num_moe_experts = 8
    recompute_kwargs = (
        dict(recompute_granularity="selective", recompute_modules=["moe"]) if recompute else {}
    )
    config = TransformerConfig(
        num_layers=1,
        hidden_size=hidden_size,
        num_attention_heads=4,
        num_moe_experts=num_moe_experts,
        use_cpu_initialization=True,
        moe_token_dispatcher_type=dispatcher_type,
        moe_flex_dispatcher_backend=flex_backend,
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
        **recompute_kwargs,
    )
    submodules = get_submodules(
        get_gpt_layer_local_submodules(num_experts=num_moe_experts, moe_grouped_gemm=False).mlp
    )
    assert isinstance(submodules, MoESubmodules)
    layer = MoELayer(config, submodules).cuda().to(dtype=dtype)
    layer.set_layer_number(0)
    return layer


def make_input(layer: MoELayer) -> torch.Tensor:
    """A per-rank input leaf (the local sequence shard under sequence parallelism)."""
    torch.manual_seed(1000 + torch.distributed.get_rank())
    return torch.randn(
        SEQ_LEN,
        MICRO_BATCH,
        layer.config.hidden_size,
        dtype=layer.config.params_dtype,
        device=torch.cuda.current_device(),
    )


def forward_backward(layer: MoELayer, inp: torch.Tensor) -> tuple:
    """One forward and backward; returns the output, the input's and the parameters' grads."""
    layer.zero_grad(set_to_none=True)
    x = inp.detach().clone().requires_grad_(True)
    output, _ = layer(x)
    output.backward(torch.ones_like(output))
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    return output.detach(), x.grad.detach(), grads


def check_release(layer: MoELayer) -> None:
    """After forward+backward the dispatcher holds no per-forward tensor and the layer's input
    (and with it its gradient) is freed once the caller drops it."""
    x = make_input(layer).requires_grad_(True)
    x_ref = weakref.ref(x)
    output, _ = layer(x)
    output.backward(torch.ones_like(output))
    torch.cuda.synchronize()
    assert x.grad is not None
    del x, output
    gc.collect()

    held = held_state(layer.token_dispatcher)
    assert not held, f"the dispatcher still holds per-forward state after backward: {held}"
    assert x_ref() is None, "the layer's input is still alive after forward+backward"


def check_outputs_unchanged(layer: MoELayer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs and gradients are those of the same layer with the release switched off, and a
    second forward after a release matches the first."""
    inp = make_input(layer)
    dispatcher_cls = type(layer.token_dispatcher)
    monkeypatch.setattr(
        dispatcher_cls, "reset_transient_forward_state", lambda self: None, raising=False
    )
    ref_out, ref_dgrad, ref_wgrads = forward_backward(layer, inp)
    monkeypatch.undo()
    for _ in range(2):
        out, dgrad, wgrads = forward_backward(layer, inp)
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(dgrad, ref_dgrad)
        assert wgrads.keys() == ref_wgrads.keys()
        for name, grad in wgrads.items():
            torch.testing.assert_close(grad, ref_wgrads[name], msg=name)


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
    @pytest.mark.parametrize("moe_token_dispatcher_type", ["allgather", "alltoall"])
    @pytest.mark.parametrize("tp_size,ep_size", [(1, 8), (2, 4)])
    def test_release_keeps_outputs_and_grads(
        self, moe_token_dispatcher_type, tp_size, ep_size, monkeypatch
    ):
        layer = build_moe_layer(moe_token_dispatcher_type, tp_size, ep_size, recompute=True)
        check_outputs_unchanged(layer, monkeypatch)


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

    @staticmethod
    def _skip_unavailable(backend: str) -> None:
        if backend == "deepep" and not is_deep_ep_available():
            pytest.skip("Deep EP is not available")
        if backend == "hybridep" and not is_hybrid_ep_available():
            pytest.skip("Hybrid EP is not available")

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    @pytest.mark.parametrize("moe_flex_dispatcher_backend", ["deepep", "hybridep"])
    @pytest.mark.parametrize("recompute", [False, True])
    def test_state_released_after_backward(self, moe_flex_dispatcher_backend, recompute):
        self._skip_unavailable(moe_flex_dispatcher_backend)
        layer = build_moe_layer(
            "flex",
            tp_size=1,
            ep_size=8,
            recompute=recompute,
            flex_backend=moe_flex_dispatcher_backend,
            dtype=torch.bfloat16,
            hidden_size=1024,
        )
        check_release(layer)

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
    @pytest.mark.internal
    @pytest.mark.parametrize("moe_flex_dispatcher_backend", ["deepep", "hybridep"])
    def test_release_keeps_outputs_and_grads(self, moe_flex_dispatcher_backend, monkeypatch):
        self._skip_unavailable(moe_flex_dispatcher_backend)
        layer = build_moe_layer(
            "flex",
            tp_size=1,
            ep_size=8,
            recompute=True,
            flex_backend=moe_flex_dispatcher_backend,
            dtype=torch.bfloat16,
            hidden_size=1024,
        )
        check_outputs_unchanged(layer, monkeypatch)
