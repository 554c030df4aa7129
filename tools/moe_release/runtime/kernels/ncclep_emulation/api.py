# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The emulated ``transformer_engine.pytorch.ep`` of one TE commit: :func:`build` binds each of
TE's names with the signature that commit has (the package docstring says which calls which)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from moe_release.runtime.cuda import placement
from moe_release.runtime.kernels.emulation_common import (
    group_size,
    kernel_host_sync,
)
from moe_release.runtime.kernels.ncclep_emulation.backend import (
    BACKEND,
    _device,
    _Module,
    _new_module,
    _require_bf16,
    _require_fp32_weights,
    _symm_alloc,
    _symm_group,
)
from moe_release.runtime.kernels.ncclep_emulation.sizes import TE_COMMITS
from moe_release.runtime.measure import faults


def build(api: str) -> _Module:
    """The emulated ``transformer_engine.pytorch.ep`` of TE ``api`` (a key of TE_COMMITS)."""
    if api not in TE_COMMITS:
        raise ValueError(f"unknown TE EP API {api!r}; known: {sorted(TE_COMMITS)}")
    m = _new_module(api)
    head, rel = api == "d0067d0", api == "4329ff8"
    _add_bootstrap(m, head, rel)
    _add_symmetric_memory(m, head, rel)
    _add_ep_buffer(m, head, rel)
    _add_dispatch_combine(m, head, rel)
    return m


def _add_bootstrap(m: _Module, head: bool, rel: bool) -> None:
    """``ep_bootstrap``, ``ep_finalize`` (and d0067d0's ``is_ep_bootstrapped``,
    ``release_symm_mem_pool``)."""

    def _bootstrap(group, num_experts, max_tokens, recv_capacity, hidden, zero_copy, num_topk=0,
                   drop=False):  # fmt: skip
        if m._BOOTSTRAPPED:
            raise RuntimeError("ep_bootstrap was already called in this process")
        if group_size(group) < 2:
            raise ValueError(
                f"ep_bootstrap requires ep_group.size() >= 2 (got {group_size(group)})."
            )
        if dist.is_initialized():
            dist.barrier(group=group)
        eager = head and recv_capacity is None
        BACKEND.initialize(group, num_experts, max_tokens, int(recv_capacity or 0), hidden,
                           bool(zero_copy), num_topk, drop, eager)  # fmt: skip
        m._BOOTSTRAPPED, m._EP_GROUP = True, group
        m._EP_RANKS = faults.group_ranks(group)  # ep_finalize's peers, should the group go
        if head:
            m._EAGER = eager

    if head:

        def ep_bootstrap(
            ep_group: dist.ProcessGroup,
            num_experts: int,
            max_tokens_per_rank: int,
            hidden_dim: int,
            num_topk: int,
            recv_capacity_per_rank: Optional[int] = None,
            max_num_sms: int = 0,
            zero_copy: bool = False,
            drop_on_overflow: bool = False,
            max_token_dtype: torch.dtype = torch.bfloat16,
        ) -> None:
            """TE d0067d0 ``ep.py:101-183``."""
            if m._BOOTSTRAPPED:
                raise RuntimeError("ep_bootstrap was already called in this process")
            if num_topk < 1:
                raise ValueError(f"ep_bootstrap requires num_topk >= 1 (got {num_topk}).")
            if zero_copy and recv_capacity_per_rank is None:
                raise ValueError("ep_bootstrap: zero_copy requires recv_capacity_per_rank")
            if drop_on_overflow and recv_capacity_per_rank is None:
                raise ValueError("ep_bootstrap: drop_on_overflow requires recv_capacity_per_rank")
            _bootstrap(ep_group, num_experts, max_tokens_per_rank, recv_capacity_per_rank,
                       hidden_dim, zero_copy, num_topk, drop_on_overflow)  # fmt: skip

        def is_ep_bootstrapped() -> bool:
            """TE d0067d0 ``ep.py:186-188``."""
            return m._BOOTSTRAPPED

        def release_symm_mem_pool() -> None:
            """TE d0067d0 ``distributed.py:1924-1955``: the pool's segments go back (the pooled
            tensors here are plain counted allocations, freed by refcount)."""

        m.is_ep_bootstrapped = is_ep_bootstrapped
        m.release_symm_mem_pool = release_symm_mem_pool
    else:

        def ep_bootstrap(
            ep_group: dist.ProcessGroup,
            num_experts: int,
            max_tokens_per_rank: int,
            recv_capacity_per_rank: int,
            hidden_dim: int,
            max_num_sms: int = 0,
            zero_copy: bool = False,
            max_token_dtype: torch.dtype = torch.bfloat16,
        ) -> None:
            """TE 4329ff84 / 622a3eea1 ``ep.py:89-140``."""
            _bootstrap(ep_group, num_experts, max_tokens_per_rank, recv_capacity_per_rank,
                       hidden_dim, zero_copy)  # fmt: skip

    def ep_finalize() -> None:
        """Idempotent teardown of the process's NCCL EP context (``ep.py:143-158``)."""
        if not m._BOOTSTRAPPED:
            return
        # NCCL EP's group and communicator teardown: a device-side collective over the EP
        # group's ranks, logged (moe_release.runtime.measure.faults), not run.
        faults.note("ncclep ep_finalize", getattr(m, "_EP_RANKS", None))
        try:
            BACKEND.finalize()
        finally:
            m._BOOTSTRAPPED, m._EP_GROUP = False, None
            if head:
                m._EAGER = False

    m.ep_bootstrap, m.ep_finalize = ep_bootstrap, ep_finalize


