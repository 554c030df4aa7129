# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""The MoE router's gating runs without Transformer Engine.

``moe/moe_utils.py`` imports ``te_general_gemm`` with the other Transformer Engine helpers inside
one ``try``, and ``router_gating_linear`` takes its torch path only when that name is None: where
the import failed the name was left undefined, and every router forward raised NameError.

The test imports ``moe_utils`` again with ``megatron.core.extensions.transformer_engine`` made
unimportable (``sys.modules`` maps it to None), runs the gating forward and backward and compares
them with the same products in torch, then puts every module back as it was.
"""

import importlib
import sys

import pytest
import torch

MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
TE_EXTENSIONS = "megatron.core.extensions.transformer_engine"


@pytest.fixture
def without_transformer_engine(monkeypatch):
    """megatron's Transformer Engine extensions unimportable and moe_utils dropped;
    sys.modules and the package's moe_utils attribute restored afterwards."""
    importlib.import_module(MOE_UTILS)
    saved = dict(sys.modules)
    # The package attribute too (an import binds it): restored by undo, as sys.modules is.
    package = sys.modules["megatron.core.transformer.moe"]
    monkeypatch.setattr(package, "moe_utils", package.moe_utils)
    monkeypatch.delitem(sys.modules, MOE_UTILS)
    monkeypatch.setitem(sys.modules, TE_EXTENSIONS, None)
    yield
    monkeypatch.undo()
    for name in set(sys.modules) - set(saved):
        del sys.modules[name]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
def test_router_gating_runs_without_transformer_engine(without_transformer_engine):
    moe_utils = importlib.import_module(MOE_UTILS)
    assert not moe_utils.HAVE_TE
    gen = torch.Generator().manual_seed(0)
    inp = torch.randn(6, 16, generator=gen).to(torch.bfloat16).cuda().requires_grad_()
    weight = torch.randn(8, 16, generator=gen).to(torch.bfloat16).cuda().requires_grad_()
    logits = moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, torch.mm(inp.detach().float(), weight.detach().float().t()))
    grad = torch.randn(6, 8, generator=gen).cuda()
    logits.backward(grad)
    assert torch.equal(inp.grad, torch.mm(grad, weight.detach().float()).to(torch.bfloat16))
    assert torch.equal(weight.grad, torch.mm(grad.t(), inp.detach().float()).to(torch.bfloat16))
