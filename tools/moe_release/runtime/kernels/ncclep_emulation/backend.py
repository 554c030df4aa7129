# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The process's NCCL EP context on CPU ranks: symmetric memory, routing, the held receive
buffers and the ops :mod:`.api` binds to TE's names."""

from __future__ import annotations

import collections
import types
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from moe_release.runtime.cuda import placement
from moe_release.runtime.kernels.emulation_common import (
    all_gather_rows,
    all_to_all,
    buffer_device,
    count_set,
    group_rank,
    group_size,
    host_all_gather_ints,
    node_layout,
)
from moe_release.runtime.kernels.ncclep_emulation.sizes import (
    HANDLE_CACHE,
    LSA_RANKS_PER_NODE,
    TE_COMMITS,
    context_bytes,
    handle_mem_size,
    handle_mem_terms,
)

# The group allocations of every ncclEpCreateGroup that leaked (see LEAKED_PER_GROUP_BYTES).
LEAKED: List[torch.Tensor] = []


# --------------------------------------------------------------------------------------------
# Symmetric memory.

# data_ptr of a symm storage -> (weakref to its tensor, group it rendezvoused on).
_SYMM: Dict[int, tuple] = {}


def _register_symm(t: torch.Tensor, group) -> torch.Tensor:
    key = t.untyped_storage().data_ptr()
    _SYMM[key] = (weakref.ref(t, lambda _, k=key: _SYMM.pop(k, None)), group)
    return t


def _symm_group(t: torch.Tensor):
    entry = _SYMM.get(t.untyped_storage().data_ptr())
    return entry[1] if entry else None


def _device() -> torch.device:
    """TE's default device, ``cuda:<current>``: the emulated GPU under the placement rules, the
    host where neither a GPU nor the rules are there."""
    if placement.active():
        return torch.device("cuda", torch.cuda.current_device())
    return buffer_device()


def _symm_alloc(shape, dtype, group, device, collective: bool) -> torch.Tensor:
    t = torch.empty(*shape, dtype=dtype, device=device or _device())
    if collective and group is not None and dist.is_initialized():
        dist.barrier(group=group)  # torch symm_mem.rendezvous is collective on the group
    return _register_symm(t, group)


# --------------------------------------------------------------------------------------------
# The C++ side: TE's EPBackend singleton over NCCL EP (ep_backend.cpp, ext/ep.cpp).


class _Routing:
    """What prepare writes into a handle: this rank's view of the all-gathered routing. As on
    a GPU, it lives in ``handle_mem`` (and so as long as the EpBuffer or a pending backward
    keeps that): the slot of every (source rank, token, local expert) hit where HtBlockLayout
    keeps the dense per-expert table (``prob``, M x E x 4 bytes) and the top-k indices where it
    caches them (``topk_idx``); the host-side sizes are Python ints here."""

    def __init__(self, handle_mem, topk_idx, group, size, rank, num_experts, max_tokens,
                 max_recv, alignment, zero_copy):  # fmt: skip
        local = num_experts // size
        tokens, k = topk_idx.shape
        self.tokens, self.k, self.local, self.size, self.max_tokens = (
            tokens,
            k,
            local,
            size,
            max_tokens,
        )
        offsets, start = {}, 0
        for name, nbytes in handle_mem_terms(max_tokens, max_recv, size, num_experts, k, zero_copy):
            offsets[name] = start
            start += nbytes
        self.slot_at, self.topk_at = offsets["prob"], offsets["topk_idx"]
        counts = host_all_gather_ints([tokens], group)
        padded = torch.full((max_tokens, k), -1, dtype=torch.long, device=topk_idx.device)
        padded[:tokens] = topk_idx.long()
        every = all_gather_rows(padded, group).view(size, max_tokens, k)
        experts = torch.arange(num_experts, device=topk_idx.device)
        hits = (every.unsqueeze(-1) == experts).any(2).view(size, max_tokens, size, local)
        for s, (n,) in enumerate(counts):
            hits[s, n:] = False
        hits_in = hits[:, :, rank]  # [source, token, local expert] received here
        # Zones: local expert by local expert, (source, token) order, padded to the alignment.
        raw = [count_set(hits_in[:, :, e]) for e in range(local)]
        align = alignment if alignment > 1 else 1
        self.padded = [c + (-c % align) if c else 0 for c in raw]
        self.raw = raw
        self.starts = [sum(self.padded[:e]) for e in range(local)]
        self.total = sum(self.padded)
        flat = hits_in.permute(2, 0, 1).reshape(local, -1)  # [expert, source * M + token]
        rank_in_zone = torch.cumsum(flat.int(), 1) - 1
        starts = torch.tensor(self.starts, dtype=torch.int32, device=topk_idx.device)
        slot = torch.where(
            flat, rank_in_zone + starts.unsqueeze(1), torch.full_like(rank_in_zone, -1)
        )
        self._slot(handle_mem).copy_(slot.view(local, size, max_tokens).permute(1, 2, 0))
        self._topk(handle_mem).copy_(padded)

    def _slot(self, handle_mem) -> torch.Tensor:
        n = self.size * self.max_tokens * self.local * 4
        view = handle_mem[self.slot_at : self.slot_at + n].view(torch.int32)
        return view.view(self.size, self.max_tokens, self.local)

    def _topk(self, handle_mem) -> torch.Tensor:
        n = self.max_tokens * self.k * 8
        return handle_mem[self.topk_at : self.topk_at + n].view(torch.int64).view(-1, self.k)

    def held(self, handle_mem) -> _Held:
        return _Held(self, handle_mem)