def _add_symmetric_memory(m: _Module, head: bool, rel: bool) -> None:
    """``symm_mem_alloc`` (and, after 4329ff8, ``is_symm_backed``)."""
    if rel:

        def symm_mem_alloc(shape, dtype, ep_group, device=None) -> torch.Tensor:
            """TE 4329ff84 ``distributed.py:1845-1863``: collective on ``ep_group``."""
            return _symm_alloc(shape, dtype, ep_group, device, collective=True)

    else:

        def symm_mem_alloc(shape, dtype, ep_group, device=None, use_pool=False, backend="NCCL"):
            """TE ``distributed.py`` (622a3eea1:1876-1909): a collective rendezvous on
            ``ep_group`` unless ``use_pool`` (the process-wide pool's segments)."""
            return _symm_alloc(shape, dtype, ep_group, device, collective=not use_pool)

        def is_symm_backed(t: torch.Tensor) -> bool:
            """TE ``ep.py:162-179``: whether ``t`` is symmetric memory."""
            return _symm_group(t) is not None

        m.is_symm_backed = is_symm_backed
    m.symm_mem_alloc = symm_mem_alloc


def _add_ep_buffer(m: _Module, head: bool, rel: bool) -> None:
    """``EpBuffer``: the handle memory and the receive buffers of one configuration."""

    def _init_buffer(self, top_k, max_tokens, recv_capacity, hidden, num_local, alignment,
                     payload_dtype, device):  # fmt: skip
        device = device if device is not None else _device()
        alignment = int(alignment)
        if alignment > 1 and (alignment & (alignment - 1)) != 0:
            raise ValueError(f"alignment must be 0, 1, or a power of two (got {alignment}).")
        self.top_k, self.alignment = int(top_k), alignment
        self.max_tokens_per_rank = int(max_tokens)
        self.recv_capacity_per_rank = None if recv_capacity is None else int(recv_capacity)
        self.hidden_dim, self.num_local_experts = int(hidden), int(num_local)
        self.payload_dtype, self.device = payload_dtype, device
        self.zero_copy = BACKEND.initialized and BACKEND.zero_copy
        size = BACKEND.handle_mem_size(self.top_k)
        self.handle_mem = torch.empty(size, dtype=torch.uint8, device=device)
        counts = torch.empty(self.num_local_experts, dtype=torch.int64 if head else torch.int32,
                             device=device)  # fmt: skip
        return counts

    if head:

        class EpBuffer:
            """TE d0067d0 ``ep.py:237-320``."""

            __slots__ = (
                "handle_mem", "top_k", "alignment", "max_tokens_per_rank",
                "recv_capacity_per_rank", "hidden_dim", "num_local_experts", "payload_dtype",
                "device", "tokens_per_expert", "zero_copy", "eager", "total_recv_tokens",
                "_host_total_recv_tokens", "dispatch_fwd_quant_recipe",
                "combine_bwd_quant_recipe",
            )  # fmt: skip

            def __init__(
                self,
                top_k: int,
                max_tokens_per_rank: int,
                hidden_dim: int,
                num_local_experts: int,
                recv_capacity_per_rank: Optional[int] = None,
                alignment: int = 0,
                payload_dtype: torch.dtype = torch.bfloat16,
                device: Optional[torch.device] = None,
                dispatch_fwd_quant_recipe=None,
                combine_bwd_quant_recipe=None,
            ) -> None:
                if not m._BOOTSTRAPPED:
                    raise RuntimeError("EpBuffer requires ep_bootstrap() to be called first.")
                if dispatch_fwd_quant_recipe is not None or combine_bwd_quant_recipe is not None:
                    raise NotImplementedError("The NCCL EP emulation does not implement MXFP8.")
                self.eager = m._EAGER
                if not self.eager and recv_capacity_per_rank is None:
                    raise ValueError(
                        "EpBuffer requires recv_capacity_per_rank unless the EP group was "
                        "bootstrapped in eager mode (recv_capacity_per_rank omitted)."
                    )
                self.tokens_per_expert = _init_buffer(
                    self, top_k, max_tokens_per_rank, recv_capacity_per_rank, hidden_dim,
                    num_local_experts, alignment, payload_dtype, device,
                )  # fmt: skip
                self.dispatch_fwd_quant_recipe = None
                self.combine_bwd_quant_recipe = None
                if self.eager:
                    pin = placement.active() or torch.cuda.is_available()
                    self.total_recv_tokens = torch.empty(1, dtype=torch.int64, pin_memory=pin)
                else:
                    self.total_recv_tokens = torch.empty(1, dtype=torch.int64, device=self.device)
                self._host_total_recv_tokens = None

    elif rel:

        class EpBuffer:
            """TE 4329ff84 ``ep.py:164-260``: in zero-copy mode it owns its symm buffers."""

            __slots__ = (
                "handle_mem", "top_k", "alignment", "max_tokens_per_rank",
                "recv_capacity_per_rank", "hidden_dim", "num_local_experts", "payload_dtype",
                "device", "token_counts", "zero_copy", "recv_tokens_symm_buf",
                "recv_topk_weights_symm_buf", "grad_expert_out_symm_buf",
            )  # fmt: skip

            def __init__(
                self,
                top_k: int,
                max_tokens_per_rank: int,
                recv_capacity_per_rank: int,
                hidden_dim: int,
                num_local_experts: int,
                alignment: int = 0,
                payload_dtype: torch.dtype = torch.bfloat16,
                device: Optional[torch.device] = None,
                dispatch_recv_tokens: Optional[torch.Tensor] = None,
                combine_grad_expert_out: Optional[torch.Tensor] = None,
            ) -> None:
                self.token_counts = _init_buffer(
                    self, top_k, max_tokens_per_rank, recv_capacity_per_rank, hidden_dim,
                    num_local_experts, alignment, payload_dtype, device,
                )  # fmt: skip
                self.recv_tokens_symm_buf = dispatch_recv_tokens
                self.grad_expert_out_symm_buf = combine_grad_expert_out
                self.recv_topk_weights_symm_buf = None
                if self.zero_copy:
                    rc, h = self.recv_capacity_per_rank, self.hidden_dim
                    self.recv_topk_weights_symm_buf = m.symm_mem_alloc(
                        (rc,), torch.float32, m._EP_GROUP, device=self.device
                    )
                    if self.recv_tokens_symm_buf is None:
                        self.recv_tokens_symm_buf = m.symm_mem_alloc(
                            (rc, h), payload_dtype, m._EP_GROUP, device=self.device
                        )
                    if self.grad_expert_out_symm_buf is None:
                        self.grad_expert_out_symm_buf = m.symm_mem_alloc(
                            (rc, h), payload_dtype, m._EP_GROUP, device=self.device
                        )

    else:

        class EpBuffer:
            """TE 622a3eea1 ``ep.py:185-234``."""

            __slots__ = (
                "handle_mem", "top_k", "alignment", "max_tokens_per_rank",
                "recv_capacity_per_rank", "hidden_dim", "num_local_experts", "payload_dtype",
                "device", "token_counts", "zero_copy",
            )  # fmt: skip

            def __init__(
                self,
                top_k: int,
                max_tokens_per_rank: int,
                recv_capacity_per_rank: int,
                hidden_dim: int,
                num_local_experts: int,
                alignment: int = 0,
                payload_dtype: torch.dtype = torch.bfloat16,
                device: Optional[torch.device] = None,
            ) -> None:
                self.token_counts = _init_buffer(
                    self, top_k, max_tokens_per_rank, recv_capacity_per_rank, hidden_dim,
                    num_local_experts, alignment, payload_dtype, device,
                )  # fmt: skip

    m.EpBuffer = EpBuffer


