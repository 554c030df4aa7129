# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The TransformerEngine NCCL EP emulation (``transformer_engine.pytorch.ep``) against TE's source.

For each of the three TE APIs megatron calls (4329ff8 for dev, 622a3ee for 0.19.2, d0067d0 for
main), a job on two gloo ranks under the placement rules runs the calls megatron makes and describes
every output; each row of :mod:`moe_release.runtime.kernels.ncclep_emulation`'s table is one test.
The semantics are checked against a reference written from TE's documented contract (``ep.h``:
expert-major zones in source order, zero padding, the unweighted sum of a token's slots, the
gradients of both), with small integers so that every bf16 sum is exact; what TE refuses is refused;
each API accepts the calls of its megatron tree and refuses the others'; the import hook serves only
megatron's two imports.
"""

import re
import sys
from typing import Dict, List

import pytest

from moe_release.runtime.kernels import ncclep_emulation as TE
from tests.tooling.runtime.kernels.test_deepep_emulation_outputs import _shape, parse_tables

THIS = "tests.tooling.runtime.kernels.test_ncclep_emulation"
WORLD = 2
APIS = sorted(TE.TE_COMMITS)
OUTPUT_ROWS, SYNC_ROWS = parse_tables(TE.__doc__)
T, K, H, LOCAL, MAX_TOKENS, RC = 6, 2, 64, 2, 64, 128


def _row_id(row: Dict[str, str]) -> str:
    parts = [row["call"], row.get("output", ""), row["mode"]]
    return re.sub(r"\s+", "_", ":".join(p for p in parts if p)) + "@" + row["source"]


def _describe(value) -> Dict[str, object]:
    from moe_release.runtime.cuda import placement

    if value is None:
        return {"type": "None"}
    return {
        "type": "tensor",
        "device": placement.placement_of(value),
        "dtype": str(value.dtype).replace("torch.", ""),
        "shape": list(value.shape),
    }


def _routing(world: int, seed: int = 3):
    """Every rank's top-k indices (distinct per row; -1 in some rows), weights and tokens (small
    integers: bf16 sums are exact), the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(seed)
    experts = world * LOCAL
    idx = torch.stack([torch.randperm(experts, generator=g)[:K] for _ in range(world * T)])
    idx = idx.view(world, T, K)
    idx[:, 0, 1] = -1
    w = torch.randint(1, 5, (world, T, K), generator=g).float() / 4
    x = torch.randint(-4, 5, (world, T, H), generator=g).to(torch.bfloat16)
    return idx, w, x, experts


def _bootstrap(m, api: str, group, experts: int, capacity, zero_copy: bool = False):
    kw = dict(num_experts=experts, max_tokens_per_rank=MAX_TOKENS, hidden_dim=H,
              zero_copy=zero_copy)  # fmt: skip
    if api == "d0067d0":
        m.ep_bootstrap(group, num_topk=K, recv_capacity_per_rank=capacity, **kw)
    else:
        m.ep_bootstrap(group, recv_capacity_per_rank=capacity, **kw)


def _buffer(m, api: str, capacity, alignment: int = 0):
    kw = dict(top_k=K, max_tokens_per_rank=MAX_TOKENS, hidden_dim=H, num_local_experts=LOCAL,
              alignment=alignment)  # fmt: skip
    return m.EpBuffer(recv_capacity_per_rank=capacity, **kw)


def _counts(api: str, buf):
    return buf.tokens_per_expert if api == "d0067d0" else buf.token_counts


# --------------------------------------------------------------------------------------------
# Rank side.


