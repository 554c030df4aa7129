# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Helpers shared by the flex dispatcher's communication-buffer tests
(test_hybrid_ep_buffer_per_group.py, test_fused_a2a_release_comm_buffers.py): a small bf16
MoELayer on the flex dispatcher with local (non-TE) experts whose weights are seeded by their
global index, so that a token sent to the wrong rank changes the result; its input, forward and
backward; a bitwise comparison of two runs; and the setup and teardown of tests that use
parallel_state's EP groups and a second model's.
"""

import dataclasses

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.moe import fused_a2a
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
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


def skip_unless(backend: str) -> None:
    if backend == "deepep" and not fused_a2a.HAVE_DEEP_EP:
        pytest.skip("Deep EP is not available")
    if backend == "hybridep" and not fused_a2a.HAVE_HYBRIDEP:
        pytest.skip("Hybrid EP is not available")
    if backend == "ncclep" and not getattr(fused_a2a, "HAVE_TE_EP", False):
        pytest.skip("NCCL EP is not available")


def build_moe_layer(backend: str, pg_collection=None, seed: int = 123) -> MoELayer:
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


def make_input(seed: int = 1000) -> torch.Tensor:
    """A per-rank input."""
    gen = torch.Generator().manual_seed(seed + torch.distributed.get_rank())
    x = torch.randn(SEQ_LEN, MICRO_BATCH, HIDDEN_SIZE, generator=gen)
    return x.to(device=torch.cuda.current_device(), dtype=torch.bfloat16)


def run_forward(layer: MoELayer, inp: torch.Tensor):
    layer.zero_grad(set_to_none=True)
    x = inp.detach().clone().requires_grad_(True)
    output, _ = layer(x)
    return x, output


def run_backward(layer: MoELayer, x: torch.Tensor, output: torch.Tensor) -> dict:
    """Backward of a ``run_forward``; its output, the input's and the parameters' gradients."""
    output.backward(torch.ones_like(output))
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    return {"out": output.detach().clone(), "x_grad": x.grad.detach().clone(), "grads": grads}


def forward_backward(layer: MoELayer, inp: torch.Tensor) -> dict:
    return run_backward(layer, *run_forward(layer, inp))


def assert_bitwise_equal(actual: dict, expected: dict, what: str) -> None:
    rank = torch.distributed.get_rank()
    assert torch.equal(actual["out"], expected["out"]), f"rank {rank}: {what}: output differs"
    assert torch.equal(actual["x_grad"], expected["x_grad"]), f"rank {rank}: {what}: input grad"
    assert expected["grads"] and actual["grads"].keys() == expected["grads"].keys()
    for name, grad in expected["grads"].items():
        assert torch.equal(actual["grads"][name], grad), f"rank {rank}: {what}: {name}.grad"


class TwoEPGroups:
    """Setup and teardown of the tests that use parallel_state's groups and a second model's:
    the buffers taken out of use (release_buffers), the extra groups destroyed, the
    model-parallel state torn down."""

    def setup_method(self, method):
        self.groups = []

    def release_buffers(self):
        fused_a2a.reset_hybrid_ep_buffer()

    def teardown_method(self, method):
        try:
            self.release_buffers()
        finally:  # a failed test's release may raise: the groups go all the same
            for group in self.groups:
                torch.distributed.destroy_process_group(group)
            Utils.destroy_model_parallel()

    def two_ep_groups(self):
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
