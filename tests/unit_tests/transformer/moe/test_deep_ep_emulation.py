# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The CPU deep_ep emulation against a reference written from the kernels' documented semantics.

Kernel checks run on real gloo ranks (world sizes 1, 2 and 4; DeepEP from 2) inside the
session's batched jobs; each check becomes one test here. Inputs are small integers, so every
comparison is ``torch.equal`` whatever the summation order.
"""

import sys
import types

import pytest

from cpu_runtime.compat import EMULATION_MODULE, load_deep_ep_emulation

JOB = "tests.unit_tests.transformer.moe.cpu_jobs:emulation_and_layer_job"
BREAK_JOB = "tests.unit_tests.transformer.moe.cpu_jobs:breakage_job"


def _kernel_verdicts(dist_job, tree, world):
    results = dist_job(JOB, world, tree, tree_kind="patched")
    return {name: [r[name] for r in results] for name in results[0] if "-kernel-" in name}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_kernels_match_reference(dist_job, patched_tree, world):
    """HybridEP at every world size, DeepEP from 2: layout, tokens, probs, combine, replay,
    padding, static budget and overflow, on every rank."""
    verdicts = _kernel_verdicts(dist_job, patched_tree, world)
    assert any(n.startswith("hybridep-kernel") for n in verdicts)
    assert any(n.startswith("deepep-kernel") for n in verdicts) == (world > 1)
    failed = {
        f"{name}@rank{rank}": detail
        for name, per_rank in verdicts.items()
        for rank, (ok, detail) in enumerate(per_rank)
        if not ok
    }
    assert not failed, failed


@pytest.mark.parametrize(
    "how", ["swap_rows", "drop_padding", "no_overflow_flag", "deepep_drop_last_rank"]
)
def test_checks_catch_a_broken_emulation(dist_job, patched_tree, how):
    """Each deliberate breakage makes some kernel or layer check fail (or a rank raise)."""
    from cpu_runtime.launcher import DistributedTestError

    try:
        results = dist_job(BREAK_JOB, 2, patched_tree, how=how)
    except DistributedTestError:
        return
    failed = [name for r in results for name, (ok, _) in r.items() if not ok]
    assert failed, f"breakage {how!r} went unnoticed by {len(results[0])} checks"


@pytest.fixture
def emulation(monkeypatch):
    """The emulation module with deep_ep entries of sys.modules restored afterwards."""
    for name in ("deep_ep", "deep_ep.utils"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return load_deep_ep_emulation()


def test_install_registers_deep_ep(emulation, monkeypatch):
    monkeypatch.delitem(sys.modules, "megatron.core.transformer.moe.fused_a2a", raising=False)
    monkeypatch.setattr(emulation, "_real_deep_ep_importable", lambda: False)
    module = emulation.install()
    try:
        import deep_ep
        from deep_ep import Buffer, HybridEPBuffer
        from deep_ep.utils import EventHandle, EventOverlap

        assert deep_ep is module is sys.modules[EMULATION_MODULE]
        assert HybridEPBuffer is emulation.HybridEPBuffer and Buffer is emulation.Buffer
        EventOverlap(EventHandle()).current_stream_wait()
    finally:
        emulation.uninstall()
    assert "deep_ep" not in sys.modules


def test_install_refuses_to_shadow_real_deep_ep(emulation, monkeypatch):
    monkeypatch.delitem(sys.modules, "megatron.core.transformer.moe.fused_a2a", raising=False)
    monkeypatch.setitem(sys.modules, "deep_ep", types.ModuleType("deep_ep"))
    with pytest.raises(RuntimeError, match="real deep_ep"):
        emulation.install()
    assert not getattr(sys.modules["deep_ep"], "IS_CPU_EMULATION", False)
    monkeypatch.delitem(sys.modules, "deep_ep")
    monkeypatch.setattr(emulation, "_real_deep_ep_importable", lambda: True)
    assert emulation.install(force=True) is emulation
    emulation.uninstall()


def test_install_refuses_after_megatron_bound_the_kernels(emulation, monkeypatch):
    monkeypatch.setitem(
        sys.modules, "megatron.core.transformer.moe.fused_a2a", types.ModuleType("fused_a2a")
    )
    with pytest.raises(RuntimeError, match="already imported"):
        emulation.install()
    assert "deep_ep" not in sys.modules


def test_loading_the_emulation_does_not_import_megatron(emulation):
    assert emulation.IS_CPU_EMULATION
    assert "deep_ep" not in sys.modules


def test_buffers_allocate_their_documented_size(monkeypatch):
    """The emulated buffers hold their real size in one counted tensor: HybridEP's by DeepEP's
    hybrid-ep rule (rows padded to max(T, 512) and the combine chunk; tokens, probs, routing
    map, scaling factors), DeepEP's as the NVLink + RDMA bytes megatron-core asks for."""
    emu = load_deep_ep_emulation()
    # The rule's worked example: T=1000 -> 1024 rows, group 2, H=2048, E=256 expert columns.
    assert emu.hybrid_ep_buffer_bytes(1000, 2048, 128, 2) == 11_141_120
    assert emu.hybrid_ep_buffer_bytes(1, 64, 4, 2) == emu.hybrid_ep_buffer_bytes(512, 64, 4, 2)
    assert emu.hybrid_ep_buffer_bytes(513, 64, 4, 1) == 576 * (128 + 20 + 4)
    monkeypatch.setenv("NUM_OF_TOKENS_PER_CHUNK_COMBINE_API", "128")
    assert emu.hybrid_ep_buffer_bytes(513, 64, 4, 1) == 640 * (128 + 20 + 4)
    monkeypatch.delenv("NUM_OF_TOKENS_PER_CHUNK_COMBINE_API")
    buf = emu.HybridEPBuffer(None, 64, 100, 4)
    assert buf.memory.nbytes == buf.nbytes == emu.hybrid_ep_buffer_bytes(100, 64, 4, 1)
    assert emu.Buffer(None, 4096, 1024).memory.nbytes == 5120
