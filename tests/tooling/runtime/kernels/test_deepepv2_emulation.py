# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The DeepEP v2 ``ElasticBuffer`` emulation against DeepEP's source at 018f21e.

Every row of :mod:`moe_release.runtime.kernels.deepepv2_emulation`'s output tables is one test (a
job on two gloo ranks under the placement rules runs each call in every mode megatron dev uses and
describes each output); the semantics are checked against a reference written from DeepEP's
documented contract (``refs.py``: rows by source rank then token, local top-k indices, the
unweighted sum of a token's copies, weights back from each expert's owner); what the real buffer
refuses is refused; the buffer's bytes are DeepEP's size formula worked by hand.
"""

import re
from typing import Dict, List

import pytest

from moe_release.runtime.kernels import deepepv2_emulation as V2
from tests.tooling.runtime.kernels.test_deepep_emulation_outputs import _shape, parse_tables

THIS = "tests.tooling.runtime.kernels.test_deepepv2_emulation"
WORLD = 2
OUTPUT_ROWS, SYNC_ROWS = parse_tables(V2.__doc__)

DISPATCH = ("recv_x", "recv_topk_idx", "recv_topk_weights", "handle", "event")
HANDLE_FIELDS = (
    "topk_idx", "psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
    "recv_src_metadata", "dst_buffer_slot_idx", "token_metadata_at_forward",
    "channel_linked_list", "num_recv_tokens_per_expert_list", "num_sms",
)  # fmt: skip
COMBINE = ("combined_x", "combined_topk_weights", "event")


def _row_id(row: Dict[str, str]) -> str:
    parts = [row["call"], row.get("output", ""), row["mode"]]
    return re.sub(r"\s+", "_", ":".join(p for p in parts if p)) + "@" + row["source"]


def _describe(value) -> Dict[str, object]:
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
    if isinstance(value, V2.EventOverlap):
        inner = "None" if value.event is None else type(value.event).__name__
        return {"type": f"EventOverlap({inner})"}
    if isinstance(value, V2.EventHandle):
        return {"type": "EventHandle"}
    if isinstance(value, bool) or not isinstance(value, (int, list)):
        return {"type": "object"}
    if isinstance(value, int):
        return {"type": "int"}
    kind = "list[int]" if all(type(v) is int for v in value) else "list"
    return {"type": kind, "shape": [len(value)]}


def _inputs(world: int, rank: int, tokens: int = 7, hidden: int = 256, local: int = 2, k: int = 2):
    """Every rank's tokens (small integers in bf16: every sum is exact), top-k indices (distinct
    per row, some -1) and weights; the same on every rank, so the reference sees them all."""
    import torch

    experts = world * local
    g = torch.Generator().manual_seed(17)
    x = torch.randint(-4, 5, (world, tokens, hidden), generator=g).to(torch.bfloat16)
    idx = torch.stack(
        [torch.randperm(experts, generator=g)[:k] for _ in range(world * tokens)]
    ).view(world, tokens, k)
    idx[:, 0, :] = -1
    idx[:, 1, 1] = -1
    w = torch.where(idx >= 0, torch.rand(world, tokens, k, generator=g), 0.0)
    return x, idx, w, experts


# --------------------------------------------------------------------------------------------
# Rank side.


def rank_kernel_outputs() -> Dict[str, object]:
    """Every call of the tables in every mode, under the placement rules."""
    import contextlib

    import torch.distributed as dist

    from moe_release.runtime.cuda import placement

    rules = contextlib.nullcontext() if placement.active() else placement.rules()
    with rules:
        return _kernel_runs(dist, placement)


def _kernel_runs(dist, placement) -> Dict[str, object]:
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    xs, idxs, ws, experts = _inputs(world, rank)
    x, idx, w = xs[rank].contiguous(), idxs[rank].contiguous(), ws[rank].contiguous()
    n, hidden, k, local = 8, x.shape[1], idx.shape[1], experts // world
    received = sum(
        any(e >= 0 and e // local == rank for e in idxs[s, t].tolist())
        for s in range(world)
        for t in range(x.shape[0])
    )
    ctx = dict(T=x.shape[0], K=k, H=hidden, E=experts, E_l=local, R=world, Nr=received)
    runs: List[Dict[str, object]] = []

    def record(call, mode, labels, names, values):
        outputs = {name: _describe(v) for name, v in zip(names, values)}
        handle = dict(zip(names, values)).get("handle")
        if isinstance(handle, V2.EPHandle) and call == "deepepv2 dispatch":
            outputs.update({f"h.{f}": _describe(getattr(handle, f)) for f in HANDLE_FIELDS})
        syncs: Dict[str, int] = {}
        for (kind, _), count in placement.SYNCS.items():
            syncs[kind] = syncs.get(kind, 0) + count
        runs.append(dict(call=call, mode=mode, labels=sorted(labels), outputs=outputs, syncs=syncs))

    hint = V2.ElasticBuffer.get_buffer_size_hint(group, n, hidden, k)
    buf = V2.ElasticBuffer(group, num_bytes=hint, num_max_tokens_per_rank=n, hidden=hidden,
                           num_topk=k)  # fmt: skip
    for mode in ("async", "sync"):
        on = mode == "async"

        def ekw(on=on):
            prev = buf.capture() if on else None
            return dict(previous_event=prev, async_with_compute_stream=on,
                        allocate_on_comm_stream=on)  # fmt: skip

        placement.SYNCS.clear()
        record("deepepv2 capture", mode, {"all"}, ("event",), (buf.capture(),))
        placement.SYNCS.clear()
        out = buf.dispatch(
            x,
            topk_idx=idx,
            topk_weights=w,
            num_experts=experts,
            num_max_tokens_per_rank=n,
            expert_alignment=1,
            num_sms=0,
            **ekw(),
        )
        record("deepepv2 dispatch", mode, {"all", mode}, DISPATCH, out)  # fmt: skip
        handle = out[3]
        placement.SYNCS.clear()
        cached = buf.dispatch(x * 2, handle=handle, num_sms=handle.num_sms, **ekw())
        record("deepepv2 cached dispatch", mode, {"all", mode}, DISPATCH, cached)
        placement.SYNCS.clear()
        comb = buf.combine(out[0], handle=handle, topk_weights=out[2], num_sms=0, **ekw())
        record("deepepv2 combine", f"weights {mode}", {"all", "weights", mode}, COMBINE, comb)
        placement.SYNCS.clear()
        comb = buf.combine(out[0], handle=handle, num_sms=0, **ekw())
        record("deepepv2 combine", f"no weights {mode}", {"all", "no weights", mode}, COMBINE,
               comb)  # fmt: skip
    return {"placement_active": placement.active(), "ctx": ctx, "runs": runs}


def rank_semantics() -> Dict[str, object]:
    """The emulation against the documented contract, on every rank: what it received, the
    combine round trips, the per-expert counts, the cached dispatch."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    xs, idxs, ws, experts = _inputs(world, rank)
    x, idx, w = xs[rank].contiguous(), idxs[rank].contiguous(), ws[rank].contiguous()
    n, hidden, k = 8, x.shape[1], idx.shape[1]
    local = experts // world
    buf = V2.ElasticBuffer(group, num_max_tokens_per_rank=n, hidden=hidden, num_topk=k)
    recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(
        x, topk_idx=idx, topk_weights=w, num_experts=experts, num_max_tokens_per_rank=n
    )
    # The reference (refs.py:16: sorted by rank, then by token within each rank).
    rows = [(s, t) for s in range(world) for t in range(x.shape[0])
            if any(e >= 0 and e // local == rank for e in idxs[s, t].tolist())]  # fmt: skip
    want_x = torch.stack([xs[s, t] for s, t in rows])
    want_idx = torch.stack(
        [torch.where((idxs[s, t] >= 0) & (idxs[s, t] // local == rank), idxs[s, t] - rank * local,
                     torch.full_like(idxs[s, t], -1)) for s, t in rows]
    )  # fmt: skip
    want_w = torch.stack([ws[s, t] for s, t in rows])
    counts = [int((want_idx == e).any(1).sum()) for e in range(local)]
    dests = [len({e // local for e in idx[t].tolist() if e >= 0}) for t in range(x.shape[0])]
    out = {
        "recv_x": torch.equal(recv_x, want_x),
        "recv_idx": torch.equal(recv_idx, want_idx),
        "recv_weights_unmasked": torch.equal(recv_w, want_w),
        "src_token": torch.equal(
            handle.recv_src_metadata[:, 0],
            torch.tensor([s * n + t for s, t in rows], dtype=torch.int32),
        ),
        "per_expert": handle.num_recv_tokens_per_expert_list == counts,
        "psum_ranks": handle.psum_num_recv_tokens_per_scaleup_rank.tolist()[-1] == len(rows),
    }
    combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    mult = torch.tensor(dests, dtype=torch.float32).unsqueeze(1)
    out["combine_sums_copies"] = torch.equal(combined, (x.float() * mult).to(torch.bfloat16))
    out["combine_weights_round_trip"] = torch.equal(combined_w, w)
    again = buf.dispatch(x, handle=handle, num_sms=handle.num_sms)
    out["cached_equals_fresh"] = torch.equal(again[0], recv_x) and again[3] is handle
    none_w = buf.combine(recv_x, handle)[1]
    out["no_weights_none"] = none_w is None
    return out


def _raises(fn, kind) -> str:
    try:
        fn()
    except kind as exc:
        return f"{kind.__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - the wrong kind is the result
        return f"wrong {type(exc).__name__}: {exc}"
    return "ran"


def rank_refusals() -> Dict[str, object]:
    """What the real buffer refuses, one call each; and its lifetime."""
    import torch
    import torch.distributed as dist

    from moe_release.runtime.measure import cpu_memory

    cpu_memory.install()
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    xs, idxs, ws, experts = _inputs(world, rank)
    x, idx, w = xs[rank].contiguous(), idxs[rank].contiguous(), ws[rank].contiguous()
    n, hidden, k = 8, x.shape[1], idx.shape[1]
    buf = V2.ElasticBuffer(group, num_max_tokens_per_rank=n, hidden=hidden, num_topk=k)
    kw = dict(num_experts=experts, num_max_tokens_per_rank=n)
    recv_x, _, recv_w, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **kw)
    out = {
        "combine_fp32": _raises(lambda: buf.combine(recv_x.float(), handle), RuntimeError),
        "dispatch_fp32": _raises(
            lambda: buf.dispatch(x.float(), topk_idx=idx, topk_weights=w, **kw), RuntimeError
        ),
        "too_many_tokens": _raises(
            lambda: buf.dispatch(torch.cat([x, x]), topk_idx=torch.cat([idx, idx]), **kw),
            RuntimeError,
        ),
        "int32_topk": _raises(
            lambda: buf.dispatch(x, topk_idx=idx.int(), topk_weights=w, **kw), RuntimeError
        ),
        "event_without_comm_stream": _raises(
            lambda: buf.dispatch(x, topk_idx=idx, previous_event=buf.capture(), **kw),
            RuntimeError,
        ),
        "cached_with_topk": _raises(
            lambda: buf.dispatch(x, topk_idx=idx, handle=handle, num_sms=4), AssertionError
        ),
        "unknown_kwarg": _raises(
            lambda: V2.ElasticBuffer(group, num_bytes=1024, not_a_deep_ep_argument=1), TypeError
        ),
        "destroy_without_flag": _raises(buf.destroy, AssertionError),
    }
    # H % 256: the combine kernel does not compile (dispatch does).
    small = V2.ElasticBuffer(group, num_max_tokens_per_rank=n, hidden=16, num_topk=k)
    sx = x[:, :16].contiguous()
    s_recv, _, _, s_handle, _ = small.dispatch(sx, topk_idx=idx, **kw)
    out["combine_hidden_16"] = _raises(lambda: small.combine(s_recv, s_handle), RuntimeError)
    # A different N on each rank: the layout's rank * N addressing breaks.
    mine = n + rank
    uneven = V2.ElasticBuffer(group, num_max_tokens_per_rank=n + 1, hidden=hidden, num_topk=k)
    out["uneven_n"] = _raises(
        lambda: uneven.dispatch(x, topk_idx=idx, num_experts=experts,
                                num_max_tokens_per_rank=mine), RuntimeError,
    )  # fmt: skip
    out.update(_lifetime(group, x, idx, n, hidden, k, kw))
    return out


def _lifetime(group, x, idx, n, hidden, k, kw) -> Dict[str, object]:
    """Memory and lifetime: window + workspace on the device, the host workspace pinned;
    destroy(), use after it, and a buffer dropped without it (with and without the flag)."""
    import contextlib
    import gc
    import io

    from moe_release.runtime.measure import cpu_memory

    out: Dict[str, object] = {}
    gc.collect()
    before = cpu_memory.settled()
    flagged = V2.ElasticBuffer(
        group, num_max_tokens_per_rank=n, hidden=hidden, num_topk=k, explicitly_destroy=True
    )
    held = cpu_memory.settled()
    out["allocated"] = held - before
    out["num_bytes"] = flagged.num_bytes
    out["window"] = flagged.runtime.window.nbytes
    out["host_pinned"] = flagged.runtime.host_workspace.is_pinned()
    flagged.destroy()
    flagged.destroy()  # a second call does nothing
    gc.collect()
    out["freed_by_destroy"] = held - cpu_memory.settled()
    out["use_after_destroy"] = _raises(
        lambda: flagged.dispatch(x, topk_idx=idx, **kw), AttributeError
    )
    # Dropped without destroy(): implicit destroy (collective) unless the flag was set, when
    # DeepEP prints its warning and leaks.
    plain = V2.ElasticBuffer(group, num_max_tokens_per_rank=n, hidden=hidden, num_topk=k)
    gc.collect()
    before = cpu_memory.settled()
    del plain
    gc.collect()
    out["plain_freed"] = before - cpu_memory.settled()
    leaked = V2.ElasticBuffer(
        group, num_max_tokens_per_rank=n, hidden=hidden, num_topk=k, explicitly_destroy=True
    )
    gc.collect()
    before = cpu_memory.settled()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        del leaked
        gc.collect()
    out["leaked_kept"] = cpu_memory.settled() - before
    out["warning"] = printed.getvalue()
    out.update(_communicator(n, hidden, k))
    return out


def _communicator(n, hidden, k) -> Dict[str, object]:
    """destroy() after the buffer's process group is destroyed: on DeepEP's own communicator
    (the default) it runs; on the group's (EP_REUSE_NCCL_COMM=1) it is refused."""
    import os

    import torch.distributed as dist

    out: Dict[str, object] = {}
    for reuse in ("0", "1"):
        os.environ["EP_REUSE_NCCL_COMM"] = reuse
        try:
            group = dist.new_group(ranks=list(range(dist.get_world_size())))
            buf = V2.ElasticBuffer(
                group, num_max_tokens_per_rank=n, hidden=hidden, num_topk=k,
                explicitly_destroy=True,
            )  # fmt: skip
            out[f"managed_{reuse}"] = buf.nccl_comm_handle.managed
            dist.destroy_process_group(group)
            out[f"destroy_after_group_{reuse}"] = _raises(buf.destroy, RuntimeError)
            if buf.runtime is not None:  # refused: leave it as DeepEP would, leaked at exit
                buf.runtime.exiting = True
        finally:
            del os.environ["EP_REUSE_NCCL_COMM"]
    return out


# --------------------------------------------------------------------------------------------
# Test side.


@pytest.fixture(scope="module")
def kernel_runs(dist_job, patched_tree):
    return dist_job(f"{THIS}:rank_kernel_outputs", WORLD, patched_tree)


def test_tables_cover_every_call():
    assert {r["call"] for r in OUTPUT_ROWS} == {
        "deepepv2 dispatch", "deepepv2 cached dispatch", "deepepv2 combine", "deepepv2 capture",
    }  # fmt: skip
    assert {r["call"] for r in SYNC_ROWS} == {r["call"] for r in OUTPUT_ROWS}
    for row in OUTPUT_ROWS + SYNC_ROWS:
        assert re.fullmatch(r"[a-z_]+\.(cu|cuh|cpp|hpp|py):\d+(-\d+)?", row["source"]), row
    assert V2.DEEP_EP_V2_SOURCE_COMMIT.startswith("018f21e")


def _expected(row: Dict[str, str], ctx: Dict[str, object], x_dtype: str) -> Dict[str, object]:
    dtype, shape = row["dtype"], row["shape"]
    if dtype in ("float32", "int64", "int32", "bool", "x.dtype"):
        want = {"type": "tensor", "device": row["device"]}
        want["dtype"] = x_dtype if dtype == "x.dtype" else dtype
    else:
        want = {"type": dtype}
    if shape != "-":
        want["shape"] = _shape(shape, ctx)
    return want


@pytest.mark.parametrize("row", OUTPUT_ROWS, ids=_row_id)
def test_output_as_the_real_buffer_returns_it(kernel_runs, row):
    assert all(r["placement_active"] for r in kernel_runs)
    seen, wrong = 0, []
    for rank, result in enumerate(kernel_runs):
        for run in result["runs"]:
            if run["call"] != row["call"] or row["mode"] not in run["labels"]:
                continue
            seen += 1
            want = _expected(row, result["ctx"], "bfloat16")
            got = run["outputs"].get(row["output"])
            if got is None or any(got.get(k) != v for k, v in want.items()):
                wrong.append(f"rank {rank}, {run['mode']}: got {got}, want {want}")
    assert seen, f"no run covers mode {row['mode']!r} of {row['call']}"
    assert not wrong, f"{row['call']} {row['output']} ({row['source']} @018f21e): {wrong}"


@pytest.mark.parametrize("row", SYNC_ROWS, ids=_row_id)
def test_host_syncs_as_the_real_buffer_makes_them(kernel_runs, row):
    want = {} if row["syncs"] == "0" else {row["kind"]: int(row["syncs"])}
    runs = [
        (rank, run)
        for rank, result in enumerate(kernel_runs)
        for run in result["runs"]
        if run["call"] == row["call"] and row["mode"] in run["labels"]
    ]
    assert runs
    wrong = [f"rank {r}, {run['mode']}: {run['syncs']}" for r, run in runs if run["syncs"] != want]
    assert not wrong, wrong


def test_every_output_is_in_the_table(kernel_runs):
    rows = {(r["call"], r["output"], r["mode"]) for r in OUTPUT_ROWS}
    missing = {
        (run["call"], name, run["mode"])
        for run in kernel_runs[0]["runs"]
        for name in run["outputs"]
        if not any((run["call"], name, label) in rows for label in run["labels"])
    }
    assert not missing, sorted(missing)


@pytest.mark.parametrize("world", [2, 4])
def test_semantics_match_the_documented_contract(dist_job, patched_tree, world):
    for rank, res in enumerate(dist_job(f"{THIS}:rank_semantics", world, patched_tree)):
        assert all(res.values()), f"rank {rank}: {res}"


def test_refuses_what_the_real_buffer_refuses(dist_job, patched_tree):
    for res in dist_job(f"{THIS}:rank_refusals", WORLD, patched_tree):
        assert "buffer.hpp:1134" in res["combine_fp32"], res
        assert "buffer.hpp:899-902" in res["dispatch_fp32"], res
        assert "buffer.hpp:684" in res["too_many_tokens"], res
        assert "buffer.hpp:704-706" in res["int32_topk"], res
        assert "buffer.hpp:482-483" in res["event_without_comm_stream"], res
        assert res["cached_with_topk"].startswith("AssertionError"), res
        assert res["unknown_kwarg"].startswith("TypeError"), res
        assert res["destroy_without_flag"].startswith("AssertionError"), res
        assert "combine.cuh:109" in res["combine_hidden_16"], res
        assert "same num_max_tokens_per_rank" in res["uneven_n"], res
        # The window is the workspace and the data buffer; the host workspace is pinned.
        assert res["window"] == V2.WORKSPACE_BYTES + res["num_bytes"], res
        assert res["allocated"] == res["window"] + V2.WORKSPACE_BYTES and res["host_pinned"]
        assert res["freed_by_destroy"] == res["allocated"], res
        assert "'NoneType' object has no attribute 'dispatch'" in res["use_after_destroy"]
        assert res["plain_freed"] == res["allocated"], res
        assert res["leaked_kept"] == 0 and "`destroy()` is not called" in res["warning"], res
        # DeepEP's own communicator outlives the group; the group's own dies with it.
        assert res["managed_0"] and not res["managed_1"], res
        assert res["destroy_after_group_0"] == "ran", res
        assert "buffer.hpp:141-148" in res["destroy_after_group_1"], res


def test_buffer_size_is_deepeps_formula_worked_by_hand():
    """``calculate_buffer_size`` for one NVLink domain, bf16 (buffer.hpp:595-629): dispatch
    tokens of a32(2H) + a32(12K + 4) bytes, R x N of them; combine tokens of a32(2H) + a32(8K),
    min(R, K) x N of them; the larger. Worked by hand from layout.cuh:195-209."""
    # R=2, N=8, H=16, K=2: Bd = 32 + 32, 2 x 8 x 64 = 1,024; Bc = 32 + 32, 2 x 8 x 64.
    assert V2.buffer_size_hint(2, 8, 16, 2) == 1_024
    # R=8, N=4096, H=7168, K=8: Bd = 14,336 + 128; 8 x 4096 x 14,464 = 473,956,352 (combine:
    # 8 x 4096 x 14,400 = 471,859,200).
    assert V2.buffer_size_hint(8, 4096, 7168, 8) == 473_956_352
    # R=2, N=8, H=256, K=2: 2 x 8 x (512 + 32) = 8,704.
    assert V2.buffer_size_hint(2, 8, 256, 2) == 8_704
    # K=0 prices 32 experts per token; fp32 tokens need twice the hidden bytes.
    assert V2.buffer_size_hint(2, 8, 256, 0) == 2 * 8 * (512 + 416)
    assert V2.buffer_size_hint(2, 8, 256, 2, elem=4) == 2 * 8 * (1024 + 32)
    terms = [16, 3072 * 8, 1024 * 16, 2048 * 16, 4096, 1024 * 8, 2048 * 8, 1024 * 1024 * 8,
             1024 * 1024 * 4, 32, 33 * 1024 * 4]  # fmt: skip
    assert V2.WORKSPACE_BYTES == (sum(terms) + 31) // 32 * 32 == 12_820_544
    with pytest.raises(RuntimeError, match="buffer.hpp:600"):
        V2.buffer_size_hint(2, 0, 256, 2)
