# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""The pipeline schedules, and so the MoE paged stash, import without Triton.

``pipeline_parallel/schedules.py`` imports ``moe/paged_stash.py`` unconditionally, which used to
import its Triton kernels unconditionally, so ``import megatron.core.pipeline_parallel`` failed
wherever Triton is absent. Only enabling the stash needs Triton: ``paged_stash_reset(enabled=True)``
must then raise an ImportError that names it.

The test imports the schedules, the stash and its kernels again with Triton made unimportable
(``sys.modules`` maps it to None, so ``import triton`` raises ModuleNotFoundError), then puts
every module back as it was.
"""

import importlib
import sys

import pytest

SCHEDULES = "megatron.core.pipeline_parallel.schedules"


def _reimported(name: str) -> bool:
    """Whether ``name`` is imported again without Triton: the schedules, the stash and its
    kernels (wherever a branch keeps them)."""
    return name == SCHEDULES or (name.startswith("megatron.") and "paged_stash" in name)


@pytest.fixture
def without_triton(monkeypatch):
    """Triton unimportable and the modules to import again dropped; sys.modules restored
    afterwards."""
    importlib.import_module(SCHEDULES)  # imports the stash (and its kernels) as it is
    saved = dict(sys.modules)
    for name in list(sys.modules):
        if name == "triton" or name.startswith("triton.") or _reimported(name):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "triton", None)
    yield
    monkeypatch.undo()  # the dropped modules and Triton back
    for name in set(sys.modules) - set(saved):  # what the test imported again goes
        del sys.modules[name]


def test_schedules_import_without_triton_and_paged_stash_names_it(without_triton):
    try:
        importlib.import_module(SCHEDULES)
    except ImportError as exc:
        pytest.fail(
            f"megatron.core.pipeline_parallel.schedules does not import without Triton: {exc}"
        )
    paged_stash = sys.modules["megatron.core.transformer.moe.paged_stash"]
    with pytest.raises(ImportError, match="(?i)triton"):
        paged_stash.paged_stash_reset(enabled=True)
