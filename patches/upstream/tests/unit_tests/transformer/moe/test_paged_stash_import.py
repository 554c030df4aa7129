# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""The pipeline schedules, and so the MoE paged stash, import without Triton.

``pipeline_parallel/schedules.py`` imports ``moe/paged_stash.py`` unconditionally, which used to
import its Triton kernels unconditionally, so ``import megatron.core.pipeline_parallel`` failed
wherever Triton is absent. Only enabling the stash needs Triton: ``paged_stash_reset(enabled=True)``
must then raise an ImportError that names it.

The test imports the schedules, the stash and its kernels again with Triton made unimportable
(``sys.modules`` maps it to None, so ``import triton`` raises ModuleNotFoundError), then puts
every module back as it was, in ``sys.modules`` and as its package's attribute.
"""

import importlib
import sys

import pytest

SCHEDULES = "megatron.core.pipeline_parallel.schedules"


def _reimported(name: str) -> bool:
    """Whether ``name`` is imported again without Triton: the schedules, the stash and its
    kernels (wherever a branch keeps them)."""
    return name == SCHEDULES or (name.startswith("megatron.") and "paged_stash" in name)


def _drop_module(monkeypatch, name: str) -> None:
    """Drop ``name`` from sys.modules and from its parent package's attributes (where an import
    binds a submodule), both restored by ``monkeypatch.undo()``."""
    parent, _, child = name.rpartition(".")
    package = sys.modules.get(parent)
    if package is not None and hasattr(package, child):
        monkeypatch.setattr(package, child, getattr(package, child))
    monkeypatch.delitem(sys.modules, name)


def _without_triton(monkeypatch):
    """Triton unimportable and the modules to import again dropped; sys.modules and the parent
    packages' attributes restored afterwards."""
    importlib.import_module(SCHEDULES)  # imports the stash (and its kernels) as it is
    saved = dict(sys.modules)
    for name in list(sys.modules):
        if name == "triton" or name.startswith("triton.") or _reimported(name):
            _drop_module(monkeypatch, name)
    monkeypatch.setitem(sys.modules, "triton", None)
    yield
    monkeypatch.undo()  # the dropped modules, their packages' attributes and Triton back
    for name in set(sys.modules) - set(saved):  # what the test imported again goes
        del sys.modules[name]


@pytest.fixture
def without_triton(monkeypatch):
    yield from _without_triton(monkeypatch)


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


def test_the_fixture_puts_every_module_back(monkeypatch):
    """After the Triton-less imports, ``from ... import paged_stash`` (a package attribute)
    and ``sys.modules`` give the modules the process had before."""
    from megatron.core.transformer import moe

    importlib.import_module(SCHEDULES)
    before = (sys.modules[SCHEDULES], moe.paged_stash)
    fixture = _without_triton(monkeypatch)
    next(fixture)
    importlib.import_module(SCHEDULES)
    assert moe.paged_stash is not before[1]  # imported again without Triton
    with pytest.raises(StopIteration):
        next(fixture)
    from megatron.core.transformer.moe import paged_stash

    assert (sys.modules[SCHEDULES], paged_stash) == before
