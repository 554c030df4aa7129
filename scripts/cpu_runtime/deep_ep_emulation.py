# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Emulation of the DeepEP / HybridEP kernels that megatron-core's flex dispatcher calls.

The emulation implements, over plain ``torch.distributed`` collectives (gloo works), the
documented semantics of the two ``deep_ep`` Python surfaces that
``megatron/core/transformer/moe/fused_a2a.py`` binds at import time:

* ``HybridEPBuffer.dispatch_with_permute`` / ``combine_with_unpermute`` (the ``hybridep`` flex
  backend): tokens are gathered on the ranks that own their experts, grouped by local expert
  (source rank, then token order, inside each expert), each expert padded with zero rows to
  ``pad_multiple``; combine sums the rows of every copy of a token without probability weighting
  and scatters probabilities back to ``[num_tokens, num_experts]``.
* ``Buffer.get_dispatch_layout`` / ``dispatch`` / ``combine`` (the ``deepep`` flex backend,
  intranode "normal" mode): a token is sent once to each rank owning one of its top-k experts;
  received top-k indices are made local (``-1`` and weight ``0`` for experts on other ranks);
  combine sums the copies of each token (and the top-k weights) on the source rank.

Only torch and the standard library are imported, so the module can be registered as
``deep_ep`` before megatron-core is first imported. It never activates by itself: call
:func:`install` explicitly (tests, the memory report). Reductions accumulate in float32 and
run in a fixed order (local experts ascending, then ranks ascending), so results are
deterministic; tensors of any floating dtype are accepted, although the real kernels move
16-bit (HybridEP) or bf16/fp8 (DeepEP) payloads only.

Tensors may live on the host or on a GPU: every tensor the emulation creates is placed on the
device of its inputs (handles included, as the real kernels keep them on the GPU), and
collectives over a gloo group stage non-CPU tensors through host memory.
"""

import importlib.util
import os
import sys
import types
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["Buffer", "EventHandle", "EventOverlap", "HybridEPBuffer", "install", "uninstall"]

# Marker so callers (and tests) can tell the emulation from a real deep_ep.
IS_CPU_EMULATION = True


class EventHandle:
    """Stand-in for DeepEP's CUDA event wrapper: everything here runs synchronously."""

    def current_stream_wait(self) -> None:
        """Nothing to wait for: the emulated kernels finish before they return."""


