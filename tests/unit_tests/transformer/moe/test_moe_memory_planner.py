# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The MoE memory planner (the overlay's ``moe_memory_planner`` module and its command).

* Buffer terms against figures worked by hand from deep_ep's source at the planner's
  ``DEEP_EP_COMMIT`` (the lines each term cites): seed 000's shape on one node, a hidden size
  that is not a multiple of 128, a multi-node group, ETP x EP, the non-shared buffer, FP8,
  regrowth, DeepEP's NVLink and RDMA hints; DeepEP v2's window and NCCL EP's context, worked by
  hand from their sources (``DEEP_EP_V2_COMMIT``, ``NCCL_EP_COMMIT``) and equal to the CPU
  runtime's separately written emulations.
* The emulation allocates the same terms (``cpu_runtime.deep_ep_emulation``), and a real
  megatron-core HybridEP dispatch + combine on CPU gloo ranks allocates the per-call prediction.
* The retained state: predicted per dispatcher and recompute mode, against the retained-state
  probe on the unpatched base over a sweep of layers, tokens, hidden, experts and top-k (the
  routing's outcome, the rows each layer's experts received, is measured; every byte is
  predicted from it); the patched tree keeps nothing.
* The command: Megatron's argument names, a Megatron-Bridge style YAML, ``--json``, and bad
  input as one line naming the argument, exit status 2.