def _add_dispatch_combine(m: _Module, head: bool, rel: bool) -> None:
    """``ep_dispatch`` and ``ep_combine``, differentiable, and ``__all__``."""

    def _alloc_io(shape, dtype, device, zero_copy):
        if zero_copy:
            return _symm_alloc(shape, dtype, m._EP_GROUP, device, collective=False)
        return torch.empty(*shape, dtype=dtype, device=device)

    # -- autograd -------------------------------------------------------------------------
    class _EpDispatch(torch.autograd.Function):
        """Dispatch: saves only the handle; returns the receive buffers detached."""

        @staticmethod
        def forward(ctx, buffer, counts, recv_tokens, recv_weights, topk_idx, tokens, weights):
            if not head:  # prepare runs inside the Function on the older APIs
                BACKEND.prepare(buffer.handle_mem, topk_idx, counts, buffer.top_k,
                                buffer.alignment, int64_only=rel)  # fmt: skip
            BACKEND.dispatch(buffer.handle_mem, tokens, weights, recv_tokens, recv_weights)
            ctx.save_for_backward(buffer.handle_mem)
            ctx.tokens_shape, ctx.tokens_dtype = tokens.shape, tokens.dtype
            ctx.weights_shape = weights.shape
            if not head:
                ctx.mark_non_differentiable(counts)
                return recv_tokens.detach(), recv_weights.detach(), counts
            return recv_tokens.detach(), recv_weights.detach()

        @staticmethod
        def backward(ctx, g_tokens, g_weights, *_):
            (handle_mem,) = ctx.saved_tensors
            g_tokens, g_weights = g_tokens.contiguous(), g_weights.contiguous()
            grad_dtype = g_tokens.dtype if head else ctx.tokens_dtype
            grad_tokens = torch.empty(ctx.tokens_shape, dtype=grad_dtype, device=g_tokens.device)
            grad_weights = torch.empty(ctx.weights_shape, dtype=torch.float32,
                                       device=g_tokens.device)  # fmt: skip
            BACKEND.dispatch_bwd(handle_mem, g_tokens, g_weights, grad_tokens, grad_weights)
            return None, None, None, None, None, grad_tokens, grad_weights

    class _EpCombine(torch.autograd.Function):
        """Combine: saves only the handle; the backward's target is a plain ctx attribute."""

        @staticmethod
        def forward(ctx, handle_mem, num_local_tokens, hidden, grad_out, zero_copy, expert_out):
            result = torch.empty(num_local_tokens, hidden, dtype=expert_out.dtype,
                                 device=expert_out.device)  # fmt: skip
            BACKEND.combine(handle_mem, expert_out, result)
            ctx.save_for_backward(handle_mem)
            ctx.grad_out, ctx.zero_copy = grad_out, zero_copy
            ctx.out_shape, ctx.out_dtype = expert_out.shape, expert_out.dtype
            ctx.out_device = expert_out.device
            return result

        @staticmethod
        def backward(ctx, g_result):
            (handle_mem,) = ctx.saved_tensors
            target = ctx.grad_out
            if target is None:
                if rel:
                    target = torch.empty(ctx.out_shape, dtype=ctx.out_dtype,
                                         device=ctx.out_device)  # fmt: skip
                else:
                    target = _alloc_io(ctx.out_shape, ctx.out_dtype, ctx.out_device,
                                       ctx.zero_copy)  # fmt: skip
            BACKEND.combine_bwd(handle_mem, g_result.contiguous(), target)
            return None, None, None, None, None, target

    # -- dispatch / combine ---------------------------------------------------------------
    def _dispatch(buffer, tokens, topk_idx, topk_weights, recv_tokens, recv_weights):
        _require_fp32_weights(topk_weights)
        _require_bf16("tokens", tokens)
        counts = buffer.tokens_per_expert if head else buffer.token_counts
        rows = buffer.recv_capacity_per_rank
        if head:
            if buffer.eager and (recv_tokens is not None or recv_weights is not None):
                raise ValueError(
                    "eager mode sizes the recv outputs from the per-step recv-token total "
                    "and cannot use caller-supplied recv_tokens / recv_topk_weights"
                )
            BACKEND.prepare(buffer.handle_mem, topk_idx, counts, buffer.top_k, buffer.alignment,
                            total=buffer.total_recv_tokens)  # fmt: skip
            if buffer.eager:
                kernel_host_sync("te_ep eager")  # the stream sync before reading the total
                buffer._host_total_recv_tokens = BACKEND._routing(buffer.handle_mem).total
                rows = buffer._host_total_recv_tokens
                kernel_host_sync("te_ep eager")  # NCCL EP reads the received count again
        if recv_tokens is None:
            recv_tokens = _alloc_io((rows, buffer.hidden_dim), buffer.payload_dtype,
                                    buffer.device, buffer.zero_copy)  # fmt: skip
        if recv_weights is None:
            recv_weights = _alloc_io((rows,), torch.float32, buffer.device, buffer.zero_copy)
        out = _EpDispatch.apply(buffer, counts, recv_tokens, recv_weights, topk_idx, tokens,
                                topk_weights)  # fmt: skip
        return (out[0], out[1], counts) if head else out

    if rel:

        def ep_dispatch(buffer, tokens: torch.Tensor, topk_idx: torch.Tensor,
                        topk_weights: torch.Tensor):  # fmt: skip
            """TE 4329ff84 ``ep.py:542-584``: the receive buffers come from the EpBuffer (owned
            in zero-copy mode) or are allocated per call."""
            _require_fp32_weights(topk_weights)
            _require_bf16("tokens", tokens)
            recv = buffer.recv_tokens_symm_buf
            if recv is None:
                recv = torch.empty(buffer.recv_capacity_per_rank, buffer.hidden_dim,
                                   dtype=buffer.payload_dtype, device=buffer.device)  # fmt: skip
            weights = (
                buffer.recv_topk_weights_symm_buf
                if buffer.zero_copy
                else torch.empty(buffer.recv_capacity_per_rank, dtype=torch.float32,
                                 device=buffer.device)
            )  # fmt: skip
            return _dispatch(buffer, tokens, topk_idx, topk_weights, recv, weights)

        def ep_combine(buffer, expert_out: torch.Tensor, *, num_local_tokens: Optional[int] = None):
            """TE 4329ff84 ``ep.py:587-610``."""
            _require_bf16("expert_out", expert_out)
            n = buffer.max_tokens_per_rank if num_local_tokens is None else num_local_tokens
            return _EpCombine.apply(buffer.handle_mem, n, buffer.hidden_dim,
                                    buffer.grad_expert_out_symm_buf, buffer.zero_copy,
                                    expert_out)  # fmt: skip

    else:

        def ep_dispatch(buffer, tokens: torch.Tensor, topk_idx: torch.Tensor,
                        topk_weights: torch.Tensor, *, recv_tokens: Optional[torch.Tensor] = None,
                        recv_topk_weights: Optional[torch.Tensor] = None):  # fmt: skip
            """TE 622a3eea1 ``ep.py:529-572`` / d0067d0 ``ep.py:830-904``."""
            return _dispatch(buffer, tokens, topk_idx, topk_weights, recv_tokens,
                             recv_topk_weights)  # fmt: skip

        def ep_combine(buffer, expert_out: torch.Tensor, *, num_local_tokens: Optional[int] = None,
                       grad_out: Optional[torch.Tensor] = None):  # fmt: skip
            """TE 622a3eea1 ``ep.py:575-599`` / d0067d0 ``ep.py:907-953``."""
            _require_bf16("expert_out", expert_out)
            if head and buffer.eager and grad_out is not None:
                raise ValueError(
                    "eager mode sizes the combine grad target per step and cannot use a "
                    "caller-supplied grad_out"
                )
            n = buffer.max_tokens_per_rank if num_local_tokens is None else num_local_tokens
            return _EpCombine.apply(buffer.handle_mem, n, buffer.hidden_dim, grad_out,
                                    buffer.zero_copy, expert_out)  # fmt: skip

    m.ep_dispatch, m.ep_combine = ep_dispatch, ep_combine
    m.__all__ = ["EpBuffer", "ep_bootstrap", "ep_finalize", "ep_dispatch", "ep_combine",
                 "symm_mem_alloc"] + ([] if rel else ["is_symm_backed"]) + (
                     ["is_ep_bootstrapped", "release_symm_mem_pool"] if head else [])  # fmt: skip
