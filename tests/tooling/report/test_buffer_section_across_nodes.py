# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The memory report across emulated nodes (``scripts/memory_report.py --nodes 2x2``): its
buffer rows are the planner's multi-node terms, byte for byte, against each emulation's own
reading of the kernels' source; what no emulation allocates (HybridEP's DOCA queue pairs, sized
inside DOCA) is named apart. The term check is run on the functions both sides use (cheap, in
the default run); the report itself on 2 x 2 nodes is ``slow`` (about 100 s)."""

import json
import subprocess
import sys

import pytest

from moe_release.plan.pricing import load_planner
from moe_release.report import buffer_section
from moe_release.runtime.kernels import hybridep_emulation as hep
from tests.helpers import REPO_ROOT

# (hidden, experts, tokens per rank): the report's quick shape, one with scaling-factor rows
# (H >= 128 per block) and a larger one.
SHAPES = [(64, 8, 512), (256, 8, 600), (2048, 16, 1024)]


def _planner_terms(backend: str, hidden: int, experts: int, tokens: int, nodes: int, per_node: int,
                   rank: int):  # fmt: skip
    planner = load_planner()
    cfg = dict(backend=backend, hidden=hidden, experts=experts, topk=2, tokens=tokens,
               nodes=[nodes, per_node])  # fmt: skip
    return buffer_section.buffer_prediction(cfg, nodes * per_node, rank), planner


@pytest.mark.parametrize("hidden, experts, tokens", SHAPES)
@pytest.mark.parametrize("rank", [0, 1])
def test_hybridep_buffer_rows_are_the_planners_multi_node_terms(hidden, experts, tokens, rank):
    """2 nodes x 2 ranks: the planner's HybridEP terms (its multi-node RDMA rows included) equal
    the emulation's, allocation by allocation, on both local ranks; the DOCA queue pairs are the
    planner's alone and named so."""
    pred, planner = _planner_terms("hybridep", hidden, experts, tokens, 2, 2, rank)
    rows = planner.hybridep_rows(tokens)
    emulated = hep.hybrid_ep_buffer_terms(rows, hidden, experts // 4, 2, rank, num_of_nodes=2)
    lines = buffer_section.term_check_lines(pred["terms"], emulated)
    assert lines[0] == (
        f"  buffer terms: planner = emulation's reading of deep_ep, {len(emulated)} allocations"
    ), lines
    assert len(lines) == 2 and lines[1].startswith(
        "  planner only (not emulated): DOCA queue pairs (approximate) "
    )
    assert pred["buffer_bytes"] == sum(t.nbytes for t in emulated)
    assert any(t.name.startswith("RDMA ") for t in emulated)  # the multi-node rows are there
    one_node = hep.hybrid_ep_buffer_terms(rows, hidden, experts // 4, 4, rank)
    assert sum(t.nbytes for t in emulated) > sum(t.nbytes for t in one_node)


@pytest.mark.parametrize("hidden", [16, 64, 2048])
def test_deepep_buffer_rows_are_the_planners_multi_node_terms(hidden, monkeypatch):
    """2 nodes x 2 ranks: the buffer megatron-core's get_buffer asks of the emulation (the
    maximum of the dispatch and combine configs' hints, fused_a2a.py) has an RDMA buffer, and
    its terms equal the planner's at ranks_per_node 2 (DeepEP's node: min(ranks_per_node, 8))."""
    from moe_release.runtime.kernels import deepep_emulation as dep

    monkeypatch.setenv("MOE_RELEASE_RANKS_PER_NODE", "2")
    world, hidden_bytes = 4, hidden * 4  # the report's model runs in fp32
    configs = (dep.Buffer.get_dispatch_config(world), dep.Buffer.get_combine_config(world))
    nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, world) for c in configs)
    rdma = max(c.get_rdma_buffer_size_hint(hidden_bytes, world) for c in configs)
    emulated = dep.buffer_terms(nvl, rdma)
    assert rdma > 0 and any(t.name == "RDMA buffer (num_rdma_bytes)" for t in emulated)
    pred, _ = _planner_terms("deepep", hidden, 8, 512, 2, 2, 0)
    assert buffer_section.term_check_lines(pred["terms"], emulated) == [
        f"  buffer terms: planner = emulation's reading of deep_ep, {len(emulated)} allocations"
    ]
    one_node, _ = _planner_terms("deepep", hidden, 8, 512, 1, 4, 0)
    assert not any(t["name"] == "RDMA buffer (num_rdma_bytes)" for t in one_node["terms"])


