# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The MoE memory planner (the overlay's ``moe_memory_planner`` package and its command).

* Buffer terms against figures worked by hand from deep_ep's source at the planner's
  ``DEEP_EP_COMMIT`` (the lines each term cites): seed 000's shape on one node, a hidden size
  that is not a multiple of 128, a multi-node group, ETP x EP, the non-shared buffer, FP8,
  regrowth, DeepEP's NVLink and RDMA hints; DeepEP v2's window and NCCL EP's context, worked by
  hand from their sources (``DEEP_EP_V2_COMMIT``, ``NCCL_EP_COMMIT``) and equal to the CPU
  runtime's separately written emulations.
* HybridEP's and DeepEP's buffers against the CPU emulations' own, separately written reading
  of deep_ep's source (``moe_release.runtime.kernels.hybridep_emulation``,
  ``moe_release.runtime.kernels.deepep_emulation``), term by term through the lines each cites; a
  deliberately wrong planner term is caught and named; a real megatron-core HybridEP dispatch +
  combine on CPU gloo ranks allocates the per-call prediction.
* The retained state: predicted per dispatcher and recompute mode, against the retained-state
  probe on the unpatched base over a sweep of layers, tokens, hidden, experts and top-k (the
  routing's outcome, the rows each layer's experts received, is measured; every byte is
  predicted from it); the patched tree keeps nothing.
* The command: Megatron's argument names, a Megatron-Bridge style YAML, ``--json``, and bad
  input as one line naming the argument, exit status 2.
* Strict inputs: a typo'd key or flag names the closest field; megatron's deprecated fields are
  read with a note; configurations the kernels refuse are refused citing the refusing line
  (each cited line checked against a deep_ep checkout when ``DEEP_EP_SRC`` names one); odd
  values never trace back; moe_layer_freq's list and pattern forms; the chunk-size environment
  in every term it sizes; the memory-location labels; DeepEP main's configs beside hybrid-ep's;
  ``--help``.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from moe_release.plan import cli, compare, inputs
