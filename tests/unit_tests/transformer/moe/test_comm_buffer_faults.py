# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The fault matrix (docs/fault-matrix.md): the communication buffers' lifecycle when something
goes wrong, per scenario and backend, against the unpatched base's recorded cell.

Each case is one cell of :mod:`moe_release.runtime.megatron.fault_scenarios` on the patched tree:
two rank processes that exit through the interpreter, every collective logged with its context
(:mod:`moe_release.runtime.measure.faults`). The pass rule (``fault_cells.violations``): within
the scenario's bound, exits within theirs, device bytes flat from cycle 1 to 5, no collective from a
finalizer, a garbage collection, an atexit hook after an exception or a backward, no peer wait in
``destroy_model_parallel()`` the base's teardown does not make, nothing kept after an abort but the
current step's buffer, no device barrier timed out, and no figure worse than the base's (golden
values, ``golden_values/fault_matrix_base.json``, recorded from a real run on the base with the
command it names). The default suite runs a case per scenario and backend; the whole product (both
variants of c and g, the base run live beside the tree) is ``slow``. Then the stand-ins the matrix
relies on, each kept honest by a test: the collective log's contexts, DeepEP's and DeepEP v2's
destructors entering their device barrier as the real ones do, the barrier's rendezvous surviving
the process group, and its timeout.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from moe_release import backends
from moe_release.runtime.megatron import fault_cells as fc
from moe_release.runtime.megatron import fault_scenarios as fs

THIS = "tests.unit_tests.transformer.moe.test_comm_buffer_faults"
GOLDEN = Path(__file__).with_name("golden_values") / "fault_matrix_base.json"
# One variant of c and g by default (c2 and g-exc: the ones a GPU job hangs or leaks in).
DEFAULT_SCENARIOS = ("a", "b", "c2", "d", "e", "f", "g-exc", "h", "i", "j", "k", "l", "m", "n")


def _cases(scenarios):
    return [
        pytest.param(
            s,
            b,
            id=f"{s}-{b}",
            marks=[pytest.mark.flex_backend(b)] if b in backends.ONLY_SOME_TREES else [],
        )
        for s in scenarios
        for b in fs.BACKENDS
        if fs.applies(s, b)
    ]


def base_key(tree: str) -> str:
    """The golden values' key of a tree: its base (``0.19.2``, ``main-d98e8a6``, ...)."""
    name = Path(tree).name
    name = name[len("base-") :] if name.startswith("base-") else name
    return name.split("+", 1)[0]


def _golden(tree: str) -> dict:
    data = json.loads(GOLDEN.read_text())
    key = base_key(tree)
    assert key in data["bases"], (
        f"no recorded base cells for {key} in {GOLDEN.name}; record them with: "
        f"{data['command']} --base {key}"
    )
    return data["bases"][key]


def _check(tree: str, scenario: str, backend: str, base: Optional[dict], **layout) -> None:
    """Run the cell (``layout``: run_cell's world and ranks_per_node) and hold it to the pass
    rule against ``base``."""
    cell = fc.run_cell(tree, scenario, backend, **layout)
    assert len(cell["ranks"]) == layout.get("world", fs.WORLD)
    summary = fc.summary(cell)
    bad = fc.violations(scenario, summary, base)
    tails = "\n".join(
        f"--- rank {i} (exit {r['rc']}) ---\n{r['output_tail'][-800:]}"
        for i, r in enumerate(cell["ranks"])
    )
    assert not bad, f"fault cell {scenario}/{backend}: " + "; ".join(bad) + "\n" + tails


@pytest.mark.parametrize("scenario,backend", _cases(DEFAULT_SCENARIOS))
def test_fault_cell(patched_tree, scenario, backend):
    """The cell passes the pass rule and is no worse than the base's recorded cell."""
    golden = _golden(patched_tree)
    key = f"{scenario}/{backend}"
    assert key in golden, f"no recorded base cell {key}"
    _check(patched_tree, scenario, backend, golden[key])


@pytest.mark.slow
@pytest.mark.parametrize("scenario,backend", _cases(fs.SCENARIOS))
def test_fault_cell_against_the_base_run_live(patched_tree, base_tree, scenario, backend):
    """The full product: every scenario (both variants of c and g) and backend, the base's cell
    measured now beside the tree's."""
    base = fc.summary(fc.run_cell(base_tree, scenario, backend))
    _check(patched_tree, scenario, backend, base)