class _Held:
    """A prepared handle's routing, read from its handle_mem for one op."""

    def __init__(self, info: _Routing, handle_mem) -> None:
        self.__dict__.update(vars(info))
        self.slot = info._slot(handle_mem)  # [source, token, local expert], -1: no hit
        self.hits_in = self.slot >= 0
        self.topk_idx = info._topk(handle_mem)[: info.tokens]
        experts = torch.arange(info.size * info.local, device=handle_mem.device)
        hits = (self.topk_idx.unsqueeze(-1) == experts).any(1)
        self.hits_out = hits.view(info.tokens, info.size, info.local)  # [token, dest, expert]

    # Rows go to each destination as its (expert, token) hits, expert-major.
    def send_pairs(self, d: int):
        return torch.nonzero(self.hits_out[:, d, :].t())  # (expert, token), sorted

    def recv_pairs(self, s: int):
        return torch.nonzero(self.hits_in[s].t())  # (expert, token), sorted

    def sends(self) -> List[int]:
        return [count_set(self.hits_out[:, d, :]) for d in range(self.size)]

    def recvs(self) -> List[int]:
        return [count_set(self.hits_in[s]) for s in range(self.size)]

    def recv_slots(self) -> torch.Tensor:
        parts = []
        for s in range(self.size):
            pairs = self.recv_pairs(s)
            parts.append(self.slot[s, pairs[:, 1], pairs[:, 0]].long())
        return torch.cat(parts)

    def padding_rows(self) -> List[int]:
        rows = []
        for e in range(self.local):
            rows += range(self.starts[e] + self.raw[e], self.starts[e] + self.padded[e])
        return rows


