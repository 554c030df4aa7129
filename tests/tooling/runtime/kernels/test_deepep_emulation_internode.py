# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""DeepEP v1 (the ``deepep`` flex backend) across emulated nodes: its multi-node path.

With ``MOE_RELEASE_RANKS_PER_NODE=2`` four gloo ranks are 2 nodes of 2, and the emulation takes
deep_ep's internode path as a real job past one node does (DeepEP 94a9f8f): megatron-core's
``get_buffer`` asks an RDMA buffer (``Config.get_rdma_buffer_size_hint`` > 0), whose NVSHMEM job
is the ranks of one local rank on every node; dispatch returns the internode 10-tuple handle; and
``destroy()`` runs the node's intranode barrier, then NVSHMEM's barrier, free and finalize over
that job's ranks, each a bounded rendezvous. Checked here: the buffer's bytes against
``csrc/config.hpp:51-103`` worked by hand, the internode output tables of
``deepep_emulation.Buffer.internode_dispatch``'s docstring row by row (as
``test_deepep_emulation_outputs`` checks the intranode ones), the reference kernel checks of
``cpu_jobs`` on 2 nodes, megatron-core's real MoELayer bitwise equal to the one-node run, the
explicit release's collective log, and a PE that never comes.
"""

import os
import re
from typing import Dict, List

import pytest

from moe_release.runtime.kernels import deepep_emulation
from tests.tooling.runtime.kernels.test_deepep_emulation_outputs import (
    _describe,
    _row_id,
    _shape,
    parse_tables,
)

THIS = "tests.tooling.runtime.kernels.test_deepep_emulation_internode"
WORLD, PER_NODE = 4, 2
TOKENS = 12
OUTPUT_ROWS, SYNC_ROWS = parse_tables(deepep_emulation.Buffer.internode_dispatch.__doc__)
DEEP_LAYOUT = (
    "num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert",
    "is_token_in_rank", "event",
)  # fmt: skip
DEEP_DISPATCH = (
    "recv_x", "recv_topk_idx", "recv_topk_weights", "num_recv_tokens_per_expert_list",
    "handle", "event",
)  # fmt: skip
INTERNODE_HANDLE = (
    "is_token_in_rank", "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix",
    "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum",
    "recv_gbl_channel_prefix_matrix", "recv_gbl_rank_prefix_sum", "recv_src_meta",
    "send_rdma_head", "send_nvl_head",
)  # fmt: skip
DEEP_COMBINE = ("combined_x", "combined_topk_weights", "event")
NVSHMEM_FREES = ("deepep nvshmem barrier", "deepep nvshmem free", "deepep nvshmem finalize")


def _nodes(ranks_per_node) -> None:
    """This rank's emulated node size (None: one node), before anything reads it."""
    if ranks_per_node is None:
        os.environ.pop("MOE_RELEASE_RANKS_PER_NODE", None)
    else:
        os.environ["MOE_RELEASE_RANKS_PER_NODE"] = str(ranks_per_node)


def _log() -> List[Dict[str, object]]:
    from moe_release.runtime.measure import faults

    return faults.ENTRIES


def _entries(ops, first: int = 0) -> List[Dict[str, object]]:
    """The device-side collectives ``ops`` this rank logged (from entry ``first`` on)."""
    return [
        {"op": e["op"], "ranks": e["ranks"], "context": e["context"]}
        for e in _log()[first:]
        if e["op"] in ops
    ]


# --------------------------------------------------------------------------------------------
# Rank side.