"""

import json
import subprocess
import sys

import pytest
import torch

from cpu_runtime.launcher import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "moe_memory_plan.py"
sys.path.insert(0, str(SCRIPT.parent))
import moe_memory_plan  # noqa: E402

planner = moe_memory_plan.load_planner()
MiB = 1024 * 1024


def _names(terms) -> dict:
    return {t.name: t.nbytes for t in terms}


def test_hybridep_buffer_at_seed_000_shape():
    """Seed 000 (H=2048, 256 experts, EP2 on one node, rank 1's 105,153 tokens): rows
    roundup_64(105153) = 105,216, N = 210,432; each term as its source line sizes it."""
    cfg = planner.MoEMemoryConfig(
        hidden_size=2048, num_moe_experts=256, moe_router_topk=8, num_layers=8,
        expert_model_parallel_size=2, tokens_per_rank=105153,
        moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep",
    )  # fmt: skip
    assert planner.hybridep_rows(105153) == 105216
    terms = _names(planner.buffer_terms(cfg))
    n = 105216 * 2
    assert terms["combine tokens (N x H, 16-bit)"] == n * 2048 * 2 == 861_929_472
    assert terms["combine probs (N x E_nvl, fp32)"] == n * 256 * 4 == 215_482_368
    assert terms["dispatch scaling factors (N x floor(H/128), fp32)"] == n * 16 * 4
    assert terms["all-gathered routing map (N x E, bool)"] == n * 256
    assert terms["dispatch chunk flags"] == terms["combine chunk flags"] == 1644 * 2 * 4
    assert terms["preprocessing scratch"] == 108 * (2 + 128) * 8
    assert sum(terms.values()) == 1_144_889_280  # 1.066 GiB, outside PyTorch's allocator


def test_hybridep_scaling_factors_floor_a_hidden_not_a_multiple_of_128():
    """``hidden_dim / 128`` is C++ integer division (intranode.cu:201): H=2880 has 22 scaling
    factors per token, where a ceil would give 23; H=64 has none."""
    for hidden, per_token in [(2880, 22), (2944, 23), (64, 0), (200, 1)]:
        lay = planner.HybridEPLayout(hidden=hidden, local_experts=4, ranks_per_node=2, nodes=1,
                                     rows=512)  # fmt: skip
        scales = _names(planner.hybridep_buffer_terms(lay))
        assert scales["dispatch scaling factors (N x floor(H/128), fp32)"] == 1024 * per_token * 4


def test_hybridep_multi_node_group():
    """H=7168, 256 experts, EP64 = 8 nodes x 8 GPUs, T=4096: the NVLink buffer holds the
    probabilities of one node's 32 experts (E_nvl), the all-gather map all 256; the RDMA
    coordinator adds its buffers for 7 peer nodes and 56 queue pairs per direction."""
    cfg = planner.MoEMemoryConfig(
        hidden_size=7168, num_moe_experts=256, moe_router_topk=8, num_layers=1,
        expert_model_parallel_size=64, tokens_per_rank=4096,
        moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep",
    )  # fmt: skip
    terms = planner.buffer_terms(cfg)
    by = _names(terms)
    n = 4096 * 64
    assert by["combine probs (N x E_nvl, fp32)"] == n * 32 * 4
    assert by["all-gathered routing map (N x E, bool)"] == n * 256
    assert by["rdma dispatch input probs (E, fp32)"] == 4096 * 256 * 4
    assert by["rdma dispatch peer tokens"] == 4096 * 7 * 7168 * 2
    rdma = sum(v for k, v in by.items() if k.startswith(("rdma", "queue")))
    nvl = sum(v for k, v in by.items() if not k.startswith(("rdma", "queue", "DOCA")))
    assert nvl == 3_917_523_616 and rdma == 1_314_416_016
    # 56 queue pairs x (2 x (16384 WQEs x 64 B + 4 KiB) + 2 doorbell pages), each direction.
    assert by["DOCA queue pairs (approximate)"] == 2 * 56 * (2 * (16384 * 64 + 4096) + 16384)
    assert "all-gather flags and peer pointers" not in by  # single node only


def test_hybridep_etp_widens_the_group_and_the_expert_columns():
    """ETP x EP is the flex dispatcher's group (tp_ep) and megatron passes ETP x experts as
    the routing map's width: ETP 2 doubles N and the expert columns per rank of the group."""
    base = dict(
        hidden_size=1024,
        num_moe_experts=16,
        moe_router_topk=2,
        num_layers=1,
        expert_model_parallel_size=2,
        tokens_per_rank=1000,
        moe_token_dispatcher_type="flex",
        moe_flex_dispatcher_backend="hybridep",
    )
    # seq 2048 / TP 2: 1,024 tokens per rank; ETP 2 doubles the group (4 ranks).
    cfg = planner.MoEMemoryConfig(
        **dict(base, tokens_per_rank=None, seq_length=2048),
        tensor_model_parallel_size=2,
        expert_tensor_parallel_size=2,
    )
    assert cfg.tokens == 1024 and cfg.group_size == 4
    wide = _names(planner.buffer_terms(cfg))
    assert wide["combine tokens (N x H, 16-bit)"] == 1024 * 4 * 1024 * 2
    assert wide["combine probs (N x E_nvl, fp32)"] == 1024 * 4 * 32 * 4  # E_nvl = 8 x 4
    assert wide["all-gathered routing map (N x E, bool)"] == 1024 * 4 * 32


def test_hybridep_non_shared_buffer_and_fp8():
    """Without the shared buffer the dispatch side adds H x (2|1) + 4 x E_nvl per row."""
    kw = dict(hidden=256, local_experts=4, ranks_per_node=2, nodes=1, rows=512)
    shared = planner.total(planner.hybridep_buffer_terms(planner.HybridEPLayout(**kw)))
    for fp8, tok in [(False, 2), (True, 1)]:
        lay = planner.HybridEPLayout(**kw, shared_buffer=False, fp8=fp8)
        assert planner.total(planner.hybridep_buffer_terms(lay)) - shared == 1024 * (
            256 * tok + 4 * 8
        )


@pytest.mark.parametrize(
    "rows,tokens,after", [(512, 100, 512), (512, 513, 576), (576, 577, 640), (1024, 600, 1024)]
)
def test_hybridep_rows_grow_by_16_then_the_chunk(rows, tokens, after):
    assert planner.hybridep_rows_after(rows, tokens) == after


@pytest.mark.parametrize("tokens,chunk,rows", [(1, 64, 512), (513, 64, 576), (513, 128, 640)])
def test_hybridep_rows_minimum_and_chunk(monkeypatch, tokens, chunk, rows):
    monkeypatch.setenv("NUM_OF_TOKENS_PER_CHUNK_COMBINE_API", str(chunk))
    assert planner.hybridep_rows(tokens) == rows


def test_hybridep_growth_decisions():
    cfg = planner.MoEMemoryConfig(
        hidden_size=2048, num_moe_experts=256, moe_router_topk=8, num_layers=1,
        expert_model_parallel_size=2, tokens_per_rank=1000,
        moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep",
    )  # fmt: skip
    size = planner.total(planner.buffer_terms(cfg), planner.OUTSIDE)
    first = planner.hybridep_growth(cfg, None)
    assert first["grows"] and first["needed_rows"] == 1024 and first["growth_bytes"] == size
    assert not planner.hybridep_growth(cfg, 1024)["grows"]
    assert planner.hybridep_growth(cfg, 2048)["growth_bytes"] == 0
    grow = planner.hybridep_growth(cfg, 512)
    assert grow["grows"] and grow["growth_bytes"] == size
    assert grow["transient_peak_dropping_old"] == size


def test_deepep_buffer():
    """DeepEP normal mode at EP2, H=2048 (hidden_bytes 4096), 20 SMs: the NVLink hint of the
    dispatch config (nvl_recv 256) and the 32 MiB workspace; no RDMA up to 8 ranks."""
    terms = _names(planner.deepep_buffer_terms(4096, 2))
    # 10 channels x 2 ranks: (2 x 1 + 3) ints of prefix, and per received token its hidden
    # bytes, source meta (8) and 128 top-k indices (int64), weights and scales (fp32); to 128.
    raw = 10 * 2 * (5 * 4 + 256 * (4096 + 8 + 128 * (8 + 4 + 4)))
    assert terms["NVLink buffer (num_nvl_bytes)"] == -(-raw // 128) * 128
    assert terms["NVLink buffer (num_nvl_bytes)"] == 31_498_752
    assert terms["workspace"] == 32 * MiB
    assert "RDMA buffer (num_rdma_bytes)" not in terms
    # EP64 (8 nodes), H=7168: RDMA from recv 128 rounded up to 140 (a multiple of 28 and 20).
    wide = _names(planner.deepep_buffer_terms(14336, 64))
    assert wide["NVLink buffer (num_nvl_bytes)"] == 377_677_824
    assert wide["RDMA buffer (num_rdma_bytes)"] == 367_550_720
    with pytest.raises(ValueError, match="no config for 3 ranks"):
        planner.deepep_buffer_terms(4096, 3)


def test_deepep_v2_buffer_worked_by_hand():
    """DeepEP v2 (``DEEP_EP_V2_COMMIT``) at EP8, H=7168, top-8, 4,096 tokens per rank. bf16: a
    dispatch token a32(14336) + a32(0) + a32(8 x 12 + 4) = 14,464 B, a combine token a32(14336)
    + a32(64) = 14,400 B, the window's data max(8 x 4096 x 14464, min(8, 8) x 4096 x 14400).
    FP8: a dispatch token 7168 + a32(4 x 224) + 128 = 8,192 B, so combine sizes the window."""
    terms = _names(planner.deepep_v2_buffer_terms(8, 4096, 7168, 8))
    assert terms["symmetric window: data buffer"] == 8 * 4096 * 14464 == 473_956_352
    assert terms["symmetric window: workspace"] == terms["host workspace (mapped)"] == 12_820_544
    fp8 = _names(planner.deepep_v2_buffer_terms(8, 4096, 7168, 8, fp8=True))
    assert fp8["symmetric window: data buffer"] == 8 * 4096 * 14400 == 471_859_200
    # Top-k 0 means 32 (elastic.py); the dispatch's 12 x 32 + 4 rounds up to 416.
    wide = _names(planner.deepep_v2_buffer_terms(2, 100, 2048, 0))
    assert wide["symmetric window: data buffer"] == max(2 * 100 * (4096 + 416), 2 * 100 * 4352)
    with pytest.raises(ValueError, match="multiple of 32, got 1000"):
        planner.deepep_v2_buffer_terms(8, 4096, 1000, 8)
    with pytest.raises(ValueError, match="buffer.hpp:600"):
        planner.deepep_v2_buffer_terms(8, 0, 7168, 8)


def test_nccl_ep_context_worked_by_hand():
    """NCCL EP (``NCCL_EP_COMMIT``) at EP8, 256 experts, top-8, H=7168, 4,096 tokens per rank,
    capacity factor 1.5 (0.19.2's static mode): M = 4,096, MR = 4096 x 8 x 1.5 = 49,152, B =
    14,336. Device: 32 MiB workspace + 32 + 8 x 4096 x 32 (routing map) + 2 x 4096 x 8 x 14336
    (token staging) + 2 x 49152 x 256 x 4 (probabilities) + 49152 x 14336 (scales) + 8 (flags);
    pinned 40 x 8. Zero-copy: no staging, megatron's two [MR, H] bf16 buffers instead."""
    assert planner.nccl_ep_capacity(4096, 8, 1.5) == (4096, 49152)
    assert planner.nccl_ep_capacity(4000, 8, 1.5, alignment=256) == (4032, 48384)
    terms = planner.nccl_ep_terms(8, 256, 4096, 49152, 7168)
    device = 33_554_432 + 32 + 1_048_576 + 939_524_096 + 100_663_296 + 704_643_072 + 8
    assert planner.total(terms, planner.OUTSIDE) == device == 1_779_433_512
    assert planner.total(terms, planner.HOST) == 320
    zc = planner.nccl_ep_terms(8, 256, 4096, 49152, 7168, zero_copy=True)
    assert planner.total(zc, planner.OUTSIDE) == device - 939_524_096 + 2 * 49152 * 14336
    cfg = planner.MoEMemoryConfig(
        hidden_size=7168, num_moe_experts=256, moe_router_topk=8, num_layers=4,
        expert_model_parallel_size=8, tokens_per_rank=4096, moe_token_dispatcher_type="flex",
        moe_flex_dispatcher_backend="ncclep", moe_expert_rank_capacity_factor=1.5,
    )  # fmt: skip
    result = planner.plan(cfg)
    assert result["totals"]["buffers_outside_allocator"] == 1_779_433_512
    assert result["totals"]["buffers_released"] == 1_779_433_832
    # The retained state is not modelled for this backend: said, not priced as 0.
    assert result["totals"]["retained_per_layer_base"] is None
    assert "not modelled" in planner.format_plan(result)
    with pytest.raises(ValueError, match="capacity_factor: must be positive"):
        planner.MoEMemoryConfig(**{**vars(cfg), "moe_expert_rank_capacity_factor": -1.0})


@pytest.mark.parametrize(
    "ranks,experts,tokens,topk,hidden,factor,zero_copy",
    [(2, 8, 64, 2, 64, 2.0, False), (2, 8, 64, 2, 64, 2.0, True), (4, 16, 100, 4, 128, 1.0,
     False), (8, 256, 4096, 8, 7168, 1.5, True)],
)  # fmt: skip
def test_planner_and_emulations_size_the_new_backends_alike(
    ranks, experts, tokens, topk, hidden, factor, zero_copy
):
    """The planner's DeepEP v2 and NCCL EP terms and the CPU runtime's emulations were each
    written from the kernels' source, separately: they agree (each emulation's sizes are also
    worked by hand in test_deepep_v2_emulation and test_te_ep_emulation)."""
    from cpu_runtime import deepep_v2_emulation as v2
    from cpu_runtime import te_ep_emulation as te

    data = v2.buffer_size_hint(ranks, tokens, hidden, topk)
    terms = _names(planner.deepep_v2_buffer_terms(ranks, tokens, hidden, topk))
    assert terms["symmetric window: data buffer"] == data
    assert terms["symmetric window: workspace"] == v2.WORKSPACE_BYTES
    m, mr = planner.nccl_ep_capacity(tokens, topk, factor)
    want = te.context_bytes(ranks, experts, m, mr, hidden, zero_copy)
    got = planner.nccl_ep_terms(ranks, experts, m, mr, hidden, zero_copy)
    zc = 2 * mr * 2 * hidden if zero_copy else 0  # megatron's buffers, not the context's
    assert planner.total(got, planner.OUTSIDE) == want["device"] + zc
    assert planner.total(got, planner.HOST) == want["pinned"]


def test_emulation_allocates_the_planner_terms(monkeypatch):
    """The CPU emulation's counted buffers are the planner's terms: HybridEP's for its rows,
    regrown (freed, then allocated) when a call needs more; DeepEP's hints for the group."""
    from cpu_runtime import deep_ep_emulation as emu

    buf = emu.HybridEPBuffer(None, 64, 100, 4)
    lay = planner.HybridEPLayout(hidden=64, local_experts=4, ranks_per_node=1, nodes=1, rows=512)
    assert buf.rows == 512
    assert buf.memory.nbytes == planner.total(planner.hybridep_buffer_terms(lay))
    buf._grow(600)
    assert buf.rows == 640
    lay = planner.HybridEPLayout(hidden=64, local_experts=4, ranks_per_node=1, nodes=1, rows=640)
    assert buf.memory.nbytes == planner.total(planner.hybridep_buffer_terms(lay))
    config = emu.Buffer.get_dispatch_config(2)
    assert config.get_nvl_buffer_size_hint(4096, 2) == 31_498_752
    assert config.get_rdma_buffer_size_hint(4096, 2) == 0
    assert emu.Buffer(None, 4096, 1024).memory.nbytes == 4096 + 160 + 32 * MiB + 1024
    with pytest.raises(AssertionError, match="Unsupported number of EP ranks: 3"):
        emu.Buffer.get_combine_config(3)


def rank_per_call(tokens: int, hidden: int):
    """Rank side: a balanced HybridEP dispatch + combine (every token to one local expert on
    each rank) through megatron-core's fused_a2a and the emulation; what they allocated."""
    import torch.distributed as dist

    from cpu_runtime.moe_harness import init_megatron
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import fused_a2a

    world = dist.get_world_size()
    init_megatron(ep=world)
    group = parallel_state.get_expert_model_parallel_group()
    local = 2
    experts = local * world
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    routing = torch.zeros(tokens, experts, dtype=torch.bool)
    for t in range(tokens):  # token t -> local expert t % local on every rank (top-k = world)
        routing[t, [r * local + t % local for r in range(world)]] = True
    probs = routing.float() / world
    out, dprobs, _, tpe, handle = fused_a2a.hybrid_ep_dispatch(
        x, routing, probs, group, local, num_permuted_tokens=None, pad_multiple=None
    )
    combined = fused_a2a.hybrid_ep_combine(out, handle, None, None)
    from cpu_runtime.compat import held_comm_buffers

    (buffer,) = held_comm_buffers(fused_a2a)
    return {
        "dispatch_tokens": out.untyped_storage().nbytes(),
        "dispatch_probs": dprobs.untyped_storage().nbytes(),
        "tokens_per_expert": tpe.to(torch.int64).untyped_storage().nbytes(),
        "combine_output": combined.untyped_storage().nbytes(),
        "buffer": buffer.memory.nbytes,
        "topk": world,
        "experts": experts,
    }


def test_per_call_prediction_matches_emulated_dispatch(dist_job, patched_tree):
    tokens, hidden = 24, 16
    for rank, got in enumerate(
        dist_job(f"{__name__}:rank_per_call", 2, patched_tree, tokens=tokens, hidden=hidden)
    ):
        cfg = planner.MoEMemoryConfig(
            hidden_size=hidden, num_moe_experts=got["experts"], moe_router_topk=got["topk"],
            num_layers=1, expert_model_parallel_size=2, tokens_per_rank=tokens,
            moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep",
        )  # fmt: skip
        predicted = planner.per_call_bytes(cfg)
        measured = {k: got[k] for k in predicted}
        assert measured == predicted, f"rank {rank}"
        # The emulation allocates the planner's buffer terms for the buffer megatron built.
        assert got["buffer"] == planner.total(planner.buffer_terms(cfg), planner.OUTSIDE)


def rank_recompute_extent(tokens: list, hidden: int):
    """Rank side: a bf16 MoELayer with HybridEP padding uneven inputs to the group's extent and
    the MoE layer recomputed in backward; the bytes of every combine output (forward and
    recompute), taken inside megatron-core before it crops them to the rank's tokens."""
    import torch.distributed as dist

    from cpu_runtime import moe_harness
    from cpu_runtime.moe_harness import init_megatron
    from megatron.core.transformer.moe import token_dispatcher

    init_megatron(ep=dist.get_world_size())
    config = moe_harness.moe_config(
        "hybridep", dist.get_world_size(), hidden=hidden, recompute=True,
        dtype=torch.bfloat16, moe_hybridep_pad_uneven_dispatch_inputs=True,
    )  # fmt: skip
    layer = moe_harness.build_moe_layer(config)
    sizes = []
    combine = token_dispatcher.hybrid_ep_combine

    def recorded(*args, **kwargs):
        out = combine(*args, **kwargs)
        sizes.append((tuple(out.shape), out.untyped_storage().nbytes()))
        return out

    token_dispatcher.hybrid_ep_combine = recorded
    n = tokens[dist.get_rank()]
    x = torch.randn(n, 1, hidden, dtype=torch.bfloat16, requires_grad=True)
    out, _ = layer(x)
    out.float().sum().backward()
    token_dispatcher.hybrid_ep_combine = combine
    return {
        "combine": sizes,
        "out_rows": out.shape[0],
        "recompute": bool(layer.moe_layer_recompute),
    }


def test_recompute_combine_output_at_the_communication_extent(dist_job, patched_tree):
    """Both the forward's and the checkpoint recompute's combine allocate a fresh BF16 [P, H]
    output at the padded communication extent P (the group's max tokens rounded to 64), before
    megatron-core crops it to the rank's own tokens: the recompute floor's allocation."""
    tokens, hidden = [24, 40], 16
    extent = 64
    for rank, got in enumerate(
        dist_job(f"{__name__}:rank_recompute_extent", 2, patched_tree, tokens=tokens, hidden=hidden)
    ):
        assert got["recompute"] and got["out_rows"] == tokens[rank]
        assert len(got["combine"]) == 2, got  # forward, then the recompute in backward
        for shape, nbytes in got["combine"]:
            assert shape == (extent, hidden)
            assert nbytes == planner.recompute_combine_floor(extent, hidden), f"rank {rank}"


def test_measured_retained_bytes_reads_the_probe(patched_tree):
    """The measured side of the comparison: what a dispatcher object references, through the
    retained-state probe (here a stand-in dispatcher holding a probs tensor and a handle)."""

    class Dispatcher:
        pass

    d = Dispatcher()
    d.probs = torch.zeros(12, 8)  # 384 bytes
    d.handle = (torch.zeros(4, dtype=torch.int64), torch.zeros(3, dtype=torch.bool))  # 32 + 3
    assert planner.measured_retained_bytes(d) == 384 + 32 + 3
    d.probs = d.handle = None
    assert planner.measured_retained_bytes(d) == 0


# --------------------------------------------------------------------------------------------
# The retained state, predicted vs the probe


def predicted_between_calls(case: dict, layers: list) -> tuple:
    """(per-layer predictions, between-calls total) for a probed case: each layer's own terms
    from its measured routed rows (and DeepEP's received tokens), plus, without recompute, the
    terms a later layer's graph reaches through each earlier layer's combine."""
    own, chain = [], []
    for layer in layers:
        shape = planner.LayerShape(
            tokens=case["tokens"], hidden=case["hidden"], experts=case["experts"],
            topk=case["topk"], group=2, local_experts=case["experts"] // 2,
            routed_rows=layer["rows"], received_tokens=layer["received"],
            dtype_bytes=4, probs_bytes=4,
            recompute=RECOMPUTE[case["recompute"]],
        )  # fmt: skip
        own.append(planner.total(planner.retained_state_terms(shape, case["dispatcher"],
                                                              case["backend"])))  # fmt: skip
        chain.append(planner.total(planner.retained_chain_terms(shape, case["dispatcher"],
                                                                case["backend"])))  # fmt: skip
    return own, sum(own) + sum(chain[:-1])


DISPATCHERS = [("flex", "hybridep"), ("flex", "deepep"), ("alltoall", None), ("allgather", None)]
# The job's recompute: MoE layers alone (selective: the "moe" module recomputed, or none), or a
# GPTModel whose every layer is recomputed (full, uniform, one layer per checkpoint).
RECOMPUTE = {True: "selective", False: "none", "full": "full"}
# The sweep: layers, tokens, hidden, experts, top-k (every dispatcher, with and without
# recompute, on each); 150 tokens are no multiple of HybridEP's 16-row map padding or its
# 64-token chunks, top-1 routes with the softmax first.
SWEEP = [(3, 256, 64, 8, 2), (2, 96, 32, 16, 4)]
SLOW_SWEEP = [(4, 150, 48, 8, 1), (2, 512, 16, 16, 3)]


def _cases(sweep, recompute=tuple(RECOMPUTE)):
    return [
        dict(dispatcher=d, backend=b, layers=n, tokens=t, hidden=h, experts=e, topk=k,
             recompute=r)
        for n, t, h, e, k in sweep
        for d, b in DISPATCHERS
        for r in recompute
    ]  # fmt: skip


JOB = "tests.unit_tests.transformer.moe.cpu_jobs:retained_state_job"


def check_retained(results, printed: list) -> None:
    for rank, cases in enumerate(results):
        for got in cases:
            case, layers = got["case"], got["layers"]
            own, between = predicted_between_calls(case, layers)
            printed.append(
                f"rank {rank} {case['dispatcher']}/{case['backend']} recompute="
                f"{case['recompute']} L={case['layers']} T={case['tokens']} H={case['hidden']}"
                f" E={case['experts']} k={case['topk']}: predicted {between:,} measured"
                f" {got['union_bytes']:,} (per layer {own} vs"
                f" {[x['pinned_bytes'] for x in layers]})"
            )
            assert got["union_bytes"] == between, printed[-1]
            if case["recompute"] in (True, "full"):  # each layer's graph ends at its own leaf
                assert [x["pinned_bytes"] for x in layers] == own, printed[-1]


def test_retained_state_predicted_equals_the_probe_on_base(dist_job, base_tree):
    """Unpatched base: what every MoE layer keeps between calls, as the probe measures it, is
    the planner's prediction to the byte, for each dispatcher, with and without recompute."""
    printed = []
    check_retained(dist_job(JOB, 2, base_tree, cases=_cases(SWEEP)), printed)
    print("\n".join(printed))


@pytest.mark.slow
def test_retained_state_predicted_equals_the_probe_wider_sweep(dist_job, base_tree):
    printed = []
    check_retained(dist_job(JOB, 2, base_tree, cases=_cases(SLOW_SWEEP)), printed)
    print("\n".join(printed))


def test_patched_tree_keeps_no_dispatcher_state(dist_job, patched_tree):
    """The patched tree's dispatchers hold nothing between calls: the planner's 0."""
    # Every dispatcher, with the layer recomputed (the most the base keeps).
    for cases in dist_job(JOB, 2, patched_tree, cases=_cases(SWEEP[:1], recompute=(True,))):
        for got in cases:
            assert got["union_bytes"] == 0, got["case"]
            assert all(x["pinned_bytes"] == 0 for x in got["layers"]), got["case"]


# --------------------------------------------------------------------------------------------
# The command


def _run(*args, cwd=None):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60, cwd=cwd
    )


SEED_000 = [
    "--hidden-size", "2048", "--num-experts", "256", "--moe-router-topk", "8",
    "--num-layers", "8", "--expert-model-parallel-size", "2", "--tokens-per-rank", "105153",
    "--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "hybridep",
    "--recompute-granularity", "selective", "--recompute-modules", "moe", "--bf16",
]  # fmt: skip


def test_command_table_and_json(patched_tree):
    done = _run(*SEED_000)
    assert done.returncode == 0, done.stderr
    assert "1,144,889,280" in done.stdout and "buffer/intranode.cu:255,260" in done.stdout
    data = json.loads(_run(*SEED_000, "--json").stdout)
    assert data["totals"]["buffers_outside_allocator"] == 1_144_889_280
    assert data["totals"]["retained_per_layer_patched"] == 0
    per_layer = data["totals"]["retained_per_layer_base"]
    assert data["totals"]["retained_between_calls_base"] == 8 * per_layer
    # The module as it ships in the patched megatron-core is the same command.
    module = subprocess.run(
        [sys.executable, "-m", "megatron.core.transformer.moe.moe_memory_planner", *SEED_000,
         "--json"], capture_output=True, text=True, timeout=60,
        env={"PYTHONPATH": str(patched_tree), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert module.returncode == 0 and json.loads(module.stdout) == data, module.stderr


def test_command_reads_a_bridge_yaml(tmp_path):
    """A Megatron-Bridge style YAML (model: and train: sections); flags override it."""
    (tmp_path / "run.yaml").write_text(
        "model:\n  hidden_size: 2048\n  num_moe_experts: 256\n  moe_router_topk: 8\n"
        "  num_layers: 8\n  expert_model_parallel_size: 2\n  seq_length: 4096\n"
        "  moe_token_dispatcher_type: flex\n  moe_flex_dispatcher_backend: hybridep\n"
        "  params_dtype: bfloat16\n  unrelated_key: 3\ntrain:\n  micro_batch_size: 2\n"
    )
    data = json.loads(_run("--config-file", str(tmp_path / "run.yaml"), "--json").stdout)
    assert data["derived"]["tokens_per_rank"] == 8192 and data["config"]["bf16"]
    data = json.loads(
        _run(
            "--config-file", str(tmp_path / "run.yaml"), "--micro-batch-size", "1", "--json"
        ).stdout
    )
    assert data["derived"]["tokens_per_rank"] == 4096


OK = ["--hidden-size", "64", "--num-experts", "8", "--moe-router-topk", "2", "--num-layers", "2"]


@pytest.mark.parametrize(
    "args,message",
    [
        (OK[2:] + ["--seq-length", "8"], "--hidden-size: required"),
        (OK + ["--seq-length", "-4"], "--seq-length: must be a positive integer, got -4"),
        (OK, "--seq-length: needed (or tokens_per_rank)"),
        (OK + ["--seq-length", "8", "--expert-model-parallel-size", "3"],
         "--expert-model-parallel-size: 3 does not divide the 8 experts"),
        (OK + ["--seq-length", "8", "--moe-token-dispatcher-type", "ring"],
         "--moe-token-dispatcher-type: 'ring' is not one of"),
        (OK + ["--seq-length", "8", "--moe-router-topk", "9"], "--moe-router-topk: 9 exceeds"),
        (OK + ["--seq-length", "8", "--held-rows", "0"], "--held-rows: must be a positive"),
        (OK + ["--seq-length", "many"], "argument --seq-length: invalid int value: 'many'"),
        (OK + ["--frobnicate"], "unrecognized arguments: --frobnicate"),
        (OK + ["--config-file", "/nonexistent.yaml"], "--config-file: /nonexistent.yaml"),
        (OK + ["--seq-length", "8", "--moe-token-dispatcher-type", "flex",
               "--moe-flex-dispatcher-backend", "deepep", "--num-experts", "12",
               "--expert-model-parallel-size", "3"],
         "--expert-model-parallel-size: ETP x EP = 3: DeepEP has no config for 3 ranks"),
        (OK + ["--seq-length", "8", "--moe-token-dispatcher-type", "flex",
               "--moe-flex-dispatcher-backend", "deepep", "--expert-model-parallel-size", "8"],
         ""),
    ],
)  # fmt: skip
def test_command_bad_input(args, message, capsys):
    """One line on stderr naming the argument, exit status 2, nothing on stdout (the command's
    main, in process; test_command_exit_status runs it as a process)."""
    status = planner.main(args)
    out, err = capsys.readouterr()
    if not message:  # the last case is good input
        assert status == 0, err
        return
    assert status == 2 and out == "", (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


def test_command_exit_status():
    done = _run(*OK, "--seq-length", "-4")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == (
        "moe_memory_planner: --seq-length: must be a positive integer, got -4"
    )
