# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""megatron-core's real flex dispatcher and MoELayer on CPU against the dense oracle.

MoEFlexTokenDispatcher (edge-case routing: an expert with no token, a rank sending only to
rank 0, a rank receiving nothing) and a full MoELayer with the real TopKRouter, plain and
inside tensor_parallel.checkpoint, must match the oracle bitwise in outputs and in gradients
of input, router (or probabilities) and experts, on every rank.
"""

import pytest

JOB = "tests.unit_tests.transformer.moe.cpu_jobs:emulation_and_layer_job"

CASES = [
    (1, "hybridep"),
    (2, "hybridep"),
    (4, "hybridep"),
    (2, "deepep"),  # DeepEP's manager needs TP x EP > 1.
    (4, "deepep"),
]


def _failures(results, prefix):
    names = [n for n in results[0] if n.startswith(prefix)]
    assert names, f"no checks named {prefix}*"
    return names, {
        f"{name}@rank{rank}": r[name][1]
        for name in names
        for rank, r in enumerate(results)
        if not r[name][0]
    }


@pytest.mark.parametrize("world,backend", CASES)
@pytest.mark.parametrize("mode", ["plain", "checkpoint"])
def test_moe_layer_matches_oracle(dist_job, patched_tree, world, backend, mode):
    results = dist_job(JOB, world, patched_tree, tree_kind="patched")
    names, failed = _failures(results, f"layer-{backend}-{mode}-")
    assert any(n.endswith("router_grad") for n in names)
    assert not failed, failed


@pytest.mark.parametrize("world,backend", CASES)
def test_flex_dispatcher_matches_oracle(dist_job, patched_tree, world, backend):
    results = dist_job(JOB, world, patched_tree, tree_kind="patched")
    _, failed = _failures(results, f"dispatcher-{backend}-")
    assert not failed, failed


def test_moe_layer_with_compiled_dispatch_preprocess(dist_job, patched_tree):
    """The same checks with megatron's jit_fuser (torch.compile) left on, at EP=2."""
    results = dist_job(JOB, 2, patched_tree, torch_compile=True, tree_kind="patched")
    _, failed = _failures(results, "layer-hybridep-")
    assert not failed, failed


def test_cpu_rng_shim_recomputes_dropout_bitwise(dist_job, patched_tree):
    """Dropout (default and tracker-forked) inside checkpoint reproduces outputs and grads."""
    results = dist_job(JOB, 1, patched_tree, tree_kind="patched")
    _, failed = _failures(results, "rng-")
    assert not failed, failed


def test_no_cuda_shims_under_the_placement_rules(dist_job, patched_tree):
    """Under the rules the dispatcher path's CUDA-only allocations are the emulated GPU's: no
    shim is installed for them."""
    results = dist_job(JOB, 1, patched_tree, tree_kind="patched")
    _, failed = _failures(results, "compat-patched-")
    assert not failed, failed


def test_base_tree_runs_with_narrow_shims(dist_job, base_tree, monkeypatch):
    """Without the placement rules (``MOE_RELEASE_PLACEMENT=0``) the over_budget and
    router-device shims are installed, and the pristine base's layers run with them."""
    monkeypatch.setenv("MOE_RELEASE_PLACEMENT", "0")
    results = dist_job(JOB, 2, base_tree, tree_kind="base")
    _, failed = _failures(results, "compat-base-")
    assert not failed, failed
    _, failed = _failures(results, "layer-")
    assert not failed, failed