class EventOverlap:
    """Stand-in for ``deep_ep.utils.EventOverlap``; a no-op on synchronous collectives."""

    def __init__(self, event: Optional[EventHandle] = None, extra_tensors=None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Nothing to wait for: the emulated kernels finish before they return."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def _buffer_device() -> torch.device:
    """Where a communication buffer lives: the current GPU, else the host."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def hybrid_ep_buffer_bytes(
    max_num_of_tokens_per_rank: int,
    hidden_dim: int,
    num_local_experts: int,
    num_of_ranks: int,
) -> int:
    """Bytes of HybridEP's intranode buffer, as DeepEP's hybrid-ep sizes it: rows per rank are
    ``max(tokens, 512)`` rounded up to the combine chunk (``NUM_OF_TOKENS_PER_CHUNK_COMBINE_API``,
    default 64); for ``N`` = rows x ranks and ``E`` = the group's expert columns it holds BF16
    tokens ``N*2H``, FP32 probabilities ``N*4E``, a routing-map byte per expert column ``N*E``
    and FP32 scaling factors ``N*4*ceil(H/128)`` (allocated even without FP8); dispatch outputs
    alias the combine inputs. (T=1000, 2 ranks, H=2048, E=256: 11,141,120 bytes.)"""
    chunk = int(os.environ.get("NUM_OF_TOKENS_PER_CHUNK_COMBINE_API", "64"))
    rows = -(-max(max_num_of_tokens_per_rank, 512) // chunk) * chunk
    n = rows * num_of_ranks
    e = num_local_experts * num_of_ranks
    return n * (2 * hidden_dim + 5 * e + 4 * -(-hidden_dim // 128))


def _group_size(group) -> int:
    return 1 if group is None and not dist.is_initialized() else dist.get_world_size(group)


def _group_rank(group) -> int:
    return 0 if group is None and not dist.is_initialized() else dist.get_rank(group)


def _staged_through_host(t: torch.Tensor, group) -> bool:
    """Whether a collective on ``t`` must go through host memory: gloo on a non-CPU tensor.

    The emulation runs on CUDA tensors too (the memory report on a GPU, several ranks sharing
    one device, where NCCL refuses a duplicate GPU). Staging explicitly keeps the result
    independent of which collectives a torch build's gloo implements for CUDA.
    """
    # The storage's device is where the memory really is (the CPU runtime's placement rules
    # report a host tensor that stands in for a device one as ``cuda:0``).
    return t.untyped_storage().device.type != "cpu" and dist.get_backend(group) == "gloo"


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy (``.cpu()`` keeps a dense tensor's strides, e.g. a transpose's)."""
    return t.to("cpu", memory_format=torch.contiguous_format)


def _collective(t: torch.Tensor, out_rows: int, group, op) -> torch.Tensor:
    """``op(out, src)`` into a new ``[out_rows, *t.shape[1:]]`` tensor on ``t``'s device,
    staged through host memory where :func:`_staged_through_host` says so."""
    staged = _staged_through_host(t, group)
    src = _host_copy(t) if staged else t.contiguous()
    out = src.new_empty((out_rows,) + tuple(t.shape[1:]))
    op(out, src)
    return out.to(t.device) if staged else out


def _all_to_all(rows: torch.Tensor, send_counts: List[int], recv_counts: List[int], group):
    """Uneven all-to-all of the leading dimension; a local copy on a group of one."""
    if len(send_counts) == 1:
        return rows.clone()
    return _collective(
        rows,
        sum(recv_counts),
        group,
        lambda out, src: dist.all_to_all_single(
            out, src, list(recv_counts), list(send_counts), group=group
        ),
    )


def _all_gather_rows(t: torch.Tensor, group) -> torch.Tensor:
    """Gather equally sized per-rank tensors along dim 0 (rank order)."""
    size = _group_size(group)
    if size == 1:
        return t.clone()
    return _collective(
        t,
        t.shape[0] * size,
        group,
        lambda out, src: dist.all_gather_into_tensor(out, src, group=group),
    )


def _sum_rows(rows: torch.Tensor, index: torch.Tensor, num_out: int, out_dtype) -> torch.Tensor:
    """out[index[i]] += rows[i] in row order, accumulated in float32."""
    acc = torch.zeros((num_out,) + tuple(rows.shape[1:]), dtype=torch.float32, device=rows.device)
    if rows.shape[0] > 0:
        acc.index_add_(0, index, rows.float())
    return acc.to(out_dtype)


@dataclass
class HybridEPConfig:
    """What the emulated metadata preprocessing fixed for one dispatch (kept in the handle)."""

    hidden_dim: int
    num_of_experts_per_rank: int
    group_size: int
    rank: int
    pad_multiple: Optional[int]
    num_permuted_tokens: Optional[int]
    tokens_per_expert: torch.Tensor


class HybridEPBuffer:
    """Emulation of ``deep_ep.HybridEPBuffer`` (permute + all-to-all + permute).

    The handle returned by :meth:`dispatch_with_permute` is a 9-tuple, as in the HybridEP
    release megatron-core 0.19.2 targets, whose last element is the overflow flag (an int32
    tensor, non-zero when ``num_permuted_tokens`` was too small and rows were dropped):

    ``(send_token_ids, send_counts, recv_counts, num_dispatched_tokens_tensor,
    local_expert_routing_map, row_id_map, num_of_tokens_per_rank, config, overflow_flag)``

    ``row_id_map[P, 2]`` holds, for every output row, the received-token index and the local
    expert, or ``-1`` for padding.

    The real buffer is allocated outside PyTorch's allocator; the emulation allocates the same
    number of bytes (:func:`hybrid_ep_buffer_bytes`) as one tensor (``memory``), so allocator
    counts see it live and die with the buffer object.
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup],
        hidden_dim: int,
        max_num_of_tokens_per_rank: int,
        num_local_experts: int,
        use_fp8: bool = False,
        num_sms_dispatch_api: Optional[int] = None,
        num_sms_combine_api: Optional[int] = None,
        num_sms_preprocessing_api: Optional[int] = None,
        num_sms_permute_api: Optional[int] = None,
        num_blocks_permute: Optional[int] = None,
        num_blocks_unpermute: Optional[int] = None,
        num_of_ranks_per_nvlink_domain: Optional[int] = None,
        use_mnnvl: Optional[bool] = None,
    ) -> None:
        if use_fp8:
            raise NotImplementedError("The HybridEP emulation does not implement FP8 dispatch.")
        self.group = group
        self.rank = _group_rank(group)
        self.group_size = _group_size(group)
        self.hidden_dim = hidden_dim
        self.max_num_of_tokens_per_rank = max_num_of_tokens_per_rank
        self.num_local_experts = num_local_experts
        self.use_fp8 = use_fp8
        # SM/block counts only tune the CUDA kernels; kept for introspection.
        self.num_sms_dispatch_api = num_sms_dispatch_api
        self.num_sms_combine_api = num_sms_combine_api
        self.num_sms_preprocessing_api = num_sms_preprocessing_api
        self.num_blocks_permute = num_blocks_permute
        self.num_blocks_unpermute = num_blocks_unpermute
        self.nbytes = hybrid_ep_buffer_bytes(
            max_num_of_tokens_per_rank, hidden_dim, num_local_experts, self.group_size
        )
        self.memory = torch.empty(self.nbytes, dtype=torch.uint8, device=_buffer_device())

    def _preprocess(
        self,
        routing_map: torch.Tensor,
        num_of_experts_per_rank: int,
        pad_multiple: Optional[int],
        num_permuted_tokens: Optional[int],
    ) -> Tuple:
        """Metadata preprocessing: every rank learns the whole routing map (one all-gather)."""
        num_tokens, num_experts = routing_map.shape
        dev = routing_map.device
        size, rank, local = self.group_size, self.rank, num_of_experts_per_rank
        if num_experts != size * local:
            raise ValueError(
                f"routing_map has {num_experts} experts, expected group size {size} x "
                f"{local} experts per rank"
            )
        global_map = _all_gather_rows(routing_map.bool(), self.group)
        # What this rank sends: each token once per destination rank, in token order.
        to_rank = routing_map.bool().view(num_tokens, size, local).any(-1)
        send_ids = [torch.nonzero(to_rank[:, d]).flatten() for d in range(size)]
        send_token_ids = torch.cat(send_ids)
        send_counts = torch.tensor([len(ids) for ids in send_ids], dtype=torch.long, device=dev)
        # What it receives: tokens of every source rank routed to its experts, source-major.
        from_src = global_map.view(size, num_tokens, size, local)[:, :, rank, :]
        recv_mask = from_src.any(-1)
        recv_counts = recv_mask.sum(-1).to(torch.long)
        local_map = from_src[recv_mask]  # [num_dispatched, local], source rank then token order
        # Permute: rows grouped by local expert, each group padded to pad_multiple.
        rows, counts = [], []
        for e in range(local):
            ids = torch.nonzero(local_map[:, e]).flatten()
            padded = len(ids)
            if pad_multiple:
                padded += -padded % pad_multiple
            pad = torch.full((padded - len(ids),), -1, dtype=torch.long, device=dev)
            rows.append(
                torch.stack(
                    [torch.cat([ids, pad]), torch.cat([torch.full_like(ids, e), pad])], dim=1
                )
            )
            counts.append(padded)
        if rows:
            row_id_map = torch.cat(rows)
        else:
            row_id_map = torch.empty((0, 2), dtype=torch.long, device=dev)
        tokens_per_expert = torch.tensor(counts, dtype=torch.int32, device=dev)
        overflow = torch.zeros(1, dtype=torch.int32, device=dev)
        if num_permuted_tokens is not None:
            total = row_id_map.shape[0]
            if total > num_permuted_tokens:
                # Rows past the static budget are dropped (their tokens get no contribution
                # from that expert); the flag tells the caller.
                overflow.fill_(1)
                row_id_map = row_id_map[:num_permuted_tokens]
                starts = torch.cumsum(tokens_per_expert, 0) - tokens_per_expert
                tokens_per_expert = (
                    (num_permuted_tokens - starts)
                    .clamp(min=0)
                    .minimum(tokens_per_expert)
                    .to(torch.int32)
                )
            else:
                tail = torch.full(
                    (num_permuted_tokens - total, 2), -1, dtype=torch.long, device=dev
                )
                row_id_map = torch.cat([row_id_map, tail])
        config = HybridEPConfig(
            hidden_dim=self.hidden_dim,
            num_of_experts_per_rank=local,
            group_size=size,
            rank=rank,
            pad_multiple=pad_multiple,
            num_permuted_tokens=num_permuted_tokens,
            tokens_per_expert=tokens_per_expert,
        )
        num_dispatched = torch.tensor([local_map.shape[0]], dtype=torch.int32, device=dev)
        handle = (
            send_token_ids,
            send_counts,
            recv_counts,
            num_dispatched,
            local_map,
            row_id_map,
            num_tokens,
            config,
            overflow,
        )
        return handle, tokens_per_expert

    def dispatch_with_permute(
        self,
        *,
        hidden: torch.Tensor,
        topk_idx: Optional[torch.Tensor] = None,
        topk_weights: Optional[torch.Tensor] = None,
        num_of_experts_per_rank: Optional[int] = None,
        num_of_experts: Optional[int] = None,
        use_fp8: Optional[bool] = None,
        routing_map: Optional[torch.Tensor] = None,
        probs: Optional[torch.Tensor] = None,
        scaling_factor: Optional[torch.Tensor] = None,
        num_permuted_tokens: Optional[int] = None,
        pad_multiple: Optional[int] = None,
        handle: Optional[tuple] = None,
        non_blocking: bool = False,
        fuse_permute_dispatch: bool = False,
    ):
        """Dispatch ``hidden[N, H]`` to the expert ranks and permute it by local expert.

        Returns ``(tokens[P, H], probs[P] fp32 | None, scaling_factor, tokens_per_expert[L],
        handle)``. With ``handle`` given (the backward of combine) the routing is replayed and
        no routing map or probabilities are needed.
        """
        if use_fp8:
            raise NotImplementedError("The HybridEP emulation does not implement FP8 dispatch.")
        if non_blocking and (num_permuted_tokens is None or num_permuted_tokens < 0):
            raise ValueError("num_permuted_tokens is required for non-blocking mode.")
        num_tokens, _ = hidden.shape
        if handle is None:
            if routing_map is None:
                if topk_idx is None or num_of_experts is None:
                    raise ValueError("dispatch_with_permute needs a routing map or a handle.")
                routing_map = torch.zeros(
                    num_tokens, num_of_experts, dtype=torch.bool, device=hidden.device
                )
                routing_map.scatter_(1, topk_idx.long(), True)
                if topk_weights is not None:
                    probs = torch.zeros(
                        num_tokens, num_of_experts, dtype=torch.float32, device=hidden.device
                    )
                    probs = probs.scatter(1, topk_idx.long(), topk_weights.float())
            if routing_map.dtype != torch.bool or routing_map.shape[0] != num_tokens:
                raise ValueError("routing_map must be bool with one row per token of hidden.")
            local = num_of_experts_per_rank or self.num_local_experts
            handle, tokens_per_expert = self._preprocess(
                routing_map, local, pad_multiple, num_permuted_tokens
            )
        else:
            if probs is not None:
                raise ValueError("probs cannot be dispatched again with a cached handle.")
            tokens_per_expert = handle[7].tokens_per_expert.clone()
        send_token_ids, send_counts, recv_counts, _, _, row_id_map, n, config, _ = handle
        if num_tokens != n:
            raise ValueError(f"hidden has {num_tokens} rows but the handle was built for {n}.")
        sends, recvs = send_counts.tolist(), recv_counts.tolist()
        size, local = config.group_size, config.num_of_experts_per_rank

        recv_hidden = _all_to_all(hidden[send_token_ids], sends, recvs, self.group)
        valid = row_id_map[:, 0] >= 0
        out = hidden.new_zeros((row_id_map.shape[0], hidden.shape[1]))
        out[valid] = recv_hidden[row_id_map[valid, 0]]

        out_probs = None
        if probs is not None:
            # Each destination only needs the probability columns of its own experts.
            per_dest = probs.float().reshape(num_tokens, size, local)
            dest_of_row = torch.repeat_interleave(
                torch.arange(size, device=send_counts.device), send_counts
            )
            send_probs = per_dest[send_token_ids, dest_of_row]
            recv_probs = _all_to_all(send_probs, sends, recvs, self.group)
            out_probs = torch.zeros(
                row_id_map.shape[0], dtype=torch.float32, device=row_id_map.device
            )
            out_probs[valid] = recv_probs[row_id_map[valid, 0], row_id_map[valid, 1]]
        return out, out_probs, None, tokens_per_expert, handle

    def combine_with_unpermute(
        self,
        *,
        hidden: torch.Tensor,
        probs: Optional[torch.Tensor] = None,
        handle: Optional[tuple] = None,
        pad_multiple: Optional[int] = None,
        fuse_unpermute_combine: bool = False,
    ):
        """Inverse of :meth:`dispatch_with_permute`: ``hidden[P, H]`` -> ``tokens[N, H]``.

        Rows of one token are summed (local experts first, then ranks, in ascending order)
        without probability weighting; padding rows are ignored. ``probs[P]`` are scattered back
        to ``[N, num_experts]``.
        """
        if handle is None:
            raise ValueError("The handle is necessary for combine.")
        send_token_ids, send_counts, recv_counts, num_dispatched, _, row_id_map, n, config, _ = (
            handle
        )
        if hidden.shape[0] != row_id_map.shape[0]:
            raise ValueError(
                f"hidden has {hidden.shape[0]} rows but dispatch produced {row_id_map.shape[0]}."
            )
        sends, recvs = send_counts.tolist(), recv_counts.tolist()
        size, local = config.group_size, config.num_of_experts_per_rank
        m = int(num_dispatched.item())
        valid = row_id_map[:, 0] >= 0
        # Unpermute on the expert rank, then send one partial sum per token copy back.
        partial = _sum_rows(hidden[valid], row_id_map[valid, 0], m, hidden.dtype)
        back = _all_to_all(partial, recvs, sends, self.group)
        out = _sum_rows(back, send_token_ids, n, hidden.dtype)

        out_probs = None
        if probs is not None:
            recv_probs = torch.zeros(m, local, dtype=torch.float32, device=hidden.device)
            recv_probs[row_id_map[valid, 0], row_id_map[valid, 1]] = probs.float()[valid]
            back_probs = _all_to_all(recv_probs, recvs, sends, self.group)
            dest_of_row = torch.repeat_interleave(
                torch.arange(size, device=send_counts.device), send_counts
            )
            out_probs = torch.zeros(n, size, local, dtype=torch.float32, device=hidden.device)
            out_probs[send_token_ids, dest_of_row] = back_probs
            out_probs = out_probs.view(n, size * local)
        return out, out_probs


class Config:
    """Stand-in for DeepEP's tuning ``Config``; only the buffer size hints are consulted."""

    def __init__(self, num_sms: int = 20, *chunk_sizes: int) -> None:
        self.num_sms = num_sms
        self.chunk_sizes = chunk_sizes

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """NVLink buffer bytes: room for 4096 tokens from each rank."""
        return hidden_bytes * num_ranks * 4096

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Intranode only: no RDMA buffer."""
        return 0


class Buffer:
    """Emulation of ``deep_ep.Buffer`` in intranode normal (non-low-latency) mode.

    The dispatch handle is ``(rank_prefix_matrix, send_counts, recv_counts, recv_src_idx,
    is_token_in_rank, send_token_ids)``; ``recv_src_idx`` is the source-rank token index of every
    received row.

    The real NVLink/RDMA buffers live outside PyTorch's allocator; the emulation allocates
    ``num_nvl_bytes + num_rdma_bytes`` (sized by the :class:`Config` hints, as megatron-core's
    ``get_buffer`` asks) as one tensor (``memory``), so allocator counts see them.
    """

    num_sms: int = 20

    def __init__(
        self,
        group: Optional[dist.ProcessGroup],
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        **kwargs,
    ) -> None:
        if low_latency_mode:
            raise NotImplementedError("The DeepEP emulation implements normal mode only.")
        self.group = group
        self.rank = _group_rank(group)
        self.group_size = _group_size(group)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.memory = torch.empty(
            num_nvl_bytes + num_rdma_bytes, dtype=torch.uint8, device=_buffer_device()
        )

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Record the SM budget (tuning only)."""
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """Tuning config for dispatch (sizes only matter to the buffer hints)."""
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """Tuning config for combine (sizes only matter to the buffer hints)."""
        return Config(Buffer.num_sms)

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Returns ``(num_tokens_per_rank[R], None, num_tokens_per_expert[E],
        is_token_in_rank[N, R], event)``; ``-1`` entries of ``topk_idx`` are ignored."""
        size = self.group_size
        if num_experts % size:
            raise ValueError(f"{num_experts} experts do not split over {size} ranks.")
        local = num_experts // size
        idx = topk_idx.long()
        valid = idx >= 0
        num_tokens_per_expert = torch.bincount(idx[valid], minlength=num_experts).to(torch.int32)
        dest = torch.where(valid, idx // local, torch.full_like(idx, size))
        is_token_in_rank = torch.zeros(idx.shape[0], size + 1, dtype=torch.bool, device=idx.device)
        is_token_in_rank.scatter_(1, dest, True)
        is_token_in_rank = is_token_in_rank[:, :size].contiguous()
        num_tokens_per_rank = is_token_in_rank.sum(0).to(torch.int32)
        return num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank, EventOverlap()

    def dispatch(
        self,
        x: torch.Tensor,
        handle: Optional[tuple] = None,
        num_tokens_per_rank: Optional[torch.Tensor] = None,
        num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
        is_token_in_rank: Optional[torch.Tensor] = None,
        num_tokens_per_expert: Optional[torch.Tensor] = None,
        topk_idx: Optional[torch.Tensor] = None,
        topk_weights: Optional[torch.Tensor] = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Send each token once to every rank owning one of its experts.

        Returns ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
        handle, event)``; received rows are in source rank, then token order. With a cached
        ``handle`` only ``x`` is sent and the three routing outputs are ``None``.
        """
        size, rank = self.group_size, self.rank
        if handle is not None:
            _, send_counts, recv_counts, _, _, send_token_ids = handle
            recv_x = _all_to_all(
                x[send_token_ids], send_counts.tolist(), recv_counts.tolist(), self.group
            )
            return recv_x, None, None, None, handle, EventOverlap()
        if is_token_in_rank is None or topk_idx is None:
            raise ValueError("dispatch needs the layout and top-k indices, or a handle.")
        num_tokens = x.shape[0]
        send_ids = [torch.nonzero(is_token_in_rank[:, d]).flatten() for d in range(size)]
        send_token_ids = torch.cat(send_ids)
        send_counts = torch.tensor(
            [len(ids) for ids in send_ids], dtype=torch.long, device=x.device
        )
        counts_all = _all_gather_rows(send_counts.view(1, size), self.group)  # [src, dst]
        recv_counts = counts_all[:, rank].contiguous()
        sends, recvs = send_counts.tolist(), recv_counts.tolist()
        recv_x = _all_to_all(x[send_token_ids], sends, recvs, self.group)
        recv_src_idx = _all_to_all(send_token_ids.to(torch.int32), sends, recvs, self.group)
        recv_idx = _all_to_all(topk_idx.long()[send_token_ids], sends, recvs, self.group)
        num_experts = int(num_tokens_per_expert.numel()) if num_tokens_per_expert is not None else 0
        if not num_experts:
            raise ValueError("dispatch needs num_tokens_per_expert from get_dispatch_layout.")
        local = num_experts // size
        begin = rank * local
        mine = (recv_idx >= begin) & (recv_idx < begin + local)
        recv_topk_idx = torch.where(mine, recv_idx - begin, torch.full_like(recv_idx, -1))
        recv_topk_weights = None
        if topk_weights is not None:
            w = _all_to_all(topk_weights.float()[send_token_ids], sends, recvs, self.group)
            recv_topk_weights = torch.where(mine, w, torch.zeros_like(w))
        per_expert = torch.bincount(recv_topk_idx[mine], minlength=local)
        if expert_alignment > 1:
            per_expert += -per_expert % expert_alignment
        rank_prefix_matrix = torch.cumsum(counts_all, 0).to(torch.int32)
        new_handle = (
            rank_prefix_matrix,
            send_counts,
            recv_counts,
            recv_src_idx,
            is_token_in_rank,
            send_token_ids,
        )
        del num_tokens
        return (
            recv_x,
            recv_topk_idx,
            recv_topk_weights,
            per_expert.tolist(),
            new_handle,
            EventOverlap(),
        )

    def combine(
        self,
        x: torch.Tensor,
        handle: tuple,
        topk_weights: Optional[torch.Tensor] = None,
        bias=None,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Send every received row back and sum the copies of each token (ranks ascending).

        Returns ``(combined_x[N, H], combined_topk_weights[N, K] | None, event)``.
        """
        if bias is not None:
            raise NotImplementedError("The DeepEP emulation does not implement combine bias.")
        _, send_counts, recv_counts, _, is_token_in_rank, send_token_ids = handle
        sends, recvs = send_counts.tolist(), recv_counts.tolist()
        num_tokens = is_token_in_rank.shape[0]
        back = _all_to_all(x, recvs, sends, self.group)
        out = _sum_rows(back, send_token_ids, num_tokens, x.dtype)
        out_weights = None
        if topk_weights is not None:
            back_w = _all_to_all(topk_weights.float(), recvs, sends, self.group)
            out_weights = _sum_rows(back_w, send_token_ids, num_tokens, torch.float32)
        return out, out_weights, EventOverlap()


def _real_deep_ep_importable() -> bool:
    current = sys.modules.get("deep_ep")
    if current is not None:
        return not getattr(current, "IS_CPU_EMULATION", False)
    try:
        return importlib.util.find_spec("deep_ep") is not None
    except (ImportError, ValueError):
        return False


def install(force: bool = False) -> types.ModuleType:
    """Register this module as ``deep_ep`` (and ``deep_ep.utils``) in ``sys.modules``.

    Must run before megatron-core's ``fused_a2a`` is imported, which binds the kernels at import
    time. Refuses to shadow an importable real ``deep_ep`` unless ``force``.
    """
    if "megatron.core.transformer.moe.fused_a2a" in sys.modules and not _is_installed():
        raise RuntimeError(
            "megatron.core.transformer.moe.fused_a2a is already imported; install the deep_ep "
            "emulation before the first `import megatron.core`."
        )
    if _real_deep_ep_importable() and not force:
        raise RuntimeError(
            "A real deep_ep is importable; refusing to shadow it with the emulation "
            "(pass force=True to override)."
        )
    module = sys.modules[__name__]
    utils = types.ModuleType("deep_ep.utils")
    utils.EventHandle = EventHandle
    utils.EventOverlap = EventOverlap
    utils.IS_CPU_EMULATION = True
    module.utils = utils
    sys.modules["deep_ep"] = module
    sys.modules["deep_ep.utils"] = utils
    return module


def _is_installed() -> bool:
    return getattr(sys.modules.get("deep_ep"), "IS_CPU_EMULATION", False)


def uninstall() -> None:
    """Remove the emulation from ``sys.modules`` (megatron modules keep what they bound)."""
    if _is_installed():
        sys.modules.pop("deep_ep", None)
        sys.modules.pop("deep_ep.utils", None)