def rank_outputs(api: str) -> Dict[str, object]:
    """Every call of the table on TE ``api``, fixed mode (and eager on d0067d0)."""
    import contextlib

    import torch.distributed as dist

    from moe_release.runtime.cuda import placement

    rules = contextlib.nullcontext() if placement.active() else placement.rules()
    runs: List[Dict[str, object]] = []
    with rules:
        rank, group = dist.get_rank(), dist.group.WORLD
        idx_all, w_all, x_all, experts = _routing(dist.get_world_size())
        for mode in ("fixed", "eager") if api == "d0067d0" else ("fixed",):
            m = TE.build(api)
            capacity = None if mode == "eager" else RC
            _bootstrap(m, api, group, experts, capacity)
            buf = _buffer(m, api, capacity)
            idx = idx_all[rank].clone()
            x = x_all[rank].clone().requires_grad_()
            w = w_all[rank].clone().requires_grad_()
            labels = sorted({"all", mode})
            ctx = dict(T=T, K=K, H=H, E_l=LOCAL, RC=RC, S=buf.handle_mem.shape[0])

            def record(call, names, values, _labels=labels, _ctx=ctx, _mode=mode):
                syncs: Dict[str, int] = {}
                for (kind, _), n in placement.SYNCS.items():
                    syncs[kind] = syncs.get(kind, 0) + n
                outputs = {n: _describe(v) for n, v in zip(names, values)}
                runs.append(dict(api=api, call=call, mode=_mode, labels=_labels, ctx=_ctx,
                                 outputs=outputs, syncs=syncs))  # fmt: skip

            record("te_ep buffer", ("handle_mem", "total_recv_tokens"),
                   (buf.handle_mem, getattr(buf, "total_recv_tokens", None)))  # fmt: skip
            placement.SYNCS.clear()
            recv, recv_w, counts = m.ep_dispatch(buf, x, idx, w)
            ctx["P"] = recv.shape[0]
            record("te_ep dispatch", ("recv_tokens", "recv_topk_weights", "token_counts"),
                   (recv, recv_w, counts))  # fmt: skip
            grads = {}
            expert_out = recv * 2
            expert_out.register_hook(lambda g, _g=grads: _g.setdefault("expert_out", g))
            placement.SYNCS.clear()
            out = m.ep_combine(buf, expert_out, num_local_tokens=T)
            record("te_ep combine", ("result",), (out,))
            (out.float().sum() + recv_w.sum()).backward()
            record("te_ep dispatch backward", ("grad_tokens", "grad_topk_weights"),
                   (x.grad, w.grad))  # fmt: skip
            record("te_ep combine backward", ("grad_expert_out",), (grads["expert_out"],))
            m.ep_finalize()
    return {"placement_active": placement.active(), "runs": runs}


def _reference(idx_all, w_all, x_all, rank: int, world: int, alignment: int):
    """The receive buffer of ``rank`` by TE's contract: zones by local expert, (source rank,
    source token) order, zero rows (weight 0) to the alignment."""
    import torch

    rows, weights, counts, owners = [], [], [], []
    for e in range(LOCAL):
        expert = rank * LOCAL + e
        hits = [(s, t) for s in range(world) for t in range(T) if expert in idx_all[s, t].tolist()]
        n = len(hits) + (-len(hits) % alignment if alignment > 1 and hits else 0)
        for s, t in hits:
            k = idx_all[s, t].tolist().index(expert)
            rows.append(x_all[s, t])
            weights.append(w_all[s, t, k])
            owners.append((s, t, expert))
        rows += [torch.zeros(H, dtype=torch.bfloat16)] * (n - len(hits))
        weights += [torch.tensor(0.0)] * (n - len(hits))
        owners += [None] * (n - len(hits))
        counts.append(n)
    return torch.stack(rows), torch.stack(weights), counts, owners