@dataclass
class _Backend:
    """``EPBackend`` (one per process) and ext/ep.cpp's globals."""

    initialized: bool = False
    group: Optional[dist.ProcessGroup] = None
    num_experts: int = 0
    max_tokens: int = 0
    max_recv: int = 0
    hidden: int = 0
    zero_copy: bool = False
    drop: bool = False
    eager: bool = False
    num_topk: int = 0
    memory: Optional[tuple] = None  # the group's device and pinned host allocations
    gin: Optional[torch.Tensor] = None  # the GIN buffer, across LSA teams only
    fabric: Optional[object] = None  # the GIN window's peers, across LSA teams only
    lsa: int = 0  # ranks of the LSA team (the emulated node)
    teams: int = 1  # LSA teams of the group (the rail team's size)
    cached: Optional[tuple] = None  # the process-wide (top_k, alignment) of the first prepare
    # The prepared handles by handle_mem address, as TE's LRU cache keys them (ep_backend.cpp).
    handles: collections.OrderedDict[int, _Routing] = field(default_factory=collections.OrderedDict)

    def get(self) -> _Backend:
        if not self.initialized:
            raise RuntimeError("EPBackend not initialized. Call nvte_ep_initialize() first.")
        return self

    def initialize(self, group, num_experts, max_tokens, max_recv, hidden, zero_copy, num_topk=0,
                   drop=False, eager=False) -> None:  # fmt: skip
        if self.initialized:
            raise RuntimeError("EP already initialized")
        size = group_size(group)
        checks = [
            (num_experts > 0 and max_tokens > 0 and hidden > 0, "sizes must be positive"),
            (hidden * 2 >= 16 and hidden * 2 % 16 == 0, "max_token_bytes % 16 == 0"),
            (num_experts % size == 0, "num_experts % ep_size == 0"),
            (eager or max_recv > 0, "max_recv_tokens_per_rank > 0"),
            (not max_recv or max_recv >= max_tokens, "max_recv >= max_dispatch"),
        ]
        for ok, what in checks:
            if not ok:
                raise RuntimeError(f"NCCL EP configuration rejected ({what}; ep_backend.cpp)")
        if eager:  # nccl_ep.cc:1780-1792: the eager bound
            max_recv = size * max_tokens * max(num_topk, 1)
        budgets = host_all_gather_ints([max_recv], group)
        if len({b for (b,) in budgets}) != 1:
            raise RuntimeError(f"NCCL EP: the recv budget differs across ranks: {budgets}")
        # The LSA team (NVLink domain) is the emulated node; the rail team its count.
        nodes = node_layout(group, LSA_RANKS_PER_NODE)
        lsa = nodes.ranks_per_node
        sizes = context_bytes(size, num_experts, max_tokens, max_recv, hidden, zero_copy,
                              lsa_ranks=lsa)  # fmt: skip
        pin = placement.active() or torch.cuda.is_available()
        memory = (
            torch.empty(sizes["device"], dtype=torch.uint8, device=_device()),
            torch.empty(sizes["pinned"], dtype=torch.uint8, pin_memory=pin),
        )
        fabric = gin = None
        if nodes.nodes > 1:
            # init_ht_internode (nccl_ep.cc:1300-1510): the GIN buffer, then ncclDevCommCreate
            # and ncclCommWindowRegister on the EP communicator, collective over its ranks.
            from moe_release.runtime.measure import faults

            gin = torch.empty(sizes["gin"], dtype=torch.uint8, device=_device())
            fabric = faults.Fabric(group, "ncclep")
            fabric.barrier("ncclep gin window register")
        if sizes["leaked"]:
            LEAKED.append(torch.empty(sizes["leaked"], dtype=torch.uint8, device=_device()))
        self.__dict__.update(
            memory=memory, gin=gin, fabric=fabric, lsa=lsa, teams=nodes.nodes,
            initialized=True, group=group, num_experts=num_experts, max_tokens=max_tokens,
            max_recv=max_recv, hidden=hidden, zero_copy=zero_copy, drop=drop, eager=eager,
            num_topk=num_topk, cached=None, handles=collections.OrderedDict(),
        )  # fmt: skip

    def finalize(self) -> None:
        """``ncclEpGroupDestroy``'s collective part across LSA teams: ``destroy_ht_internode``
        deregisters the GIN window on the EP communicator (nccl_ep.cc:2063-2066, 1536-1540),
        every rank of it; a peer that never arrives raises (the real one would hang) and the
        group's memory stays allocated (:data:`LEAKED`). Then :meth:`shutdown`."""
        fabric = self.fabric if self.initialized else None
        if fabric is not None:
            try:
                fabric.barrier("ncclep gin window deregister")
            except Exception:
                LEAKED.extend(t for t in (*(self.memory or ()), self.gin) if t is not None)
                self.shutdown()
                raise
        self.shutdown()

    def shutdown(self) -> None:
        if self.initialized:
            self.__dict__.update(initialized=False, group=None, cached=None, memory=None,
                                 gin=None, fabric=None,
                                 handles=collections.OrderedDict())  # fmt: skip

    def handle_mem_size(self, top_k: int) -> int:
        self.get()
        return handle_mem_size(self.max_tokens, self.max_recv, group_size(self.group),
                               self.num_experts, top_k, self.zero_copy)  # fmt: skip

    # -- the ops --------------------------------------------------------------------------
    def _routing(self, handle_mem: torch.Tensor) -> _Held:
        self.get()
        routing = self.handles.get(handle_mem.untyped_storage().data_ptr())
        if routing is None:
            raise RuntimeError("NCCL EP: the handle was not prepared (ep_backend.cpp)")
        return routing.held(handle_mem)

    def prepare(self, handle_mem, topk_idx, counts, top_k, alignment, total=None, int64_only=False):
        self.get()
        _on_device("prepare", handle_mem, topk_idx, counts)
        if int64_only and topk_idx.dtype != torch.int64:
            raise RuntimeError(
                f"topk_idx must be int64; got dtype={topk_idx.dtype}. Cast with topk_idx.long()."
            )
        if topk_idx.dtype not in (torch.int32, torch.int64):
            raise RuntimeError(f"topk_idx must be int32 or int64; got dtype={topk_idx.dtype}.")
        if self.cached is None:
            self.cached = (top_k, alignment)
        elif self.cached != (top_k, alignment):
            raise RuntimeError(
                f"EP prepare top_k={top_k}, alignment={alignment} disagrees with process-wide "
                f"cached top_k={self.cached[0]}, alignment={self.cached[1]}"
            )
        if topk_idx.shape[0] > self.max_tokens:
            raise RuntimeError(
                f"NCCL EP: Token count exceeds HT buffer capacity ({topk_idx.shape[0]} > "
                f"{self.max_tokens}; nccl_ep.cc:2864-2866 asserts and aborts)"
            )
        size, rank = group_size(self.group), group_rank(self.group)
        routing = _Routing(handle_mem, topk_idx, self.group, size, rank, self.num_experts,
                           self.max_tokens, self.max_recv, alignment, self.zero_copy)  # fmt: skip
        if routing.total > self.max_recv and not self.drop:
            raise RuntimeError(
                f"NCCL EP: {routing.total} received slots > max_recv_tokens_per_rank "
                f"{self.max_recv}; increase it or set overflow_policy = NCCL_EP_OVERFLOW_DROP "
                "(scan_kernel.cuh:517-527: a device trap)"
            )
        key = handle_mem.untyped_storage().data_ptr()
        self.handles.pop(key, None)
        self.handles[key] = routing
        while len(self.handles) > HANDLE_CACHE:
            self.handles.popitem(last=False)
        capacity = self.max_recv
        kept = [min(c, max(capacity - s, 0)) for c, s in zip(routing.padded, routing.starts)]
        counts.copy_(torch.tensor(kept, dtype=counts.dtype, device=counts.device))
        if total is not None:
            total.fill_(routing.total)
        return routing

    def dispatch(self, handle_mem, tokens, topk_weights, recv_tokens, recv_weights) -> None:
        r = self._routing(handle_mem)
        _on_device("dispatch", tokens, topk_weights, recv_tokens, recv_weights)
        self._zero_copy_check(recv_tokens=recv_tokens, recv_topk_weights=recv_weights)
        if recv_tokens.dtype != tokens.dtype:
            raise RuntimeError("recv_tokens dtype must match tokens dtype (ext/ep.cpp)")
        if recv_weights.numel() != recv_tokens.shape[0]:
            raise RuntimeError("recv_topk_weights.numel() must equal recv_tokens rows")
        if recv_tokens.shape[0] < min(r.total, self.max_recv):
            raise RuntimeError("NCCL EP: recv_tokens has fewer rows than the received slots")
        if self.drop:  # nccl_ep.cc:4132-4149: the capacity is zeroed before each dispatch
            recv_tokens.zero_()
            recv_weights.zero_()
        rows, weights = [], []
        for d in range(r.size):
            pairs = r.send_pairs(d)
            rows.append(tokens[pairs[:, 1]])
            experts = d * r.local + pairs[:, 0]
            take = r.topk_idx[pairs[:, 1]] == experts.unsqueeze(1)
            last_k = r.k - 1 - torch.argmax(take.flip(1).int(), dim=1)
            weights.append(topk_weights[pairs[:, 1], last_k])
        got = all_to_all(torch.cat(rows), r.sends(), r.recvs(), self.group)
        got_w = all_to_all(torch.cat(weights), r.sends(), r.recvs(), self.group)
        slots = r.recv_slots()
        keep = slots < recv_tokens.shape[0]
        recv_tokens[slots[keep]] = got[keep]
        recv_weights[slots[keep]] = got_w[keep]
        pad = [p for p in r.padding_rows() if p < recv_tokens.shape[0]]
        if pad:
            recv_tokens[pad] = 0
            recv_weights[pad] = 0

    def _reduce_to_sources(self, r: _Routing, slot_rows: torch.Tensor, out: torch.Tensor) -> None:
        """``out[t] = bf16(sum over ranks of bf16(sum of t's slots there))`` for every token t of
        this rank; ``slot_rows`` are this rank's received-slot rows (dispatch order)."""
        hidden = out.shape[1]
        partials, recv_counts = [], []
        slots = r.slot
        for s in range(r.size):
            tokens_s = torch.nonzero(r.hits_in[s].any(1)).flatten()
            acc = torch.zeros((tokens_s.shape[0], hidden), dtype=torch.float32, device=out.device)
            for e in range(r.local):
                take = r.hits_in[s, tokens_s, e]
                rows = slots[s, tokens_s[take], e]
                ok = rows < slot_rows.shape[0]
                idx = torch.nonzero(take).flatten()[ok]
                acc.index_add_(0, idx, slot_rows[rows[ok]].float())
            partials.append(acc.to(out.dtype))
            recv_counts.append(tokens_s.shape[0])
        sent_counts = [count_set(r.hits_out[:, d, :].any(1)) for d in range(r.size)]
        back = all_to_all(torch.cat(partials), recv_counts, sent_counts, self.group)
        total = torch.zeros((out.shape[0], hidden), dtype=torch.float32, device=out.device)
        start = 0
        for d in range(r.size):
            tokens_d = torch.nonzero(r.hits_out[:, d, :].any(1)).flatten()
            total.index_add_(0, tokens_d, back[start : start + tokens_d.shape[0]].float())
            start += tokens_d.shape[0]
        out.copy_(total.to(out.dtype))

    def combine(self, handle_mem, expert_out, result) -> None:
        r = self._routing(handle_mem)
        _on_device("combine", expert_out, result)
        self._zero_copy_check(expert_out=expert_out)
        if result.shape[0] != r.tokens:
            raise RuntimeError("NCCL EP: combined rows must equal the prepared token count")
        self._reduce_to_sources(r, expert_out, result)

    def dispatch_bwd(self, handle_mem, grad, grad_weights, grad_tokens, grad_topk_weights):
        r = self._routing(handle_mem)
        _on_device("dispatch_bwd", grad, grad_weights, grad_tokens, grad_topk_weights)
        self._zero_copy_check(grad=grad)
        self._reduce_to_sources(r, grad, grad_tokens)
        # Each top-k weight's gradient from its slot on the rank owning the expert.
        slots = r.recv_slots()
        back = all_to_all(grad_weights[slots], r.recvs(), r.sends(), self.group)
        dense = torch.zeros((r.tokens, r.size * r.local), dtype=torch.float32,
                            device=grad_weights.device)  # fmt: skip
        start = 0
        for d in range(r.size):
            pairs = r.send_pairs(d)
            n = pairs.shape[0]
            dense[pairs[:, 1], d * r.local + pairs[:, 0]] = back[start : start + n].float()
            start += n
        valid = r.topk_idx >= 0
        picked = dense.gather(1, r.topk_idx.clamp(min=0))
        grad_topk_weights.copy_(torch.where(valid, picked, torch.zeros_like(picked)))

    def combine_bwd(self, handle_mem, grad, grad_expert_out) -> None:
        r = self._routing(handle_mem)
        _on_device("combine_bwd", grad, grad_expert_out)
        self._zero_copy_check(grad_expert_out=grad_expert_out)
        rows = [grad[r.send_pairs(d)[:, 1]] for d in range(r.size)]
        got = all_to_all(torch.cat(rows), r.sends(), r.recvs(), self.group)
        slots = r.recv_slots()
        keep = slots < grad_expert_out.shape[0]
        grad_expert_out[slots[keep]] = got[keep].to(grad_expert_out.dtype)
        pad = [p for p in r.padding_rows() if p < grad_expert_out.shape[0]]
        if pad:
            grad_expert_out[pad] = 0

    def _zero_copy_check(self, **tensors) -> None:
        if not self.zero_copy:
            return
        for name, t in tensors.items():
            if _symm_group(t) is not self.group:
                raise RuntimeError(
                    f"ep zero-copy: {name} must be symm-mem-backed on the EP group (allocate via "
                    "symm_mem_alloc) (ext/ep.cpp:88-105)"
                )


