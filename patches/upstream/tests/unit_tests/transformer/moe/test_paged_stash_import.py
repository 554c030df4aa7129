# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""The pipeline schedules, and so the MoE paged stash, import without Triton.

``pipeline_parallel/schedules.py`` imports ``moe/paged_stash.py`` unconditionally, which used to
import its Triton kernels unconditionally, so ``import megatron.core.pipeline_parallel`` failed
wherever Triton is absent. Only enabling the stash needs Triton: ``paged_stash_reset(enabled=True)``
must then raise an ImportError that names it.

The test imports the two modules again with Triton made unimportable (``sys.modules`` maps it to
None, so ``import triton`` raises ModuleNotFoundError), then puts every module back as it was.
"""

import importlib
import sys

import pytest

# Imported again without Triton: the kernels, the stash that imports them, the schedules that
# import the stash.
RELOADED = (
    "megatron.core.transformer.moe.ops.paged_stash",
    "megatron.core.transformer.moe.paged_stash",
    "megatron.core.pipeline_parallel.schedules",
)


@pytest.fixture
def without_triton(monkeypatch):
    """Triton unimportable, and RELOADED not yet imported; sys.modules restored afterwards."""
    for name in RELOADED:
        importlib.import_module(name.rsplit(".", 1)[0])  # the parent packages stay
    saved = dict(sys.modules)
    for name in [n for n in sys.modules if n == "triton" or n.startswith("triton.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "triton", None)
    for name in RELOADED:
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield
    monkeypatch.undo()
    sys.modules.clear()
    sys.modules.update(saved)


def test_schedules_import_without_triton_and_paged_stash_names_it(without_triton):
    try:
        importlib.import_module("megatron.core.pipeline_parallel.schedules")
    except ImportError as exc:
        pytest.fail(
            f"megatron.core.pipeline_parallel.schedules does not import without Triton: {exc}"
        )
    paged_stash = sys.modules["megatron.core.transformer.moe.paged_stash"]
    with pytest.raises(ImportError, match="(?i)triton"):
        paged_stash.paged_stash_reset(enabled=True)