# -- across nodes ------------------------------------------------------------------------------

# The cells of the default run on 2 emulated nodes x 2 ranks: the restart recipe x5 (an agreed
# release over the world and a flat footprint, where every free but HybridEP's is a collective
# over ranks on both nodes) on every flex backend, and a peer on the other node that never
# tears down on the two whose teardown could wait for it.
NODES_DEFAULT = [("d", b) for b in backends.NAMES] + [("c2", "hybridep"), ("c2", "deepep")]


def _node_cases(cells):
    return [
        pytest.param(
            s,
            b,
            id=f"{s}-{b}-2x2",
            marks=[pytest.mark.flex_backend(b)] if b in backends.ONLY_SOME_TREES else [],
        )
        for s, b in cells
        if fs.applies(s, b)
    ]


NODES = {"world": fs.NODES_WORLD, "ranks_per_node": fs.NODES_RANKS_PER_NODE}


@pytest.mark.parametrize("scenario,backend", _node_cases(NODES_DEFAULT))
def test_fault_cell_across_nodes(patched_tree, scenario, backend):
    """On 2 emulated nodes x 2 ranks the cell passes the pass rule (the full product, against
    the base measured live, is ``slow``; docs/fault-matrix.md has both)."""
    _check(patched_tree, scenario, backend, None, **NODES)


@pytest.mark.slow
@pytest.mark.parametrize(
    "scenario,backend",
    _node_cases([(s, b) for s in fs.NODES_SCENARIOS for b in fs.BACKENDS]),
)
def test_fault_cell_across_nodes_against_the_base_run_live(
    patched_tree, base_tree, scenario, backend
):
    """Every scenario that changes across nodes, on every backend, on 2 x 2: no worse than the
    base's cell measured now. Where the base's cell breaks a rule (NCCL EP's ep_finalize in
    upstream's teardown, DeepEP's finalizer frees), the series may break only rules the base
    breaks too (docs/fault-matrix.md names them)."""
    base = fc.summary(fc.run_cell(base_tree, scenario, backend, **NODES))
    theirs = fc.violations(scenario, base, None)
    if not theirs:
        _check(patched_tree, scenario, backend, base, **NODES)
        return
    cell = fc.run_cell(patched_tree, scenario, backend, **NODES)
    ours = fc.violations(scenario, fc.summary(cell), base)
    kind = lambda v: re.sub(r"[\d.,]+|\[.*", "#", v.split(":")[0])  # noqa: E731
    assert {kind(v) for v in ours} <= {kind(v) for v in theirs}, (ours, theirs)


# -- the stand-ins -----------------------------------------------------------------------------


def _entries(op: str):
    from moe_release.runtime.measure import faults

    return [e for e in faults.ENTRIES if e["op"] == op]


def rank_device_barriers():
    """Rank side (2 ranks): DeepEP's and DeepEP v2's buffers built without
    ``explicitly_destroy`` and dropped (their destructors destroy: a device barrier from a
    finalizer); a flagged DeepEP buffer destroyed after its process group was destroyed (the
    barrier does not need it); HybridEP's constructor handle exchange; and a buffer dropped on
    rank 1 alone, whose destructor's barrier times out."""
    import gc
    import time

    import torch.distributed as dist

    from moe_release.runtime.kernels import deepep_module as emu
    from moe_release.runtime.kernels import deepepv2_emulation as v2
    from moe_release.runtime.kernels import hybridep_emulation as hep
    from moe_release.runtime.measure import cpu_memory

    cpu_memory.install()
    out = {}
    world = dist.group.WORLD
    plain = emu.Buffer(world, 4096, 0)
    del plain
    gc.collect()
    out["v1_destructor"] = [(e["context"], e["ranks"]) for e in _entries("deepep destroy barrier")]
    elastic = v2.ElasticBuffer(world, num_max_tokens_per_rank=8, hidden=256, num_topk=2)
    del elastic
    gc.collect()
    out["v2_destructor"] = [
        (e["context"], e["ranks"]) for e in _entries("deepepv2 destroy barrier")
    ]
    group = dist.new_group([0, 1])
    flagged = emu.Buffer(group, 4096, 0, explicitly_destroy=True)
    dist.destroy_process_group(group)
    flagged.destroy()
    out["destroyed_after_abort"] = flagged.runtime is None
    hep.HybridEPBuffer(world, 16, 12, 2)
    out["handle_exchange"] = [e["ranks"] for e in _entries("hybridep handle exchange")]
    os.environ["MOE_RELEASE_DEVICE_BARRIER_TIMEOUT"] = "1.0"
    lonely = emu.Buffer(world, 4096, 0)
    gc.collect()
    before = cpu_memory.settled()
    start = time.monotonic()
    if dist.get_rank() == 1:
        del lonely
        gc.collect()
    out["lonely_s"] = time.monotonic() - start
    out["lonely_kept"] = cpu_memory.settled() - before
    out["leaked_nbytes"] = lonely.nbytes if dist.get_rank() == 0 else None
    dist.barrier()
    if dist.get_rank() == 0:
        lonely.explicitly_destroy = True  # its peer is gone: dropped without a barrier
        lonely.runtime = None
    return out


