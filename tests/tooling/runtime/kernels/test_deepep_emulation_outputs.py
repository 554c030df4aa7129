# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Every deep_ep kernel output the emulation returns, as the real kernels return it.

The tables of :mod:`moe_release.runtime.kernels.hybridep_emulation`'s and
:mod:`moe_release.runtime.kernels.deepep_emulation`'s docstrings (output | mode | device | dtype |
shape | source at DeepEP 94a9f8f, and the host syncs each call makes) are parsed here, and each row
becomes one test: one job on two gloo ranks under the CPU runtime's placement rules runs every call
in every mode megatron-core uses (HybridEP blocking, non-blocking with a budget, drop-and-pad's
capacity budget, each also with ``fuse_permute_dispatch``; the handle replay; combine with and
without probs; DeepEP's layout, dispatch, cached dispatch and combine with and without event
overlap) and describes each output (placement, dtype, shape, or its Python type); the test compares
that with the row on every rank and every run the row's mode covers.
"""

import re
from typing import Dict, List

import pytest

from moe_release.runtime.kernels import deepep_emulation, hybridep_emulation
from moe_release.runtime.kernels.install import load_deep_ep_emulation

EMU = load_deep_ep_emulation()
FAMILIES = (hybridep_emulation, deepep_emulation)
JOB = f"{__name__}:rank_kernel_outputs"
WORLD = 2

# Names of the positional outputs of each call, and of the handle items (``h[i] name``).
HYBRID_DISPATCH = (
    "dispatched_token", "dispatched_probs", "dispatched_scaling_factor", "tokens_per_expert",
    "handle",
)  # fmt: skip
HYBRID_HANDLE = (
    "sparse_to_dense_map", "rdma_to_attn_map", "attn_to_rdma_map",
    "num_dispatched_tokens_tensor", "local_expert_routing_map", "dense_chunk_layout",
    "dense_to_expert_map", "tokens_per_expert", "num_of_tokens_per_rank", "config",
    "overflow_flag",
)  # fmt: skip
HYBRID_COMBINE = ("combined_token", "combined_probs")
DEEP_LAYOUT = (
    "num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert",
    "is_token_in_rank", "event",
)  # fmt: skip
DEEP_DISPATCH = (
    "recv_x", "recv_topk_idx", "recv_topk_weights", "num_recv_tokens_per_expert_list",
    "handle", "event",
)  # fmt: skip
DEEP_HANDLE = (
    "rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix",
    "recv_src_idx", "is_token_in_rank", "send_head",
)  # fmt: skip
DEEP_COMBINE = ("combined_x", "combined_topk_weights", "event")


# --------------------------------------------------------------------------------------------
# The tables of the emulation's docstring.


def _cells(line: str) -> List[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_tables(doc: str):
    """``(output_rows, sync_rows)``: dicts of the output tables (each under its ``[call]``
    line) and of the host-sync table."""
    outputs, syncs = [], []
    call, header = None, None
    for line in doc.splitlines():
        stripped = line.strip()
        heading = re.match(r"^\[([a-z0-9_ ]+)\] ", stripped)
        if heading:
            call, header = heading.group(1), None
            continue
        if not stripped.startswith("|"):
            header = None
            continue
        cells = _cells(stripped)
        if header is None:
            header = [c.split(" @")[0] for c in cells]
            continue
        if set(stripped) <= set("|-"):
            continue
        row = dict(zip(header, cells))
        if header[0] == "output":
            row["call"] = call
            outputs.append(row)
        elif header[:3] == ["call", "mode", "syncs"]:
            syncs.append(row)
    return outputs, syncs


OUTPUT_ROWS, SYNC_ROWS = (
    sum(rows, []) for rows in zip(*(parse_tables(m.__doc__) for m in FAMILIES))
)


def _row_id(row: Dict[str, str]) -> str:
    parts = [row["call"], row.get("output", ""), row["mode"]]
    return re.sub(r"\s+", "_", ":".join(p for p in parts if p)) + "@" + row["source"]


# --------------------------------------------------------------------------------------------
# Rank side.


def _describe(value, emu) -> Dict[str, object]:
    import torch

    from moe_release.runtime.cuda import placement

    if value is None:
        return {"type": "None"}
    if isinstance(value, torch.Tensor):
        return {
            "type": "tensor",
            "device": placement.placement_of(value),
            "dtype": str(value.dtype).replace("torch.", ""),
            "shape": list(value.shape),
        }
    if isinstance(value, emu.EventOverlap):
        inner = "None" if value.event is None else type(value.event).__name__
        return {"type": f"EventOverlap({inner})"}
    if isinstance(value, bool):
        return {"type": "bool"}
    if isinstance(value, int):
        return {"type": "int"}
    if isinstance(value, list):
        kind = "list[int]" if all(type(v) is int for v in value) else "list"
        return {"type": kind, "shape": [len(value)]}
    if isinstance(value, tuple):
        return {"type": "tuple", "shape": [len(value)]}
    return {"type": "object", "class": type(value).__name__}


def rank_kernel_outputs() -> Dict[str, object]:
    """Every call the output table lists, in every mode, under the placement rules: per run
    ``{"call", "mode", "labels", "ctx", "outputs": {name: description}, "syncs"}``."""
    import contextlib

    import torch
    import torch.distributed as dist

    from moe_release.runtime.cuda import placement

    emu = load_deep_ep_emulation()
    rules = contextlib.nullcontext() if placement.active() else placement.rules()
    with rules:
        return _kernel_runs(emu, torch, dist, placement)


def _kernel_runs(emu, torch, dist, placement) -> Dict[str, object]:
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    runs: List[Dict[str, object]] = []

    def syncs() -> Dict[str, int]:
        out: Dict[str, int] = {}
        for (kind, _), n in placement.SYNCS.items():
            out[kind] = out.get(kind, 0) + n
        return out

    def record(call, mode, labels, ctx, names, values, handle_names=()):
        outputs = {n: _describe(v, emu) for n, v in zip(names, values) if n is not None}
        handle = values[names.index("handle")] if "handle" in names else None
        if isinstance(handle, tuple):
            for i, (n, v) in enumerate(zip(handle_names, handle)):
                outputs[f"h[{i}] {n}"] = _describe(v, emu)
        runs.append(
            dict(call=call, mode=mode, labels=sorted(labels), ctx=ctx, outputs=outputs,
                 syncs=syncs())
        )  # fmt: skip

    # HybridEP: N tokens per rank, H hidden, L local experts; bf16 tokens, fp32 probs.
    n_tok, hid, local = 7, 8, 2
    experts = world * local
    g = torch.Generator().manual_seed(5)
    maps = torch.rand(world, n_tok, experts, generator=g) < 0.5
    x_all = torch.randn(world, n_tok, hid, generator=g).to(torch.bfloat16)
    probs_all = torch.rand(world, n_tok, experts, generator=g) * maps
    rmap, x, probs = maps[rank].contiguous(), x_all[rank].contiguous(), probs_all[rank]
    base = dict(N=n_tok, H=hid, E_l=local, R=world, M=1, E=experts, x_dtype="bfloat16")
    buf = emu.HybridEPBuffer(group, hid, n_tok, local)
    for fused in (False, True):
        sfx = " fused" if fused else ""
        kw = {"fuse_permute_dispatch": True} if fused else {}
        ckw = {"fuse_unpermute_combine": True} if fused else {}
        # Blocking (megatron's dropless path): num_permuted_tokens None.
        placement.SYNCS.clear()
        out = buf.dispatch_with_permute(
            hidden=x, routing_map=rmap, probs=probs, scaling_factor=None,
            num_of_experts_per_rank=local, pad_multiple=None, num_permuted_tokens=None,
            non_blocking=False, **kw,
        )  # fmt: skip
        blocking_p = int(sum(out[3].tolist()))
        ctx = dict(base, P=blocking_p)
        record("hybridep dispatch", "blocking" + sfx, {"all", "blocking"}, ctx,
               HYBRID_DISPATCH, out, HYBRID_HANDLE)  # fmt: skip
        # Combine: forward (no probs) and the dispatch's backward (probs).
        placement.SYNCS.clear()
        comb = buf.combine_with_unpermute(hidden=out[0], handle=out[4], pad_multiple=None, **ckw)
        record("hybridep combine", "no probs" + sfx, {"all", "no probs"}, ctx,
               HYBRID_COMBINE, comb)  # fmt: skip
        placement.SYNCS.clear()
        comb = buf.combine_with_unpermute(
            hidden=out[0], probs=out[1], handle=out[4], pad_multiple=None, **ckw
        )
        record("hybridep combine", "probs" + sfx, {"all", "probs"}, ctx, HYBRID_COMBINE, comb)
        # Replay (HybridEPCombine.backward) with megatron's num_permuted_tokens: the 0-dim sum.
        placement.SYNCS.clear()
        rep = buf.dispatch_with_permute(
            hidden=x * 2, scaling_factor=None, handle=out[4], pad_multiple=None,
            num_permuted_tokens=out[3].sum(), **kw,
        )  # fmt: skip
        record("hybridep replay", "after blocking" + sfx, {"all"}, ctx, HYBRID_DISPATCH, rep)
        # Non-blocking: a static budget (rank capacity) above the need, and drop-and-pad's
        # capacity x ranks x local experts (which may drop rows).
        for mode, budget in (("non-blocking", blocking_p + 5), ("drop-and-pad", 3 * world * local)):
            placement.SYNCS.clear()
            out = buf.dispatch_with_permute(
                hidden=x, routing_map=rmap, probs=probs, scaling_factor=None,
                num_of_experts_per_rank=local, pad_multiple=None, num_permuted_tokens=budget,
                non_blocking=True, **kw,
            )  # fmt: skip
            ctx = dict(base, P=budget)
            record("hybridep dispatch", mode + sfx, {"all", "non-blocking"}, ctx,
                   HYBRID_DISPATCH, out, HYBRID_HANDLE)  # fmt: skip
            placement.SYNCS.clear()
            rep = buf.dispatch_with_permute(
                hidden=x, scaling_factor=None, handle=out[4], pad_multiple=None,
                num_permuted_tokens=budget, **kw,
            )  # fmt: skip
            record("hybridep replay", f"after {mode}{sfx}", {"all"}, ctx, HYBRID_DISPATCH, rep)
            placement.SYNCS.clear()
            comb = buf.combine_with_unpermute(
                hidden=out[0], probs=out[1], handle=out[4], pad_multiple=None, **ckw
            )
            record("hybridep combine", f"probs after {mode}{sfx}", {"all", "probs"}, ctx,
                   HYBRID_COMBINE, comb)  # fmt: skip
    # The kernel without probs.
    placement.SYNCS.clear()
    out = buf.dispatch_with_permute(
        hidden=x, routing_map=rmap, probs=None, scaling_factor=None,
        num_of_experts_per_rank=local, pad_multiple=None,
    )  # fmt: skip
    record("hybridep dispatch", "no probs", {"no probs"}, base, (None, "dispatched_probs"), out)

    # DeepEP: T tokens, top-K experts (int64, -1 for none), fp32 weights, bf16 tokens.
    topk = 2
    idx_all = torch.stack(
        [torch.randperm(experts, generator=g)[:topk] for _ in range(world * n_tok)]
    ).view(world, n_tok, topk)
    idx_all[:, 0, :] = -1
    idx_all[:, 1, 1] = -1
    idx = idx_all[rank].contiguous()
    weights = torch.where(idx >= 0, torch.rand(n_tok, topk, generator=g), 0.0)
    # Received tokens, from every rank's routing (the reference, outside the measured calls).
    routed = idx_all.tolist()
    received = sum(
        any(e >= 0 and e // local == rank for e in routed[s][t])
        for s in range(world)
        for t in range(n_tok)
    )
    dctx = dict(base, T=n_tok, K=topk, Nr=received, C=emu.Buffer.num_sms // 2)
    dbuf = emu.Buffer(group, 0, 0)
    for mode in ("async", "sync"):
        overlap = mode == "async"

        def event(overlap=overlap):
            return emu.EventOverlap(emu.EventHandle()) if overlap else None

        ekw = dict(async_finish=overlap, allocate_on_comm_stream=overlap)
        placement.SYNCS.clear()
        layout = dbuf.get_dispatch_layout(idx, experts, previous_event=event(), **ekw)
        record("deepep layout", mode, {"all", mode}, dctx, DEEP_LAYOUT, layout)
        placement.SYNCS.clear()
        disp = dbuf.dispatch(
            x, topk_idx=idx, topk_weights=weights, num_tokens_per_rank=layout[0],
            num_tokens_per_rdma_rank=layout[1], is_token_in_rank=layout[3],
            num_tokens_per_expert=layout[2], previous_event=layout[4] if overlap else None,
            **ekw,
        )  # fmt: skip
        record("deepep dispatch", mode, {"all", mode}, dctx, DEEP_DISPATCH, disp, DEEP_HANDLE)
        placement.SYNCS.clear()
        cached = dbuf.dispatch(x * 2, handle=disp[4], previous_event=event(), **ekw)
        record("deepep cached dispatch", mode, {"all", mode}, dctx, DEEP_DISPATCH, cached)
        placement.SYNCS.clear()
        comb = dbuf.combine(disp[0], disp[4], topk_weights=disp[2], previous_event=event(), **ekw)
        record("deepep combine", f"weights {mode}", {"all", "weights", mode}, dctx,
               DEEP_COMBINE, comb)  # fmt: skip
        placement.SYNCS.clear()
        comb = dbuf.combine(disp[0], handle=disp[4], previous_event=event(), **ekw)
        record("deepep combine", f"no weights {mode}", {"all", "no weights", mode}, dctx,
               DEEP_COMBINE, comb)  # fmt: skip
    return {"placement_active": placement.active(), "runs": runs}


# --------------------------------------------------------------------------------------------
# Tests.


def _shape(expr: str, ctx: Dict[str, object]) -> List[int]:
    names = dict(ctx, cdiv=lambda a, b: (max(a, 1) - 1) // b + 1)
    names["ceil16"] = lambda n: 16 * names["cdiv"](n, 16)
    return list(eval(expr, {"__builtins__": {}}, names))  # the table's own shape formulas


def _expected(row: Dict[str, str], ctx: Dict[str, object]) -> Dict[str, object]:
    dtype, shape = row["dtype"], row["shape"]
    want: Dict[str, object] = {}
    if dtype in ("float32", "int64", "int32", "bool", "x.dtype"):
        want = {"type": "tensor", "device": row["device"]}
        want["dtype"] = ctx["x_dtype"] if dtype == "x.dtype" else dtype
    else:
        want = {"type": dtype}
    if shape != "-":
        want["shape"] = _shape(shape, ctx)
    return want


@pytest.fixture(scope="module")
def kernel_runs(dist_job, patched_tree):
    """The job's runs on every rank (rank order)."""
    return dist_job(JOB, WORLD, patched_tree)