BACKEND = _Backend()


def _on_device(op: str, *tensors) -> None:
    """TE registers its ops for CUDA only (``device_types="cuda"``): host tensors find no
    kernel, as torch reports it."""
    if not placement.active():
        return
    for t in tensors:
        if t is not None and placement.placement_of(t) != placement.DEVICE:
            raise NotImplementedError(
                f"Could not run 'transformer_engine_ep::{op}' with arguments from the 'CPU' "
                "backend (TE registers it for CUDA only)"
            )


# --------------------------------------------------------------------------------------------
# The Python API, one module per TE commit.


class _Module(types.ModuleType):
    """``transformer_engine.pytorch.ep``: module globals as TE keeps them."""


def _new_module(api: str) -> _Module:
    m = _Module("transformer_engine.pytorch.ep")
    m.IS_CPU_EMULATION = True
    m.TE_COMMIT = TE_COMMITS[api]
    m._BOOTSTRAPPED = False
    m._ATEXIT_REGISTERED = False
    m._EP_GROUP = None
    if api == "d0067d0":
        m._EAGER = False
    return m


def _require_bf16(name: str, t: torch.Tensor) -> None:
    if t.dtype is not torch.bfloat16:
        raise NotImplementedError(
            f"NCCL EP currently supports only bfloat16 payloads; got {name}.dtype={t.dtype}."
        )


def _require_fp32_weights(t: torch.Tensor) -> None:
    if t.dtype is not torch.float32:
        raise TypeError(
            f"topk_weights must be float32; got dtype={t.dtype}. "
            "Cast with topk_weights.float() before calling."
        )
