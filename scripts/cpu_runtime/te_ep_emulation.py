# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Emulation of TransformerEngine's NCCL EP API, ``transformer_engine.pytorch.ep`` (the
``ncclep`` flex backend), as megatron-core imports it on CPU ranks where TE is not installed.

``megatron/core/transformer/moe/fused_a2a.py`` binds it with ``from transformer_engine.pytorch
import ep as te_ep`` (``HAVE_TE_EP``), and 0.19.2/main's pipeline utils with ``from
transformer_engine.pytorch.ep import is_symm_backed``. :func:`install` answers exactly those two
imports with this emulation; every other import of ``transformer_engine`` still fails as it does
without TE, so the rest of megatron-core takes its non-TE paths.

**Which TE.** The three megatron trees call three different signatures (an unknown keyword or a
missing argument is a TypeError, as in TE), each accepted by exactly one TE commit:

* ``4329ff8`` - TE 4329ff84bfbd (release_v2.17, 2.17.1), what dev d48bd6b calls:
  ``ep_dispatch(buffer, tokens, topk_idx, topk_weights)``, ``ep_combine(..., num_local_tokens)``;
  a zero-copy ``EpBuffer`` allocates its own symm buffers; int64 top-k indices only.
* ``622a3ee`` - TE 622a3eea1 (#3187, main of 2026-07-21), what 0.19.2 calls: the
  ``recv_tokens``/``recv_topk_weights``/``grad_out`` keywords, ``use_pool`` symm allocations,
  ``is_symm_backed``.
* ``d0067d0`` - TE d0067d0da6cb (main of 2026-08-22), what main d98e8a6 calls:
  ``ep_bootstrap(..., num_topk, recv_capacity_per_rank=None, drop_on_overflow)`` (eager mode:
  no capacity, outputs sized per step, a host sync per prepare), drop on overflow,
  ``EpBuffer.tokens_per_expert`` (int64) and ``total_recv_tokens``, ``is_ep_bootstrapped``,
  ``release_symm_mem_pool``.

megatron-core 0.19.2 and main pin TE 4329ff84 (``pyproject.toml``), whose signatures refuse
their calls (0.19.2's ``ep_dispatch(recv_tokens=...)``, main's ``ep_bootstrap(num_topk=...)``);
dev pins a TE without ``ep.py``. :func:`api_for_tree` picks the API whose signatures accept the
tree's calls, read from the tree's ``fused_a2a.py``.

**Semantics** (TE ``common/ep``, over NCCL EP ``nccl_ep/`` of nccl-extensions 9f47d6eb, the pin
of TE d0067d0; the kernels of the older pins are not in our mirrors and are taken to be the same),
intranode (one NVLink domain), expert-major layout, over ``torch.distributed`` collectives:
prepare all-gathers the routing; the receive buffer holds, local expert by local expert, one slot
per (token, local expert) hit, in (source rank, source token) order, each expert's zone padded
with zero rows (weight 0) to ``alignment``; rows past the padded total are not written (with
``drop_on_overflow`` the whole capacity is zeroed first); ``recv_topk_weights[slot]`` is the
token's weight for that expert; combine sums a token's slots, unweighted, in float32 per
destination rank, rounds to bf16, then sums the ranks' partials in float32 and rounds again;
the dispatch's backward sums the slot gradients the same way and gathers each top-k weight's
gradient from its slot (0 for ``-1``); the combine's backward copies each token's gradient to
its slots and zeroes the padding rows.

Outputs (one test per row; ``T`` tokens on this rank, ``K`` top-k, ``H`` hidden, ``E_l`` local
experts, ``RC`` the receive capacity (``P``: the step's padded total in eager mode), ``S`` the
handle bytes of :func:`handle_mem_size`; modes ``fixed`` (a capacity) and ``eager``):

[te_ep dispatch] ``ep_dispatch``

| output | mode | device | dtype | shape | source @d0067d0 |
|---|---|---|---|---|---|
| recv_tokens | fixed | device | bfloat16 | [RC, H] | ep.py:856-904 |
| recv_tokens | eager | device | bfloat16 | [P, H] | ep.py:537-541 |
| recv_topk_weights | fixed | device | float32 | [RC] | ep.py:542-543 |
| recv_topk_weights | eager | device | float32 | [P] | ep.py:542-543 |
| token_counts | all | device | counts | [E_l] | ep.py:303-305 |

[te_ep combine] ``ep_combine``

| output | mode | device | dtype | shape | source @d0067d0 |
|---|---|---|---|---|---|
| result | all | device | bfloat16 | [T, H] | ep.py:637 |

[te_ep dispatch backward] the gradients of ``ep_dispatch``'s inputs

| output | mode | device | dtype | shape | source @d0067d0 |
|---|---|---|---|---|---|
| grad_tokens | all | device | bfloat16 | [T, H] | ep.py:586-588 |
| grad_topk_weights | all | device | float32 | [T, K] | ep.py:589-591 |

[te_ep combine backward] the gradient of ``ep_combine``'s input

| output | mode | device | dtype | shape | source @d0067d0 |
|---|---|---|---|---|---|
| grad_expert_out | fixed | device | bfloat16 | [RC, H] | ep.py:662-666 |
| grad_expert_out | eager | device | bfloat16 | [P, H] | ep.py:662-666 |

[te_ep buffer] ``EpBuffer``

| output | mode | device | dtype | shape | source @d0067d0 |
|---|---|---|---|---|---|
| handle_mem | all | device | uint8 | [S] | ep.py:300-302 |
| total_recv_tokens | fixed | device | int64 | [1] | ep.py:316-317 |
| total_recv_tokens | eager | pinned | int64 | [1] | ep.py:311-315 |

``counts`` is int32 on the two older APIs (``token_counts``, ext/ep.cpp:194-195 at 4329ff84) and
int64 on d0067d0 (``tokens_per_expert``); ``total_recv_tokens`` exists on d0067d0 only.

| call | mode | syncs | kind | source @d0067d0 |
|---|---|---|---|---|
| te_ep dispatch | fixed | 0 | - | nccl_ep.cc:3813-3822 |
| te_ep dispatch | eager | 2 | te_ep eager | ep.py:460-465 |
| te_ep combine | all | 0 | - | ep.py:637 |

In eager mode the prepare synchronizes the stream to read the pinned total, and NCCL EP's
dispatch reads the received count again (``nccl_ep.cc:3137-3168``).

**Refused as TE refuses it**: a non-bf16 payload (NotImplementedError, ``_require_bf16``),
non-float32 top-k weights (TypeError), int32 top-k indices on 4329ff8 (RuntimeError), a second
``ep_bootstrap`` (RuntimeError), a group of one (ValueError), an ``EpBuffer`` before the
bootstrap and any op after ``ep_finalize`` (RuntimeError: "EPBackend not initialized"), an
alignment that is no power of two (ValueError), another (top-k, alignment) than the process's
first prepare (RuntimeError), more tokens than ``max_tokens_per_rank`` (an abort in NCCL EP: a
RuntimeError here), more received slots than the capacity without ``drop_on_overflow`` (a device
trap in NCCL EP: a RuntimeError here, naming the capacity), a payload tensor in host memory (TE's
ops are registered for CUDA only: NotImplementedError), and in zero-copy mode any receive,
combine-input or gradient buffer that is not symmetric memory on the EP group (RuntimeError
"must be symm-mem-backed"). One NCCL EP context per process, bound to the bootstrapped group:
the ops carry no group, as in TE.

**Memory**: the bootstrap allocates the NCCL EP group's memory (:func:`context_bytes`: the
32 MiB workspace, the symmetric token/probability/scale buffers, the routing map, pinned host
pointers), which ``ep_finalize`` frees but for the device communicator ncclEpCreateGroup leaks
on one NVLink domain (:data:`LEAKED`); ``handle_mem`` is NCCL EP's ``HtBlockLayout`` for the
group (:func:`handle_mem_size`, ``nccl_ep.cc:2397-2471``); ``symm_mem_alloc`` allocates
through the counted allocator and, with ``use_pool=False``, rendezvouses on the group (a
barrier), as torch's symmetric memory does; the tensors it returns are what
:func:`is_symm_backed` answers True for (a view included).
"""

from __future__ import annotations

import builtins
import collections
import os
import types
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from cpu_runtime import faults, placement
from cpu_runtime.emulation_common import (
    all_gather_rows,
    all_to_all,
    buffer_device,
    count_set,
    group_rank,
    group_size,
    host_all_gather_ints,
    kernel_host_sync,
)

# The TE commits of the three APIs (module docstring).
TE_COMMITS = {
    "4329ff8": "4329ff84bfbdaa778a33cba02a15fb0807c64689",
    "622a3ee": "622a3eea1",
    "d0067d0": "d0067d0da6cb01811b8072a7d304f0e00344ce2b",
}
NCCL_EP_COMMIT = "9f47d6eb"  # nccl-extensions, the NCCL EP kernels TE d0067d0 pins

# SMs of the device the placement rules describe (an H100): NCCL EP sizes its scan scratch by it.
DEVICE_SMS = 132
# Prepared handles kept, by handle_mem address (TE's cache of NCCL EP handles is an LRU).
HANDLE_CACHE = 1024


def _a256(n: int) -> int:
    return (n + 255) // 256 * 256


def handle_mem_terms(
    max_tokens: int,
    max_recv_tokens: int,
    num_ranks: int,
    num_experts: int,
    num_topk: int,
    zero_copy: bool = False,
    device_sms: int = DEVICE_SMS,
) -> List[tuple]:
    """``(name, bytes)`` of one ``EpBuffer.handle_mem``, in order: NCCL EP's
    ``HtBlockLayout::compute`` for one NVLink domain and the expert-major layout
    (``nccl_ep.cc:2397-2471``; the local-permute mode without zero-copy, local-dup with it,
    ``nccl_ep.cc:1885-1906``): the routing and rank masks, the local-expert routing map, the scan
    scratch (8 bytes per block and rank, ``ht_ep_adapter.cu:641-647``), the dense probabilities,
    the cached top-k indices, the per-expert tables and the permute scratch, each rounded up to
    256."""
    m, mr, r, k = max_tokens, max_recv_tokens, num_ranks, num_topk
    local = num_experts // r
    permute = not zero_copy
    terms = [
        ("r2a", _a256((m + 15) // 16 * 16)),  # bool, one node
        ("ler", _a256(mr * local)),  # bool
        ("ntfe", _a256(4)),
        ("s2d", _a256(m * (r if permute else k) * 4)),
        ("rank_mask", _a256(m * r * ((r + 63) // 64) * 8)),
        ("scan_tmp", _a256(device_sms * r * 8)),
        ("prob", _a256(m * num_experts * 4)),  # dense probabilities, one node
        ("topk_idx", _a256(m * k * 8)),  # the cached top-k indices
        ("pec_active", _a256(local * 4)),
        ("eto", _a256((local + 1) * 8)),
    ]
    if zero_copy:  # local-dup fan-out groups
        terms += [("emuf_group_buf", _a256(mr // 2 * min(k, local) * 4)), ("emuf_count", _a256(4))]
    else:  # local-permute scratch
        terms += [("flat2em", _a256(mr * k * 4)), ("recv_topk_weights_flat", _a256(mr * k * 4)),
                  ("token_to_recv_slot", _a256(m * r * 4))]  # fmt: skip
    return terms


def handle_mem_size(*args, **kwargs) -> int:
    """Bytes of one ``EpBuffer.handle_mem`` (:func:`handle_mem_terms`, same arguments)."""
    return sum(n for _, n in handle_mem_terms(*args, **kwargs))


# NCCL EP's group workspace (``NUM_WORKSPACE_BYTES``, nccl_ep include/common.hpp:19) and its
# counter block (``kCounterBlockBytes``, nccl_ep.cc:1102-1128).
WORKSPACE_BYTES = 32 * 1024 * 1024
COUNTER_BLOCK_BYTES = 32
# What ncclEpCreateGroup leaks on one NVLink domain (a device communicator ncclEpGroupDestroy
# never destroys, nccl_ep.cc:1280-1297, 1515): one cuMem granule, 2 MiB on Hopper (a driver
# property; the struct copy beside it, sizeof(ncclDevComm_t), is not modelled).
LEAKED_PER_GROUP_BYTES = 2 * 1024 * 1024


def context_bytes(
    num_ranks: int,
    num_experts: int,
    max_tokens: int,
    max_recv_tokens: int,
    hidden: int,
    zero_copy: bool = False,
    token_bytes: int = 2,
) -> Dict[str, int]:
    """What ``ncclEpCreateGroup`` allocates for TE's configuration (HT, one NVLink domain,
    expert-major; nccl_ep.cc:1013-1248, 1900-1963) and ``ncclEpGroupDestroy`` frees, by kind:
    ``device`` (the 32 MiB workspace, the counter block, the all-gathered routing map
    ``R x M x ceil(E / 8)``, and the symmetric "mega" buffer: dispatch and combine token staging
    ``a256(M x R x B)`` each (none with zero-copy), their probabilities ``a256(MR x E x 4)`` each
    and the scale region ``a256(MR x B)``, allocated even for bf16, plus the 8-byte completion
    flags) and ``pinned`` (the mapped host pointer block, ``40 x R``); ``leaked``, what destroy
    does not free. Requested sizes: NCCL's cuMem granule rounding is not modelled."""
    r, m, mr, e = num_ranks, max_tokens, max_recv_tokens, num_experts
    b = hidden * token_bytes
    tokens = 0 if zero_copy else 2 * _a256(m * r * b)
    mega = tokens + 2 * _a256(mr * e * 4) + _a256(mr * b)
    device = WORKSPACE_BYTES + COUNTER_BLOCK_BYTES + r * m * ((e + 7) // 8) + mega + 8
    return {"device": device, "pinned": 40 * r, "leaked": LEAKED_PER_GROUP_BYTES}


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
        sizes = context_bytes(size, num_experts, max_tokens, max_recv, hidden, zero_copy)
        pin = placement.active() or torch.cuda.is_available()
        memory = (
            torch.empty(sizes["device"], dtype=torch.uint8, device=_device()),
            torch.empty(sizes["pinned"], dtype=torch.uint8, pin_memory=pin),
        )
        LEAKED.append(torch.empty(sizes["leaked"], dtype=torch.uint8, device=_device()))
        self.__dict__.update(
            memory=memory,
            initialized=True, group=group, num_experts=num_experts, max_tokens=max_tokens,
            max_recv=max_recv, hidden=hidden, zero_copy=zero_copy, drop=drop, eager=eager,
            num_topk=num_topk, cached=None, handles=collections.OrderedDict(),
        )  # fmt: skip

    def shutdown(self) -> None:
        if self.initialized:
            self.__dict__.update(initialized=False, group=None, cached=None, memory=None,
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


def build(api: str) -> _Module:
    """The emulated ``transformer_engine.pytorch.ep`` of TE ``api`` (a key of TE_COMMITS)."""
    if api not in TE_COMMITS:
        raise ValueError(f"unknown TE EP API {api!r}; known: {sorted(TE_COMMITS)}")
    m = _new_module(api)
    head, rel = api == "d0067d0", api == "4329ff8"

    def _alloc_io(shape, dtype, device, zero_copy):
        if zero_copy:
            return _symm_alloc(shape, dtype, m._EP_GROUP, device, collective=False)
        return torch.empty(*shape, dtype=dtype, device=device)

    # -- bootstrap ------------------------------------------------------------------------
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
        # group's ranks, logged (cpu_runtime.faults), not run.
        faults.note("ncclep ep_finalize", getattr(m, "_EP_RANKS", None))
        try:
            BACKEND.shutdown()
        finally:
            m._BOOTSTRAPPED, m._EP_GROUP = False, None
            if head:
                m._EAGER = False

    m.ep_bootstrap, m.ep_finalize = ep_bootstrap, ep_finalize

    # -- symmetric memory -----------------------------------------------------------------
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

    # -- EpBuffer -------------------------------------------------------------------------
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
                    self.recv_topk_weights_symm_buf = symm_mem_alloc(
                        (rc,), torch.float32, m._EP_GROUP, device=self.device
                    )
                    if self.recv_tokens_symm_buf is None:
                        self.recv_tokens_symm_buf = symm_mem_alloc(
                            (rc, h), payload_dtype, m._EP_GROUP, device=self.device
                        )
                    if self.grad_expert_out_symm_buf is None:
                        self.grad_expert_out_symm_buf = symm_mem_alloc(
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
    return m


# --------------------------------------------------------------------------------------------
# Install: answer megatron's two imports.


def api_for_tree(tree: str) -> Optional[str]:
    """The TE EP API whose signatures accept the calls of ``tree``'s ``fused_a2a.py`` (module
    docstring), or None for a tree without NCCL EP."""
    path = os.path.join(tree, "megatron", "core", "transformer", "moe", "fused_a2a.py")
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except OSError:
        return None
    if "te_ep.ep_bootstrap" not in source:
        return None
    if "num_topk=num_topk" in source and "drop_on_overflow" in source:
        return "d0067d0"
    if "recv_tokens=recv_tokens" in source:
        return "622a3ee"
    return "4329ff8"


_STATE: Dict[str, object] = {"module": None, "import": None}


def _import(name, globals=None, locals=None, fromlist=(), level=0):
    module = _STATE["module"]
    if module is not None and level == 0 and fromlist:
        if name == "transformer_engine.pytorch" and set(fromlist) == {"ep"}:
            package = types.ModuleType("transformer_engine.pytorch")
            package.ep = module
            return package
        if name == "transformer_engine.pytorch.ep":
            return module
    return _STATE["import"](name, globals, locals, fromlist, level)


def install(api: str) -> _Module:
    """Answer ``from transformer_engine.pytorch import ep`` (and ``from
    transformer_engine.pytorch.ep import ...``) with the emulation of TE ``api``; other TE
    imports still fail. Must run before megatron-core's fused_a2a is imported; installing the
    same API again keeps the module megatron bound."""
    current = _STATE["module"]
    if current is not None and current.TE_COMMIT == TE_COMMITS.get(api):
        return current  # a rank forked from a zygote that installed it already
    module = build(api)
    if _STATE["import"] is None:
        _STATE["import"] = builtins.__import__
        builtins.__import__ = _import
    _STATE["module"] = module
    BACKEND.shutdown()
    return module


def installed() -> Optional[_Module]:
    return _STATE["module"]


def uninstall() -> None:
    if _STATE["import"] is not None:
        builtins.__import__ = _STATE["import"]
    _STATE.update(module=None, **{"import": None})
    BACKEND.shutdown()


def release_for_exit() -> None:
    """A job's teardown (not a TE call): the process's NCCL EP context goes with it."""
    module = _STATE["module"]
    if module is not None:
        module._BOOTSTRAPPED, module._EP_GROUP = False, None
    BACKEND.shutdown()