def rank_semantics(api: str, alignment: int) -> Dict[str, object]:
    """Dispatch, combine and both backwards against the reference, on every rank."""
    import torch
    import torch.distributed as dist

    world, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    idx_all, w_all, x_all, experts = _routing(world, seed=5)
    m = TE.build(api)
    _bootstrap(m, api, group, experts, RC)
    buf = _buffer(m, api, RC, alignment)
    x = x_all[rank].clone().requires_grad_()
    w = w_all[rank].clone().requires_grad_()
    kwargs = {}
    if api != "4329ff8":  # a caller-owned buffer: rows past the zones stay as they were
        kwargs["recv_tokens"] = torch.full((RC, H), 7.0, dtype=torch.bfloat16)
    recv, recv_w, counts = m.ep_dispatch(buf, x, idx_all[rank], w, **kwargs)
    want_rows, want_w, want_counts, owners = _reference(idx_all, w_all, x_all, rank, world,
                                                        alignment)  # fmt: skip
    used = want_rows.shape[0]
    out = {
        "rows": torch.equal(recv[:used], want_rows),
        "weights": torch.equal(recv_w[:used], want_w),
        "counts": counts.tolist() == want_counts,
    }
    if kwargs:
        out["tail_untouched"] = bool((recv[used:] == 7).all())
    # Identity experts scaled per slot: combine sums a token's slots, unweighted.
    scale = torch.arange(1, RC + 1, dtype=torch.float32).remainder(3).add(1).to(torch.bfloat16)
    expert_out = recv * scale.unsqueeze(1)
    grads = {}
    expert_out.register_hook(lambda g: grads.setdefault("expert_out", g))
    result = m.ep_combine(buf, expert_out, num_local_tokens=T)
    g_out = torch.randint(-3, 4, (T, H), generator=torch.Generator().manual_seed(9 + rank))
    g_out = g_out.to(torch.bfloat16)
    g_w = torch.arange(RC, dtype=torch.float32) / 8
    (result.float() * g_out.float()).sum().add((recv_w * g_w).sum()).backward()
    # Every rank's slots and scales, to build the reference combine of this rank's tokens.
    all_slots = [None] * world
    dist.all_gather_object(all_slots, [(o, float(scale[i])) for i, o in enumerate(owners)])
    want = torch.zeros(T, H)
    want_xgrad = torch.zeros(T, H)
    want_wgrad = torch.zeros(T, K)
    g_out_all = [torch.zeros(T, H, dtype=torch.bfloat16) for _ in range(world)]
    dist.all_gather(g_out_all, g_out)
    for slots in all_slots:
        for slot, (owner, sc) in enumerate(slots):
            if owner is None or owner[0] != rank:
                continue
            _, t, expert = owner
            want[t] += x_all[rank, t].float() * sc
            want_xgrad[t] += g_out[t].float() * sc
            want_wgrad[t, idx_all[rank, t].tolist().index(expert)] = slot / 8
    out["combine"] = torch.equal(result, want.to(torch.bfloat16))
    out["grad_tokens"] = torch.equal(x.grad, want_xgrad.to(torch.bfloat16))
    out["grad_weights"] = torch.equal(w.grad, want_wgrad)
    ge = grads["expert_out"]
    pads = [i for i, o in enumerate(owners) if o is None]
    out["grad_padding_zero"] = bool((ge[pads] == 0).all()) if pads else True
    own = [g_out_all[o[0]][o[1]] if o else torch.zeros(H, dtype=torch.bfloat16) for o in owners]
    out["grad_expert_out"] = torch.equal(ge[:used], torch.stack(own))
    out["padded"] = bool(pads) == (alignment > 1)
    m.ep_finalize()
    return out


def _raises(fn, kind) -> str:
    try:
        fn()
    except kind as exc:
        return f"{kind.__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - the wrong kind is the result
        return f"wrong {type(exc).__name__}: {exc}"
    return "ran"


