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

**Across LSA teams** (nccl_ep.cc at 9f47d6eb, read from the NVIDIA/nccl-extensions mirror). NCCL
EP's node is the LSA team (``ncclTeamLsa``, the NVLink domain) and the teams are the rail team
(``ncclTeamRail``, nccl_ep.cc:1652-1653, 1864-1882); here the LSA team is the emulated node of
:func:`moe_release.runtime.kernels.emulation_common.node_layout` (``MOE_RELEASE_RANKS_PER_NODE``;
unset, one team capped at :data:`LSA_RANKS_PER_NODE` = 8, an H100 node). With ``D = R / L > 1``
teams of ``L`` ranks the bootstrap's group also takes ``init_ht_internode``'s path: one GIN
buffer of :func:`gin_buffer_terms` (nccl_ep.cc:1300-1358: the combine RED/G2S token and
probability regions for ``D - 1`` peer teams at the 64-token-chunk-aligned ``M'``, the G2S flags,
the sync guards, the token staging, the dense probabilities and the RDMA send/receive staging,
each rounded up to 4096), allocated with the rest of the context and registered with
``ncclCommWindowRegister`` on the EP communicator (every rank of the EP group, after
``ncclDevCommCreate``, nccl_ep.cc:1467-1510): a rendezvous over the group's ranks here, logged as
``ncclep gin window register``. ``ep_finalize`` (``ncclEpGroupDestroy``) deregisters it on the
same communicator (``destroy_ht_internode``, nccl_ep.cc:1514-1564, 2063-2066): ``ncclep gin window
deregister``, over the same ranks, after ``ncclep ep_finalize``; a peer that never arrives at
either makes the others raise "a GPU would trap" within ``settings.device_barrier_timeout()``
(the real bootstrap barrier would hang), and at finalize the group's memory stays allocated in
:data:`LEAKED`. The context's other terms follow the team size (:func:`context_bytes`:
probabilities over the team's ``E_l x L`` experts, the ``40 x L`` host block, the routing map's
per-team blocks), and nothing leaks: the device communicator is destroyed there.

Scale-down and gaps: a real LSA team is 8 GPUs of a node (72 in an NVL72 domain) and the cross-team
hop is GIN RDMA over the rails; here ranks of gloo. Not emulated across teams: the data path (the
dispatch and combine stay the one-team collectives above; the RDMA kernels' staging order and any
per-team partial reduction of combine are not modelled, so the combine's roundings are the
one-team ones), the handle memory's multi-team terms (:func:`handle_mem_terms` keeps the one-team
``HtBlockLayout``), ``NCCL_EP_TOKENS_PER_CHUNK`` (the 64-token default is used), the
``d_dcomms`` copy (``sizeof(ncclDevComm_t)``, not in the source), NCCL's cuMem granule rounding,
and the one-team windows' collective (de)registration (the mega buffer and completion flags,
nccl_ep.cc:1135-1149, 1199-1210), which stays folded into ``ncclep ep_bootstrap`` /
``ncclep ep_finalize`` as before.
"""

import builtins
import os
import types
from typing import Dict, Optional

from moe_release.runtime.kernels.ncclep_emulation.api import build
from moe_release.runtime.kernels.ncclep_emulation.backend import BACKEND, LEAKED, _Module
from moe_release.runtime.kernels.ncclep_emulation.sizes import (
    COUNTER_BLOCK_BYTES,
    DEVICE_SMS,
    HANDLE_CACHE,
    LEAKED_PER_GROUP_BYTES,
    LSA_RANKS_PER_NODE,
    NCCL_EP_COMMIT,
    TE_COMMITS,
    WORKSPACE_BYTES,
    context_bytes,
    gin_buffer_terms,
    handle_mem_size,
    handle_mem_terms,
)

__all__ = [
    "BACKEND",
    "COUNTER_BLOCK_BYTES",
    "DEVICE_SMS",
    "HANDLE_CACHE",
    "LEAKED",
    "LEAKED_PER_GROUP_BYTES",
    "LSA_RANKS_PER_NODE",
    "NCCL_EP_COMMIT",
    "TE_COMMITS",
    "WORKSPACE_BYTES",
    "api_for_tree",
    "build",
    "context_bytes",
    "gin_buffer_terms",
    "handle_mem_size",
    "handle_mem_terms",
    "install",
    "installed",
    "release_for_exit",
    "uninstall",
]

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
