# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""A GPTModel with a multi-token-prediction layer (mtp_num_layers=1): the MTP layer's own MoE
layer releases its dispatcher state like the decoder's, and training stays bitwise equal to the
unpatched megatron-core. Runs the memory report's worker (real GPTModel, full recompute, EP=2,
AdamW) on both trees; the same figures come from
``python scripts/memory_report.py --quick --no-sweep --mtp-layers 1``."""

import pytest

from moe_release.report import cli

CFG = dict(cli.QUICK, steps=2, mtp_layers=1)


@pytest.fixture(scope="module")
def runs(base_tree, patched_tree):
    from moe_release.runtime.measure import cpu_memory

    cpu_memory.build()
    return cli.measure(base_tree, patched_tree, dict(CFG))


def test_mtp_moe_layer_is_released(runs):
    for rank, (base, patched) in enumerate(zip(runs["base"], runs["patched"])):
        held_base, held_patched = base["dispatcher_held_bytes"], patched["dispatcher_held_bytes"]
        # The decoder's MoE layers and the MTP layer's.
        assert len(held_base) == len(held_patched) == CFG["layers"] + 1
        assert all(b > 0 for b in held_base), f"rank {rank}: base holds {held_base}"
        assert held_patched == [0] * len(held_patched), f"rank {rank}: {held_patched}"


def test_mtp_training_is_bitwise_equal_to_base(runs):
    eq = runs["bitwise"]
    assert eq["losses"] and eq["grad_norms"], eq
    assert eq["mismatched"] == [] and eq["tensors_equal"] > 0
