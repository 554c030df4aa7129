# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Upstream-style tests of what the harness plugin (moe_release.upstream_tests.plugin) gives a
test.

``test_run.py`` copies this file into a stand-in checkout as
``tests/unit_tests/test_placement_wiring.py`` and runs it through ``run.py``, with the placement
rules (and ``--te-local-spec``) and without them (``--no-placement``). Written as an upstream
test is, for a GPU: where a comment says "a GPU raises", the test fails under the placement
rules, as it would on a GPU, and passes without them (the host takes it).
"""

import pytest
import torch
from megatron.core.utils import is_te_min_version
from tests.unit_tests.test_utilities import Utils
from torch.utils.checkpoint import checkpoint

# Asked at collection, as upstream's get_valid_fp8_flags asks get_device_arch_version.
CAPABILITY = torch.cuda.get_device_capability()


def test_the_device_is_an_h100():
    assert CAPABILITY == (9, 0)
    assert torch.cuda.get_device_properties(torch.device("cuda:0")).major == 9
    assert torch.cuda.is_available()


def test_cuda_tensors_are_device_tensors():
    assert torch.ones(2, device="cuda").is_cuda
    assert torch.ones(2).cuda().is_cuda
    assert torch.nn.Linear(2, 2).cuda().weight.is_cuda
    assert not torch.ones(2, device="cpu").is_cuda


def test_record_stream_on_a_device_tensor():
    tokens_per_expert = torch.ones(4, dtype=torch.int64, device="cuda")
    tokens_per_expert.record_stream(torch.cuda.current_stream())


def test_record_stream_on_a_pinned_host_tensor():
    # As HybridEP's blocking dispatch returns tokens_per_expert.
    tokens_per_expert = torch.empty(4, dtype=torch.int64, pin_memory=True)
    tokens_per_expert.record_stream(torch.cuda.current_stream())  # a GPU raises


def test_device_and_host_tensors_do_not_mix():
    torch.ones(4, device="cuda") + torch.ones(4, device="cpu")  # a GPU raises


def test_a_read_on_another_stream_waits_for_the_write():
    side = torch.cuda.Stream()
    counts = torch.zeros(4, device="cuda")
    counts += 1  # written on the default stream
    with torch.cuda.stream(side):
        counts * 2  # a GPU races: nothing orders this read after the write


def test_a_checkpoint_recompute_moves_to_the_device():
    """The recompute runs inside the autograd engine; its .to("cuda") works there."""
    x = torch.ones(4, device="cpu", requires_grad=True)
    out = checkpoint(lambda t: t.to("cuda") * 2, x, use_reentrant=True)
    out.sum().backward()
    assert x.grad.tolist() == [2.0] * 4


def test_bf16_gemm_rounds_once():
    a = torch.randn(16, 64, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(64, 8, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(a @ b, (a.float() @ b.float()).bfloat16())


@pytest.mark.skipif(not is_te_min_version("1.9.0.dev0"), reason="Requires TE >= 1.9.0.dev0")
def test_mla_layer_on_the_te_spec():
    """What upstream's A2A-overlap tests build: an MLA layer on the TE spec (under
    --te-local-spec, the local one), run on device inputs without moving the model."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    Utils.initialize_model_parallel(1, 1)
    try:
        model_parallel_cuda_manual_seed(123)
        config = MLATransformerConfig(
            num_layers=1,
            hidden_size=64,
            num_attention_heads=4,
            kv_channels=16,
            v_head_dim=16,
            qk_head_dim=16,
            qk_pos_emb_head_dim=8,
            q_lora_rank=32,
            kv_lora_rank=32,
            add_bias_linear=False,
            normalization="RMSNorm",
            bf16=True,
            params_dtype=torch.bfloat16,
            attention_backend="unfused",
            multi_latent_attention=True,
        )
        spec = get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=True)
        layer = build_module(spec, config=config, layer_number=1)
        assert all(p.is_cuda and p.dtype == torch.bfloat16 for p in layer.parameters())
        hidden = torch.randn(8, 1, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        out = layer(hidden)[0]
        out.sum().backward()
        assert out.shape == (8, 1, 64) and out.is_cuda and hidden.grad is not None
    finally:
        Utils.destroy_model_parallel()
