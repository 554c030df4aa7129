# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Rank-side jobs: one spawn per world size runs many checks and returns their verdicts.

Spawning ranks and importing megatron-core costs seconds, so each job batches every check of
one world size and returns ``{check_name: (passed, detail)}``; the pytest side turns each entry
into its own test. Checks compare with ``torch.equal``: kernel checks use small-integer data,
so any summation order is exact, and the layer checks mirror the combine order in the oracle.
"""

import sys
from typing import Callable, Dict, Tuple

import torch
import torch.distributed as dist

from moe_release.runtime.cuda.compat import stream_stand_in_of
from moe_release.runtime.measure import cpu_memory
from moe_release.runtime.megatron import moe_harness
from tests.unit_tests.device_placement import FactoryPlacement
from tests.unit_tests.transformer.moe import moe_cpu_harness as harness

Verdicts = Dict[str, Tuple[bool, str]]


def _check(verdicts: Verdicts, name: str, actual, expected) -> None:
    if actual is None or expected is None:
        ok = actual is None and expected is None
        detail = f"{type(actual).__name__} vs {type(expected).__name__}"
    elif isinstance(expected, torch.Tensor):
        ok = (
            isinstance(actual, torch.Tensor)
            and actual.shape == expected.shape
            and actual.dtype == expected.dtype
            and torch.equal(actual, expected)
        )
        detail = "" if ok else _diff(actual, expected)
    else:
        ok = actual == expected
        detail = "" if ok else f"{actual!r} != {expected!r}"
    verdicts[name] = (bool(ok), detail)


def _diff(a, e) -> str:
    if not isinstance(a, torch.Tensor):
        return f"got {type(a).__name__}"
    if a.shape != e.shape or a.dtype != e.dtype:
        return f"got {tuple(a.shape)} {a.dtype}, expected {tuple(e.shape)} {e.dtype}"
    return f"max abs diff {(a.double() - e.double()).abs().max().item():.3g}"


# --------------------------------------------------------------------------------------------
# Kernel-level checks against a reference written from the documented semantics.


def _routing(world: int, tokens: int, local: int, seed: int) -> torch.Tensor:
    """Uneven routing with the edge cases: an expert no token picks, a token routed nowhere,
    and (world > 1) a rank that sends nothing and a rank that receives nothing."""
    g = torch.Generator().manual_seed(seed)
    maps = torch.rand(world, tokens, world * local, generator=g) < 0.45
    maps[:, :, 1] = False
    maps[:, 0, :] = False
    if world > 1:
        maps[world - 1] = False
        maps[:, :, (world - 1) * local :] = False
    return maps


def _int_data(shape, seed: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=g).to(dtype)


def _expected_dispatch(x, probs, maps, rank, local, pad):
    """Rows for each local expert: source rank, then token order; zero rows to pad."""
    world, tokens, _ = maps.shape
    rows, row_probs, counts, owners = [], [], [], []
    for e in range(local):
        g = rank * local + e
        sel = [(s, n) for s in range(world) for n in range(tokens) if maps[s, n, g]]
        count = len(sel) + ((-len(sel) % pad) if pad else 0)
        rows += [x[s, n] for s, n in sel] + [torch.zeros_like(x[0, 0])] * (count - len(sel))
        row_probs += [probs[s, n, g] for s, n in sel] + [torch.tensor(0.0)] * (count - len(sel))
        owners += [e] * count
        counts.append(count)
    h = x.shape[-1]
    out = torch.stack(rows) if rows else x.new_zeros((0, h))
    out_probs = torch.stack(row_probs).float() if row_probs else torch.zeros(0)
    return out, out_probs, torch.tensor(counts, dtype=torch.int32), torch.tensor(owners)


def hybrid_ep_kernel_checks(emu, verdicts: Verdicts) -> None:
    """HybridEPBuffer.dispatch_with_permute / combine_with_unpermute against the reference."""
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    # hybrid_ep_cpp, which megatron-core imported directly in 2026-05 (#4719): every CPU rank
    # is on this host, so every rank of the group is in the NVLink domain (allocator.cu:178).
    import hybrid_ep_cpp

    detected = hybrid_ep_cpp.ExtendedMemoryAllocator().detect_accessible_ranks(group)
    _check(verdicts, "hybridep-kernel-detect-accessible-ranks", detected, world)
    local, tokens, hidden = 2, 7, 4
    maps = _routing(world, tokens, local, seed=11)
    for dtype in (torch.float32, torch.bfloat16):
        x = _int_data((world, tokens, hidden), 12, dtype)
        probs = (_int_data((world, tokens, world * local), 13, torch.float32).abs() + 1) / 16
        probs = probs * maps
        for pad in (None, 4):
            tag = f"hybridep-kernel-{str(dtype)[6:]}-pad{pad}"
            buf = emu.HybridEPBuffer(group, hidden, tokens, local)
            out, out_probs, sf, tpe, handle = buf.dispatch_with_permute(
                hidden=x[rank],
                routing_map=maps[rank],
                probs=probs[rank],
                scaling_factor=None,
                num_of_experts_per_rank=local,
                pad_multiple=pad,
                num_permuted_tokens=None,
                non_blocking=False,
            )
            exp, exp_probs, exp_tpe, owners = _expected_dispatch(x, probs, maps, rank, local, pad)
            _check(verdicts, f"{tag}-tokens", out, exp)
            _check(verdicts, f"{tag}-probs", out_probs, exp_probs)
            # Blocking: int64 counts in pinned host memory (compared as values here; where
            # each output lives is test_deepep_emulation_outputs.py's).
            _check(
                verdicts,
                f"{tag}-tokens_per_expert",
                (tpe.dtype, tpe.tolist()),
                (torch.int64, exp_tpe.tolist()),
            )
            _check(verdicts, f"{tag}-handle_len", len(handle), 11)
            _check(verdicts, f"{tag}-overflow", int(handle[-1].item()), 0)
            # Combine: scale each row by (local expert + 1); sums of small integers are exact.
            scaled = out * (owners + 1).to(dtype).unsqueeze(-1)
            comb, comb_probs = buf.combine_with_unpermute(
                hidden=scaled, probs=out_probs, handle=handle, pad_multiple=pad
            )
            weight = ((torch.arange(world * local) % local) + 1).to(torch.float32)
            exp_comb = (x[rank].float() * (maps[rank].float() @ weight).unsqueeze(-1)).to(dtype)
            _check(verdicts, f"{tag}-combine", comb, exp_comb)
            _check(verdicts, f"{tag}-combine_probs", comb_probs, probs[rank] * maps[rank])
            # Replay with the handle (HybridEPCombine.backward): same layout, no probs, and
            # num_permuted_tokens as megatron-core passes it (the 0-dim sum of the counts).
            again, no_probs, _, tpe2, _ = buf.dispatch_with_permute(
                hidden=x[rank] * 2,
                scaling_factor=None,
                handle=handle,
                pad_multiple=pad,
                num_permuted_tokens=tpe.sum(),
            )
            _check(verdicts, f"{tag}-replay_tokens", again, exp * 2)
            _check(verdicts, f"{tag}-replay_probs", no_probs, None)
            _check(verdicts, f"{tag}-replay_tokens_per_expert", tpe2, None)
            # A static budget above the need: zero tail rows, no overflow.
            total = exp.shape[0]
            big, big_probs, _, big_tpe, big_handle = buf.dispatch_with_permute(
                hidden=x[rank],
                routing_map=maps[rank],
                probs=probs[rank],
                num_of_experts_per_rank=local,
                pad_multiple=pad,
                num_permuted_tokens=total + 3,
                non_blocking=True,
            )
            _check(
                verdicts, f"{tag}-budget_tokens", big, torch.cat([exp, exp.new_zeros(3, hidden)])
            )
            _check(
                verdicts, f"{tag}-budget_probs", big_probs, torch.cat([exp_probs, torch.zeros(3)])
            )
            _check(verdicts, f"{tag}-budget_tokens_per_expert", big_tpe, exp_tpe.long())
            _check(verdicts, f"{tag}-budget_overflow", int(big_handle[-1].item()), 0)
            # A budget below the need: rows past it dropped, overflow flagged. Every rank calls
            # (the dispatch is collective); a rank that receives nothing cannot overflow.
            budget = max(total - 1, 0)
            small, _, _, small_tpe, small_handle = buf.dispatch_with_permute(
                hidden=x[rank],
                routing_map=maps[rank],
                probs=probs[rank],
                num_of_experts_per_rank=local,
                pad_multiple=pad,
                num_permuted_tokens=budget,
                non_blocking=True,
            )
            _check(verdicts, f"{tag}-overflow_tokens", small, exp[:budget])
            _check(verdicts, f"{tag}-overflow_flag", int(small_handle[-1].item()), int(total > 0))
            _check(verdicts, f"{tag}-overflow_tpe_sum", int(small_tpe.sum()), budget)
    # Unequal token counts, which the kernel's routing-map all-gather cannot take (each rank
    # reads [N x ranks, E] with its own N): refused on every rank, naming each rank's count.
    if world > 1:
        n = tokens + rank
        try:
            emu.HybridEPBuffer(group, hidden, n, local).dispatch_with_permute(
                hidden=torch.zeros(n, hidden),
                routing_map=torch.zeros(n, world * local, dtype=torch.bool),
                num_of_experts_per_rank=local,
            )
            got = "no error"
        except ValueError as exc:
            got = str(exc).rsplit(": the ranks", 1)[-1]
        counts = ", ".join(f"rank {r}: {tokens + r}" for r in range(world))
        _check(verdicts, "hybridep-kernel-unequal-tokens", got,
               f" of the group pass different counts: {counts}")  # fmt: skip


def deep_ep_kernel_checks(emu, verdicts: Verdicts) -> None:
    """Buffer.get_dispatch_layout / dispatch / combine against the reference."""
    world, rank = dist.get_world_size(), dist.get_rank()
    local, tokens, hidden, topk = 2, 7, 4, 2
    experts = world * local
    g = torch.Generator().manual_seed(21)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(world * tokens)])
    idx = idx.view(world, tokens, topk)
    idx[:, 0, :] = -1  # a token routed nowhere
    idx[:, 1, 1] = -1  # a token with a single expert
    weights = torch.where(idx >= 0, (_int_data(idx.shape, 22, torch.float32).abs() + 1) / 8, 0.0)
    x = _int_data((world, tokens, hidden), 23, torch.bfloat16)
    buf = emu.Buffer(dist.group.WORLD, 0, 0)
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx[rank], experts)
    dest = torch.zeros(world, tokens, world, dtype=torch.bool)
    for s in range(world):
        for n in range(tokens):
            for k in range(topk):
                if idx[s, n, k] >= 0:
                    dest[s, n, idx[s, n, k] // local] = True
    _check(verdicts, "deepep-kernel-is_token_in_rank", in_rank, dest[rank])
    _check(verdicts, "deepep-kernel-tokens_per_rank", per_rank, dest[rank].sum(0).to(torch.int32))
    exp_per_expert = torch.bincount(idx[rank][idx[rank] >= 0], minlength=experts).to(torch.int32)
    _check(verdicts, "deepep-kernel-tokens_per_expert", per_expert, exp_per_expert)
    _check(verdicts, "deepep-kernel-rdma_layout", per_rdma, None)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x[rank],
        topk_idx=idx[rank],
        topk_weights=weights[rank],
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
    )
    sel = [(s, n) for s in range(world) for n in range(tokens) if dest[s, n, rank]]
    exp_x = torch.stack([x[s, n] for s, n in sel]) if sel else x.new_zeros(0, hidden)
    begin = rank * local
    exp_idx = torch.stack([idx[s, n] for s, n in sel]) if sel else idx.new_zeros(0, topk)
    mine = (exp_idx >= begin) & (exp_idx < begin + local)
    exp_w = torch.stack([weights[s, n] for s, n in sel]) if sel else torch.zeros(0, topk)
    _check(verdicts, "deepep-kernel-recv_x", recv_x, exp_x)
    _check(
        verdicts, "deepep-kernel-recv_topk_idx", recv_idx, torch.where(mine, exp_idx - begin, -1)
    )
    _check(verdicts, "deepep-kernel-recv_topk_weights", recv_w, torch.where(mine, exp_w, 0.0))
    exp_counts = [int(((exp_idx - begin) == e)[mine].sum()) for e in range(local)]
    _check(verdicts, "deepep-kernel-recv_counts", counts, exp_counts)
    # Combine: each rank scales what it received by (rank + 1); copies are summed per token.
    comb, comb_w, _ = buf.combine(recv_x * (rank + 1), handle, topk_weights=recv_w)
    factor = (dest[rank].float() @ (torch.arange(world) + 1).float()).unsqueeze(-1)
    _check(verdicts, "deepep-kernel-combine", comb, (x[rank].float() * factor).bfloat16())
    _check(verdicts, "deepep-kernel-combine_weights", comb_w, weights[rank])
    cached = buf.dispatch(x[rank] * 2, handle=handle)
    _check(verdicts, "deepep-kernel-cached_recv_x", cached[0], exp_x * 2)
    _check(verdicts, "deepep-kernel-cached_routing", cached[1:4], (None, None, None))


# --------------------------------------------------------------------------------------------
# megatron-core's real dispatcher and MoE layer against the dense oracle.


def layer_checks(backend: str, recompute: bool, verdicts: Verdicts, tokens: int = 12) -> None:
    """A full MoELayer (real TopKRouter, SequentialMLP experts, flex dispatcher) fwd + bwd."""
    from megatron.core.transformer.moe import fused_a2a

    world, rank = dist.get_world_size(), dist.get_rank()
    tag = f"layer-{backend}-{'checkpoint' if recompute else 'plain'}"
    config = moe_harness.moe_config(backend, world, recompute=recompute)
    layer = moe_harness.build_moe_layer(config)
    layer.train()
    harness.load_layer_weights(layer, config)
    if recompute:
        _check(verdicts, f"{tag}-uses_checkpoint", bool(layer.moe_layer_recompute), True)
    xs_all = harness.seeded((world, tokens, config.hidden_size), 99)
    x = xs_all[rank].clone().view(tokens, 1, -1).requires_grad_()
    out, _ = layer(x)
    grads = [harness.seeded((tokens, config.hidden_size), 100 + r) for r in range(world)]
    out.backward(grads[rank].view_as(out))

    oracle = harness.DenseOracle(config, world, layer.router.weight)
    xs = [xs_all[r].clone().requires_grad_() for r in range(world)]
    outs = oracle.forward(xs)
    torch.autograd.backward(outs, grads)
    _check(verdicts, f"{tag}-output", out.detach().view(tokens, -1), outs[rank].detach())
    _check(verdicts, f"{tag}-input_grad", x.grad.view(tokens, -1), xs[rank].grad)
    _check(verdicts, f"{tag}-router_grad", layer.router.weight.grad, oracle.router[rank].grad)
    local = config.num_moe_experts // world
    for i, expert in enumerate(layer.experts.local_experts):
        e = rank * local + i
        _check(verdicts, f"{tag}-fc1_grad{i}", expert.linear_fc1.weight.grad, oracle.w1[e].grad)
        _check(verdicts, f"{tag}-fc2_grad{i}", expert.linear_fc2.weight.grad, oracle.w2[e].grad)
    fused_a2a.reset_hybrid_ep_buffer()


def dispatcher_checks(backend: str, verdicts: Verdicts, tokens: int = 9) -> None:
    """MoEFlexTokenDispatcher alone, with edge-case routing and a per-expert scaling expert."""
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

    from megatron.core.transformer.moe import fused_a2a

    world, rank = dist.get_world_size(), dist.get_rank()
    tag = f"dispatcher-{backend}"
    config = moe_harness.moe_config(backend, world)
    num_experts, local = config.num_moe_experts, config.num_moe_experts // world
    topk = config.moe_router_topk
    # Top-k routing with the edge cases (DeepEP needs exactly k picks, so no empty tokens).
    g = torch.Generator().manual_seed(31)
    maps = torch.zeros(world, tokens, num_experts, dtype=torch.bool)
    for s in range(world):
        for n in range(tokens):
            pool = [e for e in range(num_experts) if e != 1]  # expert 1 gets no token
            if world > 1 and s == world - 1:
                # The last rank sends to the first rank(s) only.
                pool = [e for e in pool if e < max(local, topk + 1)]
            pick = torch.randperm(len(pool), generator=g)[:topk]
            maps[s, n, [pool[i] for i in pick]] = True
    probs_all = torch.rand(world, tokens, num_experts, generator=g) * maps
    x_all = harness.seeded((world, tokens, config.hidden_size), 32)
    scale_all = harness.seeded((num_experts, config.hidden_size), 33)

    from megatron.core.transformer.moe.moe_layer import get_default_pg_collection

    dispatcher = MoEFlexTokenDispatcher(
        local,
        list(range(rank * local, (rank + 1) * local)),
        config,
        pg_collection=get_default_pg_collection(),
    )
    x = x_all[rank].clone().requires_grad_()
    probs = probs_all[rank].clone().requires_grad_()
    scale = scale_all[rank * local : (rank + 1) * local].clone().requires_grad_()
    hidden, p = dispatcher.dispatch_preprocess(x, maps[rank], probs)
    hidden, p = dispatcher.token_dispatch(hidden, p)
    hidden, tokens_per_expert, p = dispatcher.dispatch_postprocess(hidden, p)
    counts = [int(c) for c in tokens_per_expert.tolist()]
    chunks = torch.split(hidden, counts)
    probs_chunks = torch.split(p, counts)
    y = torch.cat(
        [c * scale[e] * pc.unsqueeze(-1) for e, (c, pc) in enumerate(zip(chunks, probs_chunks))]
    )
    y = dispatcher.combine_preprocess(y)
    y = dispatcher.token_combine(y)
    y = dispatcher.combine_postprocess(y)
    out_grads = harness.seeded((world, tokens, config.hidden_size), 34)
    y.backward(out_grads[rank])
    exp_counts = [int(maps[:, :, rank * local + e].sum()) for e in range(local)]
    _check(verdicts, f"{tag}-tokens_per_expert", counts, exp_counts)

    # Oracle: each expert sees its rows in (source rank, token) order, as one tensor; a token's
    # output sums its experts' rows per owning rank, then over ranks, in ascending order.
    xs = [x_all[r].clone().requires_grad_() for r in range(world)]
    ps = [probs_all[r].clone().requires_grad_() for r in range(world)]
    sc = scale_all.clone().requires_grad_()
    outs = [torch.zeros_like(x_all[r]) for r in range(world)]
    for d in range(world):
        partial = [torch.zeros_like(x_all[r]) for r in range(world)]
        for e in range(d * local, (d + 1) * local):
            rows = [torch.nonzero(maps[r, :, e]).flatten() for r in range(world)]
            inp = torch.cat([xs[r][rows[r]] for r in range(world)])
            pe = torch.cat([ps[r][rows[r], e] for r in range(world)])
            y_e = inp * sc[e] * pe.unsqueeze(-1)
            start = 0
            for r in range(world):
                partial[r] = partial[r].index_add(0, rows[r], y_e[start : start + len(rows[r])])
                start += len(rows[r])
        outs = [o + p for o, p in zip(outs, partial)]
    torch.autograd.backward(outs, list(out_grads))
    _check(verdicts, f"{tag}-output", y.detach(), outs[rank].detach())
    _check(verdicts, f"{tag}-input_grad", x.grad, xs[rank].grad)
    _check(verdicts, f"{tag}-probs_grad", probs.grad, ps[rank].grad * maps[rank])
    _check(verdicts, f"{tag}-expert_grad", scale.grad, sc.grad[rank * local : (rank + 1) * local])
    fused_a2a.reset_hybrid_ep_buffer()


def rng_shim_checks(verdicts: Verdicts) -> None:
    """Dropout inside tensor_parallel.checkpoint recomputes bitwise with the CPU RNG shim."""
    from megatron.core.tensor_parallel import random as tp_random

    from megatron.core import tensor_parallel

    queued = len(getattr(torch.cuda, "_queued_calls", []))
    w = harness.seeded((8, 8), 41).requires_grad_()

    def fn(inp):
        h = torch.nn.functional.dropout(inp @ w, p=0.5, training=True)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            h = torch.nn.functional.dropout(h, p=0.3, training=True)
        return h.tanh()

    x = harness.seeded((5, 8), 42)
    results = []
    for use_checkpoint in (False, True):
        torch.manual_seed(5)
        tensor_parallel.model_parallel_cuda_manual_seed(77)
        xi = x.clone().requires_grad_()
        w.grad = None
        before = tp_random._get_cuda_rng_state()
        out = tensor_parallel.checkpoint(fn, False, xi) if use_checkpoint else fn(xi)
        out.backward(torch.ones_like(out))
        results.append((out.detach(), xi.grad, w.grad.clone(), before))
    _check(verdicts, "rng-checkpoint_output", results[1][0], results[0][0])
    _check(verdicts, "rng-checkpoint_input_grad", results[1][1], results[0][1])
    _check(verdicts, "rng-checkpoint_weight_grad", results[1][2], results[0][2])
    _check(verdicts, "rng-dropout_active", bool((results[0][0] == 0).any()), True)
    _check(verdicts, "rng-no_lazy_calls", len(getattr(torch.cuda, "_queued_calls", [])), queued)


def base_shim_checks(tree_kind: str, shims, verdicts: Verdicts) -> None:
    """No shim for the CUDA-only allocations under the placement rules (they are the emulated
    GPU's), both without them, on either tree; the module globals stay torch's."""
    from megatron.core.transformer.moe import router, token_dispatcher
    from moe_release.runtime.cuda import placement

    expected = [] if placement.active() else ["over_budget", "router_device"]
    cuda_only = [name for name in shims if name != "te_general_gemm"]  # 0.16's, not CUDA's
    _check(verdicts, f"compat-{tree_kind}-shims", cuda_only, expected)
    # token_dispatcher may see torch through the DtoH stream stand-in (streams only).
    dispatcher_torch = token_dispatcher.torch
    _check(
        verdicts,
        f"compat-{tree_kind}-module_torch_restored",
        (dispatcher_torch is torch or stream_stand_in_of(dispatcher_torch), router.torch is torch),
        (True, True),
    )


# --------------------------------------------------------------------------------------------
# Deliberate breakage: each must make at least one check above fail.


def _break(emu, how: str) -> Callable[[], None]:
    """Patch the emulation in this rank; returns the undo."""
    cls = emu.HybridEPBuffer
    original = cls.dispatch_with_permute
    original_deep = emu.Buffer.combine

    if how == "swap_rows":

        def patched(self, **kw):
            out = original(self, **kw)
            t = out[0]
            if t.shape[0] >= 2:
                t[[0, 1]] = t[[1, 0]]
            return out

        cls.dispatch_with_permute = patched
    elif how == "drop_padding":

        def patched(self, **kw):
            kw["pad_multiple"] = None
            return original(self, **kw)

        cls.dispatch_with_permute = patched
    elif how == "no_overflow_flag":

        def patched(self, **kw):
            out = original(self, **kw)
            out[4][-1].zero_()
            return out

        cls.dispatch_with_permute = patched
    elif how == "deepep_drop_last_rank":

        def patched_combine(self, x, handle, *args, **kw):
            x = x.clone()
            if self.rank == self.group_size - 1:
                x.zero_()
            return original_deep(self, x, handle, *args, **kw)

        emu.Buffer.combine = patched_combine
    else:
        raise ValueError(how)

    def undo():
        cls.dispatch_with_permute = original
        emu.Buffer.combine = original_deep

    return undo


BREAKAGES = ("swap_rows", "drop_padding", "no_overflow_flag", "deepep_drop_last_rank")


# --------------------------------------------------------------------------------------------
# Jobs (entry points for run_distributed).


def staged_kernel_checks(emu, verdicts: Verdicts) -> None:
    """The kernel checks again through the host-staged collectives a GPU run takes (gloo on
    CUDA tensors), forced here on host tensors: same results, and staging really used."""
    from moe_release.runtime.kernels import emulation_common

    original = emulation_common.staged_through_host
    used = []

    def always(t, group):
        used.append(tuple(t.shape))
        return True

    staged: Verdicts = {}
    emulation_common.staged_through_host = always
    try:
        hybrid_ep_kernel_checks(emu, staged)
        deep_ep_kernel_checks(emu, staged)
    finally:
        emulation_common.staged_through_host = original
    verdicts.update({f"staged-{name}": v for name, v in staged.items()})
    _check(verdicts, "staged-kernel-collectives-used", len(used) > 0, True)


def _emulation():
    return sys.modules["moe_release.runtime.kernels.deepep_module"]


def emulation_and_layer_job(tree_kind: str = "patched") -> Verdicts:
    """Every check for this world size."""
    world = dist.get_world_size()
    info = moe_harness.init_megatron(ep=world)
    emu = _emulation()
    verdicts: Verdicts = {}
    base_shim_checks(tree_kind, info["shims"], verdicts)
    # Every tensor the emulation creates must follow its inputs' device, or the same code
    # breaks on CUDA tensors; on the host only an explicit device= shows that.
    placement = FactoryPlacement([m.__file__ for m in emu.KERNEL_MODULES])
    with placement:
        hybrid_ep_kernel_checks(emu, verdicts)
        if world > 1:
            deep_ep_kernel_checks(emu, verdicts)
    _check(
        verdicts,
        "emulation-kernel-factories-name-a-device",
        (placement.calls > 0, placement.missing),
        (True, []),
    )
    if world > 1:
        staged_kernel_checks(emu, verdicts)
    backends = ["hybridep"] + (["deepep"] if world > 1 else [])
    for backend in backends:
        dispatcher_checks(backend, verdicts)
        for recompute in (False, True):
            layer_checks(backend, recompute, verdicts)
    if world == 1:
        rng_shim_checks(verdicts)
    return verdicts


def breakage_job(how: str) -> Verdicts:
    """The kernel and layer checks with the emulation deliberately broken in one way.

    A rank may also raise (a broken layout can break shapes); the caller counts that as the
    breakage being caught too.
    """
    moe_harness.init_megatron(ep=dist.get_world_size())
    emu = _emulation()
    verdicts: Verdicts = {}
    undo = _break(emu, how)
    try:
        hybrid_ep_kernel_checks(emu, verdicts)
        deep_ep_kernel_checks(emu, verdicts)
        for backend in ("hybridep", "deepep"):
            layer_checks(backend, False, verdicts)
    finally:
        undo()
    return verdicts


def memory_probe_job(
    num_layers: int = 3, tokens: int = 256, hidden: int = 64, recompute: bool = True
) -> Dict[str, object]:
    """A small multi-layer HybridEP run, then the retained-state probe on every MoE layer."""
    import importlib

    probe = importlib.import_module("megatron.core.transformer.moe.moe_memory_probe")
    # The allocator deltas: CUDA's counters, or on the CPU runtime the counting host allocator
    # (the placement rules answer torch.cuda.memory_allocated from it).
    if not torch.cuda.is_available():
        cpu_memory.install()
        probe.set_host_allocated_bytes(cpu_memory.memory_allocated)
    world, rank = dist.get_world_size(), dist.get_rank()
    moe_harness.init_megatron(ep=world)
    config = moe_harness.moe_config(
        "hybridep", world, hidden=hidden, ffn=2 * hidden, recompute=recompute, num_layers=num_layers
    )
    model = torch.nn.ModuleList(
        [moe_harness.build_moe_layer(config, layer_number=i + 1) for i in range(num_layers)]
    )
    model.train()
    for layer in model:
        harness.load_layer_weights(layer, config)
    x = harness.seeded((world, tokens, 1, hidden), 5)[rank].clone().requires_grad_()
    h = x
    for layer in model:
        h, _ = layer(h)
    h.sum().backward()
    del h
    reports = probe.probe_model(model, release=True)
    return {
        "text": probe.format_report(reports),
        "layers": [
            {
                "name": r.name,
                "manager": r.manager,
                "direct": r.direct,
                "by_kind": r.by_kind(),
                "pinned_bytes": r.pinned_bytes,
                "release_bytes": r.release_bytes,
                "paths": [(p.kind, p.nbytes, p.path) for p in r.pinned if not p.shared_with_model],
            }
            for r in reports
        ],
    }


def retained_state_job(cases) -> list:
    """Per case (dispatcher type, flex backend, layers, tokens, hidden, experts, topk,
    recompute): a multi-layer MoE stack's forward and backward, then the retained-state probe
    on every MoE layer, with the rows each layer's experts received (the routing's measured
    input to the prediction)."""
    import importlib

    probe = importlib.import_module("megatron.core.transformer.moe.moe_memory_probe")
    world, rank = dist.get_world_size(), dist.get_rank()
    moe_harness.init_megatron(ep=world)
    out = []
    for case in cases:
        if case["recompute"] == "full":
            out.append(_retained_state_full_recompute(case, probe))
            continue
        # megatron-core wants the softmax before the top-k for top-1 routing.
        overrides = dict(
            moe_token_dispatcher_type=case["dispatcher"], moe_router_pre_softmax=case["topk"] == 1
        )
        if case["dispatcher"] != "flex":
            overrides["moe_flex_dispatcher_backend"] = None
        config = moe_harness.moe_config(
            case.get("backend") or "hybridep",
            world,
            num_experts=case["experts"],
            topk=case["topk"],
            hidden=case["hidden"],
            ffn=2 * case["hidden"],
            recompute=case["recompute"],
            num_layers=case["layers"],
            **overrides,
        )
        model = torch.nn.ModuleList(
            [moe_harness.build_moe_layer(config, layer_number=i + 1) for i in range(case["layers"])]
        )
        model.train()
        for layer in model:
            harness.load_layer_weights(layer, config)
        rows, received = _layer_counters(model)
        # The input as a parameter (an embedding's output stands for it): every layer's input
        # is a graph output, as in a model, and the probe counts the input as the model's.
        x = harness.seeded((world, case["tokens"], 1, case["hidden"]), 5)[rank]
        model.append(moe_harness.InputHolder(x))
        h = model[-1]()
        for layer in model[:-1]:
            h, _ = layer(h)
        h.float().sum().backward()
        del h
        out.append(_probed(case, model, rows, received, probe))
        del model
    return out


def _layer_counters(layers) -> tuple:
    """Hooks recording, per MoE layer, the rows its experts receive and (DeepEP) the tokens its
    dispatch delivers."""
    rows, received = {}, {}
    for i, layer in enumerate(layers):

        def record(module, args, i=i):
            rows[i] = int(args[0].shape[0])

        layer.experts.register_forward_pre_hook(record)
        manager = getattr(layer.token_dispatcher, "_comm_manager", None)
        if type(manager).__name__ == "_DeepepManager":
            permute = manager.get_permuted_hidden_states_by_experts

            def counted(hidden_states, i=i, permute=permute):
                received[i] = int(hidden_states.shape[0])
                return permute(hidden_states)

            manager.get_permuted_hidden_states_by_experts = counted
    return rows, received


def _retained_state_full_recompute(case, probe) -> dict:
    """The full-recompute case: a GPTModel (local spec) whose every layer is recomputed
    (uniform, one layer per checkpoint), one forward and backward, then the probe."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    world = dist.get_world_size()
    cfg = dict(experts=case["experts"], topk=case["topk"], hidden=case["hidden"],
               ffn=2 * case["hidden"], layers=case["layers"], heads=4, vocab=64,
               seq=case["tokens"], dispatcher=case["dispatcher"],
               backend=case.get("backend") or "hybridep")  # fmt: skip
    overrides = dict(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1, moe_router_pre_softmax=case["topk"] == 1)  # fmt: skip
    if case["dispatcher"] != "flex":
        overrides["moe_flex_dispatcher_backend"] = None
    config = moe_harness.gpt_moe_config(cfg, world, **overrides)
    spec = get_gpt_layer_local_spec(num_experts=case["experts"], moe_grouped_gemm=False)
    model = moe_harness.gpt_model(config, cfg, spec)
    model.train()
    moe_layers = [m for _, m in model.named_modules() if hasattr(m, "token_dispatcher")]
    rows, received = _layer_counters(moe_layers)
    g = torch.Generator().manual_seed(11 + dist.get_rank())
    tokens = torch.randint(0, cfg["vocab"], (1, cfg["seq"]), generator=g)
    pos = torch.arange(cfg["seq"]).unsqueeze(0)
    mask = torch.triu(torch.ones(cfg["seq"], cfg["seq"], dtype=torch.bool), diagonal=1)[None, None]
    model(tokens, pos, attention_mask=mask, labels=tokens).float().mean().backward()
    return _probed(case, model, rows, received, probe)


def _probed(case, model, rows: dict, received: dict, probe) -> dict:
    """The probe on every MoE layer of ``model`` after its backward: per layer what it pins,
    and what all of them hold together (a later layer's graph may reach back through earlier
    layers: every storage once), with the rows and tokens the layers received."""
    reports = probe.probe_model(model)
    keys = probe.model_storage_keys(model)
    roots = []
    for _, d in probe.find_moe_dispatchers(model):
        roots += [t for _, t in probe._attr_tensors(d, "d")]
        if getattr(d, "_comm_manager", None) is not None:
            roots += [t for _, t in probe._attr_tensors(d._comm_manager, "m")]
    union = probe.reachable_storages(roots)
    return {
        "case": case,
        "union_bytes": sum(n for k, n in union.items() if k not in keys),
        "layers": [
            {
                "rows": rows[i],
                "received": received.get(i),
                "pinned_bytes": r.pinned_bytes,
                "paths": [
                    (p.kind, p.nbytes, p.path, list(p.shape), p.dtype)
                    for p in r.pinned
                    if not p.shared_with_model
                ],
            }
            for i, r in enumerate(reports)
        ],
    }
