# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Patch 1 ("Let the MoE dispatcher path import and build without CUDA"), without any shim.

Each check runs in a fresh interpreter on the patched tree, where it must pass, and on the
pristine base, where it must fail: Triton absent at import (on a base that lacks the paged stash,
0.16, not checked), and the router's gating linear without Transformer Engine, where the base
leaves ``te_general_gemm`` undefined (0.16). Where the base has neither spot (0.17, whose
series carries no such patch), both trees must import the schedules and the MoE layer without
Triton. The CUDA-only allocations of the dispatcher path are not the patch's: under the CPU
runtime they are the emulated GPU's (moe_release.runtime.cuda.placement).
"""

import os
import subprocess
import sys
import textwrap

import pytest

from moe_release import settings
from moe_release.runtime.ranks.launcher import TOOLS, free_port
from tests.helpers import REPO_ROOT

pytestmark = pytest.mark.backport  # release tests: run against every pinned base

CHECKS = {
    "triton": """
        import sys
        sys.modules["triton"] = None  # as on a host where Triton is not installed
        sys.modules["triton.language"] = None
        import megatron.core.pipeline_parallel  # schedules -> moe.paged_stash
        from megatron.core.transformer.moe import paged_stash
        assert paged_stash.HAVE_TRITON is False
        try:
            paged_stash.paged_stash_reset(enabled=True)
        except ImportError as exc:
            assert "triton" in str(exc).lower()
        else:
            raise AssertionError("enabling the stash without Triton must raise")
        """,
    # Where neither spot exists (0.17), the series carries no CPU-import patch: the base must
    # then import the pipeline schedules and the MoE layer without Triton as it is.
    "nothing_to_fix": """
        import sys
        sys.modules["triton"] = None  # as on a host where Triton is not installed
        sys.modules["triton.language"] = None
        import megatron.core.pipeline_parallel
        import megatron.core.transformer.moe.moe_layer
        """,
    "te_general_gemm": """
        import sys
        sys.modules["transformer_engine"] = None  # as on a host without Transformer Engine
        import torch
        from megatron.core.transformer.moe.moe_utils import router_gating_linear
        x = torch.randn(5, 8, requires_grad=True)
        weight = torch.randn(4, 8, requires_grad=True)
        logits = router_gating_linear(x, weight, None, torch.float32)
        logits.sum().backward()
        assert logits.shape == (5, 4) and x.grad is not None and weight.grad is not None
        """,
}


def _base_source(rel: str) -> str:
    """The text of ``megatron/core/<rel>`` in the base tree under test ("" when absent)."""
    path = os.path.join(settings.base_tree() or "", "megatron", "core", rel)
    if not os.path.isfile(path):
        return ""
    with open(path, encoding="utf-8") as f:
        return f.read()


def _applicable_checks() -> list:
    """The checks whose spot exists in the base under test ("nothing_to_fix" where none
    does; all of them when no base tree is set: the tests then skip)."""
    if not settings.base_tree():
        return sorted(CHECKS)
    moe_utils = _base_source("transformer/moe/moe_utils.py")
    present = {
        "triton": bool(_base_source("transformer/moe/paged_stash.py")),
        # Bound only by the Transformer Engine import before the first function (0.16).
        "te_general_gemm": moe_utils.split("\ndef ", 1)[0].count("te_general_gemm") == 1,
    }
    return sorted(name for name in present if present[name]) or ["nothing_to_fix"]


PRELUDE = """
import os, sys
sys.path[:0] = [{tree!r}, {tools!r}]
from moe_release.runtime.kernels.install import load_deep_ep_emulation
load_deep_ep_emulation().install()
import torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
"""


def _run_all(tree: str) -> dict:
    procs = {}
    for name in _applicable_checks():
        body = CHECKS[name]
        code = PRELUDE.format(tree=tree, tools=str(TOOLS), port=free_port()) + textwrap.dedent(body)
        env = {"PATH": "/usr/bin:/bin", "NO_VCS_VERSION": "1", "OMP_NUM_THREADS": "1",
               "CUDA_VISIBLE_DEVICES": "", "TORCHDYNAMO_DISABLE": "1"}  # fmt: skip
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", code], cwd=str(REPO_ROOT), env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
    out = {}
    try:
        for name, p in procs.items():
            _, err = p.communicate(timeout=120)
            out[name] = (p.returncode, err[-1500:])
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


@pytest.fixture(scope="module")
def patched(patched_tree):
    return _run_all(patched_tree)


@pytest.fixture(scope="module")
def base(base_tree):
    return _run_all(base_tree)


@pytest.mark.parametrize("check", _applicable_checks())
def test_patched_tree_runs_without_cuda(patched, check, request):
    rc, err = patched[check]
    assert rc == 0, err
    if check == "nothing_to_fix":  # passes without the series too: no retention to show
        request.node.user_properties.append(
            ("moe_release", "n/a: the base imports without Triton and Transformer Engine")
        )


@pytest.mark.guard
@pytest.mark.parametrize("check", _applicable_checks())
def test_unpatched_base_fails_the_same_check(base, check):
    rc, err = base[check]
    if check == "nothing_to_fix":
        assert rc == 0, f"the base needs a CPU-import fix its series does not carry:\n{err}"
        return
    assert rc != 0, f"{check} passed on the unpatched base: the test would not catch a regression"
    # The base fails for the reason the patch fixes: the Triton import, or the undefined name.
    expected = {
        "triton": "ModuleNotFoundError: import of triton halted",
        "te_general_gemm": "NameError: name 'te_general_gemm' is not defined",
    }
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert expected[check] in last, err
