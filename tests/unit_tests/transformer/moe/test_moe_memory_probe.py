# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The retained-state probe on the unpatched base: HybridEP managers pin last step's graph.

After forward and backward of a 3-layer checkpointed MoE stack at EP=2, every layer's
_HybridEPManager still references routing_map, token_probs, dispatched_probs (and the dispatch
handle through the graph). The probe must name what that pins (the checkpoint input, its
.grad, router probabilities, the handle) and the allocator must give bytes back when those
references are dropped. Numbers are measured and printed, not asserted.
"""

JOB = "tests.unit_tests.transformer.moe.cpu_jobs:memory_probe_job"


def test_probe_shows_retention_on_base(dist_job, base_tree):
    results = dist_job(JOB, 2, base_tree)
    for rank, result in enumerate(results):
        print(f"--- rank {rank} ---\n{result['text']}")
        assert len(result["layers"]) == 3
        for layer in result["layers"]:
            assert layer["manager"] == "_HybridEPManager"
            direct = set(layer["direct"])
            assert {"manager.token_probs", "manager.dispatched_probs"} <= direct, direct
            kinds = layer["by_kind"]
            # The recomputed checkpoint input is a leaf the graph holds, with its .grad.
            for kind in ("input leaf", "leaf .grad", "dispatch handle"):
                assert kinds.get(kind, 0) > 0, (layer["name"], kinds)
            # The allocator really gets memory back when the manager lets go.
            assert layer["release_bytes"] > 0, layer