def rank_refusals(api: str) -> Dict[str, object]:
    """What TE refuses, one call each."""
    import contextlib

    import torch
    import torch.distributed as dist

    from moe_release.runtime.cuda import placement

    world, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    singles = [dist.new_group([r]) for r in range(world)]
    idx_all, w_all, x_all, experts = _routing(world)
    idx, w, x = idx_all[rank], w_all[rank], x_all[rank]
    m = TE.build(api)
    out = {
        "buffer_before_bootstrap": _raises(lambda: _buffer(m, api, RC), RuntimeError),
        "group_of_one": _raises(lambda: _bootstrap(m, api, singles[rank], experts, RC), ValueError),
    }
    _bootstrap(m, api, group, experts, RC)
    out["second_bootstrap"] = _raises(lambda: _bootstrap(m, api, group, experts, RC), RuntimeError)
    out["alignment_3"] = _raises(lambda: _buffer(m, api, RC, alignment=3), ValueError)
    buf = _buffer(m, api, RC)
    out["fp32_tokens"] = _raises(lambda: m.ep_dispatch(buf, x.float(), idx, w), NotImplementedError)
    out["bf16_weights"] = _raises(lambda: m.ep_dispatch(buf, x, idx, w.bfloat16()), TypeError)
    out["int32_topk"] = _raises(lambda: m.ep_dispatch(buf, x, idx.int(), w), RuntimeError)
    long_x = torch.zeros(MAX_TOKENS + 1, H, dtype=torch.bfloat16)
    long_i = torch.zeros(MAX_TOKENS + 1, K, dtype=torch.int64)
    long_w = torch.zeros(MAX_TOKENS + 1, K)
    out["too_many_tokens"] = _raises(lambda: m.ep_dispatch(buf, long_x, long_i, long_w),
                                     RuntimeError)  # fmt: skip
    with placement.rules() if not placement.active() else contextlib.nullcontext():
        host = x.to("cpu")  # a host copy: TE's ops have no CPU kernel
        out["host_tensor"] = _raises(lambda: m.ep_dispatch(buf, host, idx, w), NotImplementedError)
    other = m.EpBuffer(top_k=K + 1, max_tokens_per_rank=MAX_TOKENS, hidden_dim=H,
                       num_local_experts=LOCAL, recv_capacity_per_rank=RC)  # fmt: skip
    m.ep_dispatch(buf, x, idx, w)
    idx3 = torch.cat([idx, torch.full((T, 1), -1)], 1)
    w3 = torch.cat([w, torch.zeros(T, 1)], 1)
    out["other_top_k"] = _raises(lambda: m.ep_dispatch(other, x, idx3, w3), RuntimeError)
    m.ep_finalize()
    out["use_after_finalize"] = _raises(lambda: m.ep_dispatch(buf, x, idx, w), RuntimeError)
    # A capacity the routing overflows: a device trap in NCCL EP (drop on d0067d0 when asked).
    m = TE.build(api)
    _bootstrap(m, api, group, experts, MAX_TOKENS)
    small = _buffer(m, api, MAX_TOKENS)
    big_i = torch.arange(MAX_TOKENS * K).remainder(experts).view(MAX_TOKENS, K)
    big_x = torch.ones(MAX_TOKENS, H, dtype=torch.bfloat16)
    big_w = torch.ones(MAX_TOKENS, K)
    out["overflow"] = _raises(lambda: m.ep_dispatch(small, big_x, big_i, big_w), RuntimeError)
    m.ep_finalize()
    # Zero-copy: a receive buffer that is not symmetric memory is refused.
    if api != "4329ff8":
        m = TE.build(api)
        _bootstrap(m, api, group, experts, RC, zero_copy=True)
        zbuf = _buffer(m, api, RC)
        plain = torch.empty(RC, H, dtype=torch.bfloat16)
        out["zero_copy_plain"] = _raises(
            lambda: m.ep_dispatch(zbuf, x, idx, w, recv_tokens=plain), RuntimeError
        )
        symm = m.symm_mem_alloc((RC, H), torch.bfloat16, group)
        out["zero_copy_symm"] = _raises(
            lambda: m.ep_dispatch(zbuf, x, idx, w, recv_tokens=symm), RuntimeError
        )
        out["symm_view_backed"] = m.is_symm_backed(symm.detach()[2:])
        out["plain_not_backed"] = not m.is_symm_backed(plain)
        m.ep_finalize()
    return out


# --------------------------------------------------------------------------------------------
# Test side.


@pytest.fixture(scope="module")
def output_runs(dist_job, patched_tree):
    return {api: dist_job(f"{THIS}:rank_outputs", WORLD, patched_tree, api=api) for api in APIS}


def _expected(row, ctx, api):
    dtype = row["dtype"]
    if dtype == "counts":
        dtype = "int64" if api == "d0067d0" else "int32"
    want = {"type": "tensor", "device": row["device"], "dtype": dtype}
    if row["shape"] != "-":
        want["shape"] = _shape(row["shape"], ctx)
    return want


def test_table_covers_every_call():
    assert {r["call"] for r in OUTPUT_ROWS} == {
        "te_ep dispatch", "te_ep combine", "te_ep dispatch backward", "te_ep combine backward",
        "te_ep buffer",
    }  # fmt: skip
    for row in OUTPUT_ROWS + SYNC_ROWS:
        assert re.fullmatch(r"[a-z_]+\.(cu|cuh|cpp|cc|py):\d+(-\d+)?", row["source"]), row


@pytest.mark.parametrize("row", OUTPUT_ROWS, ids=_row_id)
def test_output_as_te_returns_it(output_runs, row):
    seen, wrong = 0, []
    for api, results in output_runs.items():
        for rank, result in enumerate(results):
            assert result["placement_active"]
            for run in result["runs"]:
                if run["call"] != row["call"] or row["mode"] not in run["labels"]:
                    continue
                got = run["outputs"].get(row["output"])
                if api != "d0067d0" and row["output"] == "total_recv_tokens":
                    assert got == {"type": "None"}, got  # the older APIs have no such slot
                    continue
                seen += 1
                want = _expected(row, run["ctx"], api)
                if got != want:
                    wrong.append(f"{api} rank {rank} {run['mode']}: got {got}, want {want}")
    assert seen, row
    assert not wrong, wrong