def test_destructors_enter_the_device_barrier_as_deep_ep_does(dist_job, patched_tree):
    """``Buffer::~Buffer`` without ``explicitly_destroy`` calls ``destroy()``
    (DeepEP 94a9f8f ``csrc/deep_ep.cpp:209-216``), whose ``intranode::barrier`` waits for the
    NVLink peers (``:269-309``), and ``~ElasticBuffer`` does the same (``epv2-release`` 018f21e
    ``csrc/elastic/buffer.hpp:127-141``): the emulated destructors enter that barrier, logged
    from a finalizer; it rendezvouses without the process group (an explicit ``destroy()`` after
    the group was destroyed completes); HybridEP's constructor logs its handle exchange
    (``intranode.cu:300-322``); a destructor whose peer never comes gives up after the bound,
    keeping the bytes, as a GPU traps."""
    for rank, out in enumerate(dist_job(f"{THIS}:rank_device_barriers", 2, patched_tree)):
        assert out["v1_destructor"] == [(["finalizer"], [0, 1])], (rank, out)
        assert out["v2_destructor"] == [(["finalizer"], [0, 1])], (rank, out)
        assert out["destroyed_after_abort"], (rank, out)
        assert out["handle_exchange"] == [[0, 1]], (rank, out)
    r0, r1 = dist_job(f"{THIS}:rank_device_barriers", 2, patched_tree)
    assert 1.0 <= r1["lonely_s"] < 10.0 and r1["lonely_kept"] == 0, r1


CONTEXT_SCRIPT = """
import atexit, gc, sys
import torch
from moe_release.runtime.measure import faults
faults.install()

class Holder:
    def __del__(self):
        print("del", faults.context()[0], flush=True)

class Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2
    @staticmethod
    def backward(ctx, g):
        print("backward", faults.context()[0], flush=True)
        return g * 2

def hook():
    print("atexit", faults.context(), flush=True)

atexit.register(hook)
print("main", faults.context()[0], flush=True)
h = Holder(); del h
cycle = Holder(); cycle.self = cycle; del cycle; gc.collect()
x = torch.ones(2, requires_grad=True); Double.apply(x).sum().backward()
if sys.argv[1] == "raise":
    raise RuntimeError("uncaught")
"""


@pytest.mark.parametrize("how", ["return", "raise"])
def test_the_collective_log_names_each_context(how):
    """The contexts a collective entry carries: none in plain code, ``finalizer`` in a
    ``__del__``, ``gc`` in a collection, ``autograd`` in a backward, ``atexit`` in a hook
    registered after the tagging, with the exception still pending after an uncaught one."""
    tools = str(Path(fs.__file__).resolve().parents[3])
    env = dict(os.environ, PYTHONPATH=tools, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", CONTEXT_SCRIPT, how],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = done.stdout.splitlines()
    assert "main []" in lines, done.stdout + done.stderr
    assert "del ['finalizer']" in lines and "del ['finalizer', 'gc']" in lines, done.stdout
    assert "backward ['autograd']" in lines, done.stdout
    assert f"atexit (['atexit'], {how == 'raise'})" in lines, done.stdout + done.stderr
