# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The memory report on each flex backend a tree has (``memory_report.py --backend``, choices
from the backend registry): the report's worker (real GPTModel, full recompute, EP=2, AdamW)
runs DeepEP v2 and NCCL EP in bf16 (their kernels take bf16 payloads only), each MoE layer's
dispatcher state is released after the step and training stays bitwise equal to the unpatched
megatron-core; a backend a tree lacks is one line, exit 2."""

import pytest

from moe_release import backends
from moe_release.report import cli

BACKENDS = [pytest.param(b, marks=[pytest.mark.flex_backend(b)]) for b in backends.ONLY_SOME_TREES]


def _cfg(backend: str) -> dict:
    multiple = backends.get(backend).hidden_multiple
    hidden = -(-cli.QUICK["hidden"] // multiple) * multiple
    return dict(cli.QUICK, steps=2, backend=backend, hidden=hidden)


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_backend_releases_its_state_and_trains_bitwise(base_tree, patched_tree, backend):
    from moe_release.runtime.measure import cpu_memory

    cpu_memory.build()
    runs = cli.measure(base_tree, patched_tree, _cfg(backend))
    for rank, (base, patched) in enumerate(zip(runs["base"], runs["patched"])):
        held_base, held_patched = base["dispatcher_held_bytes"], patched["dispatcher_held_bytes"]
        assert len(held_base) == len(held_patched) == cli.QUICK["layers"]
        assert all(b > 0 for b in held_base), f"rank {rank}: base holds {held_base}"
        assert held_patched == [0] * len(held_patched), f"rank {rank}: {held_patched}"
    eq = runs["bitwise"]
    assert eq["losses"] and eq["mismatched"] == [] and eq["tensors_equal"] > 0, eq


def test_a_backend_the_tree_lacks_is_one_line(tmp_path, monkeypatch, capsys, patched_tree):
    """A base tree without the backend (here: one without megatron-core's config at all) stops
    the report before any run, naming the tree and what it has."""
    monkeypatch.setenv("MOE_RELEASE_BASE_TREE", str(tmp_path))
    monkeypatch.setenv("MOE_RELEASE_TREE", patched_tree)
    code = cli.main(["--quick", "--no-sweep", "--device", "cpu", "--backend", "deepep"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1] == (
        f"memory_report: --backend deepep: the base tree ({tmp_path}) has no such flex backend "
        "(it has none)"
    )


def test_every_registered_backend_is_a_choice(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--backend", "nope"])
    assert exc.value.code == 2
    choices = ", ".join(repr(name) for name in backends.NAMES)
    assert f"(choose from {choices})" in capsys.readouterr().err