@pytest.mark.parametrize(
    "ranks, per_node, tokens, hidden, topk",
    [(4, 2, 8, 256, 2), (4, 2, 512, 256, 2), (64, 8, 4096, 7168, 8)],
)
def test_deepep_v2_window_across_nodes_is_the_planners(ranks, per_node, tokens, hidden, topk):
    """DeepEP v2's hybrid layout: the data buffer the emulation sizes (calculate_buffer_size,
    buffer.hpp:529-629) is the planner's, across 2 domains of 2 and 8 of 8 ranks."""
    from moe_release.runtime.kernels import deepepv2_emulation as v2

    planner = load_planner()
    emulated = v2.buffer_size_hint(ranks, tokens, hidden, topk,
                                   num_scaleout_ranks=ranks // per_node)  # fmt: skip
    terms = planner.deepep_v2_buffer_terms(ranks, tokens, hidden, topk, ranks_per_node=per_node)
    data = next(t for t in terms if t.name.startswith("symmetric window: data buffer"))
    assert data.nbytes == emulated
    one = planner.deepep_v2_buffer_terms(ranks, tokens, hidden, topk)
    assert next(t.nbytes for t in one if t.name.startswith("symmetric window: data")) != emulated


@pytest.mark.parametrize(
    "ranks, per_node, experts, tokens, hidden",
    [(4, 2, 4, 8, 64), (4, 2, 8, 512, 64), (64, 8, 256, 4096, 7168)],
)
def test_nccl_ep_gin_buffer_across_nodes_is_the_planners(ranks, per_node, experts, tokens, hidden):
    """NCCL EP's GIN buffer across LSA teams (nccl_ep.cc:1300-1358): the emulation's regions
    sum to the planner's; one team has none."""
    from moe_release.runtime.kernels.ncclep_emulation import sizes

    planner = load_planner()
    emulated = sum(n for _, n in sizes.gin_buffer_terms(ranks, per_node, experts, tokens, hidden))
    assert emulated == planner.nccl_ep_gin_bytes(ranks, per_node, experts, tokens, hidden) > 0
    assert planner.nccl_ep_gin_bytes(ranks, ranks, experts, tokens, hidden) == 0


def test_a_differing_term_is_a_mismatch_not_a_pass():
    """The check can fail: one RDMA row off by a byte is named."""
    pred, planner = _planner_terms("hybridep", 64, 8, 512, 2, 2, 0)
    emulated = hep.hybrid_ep_buffer_terms(planner.hybridep_rows(512), 64, 2, 2, 0, num_of_nodes=2)
    i = next(i for i, t in enumerate(emulated) if t.name.startswith("RDMA combine"))
    emulated[i] = emulated[i]._replace(nbytes=emulated[i].nbytes + 1)
    lines = buffer_section.term_check_lines(pred["terms"], emulated)
    assert lines[0].startswith("  buffer terms MISMATCH: planner: 'rdma combine"), lines


@pytest.mark.slow
def test_the_report_runs_across_nodes(tmp_path):
    """``memory_report.py --nodes 2x2 --quick``: EP=4 over 2 emulated nodes, every rank's buffer
    terms equal the planner's, the series holds no dispatcher state between calls."""
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "scripts/memory_report.py", "--device", "cpu", "--nodes", "2x2",
         "--quick", "--backend", "hybridep", "--out", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    text = (out / "memory_report.txt").read_text()
    assert "EP=4 over 2 emulated nodes of 2 ranks" in text
    assert text.count("buffer terms: planner = emulation's reading of deep_ep") == 4
    report = json.loads((out / "memory_report.json").read_text())
    assert report["config"]["nodes"] == [2, 2] and len(report["patched"]) == 4
