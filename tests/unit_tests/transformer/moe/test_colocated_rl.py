# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The loop colocated RL frameworks run, on every flex backend: a training step, every
communication buffer released (``reset_fused_a2a_buffers()``), another workload allocating the
bytes that freed (a rollout engine on the same GPU), then the next training step re-creating the
buffers, bitwise equal to the same two steps without the release.

The loop is the memory report's (``moe_release.report.colocated_section``), so what these tests
check is what the report prints. megatron-core's real MoELayer on CPU gloo ranks, the backend's
kernels emulated with their buffers allocated through the counted allocator. What the release frees
is compared with the memory planner's prediction, a check of the planner: every emulation sizes its
buffers from its own reading of the kernels' source, and for HybridEP and DeepEP the planner's terms
are compared with the emulation's one by one. DeepEP v2 exists on dev only, NCCL EP from 0.19 (their
cases are deselected elsewhere).
"""

import sys

import pytest

from moe_release import backends
from moe_release.report import colocated_section

BACKENDS = [
    pytest.param(b, marks=[pytest.mark.flex_backend(b)] if b in backends.ONLY_SOME_TREES else [])
    for b in colocated_section.BACKENDS
]
# The emulations that list their allocations term by term (the backends the report prices).
LISTED = backends.ACCOUNTED


@pytest.mark.parametrize("backend", BACKENDS)
def test_release_for_a_colocated_rollout(dist_job, patched_tree, backend):
    """Released, the buffers free what the planner predicts (device and pinned host, less
    what the kernel's destroy leaks: DeepEP's RDMA receive counter, NCCL EP's device
    communicator), term by term where the emulation lists its terms; the rollout fits in what
    they freed; the next step re-creates them and both steps are bitwise those of the run
    without the release."""
    row = colocated_section.measure_backend(dist_job, patched_tree, backend)
    listed = backend in LISTED
    for rank, (freed, predicted) in enumerate(zip(row["freed"], row["predicted"])):
        mismatches = row["mismatches"][rank]
        assert (mismatches is not None) == listed, mismatches
        assert not mismatches, f"rank {rank}: {mismatches}"
        assert freed > 0 and freed == predicted, f"rank {rank}: {freed}, {predicted}"
    assert all(n <= 0 for n in row["rollout_over_training"]), row["rollout_over_training"]
    assert row["bitwise"]
    print(f"\n{backend}: the release frees {row['freed'][0]:,} bytes per rank", file=sys.stderr)


def test_report_rows(dist_job, patched_tree):
    """The report prints a row per backend: the bytes freed and the planner's, or n/a where
    the tree has no such backend."""
    has = backends.available(patched_tree)
    section = {
        b: colocated_section.measure_backend(dist_job, patched_tree, b) if b in has else None
        for b in colocated_section.BACKENDS
    }
    text = "\n".join(colocated_section.lines(section, "0.19.2"))
    for backend, row in section.items():
        (line,) = [x for x in text.splitlines() if x.startswith(backend + " ")]
        if row is None:
            assert "n/a" in line and "not on 0.19.2" in line
        else:
            assert f"{row['freed'][0]:,}" in line and "bitwise" in line
            listed = backend in LISTED
            assert "DIFFER" not in line and ("agree (every term)" in line) == listed, line
