# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The CPU deep_ep emulation against a reference written from the kernels' documented semantics.

Kernel checks run on real gloo ranks (world sizes 1, 2 and 4; DeepEP from 2) inside the
session's batched jobs; each check becomes one test here. Inputs are small integers, so every
comparison is ``torch.equal`` whatever the summation order.
"""

import sys
import types

import pytest

from moe_release.runtime.kernels.install import EMULATION_MODULE, load_deep_ep_emulation

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
    from moe_release.runtime.ranks.launcher import DistributedTestError

    try:
        results = dist_job(BREAK_JOB, 2, patched_tree, how=how)
    except DistributedTestError:
        return
    failed = [name for r in results for name, (ok, _) in r.items() if not ok]
    assert failed, f"breakage {how!r} went unnoticed by {len(results[0])} checks"


@pytest.fixture
def emulation(monkeypatch):
    """The emulation module with deep_ep entries of sys.modules restored afterwards."""
    for name in ("deep_ep", "deep_ep.utils", "hybrid_ep_cpp"):
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
        import hybrid_ep_cpp  # a hybrid-ep build's extension, imported by main 2026-05 (#4719)

        assert (
            hybrid_ep_cpp.ExtendedMemoryAllocator
            is emulation.hybridep_emulation.ExtendedMemoryAllocator
        )
    finally:
        emulation.uninstall()
    assert "deep_ep" not in sys.modules and "hybrid_ep_cpp" not in sys.modules


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
    """The emulated buffers hold their real size in one counted tensor, the emulation's own
    reading of deep_ep's source (its ``[hybridep buffer]`` and ``[deepep buffer]`` tables):
    HybridEP's for rows max(T, 512) rounded to the combine chunk (by hand, on local rank 1:
    2,048 x (2 x 2048 + 4 x 256 + 4 x 16 + 256) + chunk flags 256 + scratch 108 x 130 x 8 +
    576 small; local rank 0 holds three 8-byte flags more), DeepEP's NVLink + RDMA bytes with
    its barrier block and the 32 MiB workspace."""
    emu = load_deep_ep_emulation()
    assert emu.hybrid_ep_buffer_bytes(1024, 2048, 128, 2, local_rank=1) == 11_254_272
    assert emu.hybrid_ep_buffer_bytes(1024, 2048, 128, 2, local_rank=0) == 11_254_272 + 24
    for tokens, chunk, rows in [(1, "64", 512), (513, "64", 576), (513, "128", 640)]:
        monkeypatch.setenv("NUM_OF_TOKENS_PER_CHUNK_COMBINE_API", chunk)
        buf = emu.HybridEPBuffer(None, 64, tokens, 4)
        assert buf.rows == rows
        assert buf.memory.nbytes == buf.nbytes == emu.hybrid_ep_buffer_bytes(rows, 64, 4, 1, 0)
        assert buf.nbytes == sum(t.nbytes for t in buf.terms)
    monkeypatch.delenv("NUM_OF_TOKENS_PER_CHUNK_COMBINE_API")
    assert emu.Buffer(None, 4096, 1024).memory.nbytes == 4096 + 160 + 32 * 1024 * 1024 + 1024


def test_hybridep_memory_goes_with_its_runtime():
    """The real HybridEPBuffer's memory is its C++ ``runtime``'s (hybrid_ep_buffer.py:101-111,
    hybrid_ep.cu:75-90): dropping ``runtime`` frees it while the Python object is still
    referenced, and any later dispatch or combine raises, as ``self.runtime.<call>`` would."""
    import gc

    import torch

    from moe_release.runtime.measure import cpu_memory

    emu = load_deep_ep_emulation()
    cpu_memory.install()
    gc.collect()
    before = cpu_memory.settled()
    buf = emu.HybridEPBuffer(None, 64, 16, 4)
    held = cpu_memory.settled() - before
    assert held == buf.nbytes > 0
    buf.runtime = None
    gc.collect()
    assert cpu_memory.settled() == before and buf.memory is None
    with pytest.raises(AttributeError, match="no attribute 'dispatch_with_permute'"):
        buf.dispatch_with_permute(hidden=torch.zeros(16, 64))
    with pytest.raises(AttributeError, match="no attribute 'combine_with_unpermute'"):
        buf.combine_with_unpermute(hidden=torch.zeros(16, 64), handle=())


def _buffer_table(module) -> list:
    """The (term, source) rows of a module docstring's buffer table (its header's first cell is
    ``term``)."""
    rows, in_table = [], False
    for line in module.__doc__.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|"):
            in_table = False
        elif cells[0] == "term":
            in_table = True
        elif in_table and not set(line) <= set("|-"):
            rows.append((cells[0], cells[-1]))
    return rows


def test_buffer_tables_list_every_term():
    """Each emulation allocates exactly its docstring's buffer table, row for row (name and
    cited source): the table a reader checks against deep_ep is the code that runs."""
    from moe_release.runtime.kernels import deepep_emulation, hybridep_emulation

    terms = hybridep_emulation.hybrid_ep_buffer_terms(512, 256, 4, 2, local_rank=0)
    assert [(t.name, t.source) for t in terms] == _buffer_table(hybridep_emulation)
    rank1 = hybridep_emulation.hybrid_ep_buffer_terms(512, 256, 4, 2, local_rank=1)
    assert {t.name for t in terms} - {t.name for t in rank1} == {
        "combine write-completion flags",
        "dispatch write-completion flags",
        "all-gather NVLink sync flag",
    }
    terms = deepep_emulation.buffer_terms(4096, 1024)
    assert [(t.name, t.source) for t in terms] == _buffer_table(deepep_emulation)