def rank_kernels() -> Dict[str, object]:
    """2 nodes of 2: cpu_jobs' reference DeepEP checks (direct and host-staged, every factory
    naming a device) and its dispatcher and MoELayer checks against the dense oracle (plain and
    recomputed), then every internode call in every mode under the placement rules, each output
    described as test_deepep_emulation_outputs describes them."""
    import contextlib
    import sys

    import torch
    import torch.distributed as dist

    from moe_release.runtime.cuda import placement
    from moe_release.runtime.kernels import emulation_common
    from moe_release.runtime.megatron import moe_harness
    from tests.unit_tests.device_placement import FactoryPlacement
    from tests.unit_tests.transformer.moe import cpu_jobs

    _nodes(PER_NODE)
    moe_harness.init_megatron(ep=WORLD)
    emu = sys.modules["moe_release.runtime.kernels.deepep_module"]
    verdicts: Dict[str, object] = {}
    factories = FactoryPlacement([deepep_emulation.__file__, emulation_common.__file__])
    with factories:
        cpu_jobs.deep_ep_kernel_checks(emu, verdicts)
    verdicts["factories"] = (factories.calls > 0 and not factories.missing, factories.missing)
    staged: Dict[str, object] = {}
    original = emulation_common.staged_through_host
    emulation_common.staged_through_host = lambda t, group: True
    try:
        cpu_jobs.deep_ep_kernel_checks(emu, staged)
    finally:
        emulation_common.staged_through_host = original
    verdicts.update({f"staged-{k}": v for k, v in staged.items()})
    cpu_jobs.dispatcher_checks("deepep", verdicts)
    for recompute in (False, True):
        cpu_jobs.layer_checks("deepep", recompute, verdicts)
    rules = contextlib.nullcontext() if placement.active() else placement.rules()
    with rules:
        runs = _internode_runs(emu, torch, dist, placement, verdicts)
    return {"verdicts": verdicts, "runs": runs, "placement_active": placement.active()}