def _runs_for(results, call: str, mode: str):
    for rank, result in enumerate(results):
        for run in result["runs"]:
            if run["call"] == call and mode in run["labels"]:
                yield rank, run


def test_tables_cover_every_call():
    calls = {r["call"] for r in OUTPUT_ROWS}
    assert calls == {
        "hybridep dispatch", "hybridep replay", "hybridep combine", "deepep layout",
        "deepep dispatch", "deepep cached dispatch", "deepep combine",
    }  # fmt: skip
    assert {r["call"] for r in SYNC_ROWS} == calls
    for row in OUTPUT_ROWS + SYNC_ROWS:
        assert re.fullmatch(r"[a-z_]+\.(cu|cuh|cpp|py):\d+(-\d+)?", row["source"]), row
    for module in FAMILIES:
        assert module.DEEP_EP_SOURCE_COMMIT.startswith("94a9f8f"), module.__name__
    assert "de0dd11" in hybridep_emulation.__doc__


@pytest.mark.parametrize("row", OUTPUT_ROWS, ids=_row_id)
def test_output_as_the_real_kernel_returns_it(kernel_runs, row):
    """One row of the table: on every rank and every run its mode covers, the output has the
    row's device (placement under the rules), dtype and shape."""
    assert all(r["placement_active"] for r in kernel_runs)
    seen, wrong = 0, []
    for rank, run in _runs_for(kernel_runs, row["call"], row["mode"]):
        seen += 1
        want = _expected(row, run["ctx"])
        got = run["outputs"].get(row["output"])
        if got is None or any(got.get(k) != v for k, v in want.items()):
            wrong.append(f"rank {rank}, {run['mode']}: got {got}, want {want}")
    assert seen, f"no run covers mode {row['mode']!r} of {row['call']}"
    assert not wrong, f"{row['call']} {row['output']} ({row['source']} @94a9f8f): {wrong}"