@pytest.mark.parametrize("row", SYNC_ROWS, ids=_row_id)
def test_host_syncs_as_te_makes_them(output_runs, row):
    want = {} if row["syncs"] == "0" else {row["kind"]: int(row["syncs"])}
    runs = [
        (api, run)
        for api, results in output_runs.items()
        for result in results
        for run in result["runs"]
        if run["call"] == row["call"] and row["mode"] in run["labels"]
    ]
    assert runs
    assert all(run["syncs"] == want for _, run in runs), [(a, r["syncs"]) for a, r in runs]


@pytest.mark.parametrize("api,alignment", [("622a3ee", 0), ("622a3ee", 4), ("4329ff8", 0),
                                           ("d0067d0", 2)])  # fmt: skip
def test_semantics_match_tes_contract(dist_job, patched_tree, api, alignment):
    res = dist_job(f"{THIS}:rank_semantics", WORLD, patched_tree, api=api, alignment=alignment)
    for rank, r in enumerate(res):
        assert all(r.values()), f"rank {rank}: {r}"


@pytest.mark.parametrize("api", APIS)
def test_refuses_what_te_refuses(dist_job, patched_tree, api):
    for r in dist_job(f"{THIS}:rank_refusals", WORLD, patched_tree, api=api):
        assert "EPBackend not initialized" in r["buffer_before_bootstrap"] or (
            api == "d0067d0" and "requires ep_bootstrap" in r["buffer_before_bootstrap"]
        ), r
        assert r["group_of_one"].startswith("ValueError"), r
        assert "already called" in r["second_bootstrap"], r
        assert r["alignment_3"].startswith("ValueError"), r
        assert "only bfloat16" in r["fp32_tokens"], r
        assert "must be float32" in r["bf16_weights"], r
        assert (r["int32_topk"] == "ran") == (api != "4329ff8"), r
        assert "exceeds HT buffer capacity" in r["too_many_tokens"], r
        assert "transformer_engine_ep::" in r["host_tensor"], r
        assert "disagrees with process-wide" in r["other_top_k"], r
        assert "EPBackend not initialized" in r["use_after_finalize"], r
        assert "max_recv_tokens_per_rank" in r["overflow"], r
        if api != "4329ff8":
            assert "must be symm-mem-backed" in r["zero_copy_plain"], r
            assert r["zero_copy_symm"] == "ran" and r["symm_view_backed"], r
            assert r["plain_not_backed"], r


def test_each_api_takes_its_megatron_calls_only():
    """The signatures: 0.19.2's keyword calls only on 622a3ee, main's bootstrap only on
    d0067d0, dev's positional calls on 4329ff8 (and on 622a3ee, which keeps them)."""
    import inspect

    rel, mid, head = (TE.build(a) for a in ("4329ff8", "622a3ee", "d0067d0"))
    dispatch_kw = dict(recv_tokens=None, recv_topk_weights=None)
    assert "recv_tokens" not in inspect.signature(rel.ep_dispatch).parameters
    inspect.signature(mid.ep_dispatch).bind(None, None, None, None, **dispatch_kw)
    inspect.signature(mid.ep_combine).bind(None, None, num_local_tokens=1, grad_out=None)
    with pytest.raises(TypeError):
        inspect.signature(rel.ep_combine).bind(None, None, num_local_tokens=1, grad_out=None)
    v0192 = dict(num_experts=4, max_tokens_per_rank=64, recv_capacity_per_rank=8, hidden_dim=8,
                 max_num_sms=0, zero_copy=False)  # fmt: skip
    inspect.signature(mid.ep_bootstrap).bind(None, **v0192)
    with pytest.raises(TypeError, match="num_topk"):
        inspect.signature(head.ep_bootstrap).bind(None, **v0192)
    main = dict(v0192, num_topk=2, drop_on_overflow=True)
    inspect.signature(head.ep_bootstrap).bind(None, **main)
    with pytest.raises(TypeError):
        inspect.signature(mid.ep_bootstrap).bind(None, **main)
    assert hasattr(head, "is_ep_bootstrapped") and not hasattr(mid, "is_ep_bootstrapped")
    assert hasattr(mid, "is_symm_backed") and not hasattr(rel, "is_symm_backed")


def test_the_tree_picks_the_api(base_tree, tmp_path):
    """0.19.2's fused_a2a calls 622a3ee's signatures; a tree without NCCL EP gets none."""
    assert TE.api_for_tree(base_tree) == "622a3ee"
    assert TE.api_for_tree(str(tmp_path)) is None