from moe_release.plan.pricing import load_planner, source_files
from tests.helpers import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "moe_memory_plan.py"
planner = load_planner()
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
    result = compare.plan(cfg)
    assert result["totals"]["buffers_outside_allocator"] == 1_779_433_512
    assert result["totals"]["buffers_released"] == 1_779_433_832
    # The retained state is not modelled for this backend: said, not priced as 0.
    assert result["totals"]["retained_per_layer_base"] is None
    assert "not modelled" in compare.format_plan(result)
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
    worked by hand in test_deepepv2_emulation and test_ncclep_emulation)."""
    from moe_release.runtime.kernels import deepepv2_emulation as v2
    from moe_release.runtime.kernels import ncclep_emulation as te

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


def test_local_rank_0_holds_the_flags_its_peers_map():
    """HybridEP's local rank 0 allocates three 8-byte flags the other ranks of its NVLink domain
    map (deep_ep 94a9f8f csrc/hybrid_ep/buffer/intranode.cu:216-218 dispatch and 264-266
    combine write-completion flags, extension/allgather.cu:150-154 the all-gather's NVLink sync
    flag): the planner prices them for ``local_rank=0`` only."""
    kw = dict(hidden=2048, local_experts=128, ranks_per_node=2, nodes=1, rows=105216)
    peer = planner.hybridep_buffer_terms(planner.HybridEPLayout(**kw))
    assert peer == planner.hybridep_buffer_terms(planner.HybridEPLayout(**kw, local_rank=1))
    rank0 = planner.hybridep_buffer_terms(planner.HybridEPLayout(**kw, local_rank=0))
    extra = {t.source: t.nbytes for t in rank0 if t not in peer}
    assert extra == {
        "buffer/intranode.cu:216-218": 8,
        "buffer/intranode.cu:264-266": 8,
        "extension/allgather.cu:150-154": 8,
    }
    assert planner.total(rank0) == planner.total(peer) + 24
    cfg = dict(hidden_size=2048, num_moe_experts=256, moe_router_topk=8, num_layers=1,
               expert_model_parallel_size=2, moe_token_dispatcher_type="flex",
               moe_flex_dispatcher_backend="hybridep")  # fmt: skip
    by_rank = [
        planner.estimate(cfg, 105153, releases=True, local_rank=r).buffer_bytes for r in (0, 1)
    ]
    assert by_rank == [planner.total(rank0), planner.total(peer)]


@pytest.mark.parametrize(
    "rows,hidden,local,ranks,blocks",
    [(512, 64, 4, 1, None), (576, 2048, 128, 2, None), (1024, 7000, 1, 4, 20),
     (105216, 2048, 128, 2, None), (640, 256, 3, 8, 132)],
)  # fmt: skip
def test_planner_and_emulation_size_hybridep_alike(rows, hidden, local, ranks, blocks):
    """The planner's HybridEP buffer and the emulation's were each written from deep_ep's
    source, separately: term by term (matched through the lines they cite) they agree on
    every local rank, 0 included."""
    from moe_release.report.buffer_section import compare_terms
    from moe_release.runtime.kernels import hybridep_emulation as hep

    lay = planner.HybridEPLayout(
        hidden=hidden, local_experts=local, ranks_per_node=ranks, nodes=1, rows=rows,
        blocks_preprocessing=blocks or planner.DEFAULT_BLOCKS_PREPROCESSING,
    )  # fmt: skip
    for local_rank in range(ranks):
        ours = planner.hybridep_buffer_terms(dataclasses.replace(lay, local_rank=local_rank))
        emulated = hep.hybrid_ep_buffer_terms(rows, hidden, local, ranks, local_rank, blocks)
        assert compare_terms(ours, emulated) == []
        assert sum(t.nbytes for t in emulated) == planner.total(ours, planner.OUTSIDE)


@pytest.mark.parametrize("ranks", sorted(planner.DEEPEP_DISPATCH_CONFIGS))
@pytest.mark.parametrize("hidden_bytes,sms", [(256, 20), (4096, 24), (14336, 32)])
def test_planner_and_emulation_size_deepep_alike(ranks, hidden_bytes, sms):
    """DeepEP's buffer as megatron's ``get_buffer`` builds it (the larger of the dispatch and
    combine configs' hints) from the emulation's own ``Config`` hints and constructor, against
    the planner's terms: the same, term by term, for every group size deep_ep has a config
    for."""
    from moe_release.report.buffer_section import compare_terms
    from moe_release.runtime.kernels import deepep_emulation as dep

    dep.Buffer.set_num_sms(sms)
    try:
        configs = (dep.Buffer.get_dispatch_config(ranks), dep.Buffer.get_combine_config(ranks))
    finally:
        dep.Buffer.set_num_sms(20)
    nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, ranks) for c in configs)
    rdma = max(c.get_rdma_buffer_size_hint(hidden_bytes, ranks) for c in configs)
    ours = planner.deepep_buffer_terms(hidden_bytes, ranks, sms)
    assert compare_terms(ours, dep.buffer_terms(nvl, rdma)) == []


def _wrong(terms: list, name: str, delta: int) -> list:
    """``terms`` with term ``name`` off by ``delta`` bytes, or dropped (``delta`` None)."""
    import dataclasses

    assert any(t.name == name for t in terms), name
    if delta is None:
        return [t for t in terms if t.name != name]
    return [dataclasses.replace(t, nbytes=t.nbytes + delta) if t.name == name else t for t in terms]


@pytest.mark.parametrize(
    "name,delta,named",
    [("combine tokens (N x H, 16-bit)", 1, "combine tokens (N x H, 16-bit)"),
     ("preprocessing scratch", -8, "preprocessing scratch"),
     ("all-gathered routing map (N x E, bool)", None, "all-gather routing map"),
     ("allocator probe", None, "allocator probe")],
)  # fmt: skip
def test_a_wrong_hybridep_planner_term_is_caught(monkeypatch, name, delta, named):
    """A planner whose HybridEP term is one byte off, or which drops a term, fails the check
    the report prints (``hybridep_accounting_lines`` on a run's recorded buffer terms), in a
    line naming the term; the right planner passes it."""
    from moe_release.report import buffer_section
    from moe_release.runtime.kernels import hybridep_emulation as hep

    cfg = {"hidden": 64, "experts": 8, "topk": 2, "tokens": 512, "backend": "hybridep"}
    terms = hep.hybrid_ep_buffer_terms(512, 64, 4, 2, local_rank=1)
    run = {"comm_buffers": {"emulated_bytes": sum(t.nbytes for t in terms),
                            "terms": [t._asdict() for t in terms]}}  # fmt: skip
    lines = buffer_section.hybridep_accounting_lines(cfg, run, 2)
    assert "planner = emulation's reading" in lines[-1], lines
    right = planner.hybridep_buffer_terms
    monkeypatch.setattr(  # where buffer_terms looks it up
        planner.plan, "hybridep_buffer_terms", lambda lay: _wrong(right(lay), name, delta)
    )
    lines = buffer_section.hybridep_accounting_lines(cfg, run, 2)
    (bad,) = [x for x in lines if "MISMATCH" in x]
    assert repr(named) in bad, bad


@pytest.mark.parametrize("rank", [0, 1])
def test_the_hybridep_term_check_prices_the_rank_it_reads(rank):
    """Each rank's block of the report checks that rank's buffer: local rank 0's HybridEP buffer
    holds 3 x 8 B of flags its peer maps, and the planner priced for rank 0 has them (the check
    printed "buffer terms MISMATCH" on rank 0 when the planner priced every rank as a peer)."""
    from moe_release.report import buffer_section
    from moe_release.runtime.kernels import hybridep_emulation as hep

    cfg = {"hidden": 64, "experts": 8, "topk": 2, "tokens": 512, "backend": "hybridep"}
    terms = hep.hybrid_ep_buffer_terms(512, 64, 4, 2, local_rank=rank)
    run = {"comm_buffers": {"emulated_bytes": sum(t.nbytes for t in terms),
                            "terms": [t._asdict() for t in terms]}}  # fmt: skip
    lines = buffer_section.hybridep_accounting_lines(cfg, run, 2, rank)
    assert "planner = emulation's reading" in lines[-1], lines
    assert lines[1].split()[-1] == "1.000", lines
    if rank == 0:  # the planner priced as a peer misses local rank 0's flags
        lines = buffer_section.hybridep_accounting_lines(cfg, run, 2, 1)
        assert any("MISMATCH" in x for x in lines), lines


def test_report_checks_the_deepep_buffer_terms():
    """With ``--backend deepep`` the report's buffer rows are DeepEP's: the planner's buffer
    for the report's fp32 model (hidden bytes H x 4, fused_a2a.get_hidden_bytes) against the
    terms of the buffer megatron's get_buffer builds from the emulation's hints."""
    from moe_release.report import buffer_section
    from moe_release.runtime.kernels import deepep_emulation as dep

    cfg = {"hidden": 64, "experts": 8, "topk": 2, "tokens": 512, "backend": "deepep"}
    configs = (dep.Buffer.get_dispatch_config(2), dep.Buffer.get_combine_config(2))
    nvl = max(c.get_nvl_buffer_size_hint(64 * 4, 2) for c in configs)
    buf = dep.Buffer(None, nvl, 0)
    run = {"comm_buffers": {"emulated_bytes": buf.memory.nbytes,
                            "terms": [t._asdict() for t in buf.terms]}}  # fmt: skip
    lines = buffer_section.hybridep_accounting_lines(cfg, run, 2)
    assert lines[0].startswith("DeepEP accounting") and "1.000" in lines[1], lines
    assert "planner = emulation's reading of deep_ep, 6 allocations" in lines[-1], lines


@pytest.mark.parametrize(
    "wrong",
    ["nvl hint +128", "drop workspace", "drop receive counters", "RDMA counter freed"],
)
def test_a_wrong_deepep_planner_term_is_caught(monkeypatch, wrong):
    """A planner whose DeepEP NVLink hint is off, or which drops the workspace or the pinned
    counters, fails the term check, naming the term; one that says the RDMA counter is freed
    fails the released-bytes check the colocated section prints (the bytes freed against the
    planner's); the right planner passes both."""
    from moe_release.report import colocated_section
    from moe_release.report.buffer_section import compare_terms
    from moe_release.runtime.kernels import deepep_emulation as dep

    configs = (dep.Buffer.get_dispatch_config(2), dep.Buffer.get_combine_config(2))
    nvl = max(c.get_nvl_buffer_size_hint(4096, 2) for c in configs)
    buf = dep.Buffer(None, nvl, 0)
    freed = buf.nbytes  # what destroy() frees: all but the RDMA counter

    def row(terms) -> dict:
        return {"freed": [freed], "predicted": [planner.released_bytes(terms)],
                "mismatches": [compare_terms(terms, buf.terms)], "bitwise": True}  # fmt: skip

    assert colocated_section.check_text(row(planner.deepep_buffer_terms(4096, 2))).startswith(
        "agree"
    )
    if wrong == "nvl hint +128":
        right = planner.deepep_nvl_bytes
        monkeypatch.setattr(planner.deepep, "deepep_nvl_bytes", lambda *a: right(*a) + 128)
        named = "NVLink buffer (num_nvl_bytes)"
        terms = planner.deepep_buffer_terms(4096, 2)
    elif wrong == "RDMA counter freed":
        import dataclasses

        terms = [
            dataclasses.replace(t, released=True) for t in planner.deepep_buffer_terms(4096, 2)
        ]
        text = colocated_section.check_text(row(terms))
        assert text.startswith("DIFFER by -4 B"), text
        return
    else:
        named = "workspace" if wrong == "drop workspace" else "receive token counter"
        dropped = "workspace" if wrong == "drop workspace" else "receive counters"
        terms = [t for t in planner.deepep_buffer_terms(4096, 2) if not t.name.startswith(dropped)]
    text = colocated_section.check_text(row(terms))
    assert text.startswith("DIFFER") and repr(named) in text, text


def test_emulation_allocates_its_terms_and_regrows(monkeypatch):
    """The CPU emulation's counted buffers are its own terms: HybridEP's for its rows, regrown
    (freed, then allocated) when a call needs more, equal to the planner's for local rank 0
    (the emulated buffer's rank); DeepEP's hints for the group."""
    from moe_release.report.buffer_section import compare_terms
    from moe_release.runtime.kernels import deepep_module as emu

    buf = emu.HybridEPBuffer(None, 64, 100, 4)
    lay = planner.HybridEPLayout(hidden=64, local_experts=4, ranks_per_node=1, nodes=1, rows=512,
                                 local_rank=0)  # fmt: skip
    assert buf.rows == 512 and buf.memory.nbytes == sum(t.nbytes for t in buf.terms)
    assert compare_terms(planner.hybridep_buffer_terms(lay), buf.terms) == []
    buf._grow(600)
    assert buf.rows == 640
    lay = dataclasses.replace(lay, rows=640)
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

    from megatron.core import parallel_state
    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.megatron.moe_harness import init_megatron

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
    from moe_release.runtime.cuda.compat import held_comm_buffers

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
            local_rank=rank,
        )  # fmt: skip
        predicted = planner.per_call_bytes(cfg)
        measured = {k: got[k] for k in predicted}
        assert measured == predicted, f"rank {rank}"
        # The emulation's own buffer for the buffer megatron built: the planner's for the rank.
        assert got["buffer"] == planner.total(planner.buffer_terms(cfg), planner.OUTSIDE)


def rank_recompute_extent(tokens: list, hidden: int):
    """Rank side: a bf16 MoELayer with HybridEP padding uneven inputs to the group's extent and
    the MoE layer recomputed in backward; the bytes of every combine output (forward and
    recompute), taken inside megatron-core before it crops them to the rank's tokens."""
    import torch.distributed as dist

    from megatron.core.transformer.moe import token_dispatcher
    from moe_release.runtime.megatron import moe_harness
    from moe_release.runtime.megatron.moe_harness import init_megatron

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
# The installed API: estimate() from a TransformerConfig or a Mapping, the installed tree's state


# Seed 000 as TransformerConfig's fields: H=2048, 256 experts top-8, 8 layers, EP2, HybridEP,
# the MoE layer recomputed, bf16.
SEED_000_FIELDS = dict(
    num_layers=8, hidden_size=2048, num_attention_heads=16, num_moe_experts=256,
    moe_router_topk=8, expert_model_parallel_size=2, moe_token_dispatcher_type="flex",
    moe_flex_dispatcher_backend="hybridep", recompute_granularity="selective",
    recompute_modules=["moe"], bf16=True,
)  # fmt: skip
SEED_000_CFG = planner.MoEMemoryConfig(
    **{k: v for k, v in SEED_000_FIELDS.items() if k != "num_attention_heads"},
    tokens_per_rank=105153,
)

ESTIMATE_JOB = """
import json, sys, warnings
warnings.simplefilter("ignore")
import torch
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.moe import moe_memory_planner as p
fields = json.loads(sys.argv[1])
config = TransformerConfig(**fields, params_dtype=torch.bfloat16)
e = p.estimate(config, 105153)
print(json.dumps(dict(
    file=p.__file__, releases=e.releases, buffer_bytes=e.buffer_bytes,
    state=e.dispatcher_state_bytes, per_layer=e.dispatcher_state_bytes_per_layer,
    source=e.buffer_source, mapping=p.estimate(fields, 105153).dispatcher_state_bytes,
    trees={t: p.installed_tree_releases(t) for t in ("allgather", "alltoall", "flex")},
)))
"""


def _estimate_in(tree) -> dict:
    """estimate() of seed 000 from a real TransformerConfig, in a process whose megatron-core is
    ``tree``'s (what an installed tree's caller sees)."""
    done = subprocess.run(
        [sys.executable, "-c", ESTIMATE_JOB, json.dumps(SEED_000_FIELDS)], capture_output=True,
        text=True, timeout=300, cwd="/", env=dict(os.environ, PYTHONPATH=str(tree)),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_estimate_on_the_patched_tree_holds_no_dispatcher_state(patched_tree):
    """The patched tree releases after combine (every dispatcher's combine_postprocess calls the
    release), so its estimate holds the buffers worked by hand above and no dispatcher state,
    from a TransformerConfig and from a Mapping of its fields alike."""
    got = _estimate_in(patched_tree)
    assert got["file"].startswith(str(patched_tree))
    assert got["trees"] == {"allgather": True, "alltoall": True, "flex": True}
    assert got["releases"] is True and got["state"] == got["per_layer"] == got["mapping"] == 0
    assert got["buffer_bytes"] == 1_144_889_280
    assert got["source"] == f"deep_ep hybrid-ep {planner.DEEP_EP_COMMIT}"


def test_estimate_on_the_base_tree_holds_what_the_report_prices(base_tree):
    """The unpatched base keeps its dispatcher state: the installed estimate is the report's
    base column (8 MoE layers of the recomputed layer's terms: routing map, probabilities, the
    handle, the recompute leaf and its grad)."""
    got = _estimate_in(base_tree)
    report = compare.plan(SEED_000_CFG)["totals"]
    assert got["trees"] == {"allgather": False, "alltoall": False, "flex": False}
    assert got["releases"] is False
    assert got["per_layer"] == report["retained_per_layer_base"]
    assert got["state"] == got["mapping"] == report["retained_between_calls_base"]
    assert got["state"] == 8 * got["per_layer"] == 9_079_448_320
    assert got["buffer_bytes"] == report["buffers_outside_allocator"] == 1_144_889_280


def test_estimate_terms_and_what_it_does_not_model():
    """Each term carries its bytes, where it lives, its source and whether a release frees it;
    the backends whose dispatcher state is not modelled say None, not 0; a field out of range
    or a configuration the kernels refuse is a ValueError naming the field."""
    fields = dict(SEED_000_FIELDS, num_layers=4)
    e = planner.estimate(fields, 105153, releases=False)
    assert e.moe_layers == 4 and e.dispatcher_state_bytes == 4 * e.dispatcher_state_bytes_per_layer
    leaf = {t.name: t for t in e.dispatcher_state}["recompute input leaf [T, H]"]
    assert (leaf.nbytes, leaf.where) == (105153 * 2048 * 2, planner.ALLOCATOR)
    assert all(t.where == planner.OUTSIDE and t.released for t in e.buffers)
    assert e.buffer_pinned_host_bytes == 0
    # The unpatched tree has no collective release: nothing is releasable there.
    assert e.buffer_released_bytes == e.releasable_bytes == 0
    patched = planner.estimate(fields, 105153, releases=True)
    assert patched.dispatcher_state == ()
    assert patched.buffer_released_bytes == patched.buffer_bytes
    nccl = planner.estimate(
        dict(fields, moe_flex_dispatcher_backend="ncclep", hidden_size=7168,
             expert_model_parallel_size=8, moe_expert_rank_capacity_factor=1.5),
        4096, releases=False,
    )  # fmt: skip
    assert nccl.dispatcher_state is None and nccl.dispatcher_state_bytes is None
    assert nccl.buffer_bytes == 1_779_433_512  # worked by hand in test_nccl_ep_context_...
    assert nccl.buffer_source == f"NCCL EP nccl-extensions {planner.NCCL_EP_COMMIT}"
    alltoall = planner.estimate(dict(fields, moe_token_dispatcher_type="alltoall"), 4096,
                                releases=False)  # fmt: skip
    assert alltoall.buffers == () and alltoall.buffer_source == ""
    with pytest.raises(ValueError, match="hidden_size: HybridEP refuses 1000"):
        planner.estimate(dict(fields, hidden_size=1000), 4096, releases=True)
    with pytest.raises(ValueError, match="expert_model_parallel_size: 3 does not divide"):
        planner.estimate(dict(fields, expert_model_parallel_size=3), 4096, releases=True)
    with pytest.raises(ValueError, match="moe_token_dispatcher_type: 'ring' is not one of"):
        planner.installed_tree_releases("ring")
    with pytest.raises(ValueError, match="num_moe_experts: needed"):  # a dense model's config
        planner.estimate(dict(fields, num_moe_experts=None), 4096, releases=True)


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
    # The module as it ships in the patched megatron-core is a function, not this command
    # (its estimate is checked below): run as one, it says so in one line.
    module = subprocess.run(
        [sys.executable, "-m", "megatron.core.transformer.moe.moe_memory_planner", *SEED_000,
         "--json"], capture_output=True, text=True, timeout=60,
        env={"PYTHONPATH": str(patched_tree), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert module.returncode == 1 and module.stdout == "", module.stderr
    assert module.stderr.strip().splitlines()[-1] == (  # after megatron-core's import warnings
        "moe_memory_planner: a library, not a command: call estimate(config, tokens_per_rank); "
        "the base-versus-patched table is moe-release's scripts/moe_memory_plan.py"
    )


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
    status = cli.main(args)
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


# --------------------------------------------------------------------------------------------
# Strict inputs (issue 33): typos, deprecated fields, the kernels' refusals, odd values, the
# forms of moe_layer_freq, the chunk-size environment, which deep_ep is priced, --help


def _one_line_exit_2(capsys, args) -> str:
    """Run the command's main in process: exit status 2, nothing on stdout, one line on stderr
    (no traceback: an exception would fail the test here); that line."""
    status = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert status == 2 and out == "", (status, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moe_memory_planner: "), err
    return lines[0]


def _plan_json(capsys, args) -> tuple:
    status = cli.main([str(a) for a in args] + ["--json"])
    out, err = capsys.readouterr()
    assert status == 0, err
    return json.loads(out), err


HYBRIDEP = ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "hybridep"]
DEEPEP = ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"]
# H=7168, 256 experts top-8 (DeepSeek-V3's MoE layer), 4 layers.
V3 = ["--hidden-size", 7168, "--num-experts", 256, "--moe-router-topk", 8, "--num-layers", 4]


def _yaml(tmp_path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_a_typo_d_yaml_key_is_refused_naming_the_field(tmp_path, capsys):
    """`expert_model_paralel_size` was ignored (a group of 1: the plan 95x too small, exit 0);
    it is one line naming the key and the field it is closest to, exit 2."""
    path = _yaml(
        tmp_path,
        "model:\n  hidden_size: 7168\n  num_moe_experts: 256\n  moe_router_topk: 8\n"
        "  num_layers: 4\n  expert_model_paralel_size: 64\n  seq_length: 4096\n"
        "  moe_token_dispatcher_type: flex\n  moe_flex_dispatcher_backend: hybridep\n",
    )
    line = _one_line_exit_2(capsys, ["--config-file", path])
    assert "unknown key 'expert_model_paralel_size' (model:)" in line
    assert "closest known name is 'expert_model_parallel_size'" in line
    # The same typo as a flag names the closest flag.
    line = _one_line_exit_2(capsys, V3 + ["--expert-model-paralel-size", 64])
    assert "unrecognized arguments: --expert-model-paralel-size 64" in line
    assert "closest known flag is --expert-model-parallel-size" in line
    # Flags are not abbreviated either: a prefix is no flag.
    line = _one_line_exit_2(capsys, V3 + ["--seq-len", 8])
    assert "unrecognized arguments: --seq-len 8; the closest known flag is --seq-length" in line


def _megatron_names(tree) -> set:
    """Every field and argument name megatron-core 0.19.2 accepts: TransformerConfig's and
    ModelParallelConfig's fields, megatron/training/config's dataclasses, arguments.py's
    flags."""
    import ast
    import re
    from pathlib import Path

    root = Path(tree) / "megatron"
    files = [
        root / "core/transformer/transformer_config.py",
        root / "core/model_parallel_config.py",
    ]
    files += sorted((root / "training/config").glob("*.py"))
    names = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names |= {
                    b.target.id
                    for b in node.body
                    if isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name)
                }
    arguments = (root / "training/arguments.py").read_text()
    for flag in re.findall(r"add_argument\(\s*['\"]--([A-Za-z0-9_-]+)['\"]", arguments):
        names.add(flag.replace("-", "_"))
    return names


def test_megatron_names_near_the_planners_are_known(base_tree, tmp_path, capsys):
    """No name megatron accepts is taken for a typo: every one within the typo distance of a
    planner field is the planner's or in MEGATRON_NEIGHBOURS (re-derived here from the tree),
    and a YAML setting all of them plans (exit 0). Every planner field but its own four
    (tokens_per_rank, ranks_per_node, routed_rows_factor, deep_ep) is a megatron name."""
    names = _megatron_names(base_tree)
    known = inputs._known_keys()
    near = {n for n in names if n not in known and inputs.closest(n, known)}
    assert near == set(inputs.MEGATRON_NEIGHBOURS)
    assert {k for k in known if k not in names} == {
        "tokens_per_rank", "ranks_per_node", "routed_rows_factor", "deep_ep",
    }  # fmt: skip
    body = "".join(f"  {n}: 1\n" for n in sorted(near))
    path = _yaml(tmp_path, "model:\n  hidden_size: 64\n  num_moe_experts: 8\n"
                 "  moe_router_topk: 2\n  num_layers: 2\n  seq_length: 8\n" + body)  # fmt: skip
    data, err = _plan_json(capsys, ["--config-file", path])
    assert data["derived"]["moe_layers_per_rank"] == 2
    # Set, the fields the plan does not model are noted (not silently dropped).
    assert "note: moe_expert_capacity_factor is set; not modelled" in err


def _ring(depth: int) -> int:
    """One DOCA queue pair as the planner approximates it: send and completion queues of the
    next power of two of ``depth`` 64-byte entries plus a 4 KiB alignment each, two doorbell
    pages."""
    return 2 * ((1 << (depth - 1).bit_length()) * 64 + 4096) + 2 * 8192


def test_deprecated_hybridep_num_sms_is_read_with_a_note(tmp_path, capsys):
    """`moe_hybridep_num_sms: 32` (deprecated; megatron 0.19 routes it to
    moe_flex_dispatcher_num_sms) sizes the multi-node queue pairs: EP16 on two nodes of 8,
    T=4,096: 1 peer node x 32 SMs = 32 queue pairs per direction (not 8), each direction's
    ring of 3T+1 / 2T+1 entries (16,384 either way), tables 112 B / 88 B per pair."""
    head = (
        "model:\n  hidden_size: 7168\n  num_moe_experts: 256\n  moe_router_topk: 8\n"
        "  num_layers: 4\n  expert_model_parallel_size: 16\n  tokens_per_rank: 4096\n"
        "  moe_token_dispatcher_type: flex\n  moe_flex_dispatcher_backend: hybridep\n"
    )
    data, err = _plan_json(capsys, ["--config-file", _yaml(tmp_path, head)])
    default = {t["name"]: t["nbytes"] for t in data["buffers"]}
    data, err = _plan_json(
        capsys, ["--config-file", _yaml(tmp_path, head + "  moe_hybridep_num_sms: 32\n")]
    )
    got = {t["name"]: t["nbytes"] for t in data["buffers"]}
    assert data["config"]["moe_flex_dispatcher_num_sms"] == 32
    assert got["queue-pair tables"] == 32 * (8 + 104) + 32 * (8 + 80) == 6_400
    assert got["DOCA queue pairs (approximate)"] == 32 * _ring(12289) + 32 * _ring(8193)
    assert got["DOCA queue pairs (approximate)"] == 4 * default["DOCA queue pairs (approximate)"]
    assert "note: moe_hybridep_num_sms is deprecated" in err
    assert "transformer_config.py:1616-1635" in err
    # An explicit moe_flex_dispatcher_num_sms takes precedence, as in megatron.
    data, _ = _plan_json(capsys, ["--config-file", _yaml(tmp_path, head + (
        "  moe_hybridep_num_sms: 32\n  moe_flex_dispatcher_num_sms: 16\n"))])  # fmt: skip
    assert data["config"]["moe_flex_dispatcher_num_sms"] == 16
    # Two deprecated knobs that disagree: megatron refuses them, so does the planner.
    line = _one_line_exit_2(capsys, ["--config-file", _yaml(tmp_path, head + (
        "  moe_hybridep_num_sms: 32\n  moe_deepep_num_sms: 20\n"))])  # fmt: skip
    assert "conflicting deprecated SM counts" in line and "transformer_config.py:1630-1634" in line


def test_deprecated_moe_enable_deepep(tmp_path, capsys):
    """`moe_enable_deepep: true` selects the flex dispatcher's deepep backend (with a note);
    without the flex dispatcher, or with hybridep named, megatron refuses it."""
    head = ("model:\n  hidden_size: 2048\n  num_moe_experts: 64\n  moe_router_topk: 8\n"
            "  num_layers: 2\n  expert_model_parallel_size: 8\n  tokens_per_rank: 1024\n"
            "  moe_enable_deepep: true\n")  # fmt: skip
    data, err = _plan_json(capsys, ["--config-file", _yaml(
        tmp_path, head + "  moe_token_dispatcher_type: flex\n")])  # fmt: skip
    assert data["config"]["moe_flex_dispatcher_backend"] == "deepep"
    assert "note: moe_enable_deepep is deprecated" in err
    line = _one_line_exit_2(capsys, ["--config-file", _yaml(tmp_path, head)])
    assert "moe_enable_deepep: needs moe_token_dispatcher_type flex" in line
    both = "  moe_token_dispatcher_type: flex\n  moe_flex_dispatcher_backend: hybridep\n"
    line = _one_line_exit_2(capsys, ["--config-file", _yaml(tmp_path, head + both)])
    assert "transformer_config.py:1592-1593" in line


# Each configuration a kernel refuses: (args, environment, the flag or variable named, the
# source line cited). HybridEP's lines are deep_ep's csrc/hybrid_ep/config.cuh at
# DEEP_EP_COMMIT (BufferConfig::is_valid); DeepEP's deep_ep/buffer.py there, or
# deep_ep/buffers/legacy.py at DEEP_EP_MAIN_COMMIT.
KERNEL_REFUSALS = [
    (["--hidden-size", 1000, "--num-experts", 8, "--moe-router-topk", 2, "--num-layers", 2,
      "--expert-model-parallel-size", 2, "--tokens-per-rank", 64] + HYBRIDEP, {},
     "--hidden-size: HybridEP refuses 1000, not a multiple of 16", "config.cuh:89"),
    (["--hidden-size", 1024, "--num-experts", 6, "--moe-router-topk", 2, "--num-layers", 2,
      "--expert-model-parallel-size", 2, "--tokens-per-rank", 64] + HYBRIDEP, {},
     "--num-experts: HybridEP refuses 3 local experts x 2 ranks per NVLink domain = 6",
     "config.cuh:91"),
    (V3 + ["--expert-model-parallel-size", 16, "--tokens-per-rank", 32768] + HYBRIDEP, {},
     "--tokens-per-rank: HybridEP refuses 32,768 rows per rank across 2 nodes",
     "config.cuh:28-33"),
    # 21,825 tokens are 21,888 rows (rounded to the 64-token combine chunk): over 21,844.
    (V3 + ["--expert-model-parallel-size", 16, "--tokens-per-rank", 21825] + HYBRIDEP, {},
     "refuses 21,888 rows per rank across 2 nodes", "config.cuh:28-33"),
    # A held buffer regrown past the queue depth is refused the same way.
    (V3 + ["--expert-model-parallel-size", 16, "--tokens-per-rank", 21825, "--held-rows",
           512] + HYBRIDEP, {}, "refuses 21,888 rows", "config.cuh:28-33"),
    (V3 + ["--expert-model-parallel-size", 2, "--tokens-per-rank", 4096] + HYBRIDEP,
     {"NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API": "1"},
     "NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API: HybridEP refuses 1 tokens per chunk x 2 ranks",
     "config.cuh:93"),
    (V3 + ["--expert-model-parallel-size", 2, "--tokens-per-rank", 4096] + HYBRIDEP,
     {"NUM_OF_TOKENS_PER_CHUNK_COMBINE_API": "abc"},
     "NUM_OF_TOKENS_PER_CHUNK_COMBINE_API='abc': deep_ep reads it with atoi as 0",
     "config.cuh:388-391"),
    (V3 + ["--expert-model-parallel-size", 2, "--tokens-per-rank", 4096] + HYBRIDEP,
     {"NUM_OF_TOKENS_PER_CHUNK_PREPROCESSING_API": "-64"},
     "NUM_OF_TOKENS_PER_CHUNK_PREPROCESSING_API='-64'", "config.cuh:388-391"),
    # The GB200 DeepSeek-V3 recipe's combine chunk of 128 with the permute fused into HybridEP.
    (V3 + ["--expert-model-parallel-size", 8, "--tokens-per-rank", 4096,
           "--moe-permute-fusion-into-hybridep"] + HYBRIDEP,
     {"NUM_OF_TOKENS_PER_CHUNK_COMBINE_API": "128"},
     "--moe-permute-fusion-into-hybridep: HybridEP's fused permute needs one chunk size",
     "config.cuh:174-183"),
    (V3 + ["--expert-model-parallel-size", 8, "--tokens-per-rank", 4096,
           "--moe-flex-dispatcher-num-sms", 21] + DEEPEP, {},
     "--moe-flex-dispatcher-num-sms: DeepEP refuses an odd SM count, got 21",
     "deep_ep/buffer.py:160"),
    (V3 + ["--expert-model-parallel-size", 8, "--tokens-per-rank", 4096,
           "--moe-flex-dispatcher-num-sms", 21, "--deep-ep", "main"] + DEEPEP, {},
     "DeepEP refuses an odd SM count, got 21", "deep_ep/buffers/legacy.py:162"),
    (["--hidden-size", 7168, "--num-experts", 96, "--moe-router-topk", 8, "--num-layers", 2,
      "--expert-model-parallel-size", 48, "--tokens-per-rank", 4096] + DEEPEP, {},
     "--expert-model-parallel-size: ETP x EP = 48: DeepEP has no config for 48 ranks",
     "deep_ep/buffer.py:252"),
    (["--hidden-size", 7168, "--num-experts", 96, "--moe-router-topk", 8, "--num-layers", 2,
      "--expert-model-parallel-size", 6, "--tokens-per-rank", 4096, "--deep-ep", "main"]
     + DEEPEP, {}, "DeepEP has no config for 6 ranks", "deep_ep/buffers/legacy.py:259"),
    (["--hidden-size", 1024, "--num-experts", 4096, "--moe-router-topk", 8, "--num-layers", 1,
      "--expert-model-parallel-size", 2, "--tokens-per-rank", 64] + DEEPEP, {},
     "--num-experts: DeepEP refuses 2048 local experts per rank", "csrc/deep_ep.cpp:474"),
    (["--hidden-size", 1024, "--num-experts", 32768, "--moe-router-topk", 8, "--num-layers", 1,
      "--expert-model-parallel-size", 16, "--tokens-per-rank", 64, "--deep-ep", "main"]
     + DEEPEP, {}, "DeepEP refuses 2048 local experts", "csrc/legacy/buffer.hpp:949"),
    (["--hidden-size", 1024, "--num-experts", 64, "--moe-router-topk", 33, "--num-layers", 1,
      "--expert-model-parallel-size", 8, "--tokens-per-rank", 64] + DEEPEP, {},
     "--moe-router-topk: DeepEP's dispatch kernel asserts top-k <= 32, got 33",
     "csrc/kernels/intranode.cu:187"),
    (["--hidden-size", 1024, "--num-experts", 64, "--moe-router-topk", 33, "--num-layers", 1,
      "--expert-model-parallel-size", 16, "--tokens-per-rank", 64] + DEEPEP, {},
     "asserts top-k <= 32", "csrc/kernels/internode.cu:408"),
    (["--hidden-size", 1004, "--num-experts", 64, "--moe-router-topk", 8, "--num-layers", 1,
      "--expert-model-parallel-size", 8, "--tokens-per-rank", 64, "--bf16"] + DEEPEP, {},
     "--hidden-size: DeepEP refuses 1004 x 2-byte elements, not a multiple of 16 bytes",
     "csrc/deep_ep.cpp:717"),
    (["--hidden-size", 1004, "--num-experts", 64, "--moe-router-topk", 8, "--num-layers", 1,
      "--expert-model-parallel-size", 8, "--tokens-per-rank", 64, "--bf16", "--deep-ep", "main"]
     + DEEPEP, {}, "not a multiple of 16 bytes", "csrc/legacy/buffer.hpp:458"),
]  # fmt: skip


@pytest.mark.parametrize(
    "args,env,message,cited", KERNEL_REFUSALS, ids=[c[3] + "-" + str(i) for i, c in
                                                    enumerate(KERNEL_REFUSALS)]
)  # fmt: skip
def test_a_configuration_the_kernels_refuse_is_refused_citing_the_line(
    args, env, message, cited, monkeypatch, capsys
):
    """It got a plan and exit 0; now one line naming the input and the source line that
    refuses it, exit 2."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    line = _one_line_exit_2(capsys, args)
    assert message in line and cited in line, line


def test_the_largest_multi_node_hybridep_buffer_is_planned(capsys):
    """The queue-depth limit is on rows, not tokens: 21,824 tokens are 21,824 rows (a multiple
    of 64), 3 x 21,824 + 1 = 65,473 < 65,536: accepted across two nodes."""
    data, _ = _plan_json(capsys, V3 + ["--expert-model-parallel-size", 16, "--tokens-per-rank",
                                      21824] + HYBRIDEP)  # fmt: skip
    assert data["derived"]["hybridep_rows"] == 21824
    rows = {t["name"]: t["nbytes"] for t in data["buffers"]}
    assert rows["rdma dispatch input tokens"] == 21824 * 7168 * 2


def _cited_line(deep_ep_src, commit: str, cited: str) -> str:
    path, _, lines = cited.rpartition(":")
    first, _, last = lines.partition("-")
    text = subprocess.run(["git", "-C", deep_ep_src, "show", f"{commit}:{path}"],
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    return "\n".join(text.splitlines()[int(first) - 1 : int(last or first)])


# What each cited line holds, at the commit it is cited for.
HEP = "csrc/hybrid_ep/"
CITED = [
    ("hybrid-ep", f"{HEP}config.cuh:89", "hidden_dim % 16 == 0"),
    ("hybrid-ep", f"{HEP}config.cuh:87", "hidden_dim % 512 == 0"),
    ("hybrid-ep", f"{HEP}config.cuh:91", "num_of_experts_per_rank * num_of_ranks_per_node) % 4"),
    ("hybrid-ep", f"{HEP}config.cuh:93", "_chunk_dispatch_api * num_of_ranks_per_node) % 4"),
    ("hybrid-ep", f"{HEP}config.cuh:18", "HYBRID_EP_IB_QP_MAX_TX_DEPTH = 65536"),
    ("hybrid-ep", f"{HEP}config.cuh:28-33", "if (tx_depth < HYBRID_EP_IB_QP_MAX_TX_DEPTH)"),
    ("hybrid-ep", f"{HEP}config.cuh:197-200", "return val ? atoi(val) : default_value"),
    ("hybrid-ep", f"{HEP}config.cuh:174-183", "Fuse mode requires identical chunk sizes"),
    ("hybrid-ep", f"{HEP}config.cuh:388-391", "/ buffer_config.num_of_tokens_per_chunk_combine"),
    ("hybrid-ep", f"{HEP}config.cuh:393-398", "The buffer config is not valid."),
    ("hybrid-ep", f"{HEP}executor/executor.cu:120-123", "_chunk_preprocessing_api"),
    ("hybrid-ep", f"{HEP}executor/executor.cu:128-129", "kInt32).device(torch::kCUDA)"),
    ("hybrid-ep", f"{HEP}executor/executor.cu:155-158", "dtype(torch::kInt64).pinned_memory(true)"),
    ("hybrid-ep", "deep_ep/buffer.py:160", "assert new_num_sms % 2 == 0"),
    ("hybrid-ep", "deep_ep/buffer.py:252", "Unsupported number of EP ranks"),
    ("hybrid-ep", "csrc/deep_ep.cpp:474", "size(0) / num_ranks <= NUM_MAX_LOCAL_EXPERTS"),
    ("hybrid-ep", "csrc/deep_ep.cpp:869", "size(0) / num_ranks <= NUM_MAX_LOCAL_EXPERTS"),
    ("hybrid-ep", "csrc/kernels/intranode.cu:187", "EP_DEVICE_ASSERT(num_topk <= 32)"),
    ("hybrid-ep", "csrc/kernels/internode.cu:408", "EP_DEVICE_ASSERT(num_topk <= 32)"),
    ("hybrid-ep", "csrc/deep_ep.cpp:717", "(hidden * x.element_size()) % sizeof(int4) == 0"),
    ("hybrid-ep", "csrc/deep_ep.cpp:1111", "(hidden * x.element_size()) % sizeof(int4) == 0"),
    ("hybrid-ep", "csrc/kernels/configs.cuh:6", "NUM_MAX_LOCAL_EXPERTS 1024"),
    ("main", "csrc/legacy/buffer.hpp:469", "num_ranks <= LEGACY_NUM_MAX_LOCAL_EXPERTS"),
    ("main", "csrc/legacy/buffer.hpp:949", "num_ranks <= LEGACY_NUM_MAX_LOCAL_EXPERTS"),
    ("main", "csrc/kernels/legacy/intranode.cu:251", "EP_DEVICE_ASSERT(num_topk <= 32)"),
    ("main", "csrc/kernels/legacy/internode.cu:519", "EP_DEVICE_ASSERT(num_topk <= 32)"),
    ("main", "csrc/legacy/buffer.hpp:458", "(x.size(1) * x.element_size()) % sizeof(int4)"),
    ("main", "csrc/legacy/buffer.hpp:930", "(x.size(1) * x.element_size()) % sizeof(int4)"),
    ("main", "deep_ep/buffers/legacy.py:162", "assert new_num_sms % 2 == 0"),
    ("main", "deep_ep/buffers/legacy.py:259", "Unsupported number of EP ranks"),
    ("main", "deep_ep/buffers/legacy.py:252-254", "48: Config(Buffer.num_sms, 32, 288, 8, 128)"),
    ("main", "deep_ep/buffers/legacy.py:254", "96: Config(Buffer.num_sms, 20, 480, 12, 128)"),
    ("main", "csrc/legacy/config.hpp:75-99", "num_max_rdma_chunked_recv_tokens * sizeof(int4) * 2"),
    ("main", "csrc/legacy/buffer.hpp:149-150", "(&workspace, LEGACY_NUM_WORKSPACE_BYTES)"),
    ("main", "csrc/legacy/buffer.hpp:164-168", "cudaMallocHost(&moe_recv_rdma_counter"),
]  # fmt: skip


@pytest.mark.needs_env("DEEP_EP_SRC")  # a deep_ep git checkout to read
@pytest.mark.parametrize("source,cited,holds", CITED)
def test_the_cited_lines_say_what_the_planner_says(source, cited, holds):
    """The source lines the refusals and terms cite hold the check or allocation named (read
    from a deep_ep checkout at the commit cited: DEEP_EP_SRC=path)."""
    assert holds in _cited_line(os.environ["DEEP_EP_SRC"], planner.DEEP_EP_SOURCES[source], cited)


def test_every_refusal_cites_a_line_the_table_checks():
    """Each kernel refusal's cited line is among those the cited-lines test reads (so a
    refusal cannot cite a line nobody checked)."""
    checked = {c for _, c, _ in CITED}
    for _, _, _, cited in KERNEL_REFUSALS:
        assert any(c.endswith(cited) for c in checked), cited


def test_routed_rows_factor_inf_is_one_line_not_a_traceback():
    """`--routed-rows-factor inf` (or 1e400, which is inf as a float) was a traceback, exit 1."""
    for value in ("inf", "1e400", "nan"):
        done = _run(*OK, "--seq-length", "8", "--routed-rows-factor", value)
        assert done.returncode == 2 and done.stdout == "", done.stderr
        assert done.stderr.strip() == (
            f"moe_memory_planner: --routed-rows-factor: must be a finite number, got '{value}'"
        )


# Odd values for every argument: non-finite, huge, negative, zero, of the wrong type.
GOOD = OK + ["--seq-length", "8"]
INT_FLAGS = [f for f, n in inputs.FLAGS.items() if n in inputs.INT_FIELDS]
BAD_INTS = ["0", "-1", "2147483648", "99999999999999999999999", "1.5", "nan", "inf", "", "x"]
BAD_FLOATS = ["0", "-1", "nan", "inf", "-inf", "1e400", "1e308", "x", "", "3"]  # 3 > EP 1
BAD_NAMES = ["0", "", "x", "nan"]
ODD_FLAG_CASES = (
    [(flag, v) for flag in INT_FLAGS + ["--held-rows"] for v in BAD_INTS]
    + [(flag, v) for flag in ("--routed-rows-factor",) for v in BAD_FLOATS]
    + [("--moe-expert-rank-capacity-factor", v) for v in BAD_FLOATS[:-1]]
    + [(flag, v) for flag in ("--moe-token-dispatcher-type", "--moe-flex-dispatcher-backend",
                              "--moe-router-dtype", "--recompute-granularity", "--deep-ep")
       for v in BAD_NAMES]
    + [("--moe-layer-freq", v) for v in ["0", "-1", "x", "1.5", "[2]*2", "[1]*3", "[1]*10**9",
                                         "[1]*1000000000", "__import__('os').getcwd()",
                                         "[1,0", "(" * 5000, "+".join(["[1]"] * 20000),
                                         "[1.0, 1.0]", "[True, True]"]]
    + [("--pipeline-model-parallel-layout", v) for v in ["", "x", "Et|L", "E(t|)*3L",
                                                        "(t)*1" + "0" * 5000, "t*-1"]]
)  # fmt: skip


@pytest.mark.parametrize("flag,value", ODD_FLAG_CASES)
def test_odd_flag_values_are_one_line_exit_2(flag, value, capsys):
    """No traceback on any value: each is refused in one line naming the flag, exit 2."""
    line = _one_line_exit_2(capsys, GOOD + [flag, value])
    assert flag in line, line
    assert len(line) < 300  # a pattern or list is never echoed whole


ODD_YAML = [".nan", ".inf", "-.inf", "-1", "0", "100000000000000000000", "abc", "[1, 2]",
            "true", "2.5", "'12'", "1e30"]  # fmt: skip
YAML_FIELDS = sorted(inputs.INT_FIELDS | set(inputs.FLOAT_FIELDS)) + [
    "moe_token_dispatcher_type", "moe_layer_freq", "recompute_modules", "bf16", "fp16",
    "moe_ncclep_zero_copy", "moe_hybridep_num_sms", "moe_deepep_num_sms", "moe_enable_deepep",
    "deep_ep", "sequence_parallel", "moe_layer_recompute", "pipeline_model_parallel_layout",
]  # fmt: skip


@pytest.mark.parametrize("field_name", YAML_FIELDS)
def test_odd_yaml_values_never_trace_back(field_name, tmp_path, capsys):
    """Every value of the wrong kind in a YAML: exit 2 in one line naming the field, or (for
    a value the field takes, such as 2.5 for a capacity factor) a plan; never a traceback."""
    base = {"hidden_size": 64, "num_moe_experts": 8, "moe_router_topk": 2, "num_layers": 2,
            "seq_length": 8}  # fmt: skip
    for value in ODD_YAML:
        fields = dict(base)
        fields[field_name] = value
        body = "".join(f"  {k}: {v}\n" for k, v in fields.items())
        path = _yaml(tmp_path, "model:\n" + body)
        status = cli.main(["--config-file", path, "--json"])
        out, err = capsys.readouterr()
        if status == 0:
            assert (field_name, value) in YAML_ACCEPTED, (field_name, value, err)
            continue
        assert status == 2 and out == "", (field_name, value, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err, (field_name, value, err)
        flag = inputs.FIELD_FLAGS.get(field_name, field_name)
        assert flag in lines[0] or field_name in lines[0], (field_name, value, lines[0])


# The odd values a field takes: a capacity factor of 2.5 (or the string '12', read as a number,
# as from the command line), moe_layer_freq '12' (megatron's moe_freq_type reads "N"), true.
YAML_ACCEPTED = {
    ("moe_expert_rank_capacity_factor", "2.5"), ("moe_expert_rank_capacity_factor", "'12'"),
    ("moe_layer_freq", "'12'"), ("bf16", "true"), ("fp16", "true"),
    ("moe_ncclep_zero_copy", "true"), ("sequence_parallel", "true"),
    ("moe_layer_recompute", "true"),
}  # fmt: skip


# moe_layer_freq in megatron's forms; MoE layers on the pipeline stage that holds the most.
LAYER_FREQ = [
    # 8 layers on 2 stages, dense first 3: stage 0 holds layer 3, stage 1 layers 4-7.
    (["--num-layers", 8, "--pipeline-model-parallel-size", 2, "--moe-layer-freq",
      "([0]*3+[1]*5)"], 4),
    (["--num-layers", 8, "--moe-layer-freq", "[0,0,0,1,1,1,1,1]"], 5),
    (["--num-layers", 8, "--moe-layer-freq", "([1]*3+[0]*1)*2"], 6),
    (["--num-layers", 8, "--moe-layer-freq", "3"], 3),  # layers 0, 3, 6
    (["--num-layers", 8, "--pipeline-model-parallel-size", 2, "--moe-layer-freq", "3"], 2),
    # DeepSeek-V3: 61 layers, the first 3 dense.
    (["--num-layers", 61, "--moe-layer-freq", "([0]*3+[1]*58)"], 58),
    (["--num-layers", 8, "--moe-layer-freq", "[0]*8"], 0),
]  # fmt: skip


@pytest.mark.parametrize("args,moe_layers", LAYER_FREQ)
def test_moe_layer_freq_forms(args, moe_layers, capsys):
    """Megatron's list and pattern-string forms were refused (the list echoed back); each now
    counts the MoE layers of the fullest stage (counted by hand above), and the state kept
    between calls is that many layers' (recomputed: each layer's own terms, no chain)."""
    base = ["--hidden-size", 64, "--num-experts", 8, "--moe-router-topk", 2,
            "--seq-length", 64, "--recompute-granularity", "full"]  # fmt: skip
    data, _ = _plan_json(capsys, base + args)
    assert data["derived"]["moe_layers_per_rank"] == moe_layers
    tot = data["totals"]
    assert tot["retained_between_calls_base"] == moe_layers * tot["retained_per_layer_base"]


def test_moe_layer_freq_from_yaml(tmp_path, capsys):
    """A Bridge YAML's list (or pattern string) of moe_layer_freq plans as the flag does."""
    head = ("model:\n  hidden_size: 64\n  num_moe_experts: 8\n  moe_router_topk: 2\n"
            "  num_layers: 8\n  seq_length: 64\n  pipeline_model_parallel_size: 2\n")  # fmt: skip
    for freq in ("[0, 0, 0, 1, 1, 1, 1, 1]", "'([0]*3+[1]*5)'"):
        path = _yaml(tmp_path, head + f"  moe_layer_freq: {freq}\n")
        data, _ = _plan_json(capsys, ["--config-file", path])
        assert data["derived"]["moe_layers_per_rank"] == 4
        assert data["config"]["moe_layer_freq"] == [0, 0, 0, 1, 1, 1, 1, 1]
    line = _one_line_exit_2(capsys, ["--config-file", _yaml(
        tmp_path, head + "  moe_layer_freq: [" + ", ".join(["1"] * 61) + "]\n")])  # fmt: skip
    assert "the pattern has 61 entries for 8 layers" in line and "gpt_layer_specs.py:653" in line
    assert "1, 1, 1" not in line  # the list is not echoed back


def _hybridep_terms(capsys, args, env, monkeypatch) -> tuple:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    data, _ = _plan_json(capsys, args)
    return {t["name"]: t["nbytes"] for t in data["buffers"]}, data


@pytest.mark.parametrize(
    "env,rows,dispatch_chunk,combine_chunk",
    [
        ({}, 1024, 64, 64),
        # The real GB200 DeepSeek-V3 recipe's 128: rows and the combine flags, not dispatch's.
        ({"NUM_OF_TOKENS_PER_CHUNK_COMBINE_API": "128"}, 1024, 64, 128),
        ({"NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API": "32"}, 1024, 32, 64),
        ({"NUM_OF_TOKENS_PER_CHUNK_COMBINE_API": "384"}, 1152, 64, 384),
        # atoi: leading blanks and a sign read, trailing text ignored.
        ({"NUM_OF_TOKENS_PER_CHUNK_COMBINE_API": " +128abc",
          "NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API": "32 tokens"}, 1024, 32, 128),
    ],
)  # fmt: skip
def test_chunk_sizes_are_read_for_every_term_they_size(
    env, rows, dispatch_chunk, combine_chunk, monkeypatch, capsys
):
    """EP2 on one node, T=1000, H=1024, 8 experts: rows = roundup(max(T, 512), combine chunk)
    (config.cuh:384-387), dispatch/combine chunk flags = ceil(rows / chunk) x 2 ranks x 4 B
    (config.cuh:388-391, intranode.cu:229-230 and 277-278). NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API
    was never read and the combine variable did not reach the flags."""
    args = ["--hidden-size", 1024, "--num-experts", 8, "--moe-router-topk", 2, "--num-layers",
            1, "--expert-model-parallel-size", 2, "--tokens-per-rank", 1000] + HYBRIDEP  # fmt: skip
    terms, data = _hybridep_terms(capsys, args, env, monkeypatch)
    assert data["derived"]["hybridep_rows"] == rows
    assert terms["combine tokens (N x H, 16-bit)"] == rows * 2 * 1024 * 2
    assert terms["dispatch chunk flags"] == -(-rows // dispatch_chunk) * 2 * 4
    assert terms["combine chunk flags"] == -(-rows // combine_chunk) * 2 * 4


def test_chunk_sizes_size_the_rdma_flags_and_the_handle(monkeypatch, capsys):
    """Across nodes (EP16, two nodes of 8, T=4,096) the RDMA flags are 2 x (ceil(rows / chunk)
    x peers + 2 x peers) x 8 B + 8 B per direction (internode_doca.cu:404-407, 567-570);
    NUM_OF_TOKENS_PER_CHUNK_PREPROCESSING_API sizes the handle's dense_chunk_layout,
    ceil(T / chunk) x 16 ranks x 4 B (executor.cu:120-123)."""
    env = {"NUM_OF_TOKENS_PER_CHUNK_COMBINE_API": "128",
           "NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API": "32",
           "NUM_OF_TOKENS_PER_CHUNK_PREPROCESSING_API": "256"}  # fmt: skip
    args = V3 + ["--expert-model-parallel-size", 16, "--tokens-per-rank", 4096] + HYBRIDEP
    terms, data = _hybridep_terms(capsys, args, env, monkeypatch)
    assert terms["rdma dispatch flags"] == 2 * (4096 // 32 + 2) * 8 + 8 == 2088
    assert terms["rdma combine flags"] == 2 * (4096 // 128 + 2) * 8 + 8 == 552
    handle = {t["name"]: t for t in data["retained_per_layer"]}
    assert handle["handle: dense_chunk_layout"]["nbytes"] == (4096 // 256) * 16 * 4


def test_memory_location_labels_are_the_sources(capsys):
    """The handle's raw tokens_per_expert is int32 on the device (executor.cu:128-129); the
    tokens_per_expert megatron keeps is deep_ep's padded int64 copy, pinned host when the
    dispatch blocks (executor.cu:155-158); the dispatched-token count is pinned
    (executor.cu:103-109). The labels were swapped."""
    args = ["--hidden-size", 1024, "--num-experts", 8, "--moe-router-topk", 2, "--num-layers",
            1, "--expert-model-parallel-size", 2, "--tokens-per-rank", 1000] + HYBRIDEP  # fmt: skip
    data, _ = _plan_json(capsys, args)
    where = {t["name"]: (t["where"], t["nbytes"]) for t in data["retained_per_layer"]}
    assert where["handle: tokens_per_expert"] == (planner.ALLOCATOR, 4 * 4)
    assert where["tokens_per_expert [L] int64"] == (planner.HOST, 4 * 8)
    assert where["handle: num_dispatched_tokens"] == (planner.HOST, 4)


def test_deep_ep_main_prices_its_own_configs(capsys):
    """DeepEP main (2.1.0) at EP64, H=7168 (hidden_bytes 14,336), 20 SMs: its dispatch and
    combine configs send 8 RDMA tokens per chunk (hybrid-ep: 28 and 20), so the receive count
    stays 128 (hybrid-ep rounds it to 140): 10 channels x 8 RDMA ranks x (18 x 2 x 4 B + 128 x
    2 x (14,336 + 8 + 128 x 16 + 16)), to 128 B; 31.5 MB less. The NVLink hint is the same
    (288 receive tokens either way). The plan names the source it priced."""
    want = 10 * 8 * (18 * 2 * 4 + 128 * 2 * (14336 + 8 + 128 * 16 + 16))
    want = -(-want // 128) * 128
    main = _names(planner.deepep_buffer_terms(14336, 64, source="main"))
    assert main["RDMA buffer (num_rdma_bytes)"] == want == 336_047_360
    hybrid = _names(planner.deepep_buffer_terms(14336, 64))
    assert hybrid["RDMA buffer (num_rdma_bytes)"] - want == 31_503_360
    assert main["NVLink buffer (num_nvl_bytes)"] == hybrid["NVLink buffer (num_nvl_bytes)"]
    args = V3 + ["--expert-model-parallel-size", 64, "--tokens-per-rank", 4096] + DEEPEP
    data, _ = _plan_json(capsys, args + ["--deep-ep", "main"])
    assert data["derived"]["deep_ep_source"] == "main"
    assert data["derived"]["deep_ep_commit"] == planner.DEEP_EP_MAIN_COMMIT
    sources = {t["name"]: t["source"] for t in data["buffers"]}
    assert sources["RDMA buffer (num_rdma_bytes)"] == "csrc/legacy/config.hpp:75-99"
    status = cli.main([str(a) for a in args + ["--deep-ep", "main"]])
    assert status == 0 and "deep_ep main dd758ca" in capsys.readouterr().out
    status = cli.main([str(a) for a in args])
    assert status == 0 and "deep_ep hybrid-ep 94a9f8f" in capsys.readouterr().out


@pytest.mark.parametrize("ep", [48, 96])
def test_deep_ep_main_accepts_ep_48_and_96(ep, capsys):
    """Main has configs for 48 and 96 ranks (legacy.py:252, 254); hybrid-ep refuses them
    (buffer.py:252). bf16, H=7168 (hidden_bytes 14,336). EP96: main's 96-rank configs (20, 480,
    12, 128) and (1, 480, 8, 128): 480 NVLink receive tokens, and 128 RDMA ones rounded to a
    multiple of 12 and of 8: 132 and 128, 132 the larger."""
    args = ["--hidden-size", 7168, "--num-experts", 2 * ep, "--moe-router-topk", 8,
            "--num-layers", 1, "--expert-model-parallel-size", ep, "--tokens-per-rank",
            4096, "--bf16"] + DEEPEP  # fmt: skip
    data, _ = _plan_json(capsys, args + ["--deep-ep", "main"])
    terms = {t["name"]: t["nbytes"] for t in data["buffers"]}
    nvl_recv, rdma_recv = (288, 128) if ep == 48 else (480, 132)
    rr = ep // 8
    nvl = 10 * 8 * ((2 * rr + 3) * 4 + nvl_recv * (14336 + 8 + 128 * 16))
    rdma = 10 * rr * (18 * 2 * 4 + rdma_recv * 2 * (14336 + 8 + 128 * 16 + 16))
    assert terms["NVLink buffer (num_nvl_bytes)"] == -(-nvl // 128) * 128
    assert terms["RDMA buffer (num_rdma_bytes)"] == -(-rdma // 128) * 128
    line = _one_line_exit_2(capsys, args)
    assert f"DeepEP has no config for {ep} ranks (deep_ep/buffer.py:252" in line


def test_deep_ep_main_is_not_hybridep(capsys):
    """HybridEP is on deep_ep's hybrid-ep branch only: choosing main for it is one line."""
    args = V3 + ["--expert-model-parallel-size", 8, "--tokens-per-rank", 4096] + HYBRIDEP
    line = _one_line_exit_2(capsys, args + ["--deep-ep", "main"])
    assert "--deep-ep: 'main' applies to the deepep backend" in line
    line = _one_line_exit_2(capsys, args + ["--deep-ep", "v3"])
    assert "--deep-ep: 'v3' is not one of hybrid-ep, main" in line


def test_help_teaches_every_flag():
    """--help: every flag says what it is and its default (or that it is required), the
    required ones marked; exit 0."""
    done = _run("--help")
    assert done.returncode == 0 and "Traceback" not in done.stderr
    parser = inputs.build_parser()
    for action in parser._actions:
        if action.dest == "help":
            continue
        text = action.help or ""
        required = action.dest in inputs.REQUIRED
        assert ("[required]" in text) == required, action.option_strings
        assert required or "default" in text, action.option_strings
    for flag in ("--hidden-size", "--num-experts", "--moe-router-topk", "--num-layers"):
        assert flag in done.stdout
    assert "[required]" in done.stdout and "NUM_OF_TOKENS_PER_CHUNK_COMBINE_API" in done.stdout


def test_sequence_parallel_and_moe_layer_recompute_are_read(tmp_path, capsys):
    """sequence_parallel: false (megatron's default; it only warns with EP and TP) leaves each
    TP rank the whole sequence: T = 4096 x 2 / CP 1 = 8,192, not / TP 2. Not given, the plan
    assumes it on (T = 4,096) and says so. The deprecated moe_layer_recompute is selective
    recompute of the MoE layer (the recompute leaf and its grad are kept), and with full
    granularity megatron refuses it."""
    head = ("model:\n  hidden_size: 64\n  num_moe_experts: 8\n  moe_router_topk: 2\n"
            "  num_layers: 2\n  seq_length: 4096\n  tensor_model_parallel_size: 2\n"
            "  expert_model_parallel_size: 2\ntrain:\n  micro_batch_size: 2\n")  # fmt: skip
    data, err = _plan_json(capsys, ["--config-file", _yaml(tmp_path, head)])
    assert data["derived"]["tokens_per_rank"] == 4096
    assert "note: sequence_parallel not given: assumed on" in err
    data, err = _plan_json(
        capsys, ["--config-file", _yaml(tmp_path, head + "  sequence_parallel: false\n")]
    )
    assert data["derived"]["tokens_per_rank"] == 8192 and "note" not in err
    data, err = _plan_json(
        capsys, ["--config-file", _yaml(tmp_path, head + "  moe_layer_recompute: true\n")]
    )
    assert data["derived"]["recompute"] == "selective"
    leaf = {t["name"]: t["nbytes"] for t in data["retained_per_layer"]}
    assert leaf["recompute input leaf [T, H]"] == 4096 * 64 * 4  # fp32 activations
    assert "note: moe_layer_recompute is deprecated" in err
    line = _one_line_exit_2(capsys, ["--config-file", _yaml(tmp_path, head + (
        "  moe_layer_recompute: true\n  recompute_granularity: full\n"))])  # fmt: skip
    assert "transformer_config.py:1840-1843" in line


V3_LAYOUT = "Et*4|(tttt|)*14,tmL"  # DeepSeek-V3 on PP4 x VPP4: 16 stages, 61 decoder layers


def test_pipeline_layout_and_virtual_stages_place_the_moe_layers(tmp_path, capsys):
    """DeepSeek-V3 (61 layers, the first 3 dense) on PP 4 with megatron's layout
    'Et*4|(tttt|)*14,tmL': stage s is on rank s % 4; stage 0 holds layers 0-3 (one MoE), stages
    1-14 four MoE layers each, stage 15 layer 60. Rank 0: 1 + 3 x 4 = 13, ranks 1 and 2: 16,
    rank 3: 3 x 4 + 1 = 13. It was refused (61 layers do not divide over PP 4). The same
    layout as a YAML list of lists plans alike. Without a layout, VPP 2 on PP 2 splits 8 layers
    into stages of 2, and with every 3rd layer MoE (0, 3, 6) rank 1 holds two, rank 0 one."""
    args = ["--hidden-size", 64, "--num-experts", 8, "--moe-router-topk", 2, "--seq-length", 64,
            "--num-layers", 61, "--moe-layer-freq", "([0]*3+[1]*58)",
            "--pipeline-model-parallel-size", 4]  # fmt: skip
    data, _ = _plan_json(capsys, args + ["--pipeline-model-parallel-layout", V3_LAYOUT])
    assert data["derived"]["moe_layers_per_pipeline_rank"] == [13, 16, 16, 13]
    assert data["derived"]["moe_layers_per_rank"] == 16
    stages = (
        [["embedding"] + ["decoder"] * 4] + [["decoder"] * 4] * 14 + [["decoder", "mtp", "loss"]]
    )
    path = _yaml(tmp_path, "model:\n  hidden_size: 64\n  num_moe_experts: 8\n"
                 "  moe_router_topk: 2\n  seq_length: 64\n  num_layers: 61\n"
                 "  moe_layer_freq: '([0]*3+[1]*58)'\n  pipeline_model_parallel_size: 4\n"
                 "  virtual_pipeline_model_parallel_size: 4\n"
                 f"  pipeline_model_parallel_layout: {json.dumps(stages)}\n")  # fmt: skip
    yaml_data, _ = _plan_json(capsys, ["--config-file", path])
    assert yaml_data["derived"]["moe_layers_per_pipeline_rank"] == [13, 16, 16, 13]
    vpp = ["--hidden-size", 64, "--num-experts", 8, "--moe-router-topk", 2, "--seq-length", 64,
           "--num-layers", 8, "--moe-layer-freq", 3, "--pipeline-model-parallel-size", 2,
           "--num-virtual-stages-per-pipeline-rank", 2]  # fmt: skip
    data, _ = _plan_json(capsys, vpp)
    assert data["derived"]["moe_layers_per_pipeline_rank"] == [1, 2]


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--num-layers", 62, "--pipeline-model-parallel-layout", V3_LAYOUT],
         "61 decoder layers for num_layers 62 (megatron/core/transformer/"
         "pipeline_parallel_layer_layout.py:106-109)"),
        (["--num-layers", 61, "--pipeline-model-parallel-layout", "Et*4|(tttt|)*13,tmL"],
         "15 stages do not divide over PP 4 (megatron/core/transformer/"
         "pipeline_parallel_layer_layout.py:40-44)"),
        (["--num-layers", 61, "--pipeline-model-parallel-layout", "Et*4|x|L"],
         "--pipeline-model-parallel-layout: 'x' is no layer"),
        (["--num-layers", 61, "--pipeline-model-parallel-layout", "(t|)*99999999999"],
         "longer than any model"),
        (["--num-layers", 61, "--pipeline-model-parallel-layout", V3_LAYOUT,
          "--num-virtual-stages-per-pipeline-rank", 2],
         "--num-virtual-stages-per-pipeline-rank: 2, but the layout has 4 stages per pipeline"),
        (["--num-layers", 61, "--num-virtual-stages-per-pipeline-rank", 2],
         "--pipeline-model-parallel-size: must divide num_layers (x 2 virtual stages)"),
    ],
)  # fmt: skip
def test_a_bad_pipeline_layout_is_one_line(extra, message, capsys):
    """A layout megatron refuses (decoder count, stages over PP: its lines cited), an unknown
    layer, a repeat beyond any model, a VPP the layout contradicts: one line, exit 2."""
    base = ["--hidden-size", 64, "--num-experts", 8, "--moe-router-topk", 2, "--seq-length", 64,
            "--pipeline-model-parallel-size", 4]  # fmt: skip
    line = _one_line_exit_2(capsys, base + extra)
    assert message in line, line


def test_hybridep_ranks_per_nvlink_domain_from_the_environment(monkeypatch, capsys):
    """NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN, read by deep_ep over what it detects
    (hybrid_ep_buffer.py:63-72), is the plan's NVLink domain: EP16 with 16 ranks per domain is
    one node (no RDMA terms; N = 4,096 x 16); with 4, four nodes (3 peer nodes). A value int()
    refuses, or one that does not divide the group (hybrid_ep_buffer.py:74-76), is one line."""
    args = V3 + ["--expert-model-parallel-size", 16, "--tokens-per-rank", 4096] + HYBRIDEP
    monkeypatch.setenv("NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN", "16")
    data, err = _plan_json(capsys, args + ["--ranks-per-node", 8])
    terms = {t["name"]: t["nbytes"] for t in data["buffers"]}
    assert terms["combine tokens (N x H, 16-bit)"] == 4096 * 16 * 7168 * 2
    assert not any(name.startswith("rdma") for name in terms)
    assert "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=16 overrides --ranks-per-node 8" in err
    monkeypatch.setenv("NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN", "4")
    data, _ = _plan_json(capsys, args)
    terms = {t["name"]: t["nbytes"] for t in data["buffers"]}
    assert terms["rdma dispatch peer tokens"] == 4096 * 3 * 7168 * 2
    for bad, cited in (("eight", "hybrid_ep_buffer.py:63-65"), ("3", "hybrid_ep_buffer.py:74-76"),
                       ("0", "hybrid_ep_buffer.py:74-76")):  # fmt: skip
        monkeypatch.setenv("NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN", bad)
        line = _one_line_exit_2(capsys, args)
        assert f"NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN={bad!r}" in line and cited in line


def test_inputs_read_but_not_priced_are_said(tmp_path, capsys):
    """What the plan does not price is said on stderr, the plan still printed: --held-rows for
    a backend other than HybridEP, per-expert padding of the routed rows for FP8."""
    data, err = _plan_json(capsys, GOOD + ["--held-rows", 512])
    assert "note: --held-rows prices a HybridEP buffer's growth; not read" in err
    assert "growth" not in data
    path = _yaml(tmp_path, "model:\n  hidden_size: 64\n  num_moe_experts: 8\n"
                 "  moe_router_topk: 2\n  num_layers: 2\n  seq_length: 8\n"
                 "  moe_router_padding_for_fp8: true\n")  # fmt: skip
    _, err = _plan_json(capsys, ["--config-file", path])
    assert "note: moe_router_padding_for_fp8 is set; not modelled" in err


def test_bridge_yaml_shapes(tmp_path, capsys):
    """Megatron-Bridge writes params_dtype as {_target_: torch.bfloat16}: 16-bit activations,
    as torch.float16 is (the dict was skipped, fp32 assumed: token terms 2x). A typo'd section
    name (modle:) is one line naming the section it is closest to, not a silent 'required'."""
    body = ("  hidden_size: 64\n  num_moe_experts: 8\n  moe_router_topk: 2\n  num_layers: 2\n"
            "  seq_length: 8\n")  # fmt: skip
    for dtype, bf16 in (
        ("torch.bfloat16", True),
        ("torch.float16", True),
        ("torch.float32", False),
    ):
        path = _yaml(tmp_path, "model:\n" + body + "  params_dtype:\n    _call_: false\n"
                     f"    _target_: {dtype}\n")  # fmt: skip
        data, _ = _plan_json(capsys, ["--config-file", path])
        assert data["config"]["bf16"] is bf16, dtype
    line = _one_line_exit_2(capsys, ["--config-file", _yaml(tmp_path, "modle:\n" + body)])
    assert "unknown section 'modle'; the closest known is 'model'" in line


PIPE = ["--hidden-size", 64, "--num-experts", 8, "--moe-router-topk", 2, "--seq-length", 64]


@pytest.mark.parametrize(
    "args,per_rank",
    [
        # 61 layers on PP 4, 13 first and 12 last: the middle two get 18 each. Dense 0-2:
        # rank 0 holds 0-12 (10 MoE), ranks 1, 2 13-30 and 31-48, rank 3 49-60.
        (["--num-layers", 61, "--pipeline-model-parallel-size", 4, "--moe-layer-freq",
          "([0]*3+[1]*58)", "--decoder-first-pipeline-num-layers", 13,
          "--decoder-last-pipeline-num-layers", 12], [10, 18, 18, 12]),
        # 60 layers, PP 4 x VPP 2, 12 first and last: virtual stages of 6, 9, 9, 6 layers in
        # order [0,6) [6,15) [15,24) [24,30) [30,36) ...; every 2nd layer MoE.
        (["--num-layers", 60, "--pipeline-model-parallel-size", 4, "--moe-layer-freq", 2,
          "--num-virtual-stages-per-pipeline-rank", 2, "--decoder-first-pipeline-num-layers",
          12, "--decoder-last-pipeline-num-layers", 12], [6, 10, 8, 6]),
    ],
)  # fmt: skip
def test_uneven_first_and_last_pipeline_stages(args, per_rank, capsys):
    """num_layers_in_first/last_pipeline_stage (--decoder-first/last-pipeline-num-layers) place
    the layers as megatron's get_transformer_layer_offset does; the MoE layers of each rank
    are counted by hand above."""
    data, _ = _plan_json(capsys, PIPE + args)
    assert data["derived"]["moe_layers_per_pipeline_rank"] == per_rank
    assert data["derived"]["moe_layers_per_rank"] == max(per_rank)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--num-layers", 60, "--pipeline-model-parallel-size", 4,
          "--num-virtual-stages-per-pipeline-rank", 2, "--decoder-first-pipeline-num-layers",
          13], "--decoder-first-pipeline-num-layers: 13 does not divide into 2 virtual stages "
         "(megatron/core/transformer/transformer_config.py:2000-2011)"),
        (["--num-layers", 61, "--pipeline-model-parallel-size", 3,
          "--decoder-first-pipeline-num-layers", 30, "--decoder-last-pipeline-num-layers", 31],
         "0 middle layers for 1 middle stages (megatron/core/transformer/"
         "transformer_config.py:2035-2039)"),
        (["--num-layers", 61, "--pipeline-model-parallel-size", 4,
          "--decoder-first-pipeline-num-layers", 14],
         "47 middle layers do not divide over 3 middle stages"),
        (["--num-layers", 61, "--pipeline-model-parallel-size", 4,
          "--decoder-first-pipeline-num-layers", 5, "--pipeline-model-parallel-layout",
          V3_LAYOUT], "cannot be set with num_layers_in_first/last_pipeline_stage"),
    ],
)  # fmt: skip
def test_an_uneven_split_megatron_refuses_is_one_line(args, message, capsys):
    line = _one_line_exit_2(capsys, PIPE + args)
    assert message in line, line


# megatron-core 0.19.2 lines the planner cites, and what each holds.
MEGATRON_CITED = [
    ("core/transformer/transformer_config.py", "1616-1635", "_deprecated_num_sms"),
    ("core/transformer/transformer_config.py", "1630-1634", "Conflicting deprecated SM-count"),
    ("core/transformer/transformer_config.py", "1589-1598", "moe_enable_deepep is deprecated"),
    ("core/transformer/transformer_config.py", "1590-1591", "only supported with flex token"),
    ("core/transformer/transformer_config.py", "1592-1593", "Only one backend is supported"),
    ("core/transformer/transformer_config.py", "1835-1846", '"moe" not in self.recompute_mod'),
    ("core/transformer/transformer_config.py", "1840-1843", "with full recompute granularity"),
    ("core/transformer/transformer_config.py", "1923-1932", "cannot be"),
    ("core/transformer/transformer_config.py", "1939-1953", "cannot be set"),
    ("core/transformer/transformer_block.py", "185-196", "Not enough layers in the first"),
    ("core/transformer/transformer_config.py", "1973-1979", "conflicts with"),
    ("core/transformer/transformer_config.py", "2000-2011", "number of layers at first stage"),
    ("core/transformer/transformer_config.py", "2019-2030", "number of layers at last stage"),
    ("core/transformer/transformer_config.py", "2035-2039", "middle PP stages available"),
    ("core/transformer/transformer_config.py", "2043-2062", "number of layers at middle stage"),
    ("core/model_parallel_config.py", "560-565", "sequence parallelism must be used"),
    ("core/models/gpt/gpt_layer_specs.py", "653", "len(moe_layer_pattern) == config.num_layers"),
    ("core/transformer/pipeline_parallel_layer_layout.py", "40-44", "% pipeline_model_parallel"),
    ("core/transformer/pipeline_parallel_layer_layout.py", "106-109", "must match num_layers"),
    ("core/transformer/moe/token_dispatcher.py", "1279", "set_deepep_num_sms("),
]  # fmt: skip


@pytest.mark.parametrize("path,lines,holds", MEGATRON_CITED)
def test_the_cited_megatron_lines_say_what_the_planner_says(path, lines, holds, base_tree):
    """Each megatron-core line the planner cites (in its refusals and notes) holds the check
    named, in the base tree (megatron-core 0.19.2)."""
    from pathlib import Path

    text = (Path(base_tree) / "megatron" / path).read_text().splitlines()
    first, _, last = lines.partition("-")
    assert holds in "\n".join(text[int(first) - 1 : int(last or first)])
    cited = "".join(p.read_text() for p in [*source_files(), Path(inputs.__file__)])
    assert f":{lines}" in cited  # and the planner (its pricing or its command) cites them


def test_layers_per_virtual_stage_sets_vpp(tmp_path, capsys):
    """--num-layers-per-virtual-pipeline-stage (a YAML's num_layers_per_virtual_pipeline_stage):
    8 layers on PP 2 with 2 per virtual stage is VPP 2, the same split as
    --num-virtual-stages-per-pipeline-rank 2 ([1, 2] MoE layers with every 3rd layer MoE);
    megatron refuses it beside another VPP argument or a share it does not divide."""
    base = PIPE + ["--num-layers", 8, "--moe-layer-freq", 3, "--pipeline-model-parallel-size", 2]
    data, _ = _plan_json(capsys, base + ["--num-layers-per-virtual-pipeline-stage", 2])
    assert data["config"]["virtual_pipeline_model_parallel_size"] == 2
    assert data["derived"]["moe_layers_per_pipeline_rank"] == [1, 2]
    line = _one_line_exit_2(capsys, base + ["--num-layers-per-virtual-pipeline-stage", 3])
    assert "--num-layers-per-virtual-pipeline-stage: 3 does not divide" in line
    assert "megatron/training/arguments.py:933-938" in line
    both = [
        "--num-layers-per-virtual-pipeline-stage",
        2,
        "--num-virtual-stages-per-pipeline-rank",
        2,
    ]
    line = _one_line_exit_2(capsys, base + both)
    assert "arguments.py:894-905" in line


def test_embedding_and_loss_in_the_pipeline_split(tmp_path, capsys):
    """account_for_embedding/loss_in_pipeline_split: 7 layers + the embedding + the loss are 9
    on PP 3, three per stage: the first and last stages build 2 decoder layers, the middle 3
    (transformer_block.py get_num_layers_to_build); without them 7 do not divide over 3. With
    uneven first/last stages megatron refuses them."""
    base = PIPE + ["--num-layers", 7, "--pipeline-model-parallel-size", 3]
    line = _one_line_exit_2(capsys, base)
    assert "--pipeline-model-parallel-size: must divide num_layers" in line
    flags = ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
    data, _ = _plan_json(capsys, base + flags)
    assert data["derived"]["moe_layers_per_pipeline_rank"] == [2, 3, 2]
    path = _yaml(tmp_path, "model:\n  hidden_size: 64\n  num_moe_experts: 8\n"
                 "  moe_router_topk: 2\n  seq_length: 64\n  num_layers: 7\n"
                 "  pipeline_model_parallel_size: 3\n"
                 "  account_for_embedding_in_pipeline_split: true\n"
                 "  account_for_loss_in_pipeline_split: true\n")  # fmt: skip
    data, _ = _plan_json(capsys, ["--config-file", path])
    assert data["derived"]["moe_layers_per_pipeline_rank"] == [2, 3, 2]
    line = _one_line_exit_2(capsys, base + flags + ["--decoder-first-pipeline-num-layers", 1])
    assert "transformer_config.py:1923-1932" in line


def test_fused_permute_with_one_chunk_size_plans(monkeypatch, capsys):
    """With the permute fused into HybridEP and all three chunk variables 128, the kernel
    accepts the configuration: rows roundup_128(4096) = 4096, chunk flags 32 x 8 ranks x 4 B."""
    for kind in ("DISPATCH", "COMBINE", "PREPROCESSING"):
        monkeypatch.setenv(f"NUM_OF_TOKENS_PER_CHUNK_{kind}_API", "128")
    args = V3 + ["--expert-model-parallel-size", 8, "--tokens-per-rank", 4096] + HYBRIDEP
    data, _ = _plan_json(capsys, args + ["--moe-permute-fusion-into-hybridep"])
    terms = {t["name"]: t["nbytes"] for t in data["buffers"]}
    assert terms["dispatch chunk flags"] == terms["combine chunk flags"] == 32 * 8 * 4


# --------------------------------------------------------------------------------------------
# Across nodes (issue 45): DeepEP v2's hybrid layout and NCCL EP's internode buffers, the
# refusals, the device's rounding and the in-flight and never-freed terms, each worked by hand.

# The shape of the issue: bf16, H = 7168, 256 experts, top-8, 4,096 tokens per rank, 8 ranks per
# NVLink domain.
SHAPE = dict(hidden_size=7168, num_moe_experts=256, moe_router_topk=8, num_layers=4,
             tokens_per_rank=4096, moe_token_dispatcher_type="flex")  # fmt: skip


def test_deepep_v2_hybrid_layout_worked_by_hand():
    """DeepEP v2 across O domains of U = 8 ranks (buffer.hpp:544-591 at DEEP_EP_V2_COMMIT):
    Bd = 14,464, Bc = 14,400 (as in one domain), N = 4,096, scale-out slots N + 1280.
    2 x 8: dispatch 14464 x (8 x 2 x 4096 + 4096 + 2 x 5376) = 1,162,674,176; combine 14400 x
    (8 x 2 x 4096 + 2 x 4096 + 2 x 5376) = 1,216,512,000, the larger. 4 x 8: dispatch 14464 x
    (131072 + 4096 + 21504) = 2,266,103,808; combine 14400 x (131072 + 4 x 4096 + 21504) =
    2,433,024,000. The same 16 ranks in one domain (an NVL72 rack): 16 x 4096 x 14464."""
    data = "symmetric window: data buffer"
    two = _names(planner.deepep_v2_buffer_terms(16, 4096, 7168, 8, ranks_per_node=8))
    assert two[f"{data} (2 domains x 8 ranks)"] == 14400 * (65536 + 8192 + 10752) == 1_216_512_000
    assert 14464 * (65536 + 4096 + 10752) == 1_162_674_176  # dispatch: smaller here
    four = _names(planner.deepep_v2_buffer_terms(32, 4096, 7168, 8, ranks_per_node=8))
    assert four[f"{data} (4 domains x 8 ranks)"] == 14400 * (131072 + 16384 + 21504)
    assert four[f"{data} (4 domains x 8 ranks)"] == 2_433_024_000
    one = _names(planner.deepep_v2_buffer_terms(16, 4096, 7168, 8, ranks_per_node=16))
    assert one[data] == 16 * 4096 * 14464 == 947_912_704
    assert _names(planner.deepep_v2_buffer_terms(16, 4096, 7168, 8)) == one  # None: one domain
    for terms in (two, four, one):
        assert terms["symmetric window: workspace"] == 12_820_544  # topology-free (layout.cuh)
    # The command and the installed estimate() price it from --ranks-per-node alike.
    cfg = planner.MoEMemoryConfig(**SHAPE, expert_model_parallel_size=16, ranks_per_node=8,
                                  moe_flex_dispatcher_backend="deepepv2")  # fmt: skip
    assert compare.plan(cfg)["totals"]["buffers_outside_allocator"] == 1_216_512_000 + 12_820_544


def test_nccl_ep_across_domains_worked_by_hand():
    """NCCL EP at EP16 = 2 x 8 and EP32 = 4 x 8 (eager: MR = R x M x top-k = 524,288 and
    1,048,576; B = 14,336; nccl_ep.cc at NCCL_EP_COMMIT). Probabilities hold the experts of one
    domain, L x E / R = 128 and 64: 2 x MR x 128 x 4 = 536,870,912 both times (1026-1028), not
    2 x MR x 256 x 4. The GIN buffer (1300-1358), N domains, T = 4,096, Ed = 128 (EP16):
    2 x a4k(4096 x 1 x 14336) + 2 x a4k(4096 x 1 x 128 x 4) + 2 x a4k(1 x 64 x 8) + 2 x a4k(2 x 8)
    + a4k(4096 x 14336) + a4k(4096 x 256 x 4) + 2 x a4k(1 x 4096 x (14336 + 512)) = 306,200,576;
    EP32 (Ed = 64): 2 x 176,160,768 + 2 x 3,145,728 + 2 x 4,096 + 2 x 4,096 + 58,720,256 +
    4,194,304 + 2 x 179,306,496 = 780,156,928. Totals 10,273,964,072 and 20,145,258,536."""
    gin16 = (2 * 58_720_256 + 2 * 2_097_152 + 2 * 4096 + 2 * 4096 + 58_720_256 + 4_194_304
             + 2 * 60_817_408)  # fmt: skip
    assert planner.nccl_ep_gin_bytes(16, 8, 256, 4096, 7168) == gin16 == 306_200_576
    assert planner.nccl_ep_gin_bytes(32, 8, 256, 4096, 7168) == 780_156_928
    assert planner.nccl_ep_gin_bytes(8, 8, 256, 4096, 7168) == 0  # one domain: none
    for r, gin, device in ((16, 306_200_576, 10_273_964_072), (32, 780_156_928, 20_145_258_536)):
        mr = r * 4096 * 8
        terms = planner.nccl_ep_terms(r, 256, 4096, mr, 7168, ranks_per_node=8)
        named = _names(terms)
        assert named["dispatch and combine probabilities"] == 2 * mr * (8 * 256 // r) * 4
        assert named[f"GIN buffer ({r // 8} domains x 8 ranks)"] == gin
        assert named["host pointer block (mapped)"] == 40 * 8  # per domain rank (1072-1075)
        want = 33_554_432 + 32 + r * 4096 * 32 + 2 * 4096 * r * 14336 + 536_870_912 \
            + mr * 14336 + 8 + gin  # fmt: skip
        assert planner.total(terms, planner.OUTSIDE) == want == device
    # One domain keeps its device communicator: never freed, its bytes NCCL's own (not priced).
    one = planner.nccl_ep_terms(8, 256, 4096, 262144, 7168, ranks_per_node=8)
    leak = [t for t in one if not t.released]
    assert [(t.nbytes, t.source) for t in leak] == [(0, "nccl_ep.cc:1282-1297")]
    assert "never released" in leak[0].note
    assert planner.total(one, planner.OUTSIDE) == 5_269_094_440
    # The command and estimate() agree: EP16 from flags, and from a TransformerConfig mapping.
    cfg = planner.MoEMemoryConfig(**SHAPE, expert_model_parallel_size=16, ranks_per_node=8,
                                  moe_flex_dispatcher_backend="ncclep")  # fmt: skip
    plan = compare.plan(cfg)
    assert plan["totals"]["buffers_outside_allocator"] == 10_273_964_072
    fields = {k: v for k, v in SHAPE.items() if k != "tokens_per_rank"}
    est = planner.estimate(dict(fields, expert_model_parallel_size=16,
                                moe_flex_dispatcher_backend="ncclep"), 4096, ranks_per_node=8,
                           releases=True)  # fmt: skip
    assert [dataclasses.asdict(t) for t in est.buffers] == plan["buffers"]


def test_nccl_ep_routing_handle_worked_by_hand():
    """One MoE layer's routing handle, held from its forward until its backward in PyTorch's
    allocator (nccl_ep.cc:2397-2464; TE pytorch/ep.py:301-302), expert-major with local permute,
    132 SMs. EP8: r2a 4,096 + ler 262144 x 32 + ntfe 256 + s2d 4096 x 8 x 4 + rank mask
    4096 x 8 x 8 + scan 132 x 8 x 8 = 8,448 + dense probabilities 4096 x 256 x 4 + top-k
    4096 x 8 x 8 + 256 + 512 + flat2em and weights 2 x 262144 x 8 x 4 + 4096 x 8 x 4
    = 30,160,128. EP16 = 2 x 8: no dense probabilities (the GIN buffer's), a2r 4,096, the rest
    by MR = 524,288 = 43,275,264. Not a buffer: not in the buffer totals or the release."""
    ep8 = (4096 + 8_388_608 + 256 + 131_072 + 262_144 + 8_448 + 4_194_304 + 262_144 + 256
           + 512 + 2 * 8_388_608 + 131_072)  # fmt: skip
    assert planner.nccl_ep_handle_bytes(8, 8, 256, 4096, 262144, 8) == ep8 == 30_160_128
    assert planner.nccl_ep_handle_bytes(16, 8, 256, 4096, 524288, 8) == 43_275_264
    assert planner.nccl_ep_handle_bytes(8, 8, 256, 4096, 262144, 8, sms=78) == ep8 - 8448 + 5120
    terms = planner.nccl_ep_terms(8, 256, 4096, 262144, 7168, ranks_per_node=8, topk=8)
    handle = [t for t in terms if t.in_flight]
    assert [(t.nbytes, t.where) for t in handle] == [(30_160_128, planner.ALLOCATOR)]
    assert handle[0].note.startswith("held by: the layer's forward until its backward")
    assert planner.released_bytes(terms) == planner.released_bytes(
        [t for t in terms if not t.in_flight])  # fmt: skip


def test_device_rounding_worked_by_hand():
    """What the device takes beyond the bytes asked for: one ncclMemAlloc rounded to 2 MiB (the
    assumed cuMem granularity). DeepEP v2 EP8: its window, 473,956,352 + 12,820,544 =
    486,776,896 B, takes 233 x 2 MiB = 488,636,416 (+1,859,520). NCCL EP's 8-byte completion
    flags take a whole granule (+2,097,144); its intranode buffer is a 2 MiB multiple here."""
    cfg = planner.MoEMemoryConfig(**SHAPE, expert_model_parallel_size=8,
                                  moe_flex_dispatcher_backend="deepepv2")  # fmt: skip
    est = planner.estimate_config(cfg, releases=True)
    assert [t.nbytes for t in est.buffer_device_rounding] == [488_636_416 - 486_776_896]
    assert est.buffer_device_bytes == est.buffer_bytes + 1_859_520 == 488_636_416
    plan = compare.plan(cfg)
    assert plan["totals"]["buffers_outside_allocator_device"] == 488_636_416
    assert "as the device sees them (rounded)" in compare.format_plan(plan)
    nccl = planner.estimate_config(dataclasses.replace(cfg, moe_flex_dispatcher_backend="ncclep"),
                                   releases=True)  # fmt: skip
    outside = [t for t in nccl.buffer_device_rounding if t.where == planner.OUTSIDE]
    assert [t.nbytes for t in outside] == [2 * 1024 * 1024 - 8]
    # The byte-exact terms do not change: rounding is its own column.
    assert nccl.buffer_bytes == 5_269_094_440


@pytest.mark.parametrize(
    "args,message",
    [
        (["--moe-flex-dispatcher-backend", "ncclep", "--expert-model-parallel-size", "1"],
         "--expert-model-parallel-size: the NCCL EP dispatcher requires ETP x EP > 1, got 1 "
         "(token_dispatcher.py:1788; TransformerEngine pytorch/ep.py:138-139)"),
        (["--moe-flex-dispatcher-backend", "deepepv2", "--expert-model-parallel-size", "1"],
         "requires ETP x EP > 1, got 1 (dev token_dispatcher.py:1896)"),
        (["--moe-flex-dispatcher-backend", "deepep", "--expert-model-parallel-size", "1"],
         "requires ETP x EP > 1, got 1 (token_dispatcher.py:1770)"),
        (["--moe-flex-dispatcher-backend", "deepepv2", "--expert-model-parallel-size", "8",
          "--num-experts", "4096"], "--num-experts: DeepEP v2 takes at most 2048 experts, got "
         "4096 (layout.cuh:39)"),
        (["--moe-flex-dispatcher-backend", "deepepv2", "--expert-model-parallel-size", "2",
          "--num-experts", "1024"], "at most 256 experts per rank, got 512 (layout.cuh:40)"),
        (["--moe-flex-dispatcher-backend", "deepepv2", "--expert-model-parallel-size", "8",
          "--hidden-size", "2080"], "combine needs a multiple of 256, got 2080 (combine.cuh:109"),
        (["--moe-flex-dispatcher-backend", "deepepv2", "--expert-model-parallel-size", "16",
          "--num-experts", "2048", "--ranks-per-node", "8"],
         "ranks per domain + experts per rank <= 128, got 8 + 128 (hybrid_dispatch.cuh:260-261)"),
        (["--moe-flex-dispatcher-backend", "deepepv2", "--expert-model-parallel-size", "128",
          "--ranks-per-node", "2"], "at most 32 NVLink domains, got 64 (hybrid_dispatch.cuh:331)"),
        (["--moe-flex-dispatcher-backend", "ncclep", "--expert-model-parallel-size", "8",
          "--hidden-size", "2052"], "--hidden-size: NCCL EP's high-throughput kernels need a token "
         "row of 2 x 2052 bytes to be a multiple of 16 (nccl_ep.cc:1634-1641)"),
    ],
)  # fmt: skip
def test_refusals_across_nodes(args, message, capsys):
    base = ["--hidden-size", "7168", "--num-experts", "256", "--moe-router-topk", "8",
            "--num-layers", "4", "--tokens-per-rank", "4096",
            "--moe-token-dispatcher-type", "flex"]  # fmt: skip
    # argparse keeps the last of a repeated flag: the case's own value wins.
    line = _one_line_exit_2(capsys, base + args)
    assert message in line, line


def test_nccl_ep_token_limit_is_a_warning(capsys):
    """NCCL EP documents 8,192 tokens per rank (include/common.hpp:26) and checks nothing: the
    plan prices 105,153 tokens as given and says so in one warning line, exit status 0."""
    args = ["--hidden-size", "2048", "--num-experts", "128", "--moe-router-topk", "8",
            "--num-layers", "4", "--tokens-per-rank", "105153", "--expert-model-parallel-size",
            "2", "--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend",
            "ncclep"]  # fmt: skip
    result, err = _plan_json(capsys, args)
    assert err.strip() == (
        "moe_memory_planner: warning: tokens_per_rank: NCCL EP documents at most 8,192 tokens "
        "per rank, got 105,153; nothing checks it at the pinned commit (include/common.hpp:26, "
        "RELEASE.md:19), priced as given"
    )
    assert result["warnings"] == [err.strip().split("warning: ", 1)[1]]
    assert result["totals"]["buffers_outside_allocator"] > 0
    _plan_json(capsys, args[:9] + ["4096"] + args[10:])
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("ranks", [16, 32])
def test_hybridep_and_deepep_across_nodes_price_by_node(ranks):
    """HybridEP and DeepEP v1 already lay out by node: at 2 x 8 and 4 x 8 their RDMA terms
    appear and grow with the nodes, and one NVLink domain of the same ranks has none."""
    for backend in ("hybridep", "deepep"):
        cfg = planner.MoEMemoryConfig(**SHAPE, expert_model_parallel_size=ranks, ranks_per_node=8,
                                      moe_flex_dispatcher_backend=backend)  # fmt: skip
        names = [t.name for t in planner.buffer_terms(cfg)]
        assert any("RDMA" in n or "rdma" in n for n in names), (backend, names)


def test_permute_fusion_keeps_te_row_id_map_worked_by_hand(capsys):
    """With moe_permute_fusion, megatron's moe_utils.permute returns Transformer Engine's
    row_id_map as the sorted indices (fused_permute_with_probs; TE d0067d0
    triton/permutation.py:52: [tokens, 2 x experts + 1] int32), and the all-to-all dispatcher
    keeps it in reversed_local_input_permutation_mapping. Qwen3.6-35B-A3B's MoE shape (H 2048,
    256 experts, top-8, 40 MoE layers), one H200, 73,696 tokens, fp32 router: per layer probs
    73696 x 256 x 4 + routing map 73696 x 256 + 2,048 + row_id_map 73696 x 513 x 4 =
    245,557,120; x 40 = 9,822,284,800 B = 9.148 GiB (ART #861 reports "approximately 9.15 GiB
    across 40 MoE layers"; without the fusion the map is 73696 x 8 x 8 and the total 3.96e9)."""
    args = ["--hidden-size", "2048", "--num-experts", "256", "--moe-router-topk", "8",
            "--num-layers", "40", "--tokens-per-rank", "73696", "--bf16",
            "--moe-token-dispatcher-type", "alltoall", "--moe-router-dtype", "fp32"]  # fmt: skip
    fused, _ = _plan_json(capsys, args + ["--moe-permute-fusion"])
    names = {
        t["name"].split(":")[0].split(" [")[0]: t["nbytes"] for t in fused["retained_per_layer"]
    }
    assert names["reversed_local_input_permutation_mapping"] == 73696 * 513 * 4 == 151_224_192
    per_layer = 73696 * 256 * 4 + 73696 * 256 + 2048 + 73696 * 513 * 4
    assert fused["totals"]["retained_per_layer_base"] == per_layer == 245_557_120
    assert fused["totals"]["retained_between_calls_base"] == 40 * per_layer == 9_822_284_800
    plain, _ = _plan_json(capsys, args)
    assert plain["totals"]["retained_per_layer_base"] == per_layer - 73696 * 513 * 4 + 73696 * 64
    # The all-gather and DeepEP maps follow the same rule, over their own routing maps.
    shape = planner.LayerShape(tokens=100, hidden=64, experts=8, topk=2, group=2,
                               local_experts=4, routed_rows=200, received_tokens=150,
                               permute_fusion=True)  # fmt: skip
    ag = _names(planner.retained_state_terms(shape, "allgather"))
    assert ag["reversed_local_input_permutation_mapping: TE row_id_map [200, 2 x 4 + 1] int32"] \
        == 200 * 9 * 4  # fmt: skip
    dp = _names(planner.retained_state_terms(shape, "flex", "deepep"))
    assert dp["reversed_mapping_for_combine: TE row_id_map [150, 2 x 4 + 1] int32"] == 150 * 9 * 4


# --------------------------------------------------------------------------------------------
# What a rank gets back for rollout: the collective release's buffers by kind, plus the
# dispatcher state the patched tree no longer holds between calls, as a share of the device.

GiB = 1024**3
# EP16 = 2 nodes x 8 GPUs, DeepEP normal mode, the MoE layer recomputed.
ROLLOUT = ["--hidden-size", 7168, "--num-experts", 256, "--moe-router-topk", 8, "--num-layers",
           4, "--tokens-per-rank", 4096, "--bf16", "--expert-model-parallel-size", 16,
           "--ranks-per-node", 8, "--recompute-granularity", "selective",
           "--recompute-modules", "moe"] + DEEPEP  # fmt: skip


def _rollout_by_hand() -> dict:
    """The rollout line's figures at ROLLOUT, from deep_ep's and megatron's formulas written out
    (DEEP_EP_COMMIT; 20 SMs: 10 channels; hidden bytes 7168 x 2 = 14,336; top-8, T = 4,096).

    The collective release frees DeepEP's Buffer. Device, outside the allocator:
    NVLink buffer (config.hpp:51-73): dispatch and combine both receive 288 for 16 ranks; 8 NVLink
    peers, 2 RDMA ranks: 10 x 8 x (2 x 2 + 3) x 4 + 10 x 8 x 288 x (14336 + 8) + 10 x 8 x 288 x
    128 x (8 + 4 + 4) = 377,673,920, rounded up to 128: 377,673,984; its barrier signals and
    pointers 8 x 4 + 8 x 8 + 8 x 8 = 160; the workspace 32 MiB; RDMA buffer (config.hpp:75-103,
    num_rdma_bytes, in NVSHMEM's heap): the dispatch config's receive 128 rounded up to its send
    20 is 140 (the combine's, 132, is smaller): 10 x 2 x (8 x 2 + 2) x 2 x 4 + 10 x 2 x 140 x
    ((14336 + 8) x 2 + 128 x 16 x 2 + 16 x 2) = 91,887,680, to 128: 91,887,744. Pinned host:
    the receive counters 8 + 4 x 1024 = 4,104 (destroy() keeps the 4-byte RDMA counter).

    The dispatcher state an unpatched tree keeps per MoE layer (_DeepepManager): token_indices
    T x k int64, token_probs T x k fp32, tokens_per_expert 16 x int64, dispatched_routing_map
    R x 16 bool with R = ceil(T x 16 x (1 - C(240, 8) / C(256, 8))) the tokens a rank receives
    under uniform routing, reversed_mapping_for_combine P = T x k int64, and the recompute
    input leaf and its grad 2 x T x H x 2; 4 MoE layers, no chain (recompute)."""
    import math

    nvl = 10 * 8 * 7 * 4 + 10 * 8 * 288 * (14336 + 8) + 10 * 8 * 288 * 128 * 16
    assert nvl == 377_673_920
    nvl = -(-nvl // 128) * 128
    rdma = 10 * 2 * 18 * 2 * 4 + 10 * 2 * 140 * ((14336 + 8) * 2 + 128 * 16 * 2 + 16 * 2)
    assert rdma == 91_887_680
    rdma = -(-rdma // 128) * 128
    device = nvl + 160 + 32 * MiB + rdma
    host = 8 + 4 * 1024
    received = math.ceil(4096 * 16 * (1 - math.comb(240, 8) / math.comb(256, 8)))
    per_layer = (4096 * 8 * 8 + 4096 * 8 * 4 + 16 * 8 + received * 16 + 4096 * 8 * 8
                 + 2 * 4096 * 7168 * 2)  # fmt: skip
    state = 4 * per_layer
    return dict(device=device, host=host, state=state, received=received)


def test_what_a_rank_gets_back_for_rollout_worked_by_hand(capsys):
    """The plan's last line at EP16 over 2 nodes of 8 with DeepEP, every figure worked by hand
    (:func:`_rollout_by_hand`): buffers 503,116,320 device + 4,104 pinned host, the dispatcher
    state 4 x 118,523,520 (R = 26,720 tokens received), total 977,214,504 B; the device's part
    977,210,400 B is 1.14% of the default 80 GiB, 0.65% of 141 GiB; NVSHMEM's own memory (the
    RDMA buffer lives in its heap) is named as not priced. estimate() returns the same total;
    the unpatched tree gets back 0."""
    hand = _rollout_by_hand()
    assert hand["device"] == 377_673_984 + 160 + 33_554_432 + 91_887_744 == 503_116_320
    assert hand["received"] == 26_720
    assert hand["state"] == 4 * 118_523_520 == 474_094_080
    total = hand["device"] + hand["host"] + hand["state"]
    device = hand["device"] + hand["state"]  # DeepEP's state is all in PyTorch's allocator
    assert (total, device) == (977_214_504, 977_210_400)
    nvshmem = "NVSHMEM's own memory beyond num_rdma_bytes (DeepEP across 2 nodes)"

    def line(share: str, memory: str) -> str:
        return (
            "per rank, back for rollout (patched; base 0): collective buffer release "
            "503,120,424 B (device 503,116,320 + pinned host 4,104) + dispatcher state no "
            "longer held between calls 474,094,080 B = 977,214,504 B; on the device "
            f"977,210,400 B = {share} of {memory}; not priced: {nvshmem}"
        )

    assert 100 * device / (80 * GiB) == pytest.approx(1.1376, abs=1e-4)
    assert cli.main([str(a) for a in ROLLOUT]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == line("1.14%", "80 GiB")  # the table's last line
    assert sum(o.startswith("per rank, back for rollout") for o in out) == 1
    assert 100 * device / (141 * GiB) == pytest.approx(0.6455, abs=1e-4)
    assert cli.main([str(a) for a in ROLLOUT] + ["--device-memory", "141GiB"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == line("0.65%", "141 GiB")
    data, _ = _plan_json(capsys, ROLLOUT)
    r = data["releasable"]
    assert (r["buffers_device"], r["buffers_pinned_host"]) == (hand["device"], hand["host"])
    assert (r["state_device"], r["state_pinned_host"]) == (hand["state"], 0)
    assert (r["total"], r["device_bytes"], r["device_memory"]) == (total, device, 80 * GiB)
    assert r["not_priced"] == [nvshmem]
    tot = data["totals"]
    assert (tot["releasable_patched"], tot["releasable_base"]) == (total, 0)
    assert tot["buffers_released"] == hand["device"] + hand["host"]  # the patched tree's
    assert tot["retained_between_calls_base"] == hand["state"]  # what the patched one drops
    # estimate() returns the same total; an unpatched tree (no collective release, the state
    # kept) gets back nothing.
    fields = dict(hidden_size=7168, num_moe_experts=256, moe_router_topk=8, num_layers=4,
                  expert_model_parallel_size=16, moe_token_dispatcher_type="flex",
                  moe_flex_dispatcher_backend="deepep", recompute_granularity="selective",
                  recompute_modules=["moe"], bf16=True)  # fmt: skip
    est = planner.estimate(fields, 4096, ranks_per_node=8, releases=True, device_memory=141 * GiB)
    assert est.releasable_bytes == est.releasable.total == total
    assert est.releasable.device_share == device / (141 * GiB)
    base = planner.estimate(fields, 4096, ranks_per_node=8, releases=False)
    assert base.releasable_bytes == base.buffer_released_bytes == 0
    assert base.releasable == planner.ReleasableBytes()
    assert base.dispatcher_state_bytes == hand["state"]  # kept, not released
    with pytest.raises(ValueError, match="device_memory: must be a positive number of bytes"):
        planner.estimate(fields, 4096, ranks_per_node=8, releases=True, device_memory=0)


def test_the_rollout_line_names_only_what_applies(capsys):
    """What the total leaves out is named only where it applies: DeepEP in one node (no NVSHMEM)
    and the all-to-all dispatcher (no buffers) name nothing; HybridEP across 2 nodes names
    DOCA's own memory; DeepEP v2 and NCCL EP name NCCL's communicators, ncclMemAlloc's rounding
    and their dispatcher state, which is not modelled (so not counted)."""

    def last(args) -> str:
        assert cli.main([str(a) for a in args]) == 0
        return capsys.readouterr().out.splitlines()[-1]

    assert "not priced" not in last(ROLLOUT + ["--expert-model-parallel-size", 8])
    alltoall = last(ROLLOUT + ["--moe-token-dispatcher-type", "alltoall"])
    assert "collective buffer release 0 B (device 0 + pinned host 0)" in alltoall
    assert "not priced" not in alltoall
    hep = last(ROLLOUT + ["--moe-flex-dispatcher-backend", "hybridep"])
    assert hep.endswith("; not priced: DOCA's own memory beyond the RDMA buffers and queue "
                        "pairs priced (HybridEP across 2 nodes)")  # fmt: skip
    for backend in ("deepepv2", "ncclep"):
        data, _ = _plan_json(capsys, ROLLOUT + ["--moe-flex-dispatcher-backend", backend])
        r = data["releasable"]
        assert r["dispatcher_state"] is None and r["total"] == r["buffers"]
        assert r["not_priced"][0] == "NCCL's communicator memory"
        assert r["not_priced"][1].startswith("ncclMemAlloc's rounding to the cuMem granularity")
        assert r["not_priced"][-1] == f"the dispatcher state (not modelled for {backend})"


@pytest.mark.parametrize(
    "value,nbytes", [("85899345920", 80 * GiB), ("80GiB", 80 * GiB), ("141 gib", 141 * GiB),
                     ("80GB", 80 * 10**9), ("0.5KiB", 512), ("1024MiB", GiB)],
)  # fmt: skip
def test_device_memory_sizes(value, nbytes):
    assert inputs.parse_size(value) == nbytes


@pytest.mark.parametrize("value", ["0", "-1", "80XB", "1.5", "GiB", "", "0.1B"])
def test_a_bad_device_memory_is_one_line(value, capsys):
    line = _one_line_exit_2(capsys, ROLLOUT + ["--device-memory", value])
    assert "argument --device-memory: must be" in line, line


# --------------------------------------------------------------------------------------------
# What a layer holds until its backward: NCCL EP's routing handle, per MoE layer in flight, and
# DeepEP's handle across nodes (the internode dispatch's 10 tensors); the commits modelled.

# The NCCL EP shape: H 4096, 128 experts, top-8, 4,096 tokens per rank, EP32 = 4 domains of 8,
# eager (MR = 32 x 4,096 x 8), 4 layers, all MoE.
NCCL_EP32 = dict(hidden_size=4096, num_moe_experts=128, moe_router_topk=8, num_layers=4,
                 tokens_per_rank=4096, moe_token_dispatcher_type="flex", bf16=True,
                 moe_flex_dispatcher_backend="ncclep", expert_model_parallel_size=32)  # fmt: skip


def _nccl_ep32_handle_by_hand() -> int:
    """The routing handle at NCCL_EP32 (nccl_ep.cc:2397-2464, 132 SMs), M = 4,096, MR =
    1,048,576, N = 4 domains of L = 8, 4 local experts, each term rounded up to 256: r2a
    4 x 4096, a2r 4096 x 3, ler MR x 4, ntfe 4 -> 256, s2d 4 x 4096 x 8 x 4, rank mask
    4 x 4096 x 8 x 1 x 8, scan 132 x 8 x 8, no dense probabilities (the GIN buffer's), top-k
    4096 x 8 x 8, counts 4 x 4 -> 256, offsets 5 x 8 -> 256, and the permute scratch
    2 x MR x 8 x 4 + 4096 x 8 x 4 x 4."""
    mr = 32 * 4096 * 8
    return (4 * 4096 + 4096 * 3 + mr * 4 + 256 + 4 * 4096 * 8 * 4 + 4 * 4096 * 8 * 8
            + 132 * 8 * 8 + 4096 * 8 * 8 + 256 + 256
            + 2 * mr * 8 * 4 + 4096 * 8 * 4 * 4)  # fmt: skip


def test_nccl_ep_handle_is_held_until_the_layers_backward(capsys):
    """TE's dispatch and combine save the routing handle for backward (pytorch/ep.py:554, 639 at
    TRANSFORMER_ENGINE_COMMIT); megatron drops only its EpBuffer at combine (main
    token_dispatcher.py:1788). So every MoE layer whose forward has run and whose backward has
    not holds one: 73,700,352 B per layer at NCCL_EP32, x 4 MoE layers = 294,801,408 B before
    the first backward, and nothing between steps (not a buffer, not released). A recomputed
    layer keeps no graph from its forward: one handle, the layer under backward. Pipelined
    (16 layers, PP 4): 1F1B keeps PP - r micro-batches on rank r, 4 x 4 MoE layers on rank 0;
    interleaved (VPP 2, 2 MoE layers a chunk): rank 0 warms up (4 - 1) x 2 + (2 - 1) x 4 = 10
    virtual micro-batches and runs one more forward before its first backward: 11 x 2."""
    per_layer = _nccl_ep32_handle_by_hand()
    assert per_layer == 73_700_352
    cfg = planner.MoEMemoryConfig(**NCCL_EP32)
    est = planner.estimate_config(cfg, releases=False)
    handle = [t for t in est.buffers if t.in_flight]
    assert [t.nbytes for t in handle] == [per_layer]
    assert handle[0].note.startswith("held by: the layer's forward until its backward")
    assert "ep.py:554,639" in handle[0].note and "token_dispatcher.py:1788" in handle[0].note
    assert (est.moe_layers_in_flight, est.in_flight_bytes_per_layer) == (4, per_layer)
    assert est.in_flight_bytes == 4 * per_layer == 294_801_408
    # Between steps nothing holds it: not a buffer, not in what a release gives back.
    patched = planner.estimate_config(cfg, releases=True)
    assert patched.in_flight_bytes == 4 * per_layer
    freed = sum(t.nbytes for t in patched.buffers if t.released) - per_layer
    assert patched.releasable.buffers == planner.released_bytes(patched.buffers) == freed
    # The command: JSON totals and the table's row, base and patched alike.
    args = [a for k, v in NCCL_EP32.items() if k != "bf16"
            for a in (inputs.FIELD_FLAGS[k], str(v))] + ["--bf16"]  # fmt: skip
    data, _ = _plan_json(capsys, args)
    assert data["totals"]["in_flight_per_layer"] == per_layer
    assert data["totals"]["in_flight_between_forward_and_backward"] == 294_801_408
    assert data["derived"]["moe_layers_in_flight"] == 4
    assert cli.main(args) == 0
    table = capsys.readouterr().out
    assert f"{'held forward to backward, 4 MoE layers in flight':52}{294_801_408:>16,}" in table
    # Recomputed: one layer at a time.
    for recompute in (
        dict(recompute_granularity="full"),
        dict(recompute_granularity="selective", recompute_modules=("moe",)),
    ):
        one = planner.MoEMemoryConfig(**NCCL_EP32, **recompute)
        assert planner.estimate_config(one, releases=False).in_flight_bytes == per_layer
    # Pipelined: 1F1B and interleaved.
    pp = dict(NCCL_EP32, num_layers=16, pipeline_model_parallel_size=4)
    assert planner.MoEMemoryConfig(**pp).moe_layers_in_flight == 4 * 4
    vpp = planner.MoEMemoryConfig(**pp, virtual_pipeline_model_parallel_size=2)
    assert vpp.moe_layers_in_flight == ((4 - 1) * 2 + (2 - 1) * 4 + 1) * 2 == 22
    assert planner.estimate_config(vpp, releases=False).in_flight_bytes == 22 * per_layer


def test_interleaved_layers_in_flight_with_uneven_chunks():
    """PP 2, VPP 2, 8 layers, MoE at layers 0, 1 and 5: rank 0's chunks hold 2 (layers 0-1) and
    1 (layers 4-5) MoE layers, rank 1's none. Rank 0 warms up (2 - 1) x 2 + (2 - 1) x 2 = 4
    forwards, chunks 0, 0, 1, 1: 2 + 2 + 1 + 1 = 6; then each step a forward (chunks 0, 0, 1,
    1, ...) and a backward (reverse chunks: 1, 1, 0, 0, ...): 6 + 2 = 8, - 1 = 7, + 2 = 9, - 1 =
    8, + 1 = 9, - 2 = 7, + 1 = 8, - 2 = 6, then again: the most is 9."""
    cfg = planner.MoEMemoryConfig(hidden_size=64, num_moe_experts=8, moe_router_topk=2,
                                  num_layers=8, tokens_per_rank=64,
                                  pipeline_model_parallel_size=2,
                                  virtual_pipeline_model_parallel_size=2,
                                  moe_layer_freq=(1, 1, 0, 0, 0, 1, 0, 0))  # fmt: skip
    assert cfg.stage_moe_layers() == [2, 0, 1, 0] and cfg.rank_moe_layers() == [3, 0]
    assert cfg.moe_layers_in_flight == 9


# DeepEP across 2 nodes: EP16 = 2 x 8, H 7168, 256 experts, top-8, 4,096 tokens, 20 SMs (10
# channels), no recompute (the chain: a later layer's graph reaches this layer's combine).
DEEPEP_EP16 = dict(hidden_size=7168, num_moe_experts=256, moe_router_topk=8, num_layers=4,
                   tokens_per_rank=4096, moe_token_dispatcher_type="flex", bf16=True,
                   moe_flex_dispatcher_backend="deepep", expert_model_parallel_size=16)  # fmt: skip


def test_deepep_internode_handle_worked_by_hand():
    """Past 8 ranks DeepEP dispatches internode and its handle, which FusedCombine's ctx keeps
    (fused_a2a.py:186), is the 10 tensors of deep_ep/buffer.py:589-592 (deep_ep.cpp:394, 948-951,
    1005-1009 at DEEP_EP_COMMIT), not the intranode 6-tuple. At DEEPEP_EP16 (N = 2 RDMA ranks,
    C = 10): R = ceil(4096 x 16 x (1 - C(240, 8) / C(256, 8))) = 26,720 tokens received, R_rdma
    = ceil(4096 x 2 x (1 - C(128, 8) / C(256, 8))) = 8,164 received over RDMA for the node:
    is_token_in_rank 4096 x 16, rdma_channel_prefix_matrix 2 x 10 x 4, gbl_channel_prefix_matrix
    16 x 10 x 4, recv_rdma_channel_prefix_matrix 2 x 10 x 4, recv_rdma_rank_prefix_sum 2 x 4,
    recv_gbl_channel_prefix_matrix 16 x 10 x 4, recv_gbl_rank_prefix_sum 16 x 4, recv_src_meta
    R x 8, send_rdma_head 4096 x 2 x 4, send_nvl_head R_rdma x 8 x 4 = 574,824 B per layer (the
    intranode tuple priced before: 16 x 16 x 4 + 2 x 16 x 10 x 4 + R x 4 + 4096 x 16 + 4096 x 16
    x 4 = 436,864)."""
    import math

    r = math.ceil(4096 * 16 * (1 - math.comb(240, 8) / math.comb(256, 8)))
    rr = math.ceil(4096 * 2 * (1 - math.comb(128, 8) / math.comb(256, 8)))
    assert (r, rr) == (26_720, 8_164)
    want = {
        "is_token_in_rank [T, G] bool": 4096 * 16,
        "rdma_channel_prefix_matrix [N, C] int32": 2 * 10 * 4,
        "gbl_channel_prefix_matrix [G, C] int32": 16 * 10 * 4,
        "recv_rdma_channel_prefix_matrix [N, C] int32": 2 * 10 * 4,
        "recv_rdma_rank_prefix_sum [N] int32": 2 * 4,
        "recv_gbl_channel_prefix_matrix [G, C] int32": 16 * 10 * 4,
        "recv_gbl_rank_prefix_sum [G] int32": 16 * 4,
        "recv_src_meta [R, 8] uint8": r * 8,
        "send_rdma_head [T, N] int32": 4096 * 2 * 4,
        "send_nvl_head [R_rdma, 8] int32": rr * 8 * 4,
    }
    shape = planner.layer_shape(planner.MoEMemoryConfig(**DEEPEP_EP16))
    chain = planner.retained_chain_terms(shape, "flex", "deepep")
    assert {t.name: t.nbytes for t in chain} == {f"handle: {k}": v for k, v in want.items()}
    assert sum(want.values()) == 574_824
    assert 16 * 16 * 4 + 2 * 16 * 10 * 4 + r * 4 + 4096 * 16 + 4096 * 16 * 4 == 436_864
    assert all(t.where == planner.ALLOCATOR and "deep_ep.cpp:" in t.source for t in chain)
    # The unpatched tree keeps it for every MoE layer but the last; the patched tree none.
    est = planner.estimate_config(planner.MoEMemoryConfig(**DEEPEP_EP16), releases=False)
    assert planner.total(est.dispatcher_state_chain) == 574_824
    assert est.dispatcher_state_bytes == 4 * est.dispatcher_state_bytes_per_layer + 3 * 574_824
    # One node (EP8) keeps the intranode tuple: R = ceil(4096 x 8 x (1 - C(224, 8) / C(256, 8))).
    r8 = math.ceil(4096 * 8 * (1 - math.comb(224, 8) / math.comb(256, 8)))
    one = planner.layer_shape(
        planner.MoEMemoryConfig(**dict(DEEPEP_EP16, expert_model_parallel_size=8))
    )
    intranode = planner.total(planner.retained_chain_terms(one, "flex", "deepep"))
    assert intranode == 8 * 8 * 4 + 2 * 8 * 10 * 4 + r8 * 4 + 4096 * 8 + 4096 * 8 * 4


def test_the_plan_names_the_commits_it_models(capsys):
    """The table's second line and --json name the commit of each library the planner was read
    at (docs/planner.md sets them beside megatron's pins)."""
    commits = {
        "deep_ep hybrid-ep": "94a9f8f6b146c07d97ec58f67cd6d303296d6098",
        "deep_ep main": "dd758caf451848bd150e1046af3d0a73e5fff38d",
        "DeepEP v2 epv2-release": "018f21ea62c6c2888d9b46806aad6d90b399b23d",
        "TransformerEngine": "d0067d0da6cb01811b8072a7d304f0e00344ce2b",
        "NCCL EP nccl-extensions": "9f47d6eb3b60962d8157a579b4caaaa4ae6b19f4",
    }
    assert planner.MODELLED_COMMITS == commits
    data, _ = _plan_json(capsys, OK + ["--seq-length", "8"])
    assert data["modelled_commits"] == commits
    assert data["derived"]["transformer_engine_commit"] == commits["TransformerEngine"]
    assert cli.main(OK + ["--seq-length", "8"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        "modelled at: deep_ep hybrid-ep 94a9f8f, deep_ep main dd758ca, DeepEP v2 epv2-release "
        "018f21e, TransformerEngine d0067d0, NCCL EP nccl-extensions 9f47d6e"
    )