def _internode_runs(emu, torch, dist, placement, verdicts) -> List[Dict[str, object]]:
    world, rank = dist.get_world_size(), dist.get_rank()
    runs: List[Dict[str, object]] = []

    def record(call, mode, labels, ctx, names, values, handle_names=()):
        outputs = {n: _describe(v, emu) for n, v in zip(names, values) if n is not None}
        handle = values[names.index("handle")] if "handle" in names else None
        if isinstance(handle, tuple):
            for i, (n, v) in enumerate(zip(handle_names, handle)):
                outputs[f"h[{i}] {n}"] = _describe(v, emu)
        syncs: Dict[str, int] = {}
        for (kind, _), n in placement.SYNCS.items():
            syncs[kind] = syncs.get(kind, 0) + n
        runs.append(
            dict(call=call, mode=mode, labels=sorted(labels), ctx=ctx, outputs=outputs,
                 syncs=syncs)
        )  # fmt: skip

    n_tok, hid, local, topk = 7, 8, 2, 2
    experts = world * local
    g = torch.Generator().manual_seed(5)
    idx_all = torch.stack(
        [torch.randperm(experts, generator=g)[:topk] for _ in range(world * n_tok)]
    ).view(world, n_tok, topk)
    idx_all[:, 0, :] = -1
    idx_all[:, 1, 1] = -1
    x = torch.randn(n_tok, hid, generator=g).to(torch.bfloat16)
    idx = idx_all[rank].contiguous()
    weights = torch.where(idx >= 0, torch.rand(n_tok, topk, generator=g), 0.0)
    routed, node, me = idx_all.tolist(), rank // PER_NODE, rank % PER_NODE
    received = sum(
        any(e >= 0 and e // local == rank for e in routed[s][t])
        for s in range(world)
        for t in range(n_tok)
    )
    # Over RDMA: the tokens of the rank of this local rank on each node bound for this node.
    rdma_received = sum(
        any(e >= 0 and e // local // PER_NODE == node for e in routed[s][t])
        for s in range(me, world, PER_NODE)
        for t in range(n_tok)
    )
    ctx = dict(T=n_tok, H=hid, K=topk, R=world, E=experts, E_l=local, Nr=received,
               Rr=world // PER_NODE, Nrr=rdma_received, C=emu.Buffer.num_sms // 2,
               x_dtype="bfloat16")  # fmt: skip
    buf = emu.Buffer(dist.group.WORLD, 0, 0)
    for mode in ("async", "sync"):
        overlap = mode == "async"

        def event(overlap=overlap):
            return emu.EventOverlap(emu.EventHandle()) if overlap else None

        ekw = dict(async_finish=overlap, allocate_on_comm_stream=overlap)
        placement.SYNCS.clear()
        layout = buf.get_dispatch_layout(idx, experts, previous_event=event(), **ekw)
        record("deepep internode layout", mode, {"all", mode}, ctx, DEEP_LAYOUT, layout)
        placement.SYNCS.clear()
        disp = buf.dispatch(
            x, topk_idx=idx, topk_weights=weights, num_tokens_per_rank=layout[0],
            num_tokens_per_rdma_rank=layout[1], is_token_in_rank=layout[3],
            num_tokens_per_expert=layout[2], previous_event=layout[4] if overlap else None,
            **ekw,
        )  # fmt: skip
        record("deepep internode dispatch", mode, {"all", mode}, ctx, DEEP_DISPATCH, disp,
               INTERNODE_HANDLE)  # fmt: skip
        # A few values the reference fixes: the tokens per node (once each), the rows received
        # in all and over RDMA, each row's source node in its SourceMeta.
        per_node = [
            sum(any(e >= 0 and e // local // PER_NODE == n for e in routed[rank][t])
                for t in range(n_tok))
            for n in range(world // PER_NODE)
        ]  # fmt: skip
        h = disp[4]
        got = (layout[1].tolist(), int(h[6][-1]), int(h[4][-1]), int(h[9].shape[0]))
        verdicts[f"internode-counts-{mode}"] = (
            got == (per_node, received, rdma_received, rdma_received),
            str(got),
        )
        sources = torch.repeat_interleave(
            torch.arange(world), torch.diff(h[6].long(), prepend=torch.zeros(1, dtype=torch.long))
        )
        meta = h[7].view(torch.int32)
        verdicts[f"internode-src_meta-{mode}"] = (
            torch.equal(meta[:, 0].long(), sources // PER_NODE),
            str(meta.tolist()),
        )
        placement.SYNCS.clear()
        cached = buf.dispatch(x * 2, handle=disp[4], previous_event=event(), **ekw)
        record("deepep internode cached dispatch", mode, {"all", mode}, ctx, DEEP_DISPATCH,
               cached)  # fmt: skip
        placement.SYNCS.clear()
        comb = buf.combine(disp[0], disp[4], topk_weights=disp[2], previous_event=event(), **ekw)
        record("deepep internode combine", f"weights {mode}", {"all", "weights", mode}, ctx,
               DEEP_COMBINE, comb)  # fmt: skip
        placement.SYNCS.clear()
        comb = buf.combine(disp[0], handle=disp[4], previous_event=event(), **ekw)
        record("deepep internode combine", f"no weights {mode}", {"all", "no weights", mode},
               ctx, DEEP_COMBINE, comb)  # fmt: skip
    return runs


def _setup(ranks_per_node):
    """The emulated nodes, the counted allocator and megatron's EP = 4 groups."""
    from moe_release.runtime.measure import cpu_memory
    from moe_release.runtime.megatron import moe_harness

    _nodes(ranks_per_node)
    cpu_memory.install()
    moe_harness.init_megatron(ep=WORLD)
    return cpu_memory


def _layer_step():
    """megatron-core's MoELayer (flex dispatcher, deepep) forward and backward, the weights and
    inputs global-seeded (the same on any layout); its results and buffer."""
    import torch

    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.cuda.compat import held_comm_buffers
    from tests.unit_tests.transformer.moe import test_comm_buffers

    handles = []
    original = deepep_emulation.Buffer.internode_dispatch

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if out[4] is not None:
            handles.append([(str(t.dtype), list(t.shape)) for t in out[4]])
        return out

    deepep_emulation.Buffer.internode_dispatch = spy
    try:
        layer, out, x_grad = test_comm_buffers._layer_step("deepep", WORLD)
    finally:
        deepep_emulation.Buffer.internode_dispatch = original
    (buffer,) = held_comm_buffers(fused_a2a)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    x = torch.empty(TOKENS, layer.config.hidden_size, dtype=layer.config.params_dtype)
    res = {
        "out": out,
        "x_grad": x_grad,
        "grads": grads,
        "num_nvl_bytes": buffer.num_nvl_bytes,
        "num_rdma_bytes": buffer.num_rdma_bytes,
        "nbytes": buffer.nbytes,
        "layout": tuple(buffer.layout),
        "handles": handles,
        "hidden_bytes": fused_a2a.get_hidden_bytes(x),
    }
    return res, buffer


def rank_layer_and_release(ranks_per_node) -> Dict[str, object]:
    """A step, then the patched tree's explicit release: the bytes it gives back and the
    device-side collectives it logs."""
    import gc

    import torch.distributed as dist

    from megatron.core.transformer.moe import fused_a2a

    mem = _setup(ranks_per_node)
    res, buffer = _layer_step()
    made = _entries(("deepep nvshmem init",))
    del buffer
    gc.collect()
    before = mem.settled()
    fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
    gc.collect()
    res["freed"] = before - mem.settled()
    res["made"] = made
    res["frees"] = _entries(("deepep destroy barrier",) + NVSHMEM_FREES)
    return res


def rank_pe_never_comes() -> Dict[str, object]:
    """2 nodes of 2: after a step the buffer's destroy() (what the explicit release runs) on
    ranks 0-2 only; rank 3 never comes. Which rendezvous gives up, after how long."""
    import time

    import torch.distributed as dist

    from moe_release.runtime.measure import faults

    os.environ["MOE_RELEASE_DEVICE_BARRIER_TIMEOUT"] = "1.5"
    _setup(PER_NODE)
    _, buffer = _layer_step()
    out: Dict[str, object] = {}
    if dist.get_rank() != WORLD - 1:
        start = time.monotonic()
        try:
            buffer.destroy()
            out["error"] = None
        except faults.DeviceBarrierTimeout as exc:
            out["error"] = str(exc)
        out["elapsed"] = time.monotonic() - start
        out["kept"] = buffer.runtime is not None and buffer.memory is not None
    out["entered"] = _entries(("deepep destroy barrier",) + NVSHMEM_FREES)
    dist.barrier()
    return out


def rank_base_lifecycle() -> Dict[str, object]:
    """The unpatched base on 2 nodes of 2: is there an explicit release, and how is the buffer
    built? Then its one way to free the buffer: dropping fused_a2a's global (a larger or another
    group's buffer replacing it; else the interpreter's exit), where deep_ep's destructor runs
    destroy(). Twice: every rank drops it; then, after another step, all but rank 3 do."""
    import gc
    import time

    import torch.distributed as dist

    from megatron.core.transformer.moe import fused_a2a

    os.environ["MOE_RELEASE_DEVICE_BARRIER_TIMEOUT"] = "1.5"
    mem = _setup(PER_NODE)
    out: Dict[str, object] = {"release_api": hasattr(fused_a2a, "reset_fused_a2a_buffers")}
    for phase, keep in (("all", None), ("lonely", WORLD - 1)):
        _, buffer = _layer_step()
        out["explicitly_destroy"] = buffer.explicitly_destroy
        nbytes, leaked, first = (
            buffer.nbytes,
            len(deepep_emulation.LEAKED_BUFFERS),
            len(_log()),
        )
        del buffer
        gc.collect()
        before = mem.settled()
        start = time.monotonic()
        if dist.get_rank() != keep:
            fused_a2a._buffer = None
            gc.collect()
        out[phase] = {
            "elapsed": time.monotonic() - start,
            "nbytes": nbytes,
            "freed": before - mem.settled(),
            "leaked": len(deepep_emulation.LEAKED_BUFFERS) - leaked,
            "entered": _entries(("deepep destroy barrier",) + NVSHMEM_FREES, first),
        }
        dist.barrier()
    if dist.get_rank() == WORLD - 1:
        fused_a2a._buffer.runtime = None  # its peers are gone: no destructor barrier at exit
    return out


# --------------------------------------------------------------------------------------------
# Tests.


def _expected(row: Dict[str, str], ctx: Dict[str, object]) -> Dict[str, object]:
    dtype, shape = row["dtype"], row["shape"]
    if dtype in ("float32", "int64", "int32", "bool", "uint8", "x.dtype"):
        want = {"type": "tensor", "device": row["device"]}
        want["dtype"] = ctx["x_dtype"] if dtype == "x.dtype" else dtype
    else:
        want = {"type": dtype}
    if shape != "-":
        want["shape"] = _shape(shape, ctx)
    return want


@pytest.fixture(scope="module")
def kernels(dist_job, patched_tree):
    return dist_job(f"{THIS}:rank_kernels", WORLD, patched_tree)


@pytest.fixture(scope="module")
def layers(dist_job, patched_tree):
    """The step and release on one node and on 2 nodes of 2 (rank order each)."""
    return {
        per: dist_job(f"{THIS}:rank_layer_and_release", WORLD, patched_tree, ranks_per_node=per)
        for per in (None, PER_NODE)
    }


def test_reference_kernel_checks_hold_across_nodes(kernels):
    """cpu_jobs' reference checks of the DeepEP kernels (tokens, indices, weights, counts,
    combine, cached dispatch; also host-staged) and of megatron-core's dispatcher and MoELayer
    against the dense oracle, on 2 nodes of 2. The one check that differs is the layout's RDMA
    counts: None on one node, a [nodes] tensor across nodes (deep_ep.cpp:395-396)."""
    for rank, result in enumerate(kernels):
        verdicts = result["verdicts"]
        assert len(verdicts) > 20 and any(n.startswith("layer-deepep-checkpoint") for n in verdicts)
        failed = {n: d for n, (ok, d) in verdicts.items() if not ok and "rdma_layout" not in n}
        assert not failed, (rank, failed)
        for name in ("deepep-kernel-rdma_layout", "staged-deepep-kernel-rdma_layout"):
            assert verdicts[name] == (False, "Tensor vs NoneType"), (rank, name)


def test_tables_cover_every_internode_call():
    calls = {r["call"] for r in OUTPUT_ROWS}
    assert calls == {
        "deepep internode layout", "deepep internode dispatch",
        "deepep internode cached dispatch", "deepep internode combine",
    }  # fmt: skip
    assert {r["call"] for r in SYNC_ROWS} == calls
    handle = [r["output"] for r in OUTPUT_ROWS if r["output"].startswith("h[")]
    assert handle == [f"h[{i}] {n}" for i, n in enumerate(INTERNODE_HANDLE)]
    for row in OUTPUT_ROWS + SYNC_ROWS:
        assert re.fullmatch(r"[a-z_]+\.(cu|cuh|cpp|py):\d+(-\d+)?", row["source"]), row


@pytest.mark.parametrize("row", OUTPUT_ROWS, ids=_row_id)
def test_internode_output_as_the_real_kernel_returns_it(kernels, row):
    """One row of the internode tables: on every rank and run its mode covers, the output has
    the row's device (placement under the rules), dtype and shape."""
    assert all(r["placement_active"] for r in kernels)
    seen, wrong = 0, []
    for rank, result in enumerate(kernels):
        for run in result["runs"]:
            if run["call"] != row["call"] or row["mode"] not in run["labels"]:
                continue
            seen += 1
            want = _expected(row, run["ctx"])
            got = run["outputs"].get(row["output"])
            if got is None or any(got.get(k) != v for k, v in want.items()):
                wrong.append(f"rank {rank}, {run['mode']}: got {got}, want {want}")
    assert seen, f"no run covers mode {row['mode']!r} of {row['call']}"
    assert not wrong, f"{row['call']} {row['output']} ({row['source']} @94a9f8f): {wrong}"


@pytest.mark.parametrize("row", SYNC_ROWS, ids=_row_id)
def test_internode_host_syncs(kernels, row):
    want = {} if row["syncs"] == "0" else {row["kind"]: int(row["syncs"])}
    runs = [(r, run) for r, res in enumerate(kernels) for run in res["runs"]]
    runs = [(r, run) for r, run in runs if run["call"] == row["call"]]
    assert runs and all(run["syncs"] == want for _, run in runs), (want, runs)


def test_every_internode_output_is_in_the_table(kernels):
    rows = {(r["call"], r["output"], r["mode"]) for r in OUTPUT_ROWS}
    missing = {
        (run["call"], name, run["mode"])
        for run in kernels[0]["runs"]
        for name in run["outputs"]
        if not any((run["call"], name, label) in rows for label in run["labels"])
    }
    assert not missing, sorted(missing)


def test_buffer_sizes_follow_the_nodes(layers):
    """megatron-core's get_buffer on 2 nodes of 2 asks (and gets) an RDMA buffer of
    ``config.hpp:75-103``'s size, worked here by hand: 10 channels (20 SMs) x 2 RDMA ranks x
    ((2 x 8 + 2) x 2 ints + 2 x 132 tokens (the 128-token RDMA chunk rounded up to the 6-token
    send chunk) x (64 hidden bytes + 8 SourceMeta + 128 x (8 + 4 + 4) + 16)), rounded up to 128;
    the NVLink buffer counts 2 NVLink ranks, 2 RDMA ranks (``config.hpp:51-73``). On one node:
    no RDMA buffer, 4 NVLink ranks."""
    rdma = 10 * 2 * (18 * 2 * 4 + 2 * 132 * (64 + 8 + 128 * 16 + 16))
    rdma = -(-rdma // 128) * 128
    nvl_2x2 = -(-(10 * 2 * ((2 * 2 + 3) * 4 + 256 * (64 + 8 + 128 * 16))) // 128) * 128
    nvl_1x4 = -(-(10 * 4 * ((2 * 1 + 3) * 4 + 256 * (64 + 8 + 128 * 16))) // 128) * 128
    assert rdma == 11_281_024 and nvl_2x2 == 10_855_040 and nvl_1x4 == 21_709_696
    for rank, res in enumerate(layers[PER_NODE]):
        assert res["hidden_bytes"] == 64, res["hidden_bytes"]
        assert res["layout"] == (2, 2, rank // 2, rank % 2), res["layout"]
        assert (res["num_nvl_bytes"], res["num_rdma_bytes"]) == (nvl_2x2, rdma), rank
        # NVLink buffer + barrier block + workspace + RDMA buffer, and the pinned counters.
        assert res["nbytes"] == nvl_2x2 + 160 + 32 * 2**20 + rdma + 8 + 4096, rank
    for rank, res in enumerate(layers[None]):
        assert res["layout"] == (4, 1, 0, rank), res["layout"]
        assert (res["num_nvl_bytes"], res["num_rdma_bytes"]) == (nvl_1x4, 0), rank
        assert res["handles"] == []


def test_the_layer_takes_the_internode_handle(layers):
    """Every fresh dispatch of the step (forward) returned the real internode 10-tuple:
    ``deep_ep.cpp:948-1009``'s dtypes and shapes (C = 10, Rr = 2, R = 4, T = 12)."""
    for rank, res in enumerate(layers[PER_NODE]):
        assert res["handles"], rank
        for handle in res["handles"]:
            dtypes = [d for d, _ in handle]
            shapes = [s for _, s in handle]
            assert (
                dtypes
                == ["torch.bool"] + ["torch.int32"] * 6 + ["torch.uint8"] + ["torch.int32"] * 2
            ), (rank, handle)
            nr, nrr = shapes[7][0], shapes[9][0]
            assert shapes == [
                [12, 4], [2, 10], [4, 10], [2, 10], [2], [4, 10], [4], [nr, 8], [12, 2], [nrr, 8]
            ], (rank, handle)  # fmt: skip


def test_the_layer_is_bitwise_equal_across_nodes(layers):
    """megatron-core's MoELayer (flex, deepep) forward and backward on 2 nodes of 2: the
    output, the input's and every parameter's gradient bitwise equal to the one-node run."""
    import torch

    for rank, (one, two) in enumerate(zip(layers[None], layers[PER_NODE])):
        assert torch.equal(one["out"], two["out"]), rank
        assert torch.equal(one["x_grad"], two["x_grad"]), rank
        assert one["grads"].keys() == two["grads"].keys() and one["grads"], rank
        for name in one["grads"]:
            assert torch.equal(one["grads"][name], two["grads"][name]), (rank, name)


def test_the_release_frees_the_rdma_buffer_over_the_nvshmem_job(layers):
    """reset_fused_a2a_buffers(collective=True) on 2 nodes of 2 frees every byte, the RDMA
    buffer's included; its log shows the intranode barrier over the rank's node, then NVSHMEM's
    barrier, free and finalize over the rank's NVSHMEM job (its local rank on both nodes,
    deep_ep.cpp:347-349), all from the release; the construction's NVSHMEM init over the same
    ranks. On one node: the intranode barrier over all 4 ranks, no NVSHMEM."""
    for rank, res in enumerate(layers[PER_NODE]):
        node = [rank // 2 * 2, rank // 2 * 2 + 1]
        team = [rank % 2, rank % 2 + 2]
        assert res["freed"] == res["nbytes"] > res["num_rdma_bytes"] > 0, (rank, res["freed"])
        assert res["made"] == [{"op": "deepep nvshmem init", "ranks": team, "context": []}]
        assert [(e["op"], e["ranks"]) for e in res["frees"]] == [
            ("deepep destroy barrier", node)
        ] + [(op, team) for op in NVSHMEM_FREES], (rank, res["frees"])
        assert all(e["context"] == ["release"] for e in res["frees"]), res["frees"]
    for res in layers[None]:
        assert res["freed"] == res["nbytes"] > 0 and res["made"] == []
        assert [(e["op"], e["ranks"]) for e in res["frees"]] == [
            ("deepep destroy barrier", [0, 1, 2, 3])
        ]


def test_a_pe_that_never_comes_traps_within_the_bound(dist_job, patched_tree):
    """Rank 3 never destroys its buffer: rank 2 (its node) gives up in the intranode barrier;
    ranks 0 and 1 pass theirs and give up in the NVSHMEM barrier of their job ([0, 2], [1, 3]),
    whose other PE never comes: "a GPU would trap" after the 1.5 s bound, the bytes kept."""
    results = dist_job(f"{THIS}:rank_pe_never_comes", WORLD, patched_tree, timeout=120.0)
    where = {0: "deepep nvshmem barrier", 1: "deepep nvshmem barrier", 2: "deepep destroy barrier"}
    among = {0: [0, 2], 1: [1, 3], 2: [2, 3]}
    for rank, op in where.items():
        out = results[rank]
        assert out["error"].startswith(f"{op}: device barrier among ranks {among[rank]}"), out
        assert "a GPU would trap" in out["error"] and out["kept"], out
        assert 1.5 <= out["elapsed"] < 10.0, out
    assert results[3]["entered"] == []


def test_the_base_frees_across_nodes_only_from_the_destructor(dist_job, base_tree):
    """The unpatched base has no explicit release and builds the buffer without
    ``explicitly_destroy``: the only free is ``~Buffer`` where fused_a2a's last reference goes
    (here dropped by hand; a replacing buffer, or the interpreter's exit), whose destroy() runs
    the intranode barrier and NVSHMEM's barrier, free and finalize over the NVSHMEM job from a
    finalizer. With rank 3 not dropping it, rank 2 traps in the intranode barrier and ranks 0
    and 1 in the NVSHMEM barrier, each keeping every byte (printed to stderr, no exception)."""
    results = dist_job(f"{THIS}:rank_base_lifecycle", WORLD, base_tree, timeout=120.0)
    for rank, out in enumerate(results):
        assert not out["release_api"] and not out["explicitly_destroy"], out
        node, team = [rank // 2 * 2, rank // 2 * 2 + 1], [rank % 2, rank % 2 + 2]
        done = out["all"]
        assert done["freed"] == done["nbytes"] > 0 and done["leaked"] == 1, done
        assert done["entered"] == [{"op": "deepep destroy barrier", "ranks": node,
                                    "context": ["finalizer"]}] + [
            {"op": op, "ranks": team, "context": ["finalizer"]} for op in NVSHMEM_FREES
        ]  # fmt: skip
    last = {0: ("deepep nvshmem barrier", 2), 1: ("deepep nvshmem barrier", 2)}
    last[2] = ("deepep destroy barrier", 1)
    for rank, (op, entered) in last.items():
        lonely = results[rank]["lonely"]
        assert lonely["entered"][-1]["op"] == op and len(lonely["entered"]) == entered, lonely
        assert lonely["freed"] == 0 and lonely["leaked"] == 3 and lonely["elapsed"] >= 1.5, lonely
    assert results[3]["lonely"]["entered"] == []