def test_import_hook_serves_only_megatrons_imports():
    """``from transformer_engine.pytorch import ep`` and ``from transformer_engine.pytorch.ep
    import is_symm_backed`` find the emulation; ``import transformer_engine`` still fails."""
    assert "transformer_engine" not in sys.modules
    module = TE.install("622a3ee")
    try:
        from transformer_engine.pytorch import ep as te_ep
        from transformer_engine.pytorch.ep import is_symm_backed

        assert te_ep is module and is_symm_backed is module.is_symm_backed
        with pytest.raises(ImportError):
            import transformer_engine  # noqa: F401
        with pytest.raises(ImportError):
            from transformer_engine.pytorch import Linear  # noqa: F401
        assert "transformer_engine" not in sys.modules
    finally:
        TE.uninstall()
    with pytest.raises(ImportError):
        from transformer_engine.pytorch import ep  # noqa: F401


def test_handle_mem_size_is_nccl_eps_layout_worked_by_hand():
    """``HtBlockLayout::compute`` (nccl_ep.cc:2397-2471), one node, expert-major, local permute:
    M=64, MR=32, R=2, E=4 (E_l=2), K=2, 132 SMs; each term rounded up to 256."""
    # r2a 64 -> 256; ler 32 x 2 = 64 -> 256; ntfe 4 -> 256; s2d 64 x 2 x 4 = 512; rank masks
    # 64 x 2 x 8 = 1,024; scan 132 x 2 x 8 = 2,112 -> 2,304; probs 64 x 4 x 4 = 1,024;
    # top-k 64 x 2 x 8 = 1,024; pec 8 -> 256; eto 24 -> 256; flat2em 32 x 2 x 4 = 256;
    # weights 256; token-to-slot 64 x 2 x 4 = 512.
    want = 256 + 256 + 256 + 512 + 1024 + 2304 + 1024 + 1024 + 256 + 256 + 256 + 256 + 512
    assert TE.handle_mem_size(64, 32, 2, 4, 2) == want == 8_192
    # Zero-copy (local dup): s2d by K (64 x 2 x 4), the fan-out groups 16 x 2 x 4 and a counter.
    zc = want - 512 - 256 - 256 - 512 + 512 + 256 + 256
    assert TE.handle_mem_size(64, 32, 2, 4, 2, zero_copy=True) == zc


def test_context_bytes_are_nccl_eps_group_allocations_worked_by_hand():
    """``ncclEpCreateGroup`` for TE's configuration (nccl_ep.cc:1013-1248, 1900-1963): R=2,
    E=4, M=64, MR=256, hidden 256 bf16 (B = 512 bytes a token)."""
    # Workspace 33,554,432 + counters 32 + routing map 2 x 64 x ceil(4/8) = 128; the mega buffer:
    # staging 2 x a256(64 x 2 x 512) = 131,072, probabilities 2 x a256(256 x 4 x 4) = 8,192,
    # scales a256(256 x 512) = 131,072 (270,336); completion flags 8.
    sizes = TE.context_bytes(2, 4, 64, 256, 256)
    assert sizes == {"device": 33_824_936, "pinned": 80, "leaked": 2 * 1024 * 1024}
    # Zero-copy: no staging.
    assert TE.context_bytes(2, 4, 64, 256, 256, zero_copy=True)["device"] == 33_824_936 - 131_072


def rank_context_memory() -> Dict[str, int]:
    """Rank side: the counted bytes a bootstrap allocates and ep_finalize frees."""
    import gc

    import torch.distributed as dist

    from moe_release.runtime.measure import cpu_memory

    cpu_memory.install()
    m = TE.build("622a3ee")
    gc.collect()
    before = cpu_memory.settled()
    _bootstrap(m, "622a3ee", dist.group.WORLD, WORLD * LOCAL, RC)
    held = cpu_memory.settled()
    m.ep_finalize()
    gc.collect()
    return {"allocated": held - before, "freed": held - cpu_memory.settled()}


def test_bootstrap_allocates_the_context_and_finalize_frees_it(dist_job, patched_tree):
    want = TE.context_bytes(WORLD, WORLD * LOCAL, MAX_TOKENS, RC, H)
    for res in dist_job(f"{THIS}:rank_context_memory", WORLD, patched_tree):
        assert res["allocated"] == want["device"] + want["pinned"] + want["leaked"], res
        assert res["freed"] == want["device"] + want["pinned"], res