@pytest.mark.parametrize("row", SYNC_ROWS, ids=_row_id)
def test_host_syncs_as_the_real_kernel_makes_them(kernel_runs, row):
    """The kernel's own host synchronizations, counted once per call (none elsewhere)."""
    want = {} if row["syncs"] == "0" else {row["kind"]: int(row["syncs"])}
    runs = list(_runs_for(kernel_runs, row["call"], row["mode"]))
    assert runs, f"no run covers mode {row['mode']!r} of {row['call']}"
    wrong = [f"rank {r}, {run['mode']}: {run['syncs']}" for r, run in runs if run["syncs"] != want]
    assert not wrong, f"{row['call']} ({row['source']} @94a9f8f), want {want}: {wrong}"


def test_every_run_output_is_in_the_table(kernel_runs):
    """No output of a run goes unchecked: each has a row whose mode covers the run."""
    rows = {(r["call"], r["output"], r["mode"]) for r in OUTPUT_ROWS}
    missing = set()
    for run in kernel_runs[0]["runs"]:
        for name in run["outputs"]:
            if not any((run["call"], name, label) in rows for label in run["labels"]):
                missing.add((run["call"], name, run["mode"]))
    assert not missing, sorted(missing)


def test_event_overlap_waits_only_on_an_event():
    """As deep_ep/utils.py:40: current_stream_wait() asserts an event (async_finish calls)."""
    EMU.EventOverlap(EMU.EventHandle()).current_stream_wait()
    with pytest.raises(AssertionError, match="async_finish"):
        EMU.EventOverlap().current_stream_wait()
    with EMU.EventOverlap():
        pass  # leaving the block waits only when there is an event


def test_replay_needs_num_permuted_tokens():
    """The replay sets the handle's int64 num_permuted_tokens from the argument; None is
    refused as pybind refuses it (megatron-core always passes it)."""
    import torch

    buf = EMU.HybridEPBuffer(None, 4, 3, 2)
    x = torch.ones(3, 4)
    rmap = torch.tensor([[True, False], [True, True], [False, False]])
    out = buf.dispatch_with_permute(hidden=x, routing_map=rmap, num_of_experts_per_rank=2)
    with pytest.raises(TypeError, match="num_permuted_tokens"):
        buf.dispatch_with_permute(hidden=x, handle=out[4])
    again = buf.dispatch_with_permute(hidden=x, handle=out[4], num_permuted_tokens=out[3].sum())
    assert torch.equal(again[0], out[0]) and again[3] is None
