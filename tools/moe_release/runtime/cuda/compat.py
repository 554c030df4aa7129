# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""CPU compatibility for running megatron-core's real MoE code on a host without CUDA.

Each kind of help is as narrow as the spot it covers (the kernels' emulations are registered by
:mod:`moe_release.runtime.kernels.install`):

* :func:`install_cpu_rng_shim` gives ``tensor_parallel.random`` a CPU stand-in for the CUDA
  generator (a dedicated ``torch.Generator``), set synchronously. A runtime stand-in, not a patch:
  upstream's checkpointing is CUDA-RNG by design and a host generator there would change what
  production code saves.
* :func:`install_base_tree_shims` covers, on megatron-core 0.16 without patch 1,
  ``moe_utils.te_general_gemm``, which is undefined without Transformer Engine; and, only when
  the placement rules are off (``MOE_RELEASE_PLACEMENT=0``: there is no emulated GPU then),
  ``_HybridEPManager.over_budget`` allocated with ``device='cuda'`` and ``Router.gating`` moving
  host weights to ``torch.cuda.current_device()``. Under the rules both are what they are on a
  GPU: a device tensor and device 0.
* :func:`install_dtoh_stream_cpu_shim` runs the all-to-all dispatcher's dropless path and the
  shared-expert overlap: a host stand-in for their side streams and events
  (:class:`HostStream`), with split sizes arriving as numpy arrays as they do from a GPU.
* :func:`install_router_buffers_cpu_shim` and :func:`install_mtp_cpu_shim` let TopKRouter's
  aux-loss buffers and multi-token prediction's loss tracker live on the host.
* :func:`install_attention_cpu_shim` and :func:`install_tensor_parallel_cpu_shim` let
  GlobalMemoryBuffer and the tensor-parallel gathers/reduce-scatters, which allocate on
  ``torch.cuda.current_device()``, allocate on the host, and give the gathers/reduce-scatters
  with uneven splits (NCCL takes them, gloo does not) a padded equivalent.
"""

import functools
import inspect
import sys
import types

import torch

from moe_release.runtime.cuda import placement
from moe_release.runtime.cuda.host_streams import (  # noqa: F401 (re-exported)
    HOST_STREAMS,
    HostEvent,
    HostStream,
    HostStreams,
)


class _Proxy(types.ModuleType):
    """A module stand-in that overrides a few attributes and forwards the rest."""

    def __init__(self, target, **overrides):
        super().__init__(getattr(target, "__name__", "proxy"))
        self.__dict__["_target"] = target
        self.__dict__["_overrides"] = frozenset(overrides)
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self.__dict__["_target"], name)


# The device generator of the placement rules: random ops on device tensors draw from it there.
_SHADOW_CUDA_GENERATOR = placement.CUDA_GENERATOR


def _shadow_get_state(*args, **kwargs) -> torch.Tensor:
    return _SHADOW_CUDA_GENERATOR.get_state()


def _shadow_set_state(new_state: torch.Tensor, *args, **kwargs) -> None:
    # Set now: the real _set_cuda_rng_state queues a lazy call that never runs without CUDA,
    # which both loses the state and keeps every state tensor alive.
    _SHADOW_CUDA_GENERATOR.set_state(new_state)


def _shadow_manual_seed(seed: int) -> None:
    _SHADOW_CUDA_GENERATOR.manual_seed(seed)


def install_cpu_rng_shim() -> None:
    """Route ``tensor_parallel.random``'s CUDA RNG calls to a host generator (idempotent)."""
    from megatron.core.tensor_parallel import random as tp_random

    if getattr(tp_random, "_moe_release_cpu_rng_shim", False) or torch.cuda.is_available():
        return
    tp_random._get_cuda_rng_state = _shadow_get_state
    tp_random._set_cuda_rng_state = _shadow_set_state
    cuda = _Proxy(
        torch.cuda,
        get_rng_state=_shadow_get_state,
        set_rng_state=_shadow_set_state,
        manual_seed=_shadow_manual_seed,
    )
    tp_random.torch = _Proxy(torch, cuda=cuda)
    tp_random._moe_release_cpu_rng_shim = True


def _needs_over_budget_shim() -> bool:
    from megatron.core.transformer.moe.token_dispatcher import _HybridEPManager

    source = inspect.getsource(_HybridEPManager.__init__)
    return "device='cuda'" in source and "is_available()" not in source


def _needs_router_shim() -> bool:
    from megatron.core.transformer.moe.router import Router

    source = inspect.getsource(Router.gating)
    return "current_device()" in source and "is_available()" not in source


def host_zeros(*args, device=None, **kwargs) -> torch.Tensor:
    """``torch.zeros`` with ``device="cuda"`` placed on the host (under the placement rules,
    which place ``device="cuda"`` themselves, a device tensor)."""
    if placement.active():
        return torch.zeros(*args, device=device, **kwargs)
    return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def install_base_tree_shims() -> list:
    """On megatron-core 0.16 without patch 1, ``moe_utils.te_general_gemm`` left undefined
    without Transformer Engine (the router's gating linear reads it; patch 1 makes it None
    there); without the placement rules, the two CUDA-only allocations of the dispatcher path.

    Returns the names of the shims installed.
    """
    installed = []
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        installed.append("te_general_gemm")
    if torch.cuda.is_available() or placement.active():
        return installed
    if _needs_over_budget_shim():
        from megatron.core.transformer.moe import token_dispatcher

        manager = token_dispatcher._HybridEPManager
        original = manager.__init__

        @functools.wraps(original)
        def __init__(self, *args, **kwargs):
            # Only the module global `torch` seen while the constructor runs is swapped.
            saved = token_dispatcher.torch
            token_dispatcher.torch = _Proxy(torch, zeros=host_zeros)
            try:
                original(self, *args, **kwargs)
            finally:
                token_dispatcher.torch = saved

        manager.__init__ = __init__
        installed.append("over_budget")
    if _needs_router_shim():
        from megatron.core.transformer.moe import router

        _with_host_current_device(router, router.Router, "gating")
        installed.append("router_device")
    return installed


def _host_current_device():
    # Under the placement rules device 0 is the (emulated) GPU; without them, the host.
    return 0 if placement.active() else "cpu"


def _host_device_torch() -> types.ModuleType:
    """``torch`` whose ``cuda.current_device()`` answers "cpu" (0 under the placement rules,
    which place device 0 on the host as a device tensor); everything else is torch's."""
    return _Proxy(torch, cuda=_Proxy(torch.cuda, current_device=_host_current_device))


def _with_host_current_device(module, cls, method: str) -> None:
    """Wrap ``cls.method`` so that, while it runs, ``module``'s ``torch.cuda.current_device()``
    answers "cpu" (only that module global is swapped, and restored afterwards)."""
    original = getattr(cls, method)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        saved = module.torch
        module.torch = _host_device_torch()
        try:
            return original(self, *args, **kwargs)
        finally:
            module.torch = saved

    setattr(cls, method, wrapper)


def install_attention_cpu_shim() -> bool:
    """Fixture for models with attention: megatron's GlobalMemoryBuffer (used by the local
    DotProductAttention) allocates on ``torch.cuda.current_device()``; without CUDA it
    allocates on the host. Idempotent; returns whether it installed anything."""
    from megatron.core import utils as mcore_utils

    buffer_cls = mcore_utils.GlobalMemoryBuffer
    if torch.cuda.is_available() or getattr(buffer_cls, "_moe_release_cpu", False):
        return False
    _with_host_current_device(mcore_utils, buffer_cls, "get_tensor")
    buffer_cls._moe_release_cpu = True
    return True


def _padded_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    out = t.new_zeros((rows, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


def uneven_all_gather(tensor_list, tensor, group=None, async_op: bool = False):
    """``torch.distributed.all_gather`` with per-rank sizes along dim 0, which NCCL accepts and
    gloo does not: pad every part to the largest, gather, keep each rank's rows."""
    import torch.distributed as dist

    if all(t.shape == tensor.shape for t in tensor_list):
        return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    if async_op:
        raise NotImplementedError("uneven all_gather stand-in is synchronous")
    rows = max(t.shape[0] for t in tensor_list)
    parts = [torch.empty_like(_padded_rows(tensor, rows)) for _ in tensor_list]
    dist.all_gather(parts, _padded_rows(tensor, rows), group=group)
    for out, part in zip(tensor_list, parts):
        out.copy_(part[: out.shape[0]])
    return None


def uneven_reduce_scatter(output, input_list, op=None, group=None, async_op: bool = False):
    """``torch.distributed.reduce_scatter`` with per-rank sizes along dim 0 (as NCCL accepts):
    pad every part to the largest, reduce-scatter, keep this rank's rows."""
    import torch.distributed as dist

    op = dist.ReduceOp.SUM if op is None else op
    if all(t.shape == output.shape for t in input_list):
        return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)
    if async_op:
        raise NotImplementedError("uneven reduce_scatter stand-in is synchronous")
    rows = max(t.shape[0] for t in input_list)
    reduced = torch.empty_like(_padded_rows(output, rows))
    dist.reduce_scatter(reduced, [_padded_rows(t, rows) for t in input_list], op=op, group=group)
    output.copy_(reduced[: output.shape[0]])
    return None


def install_tensor_parallel_cpu_shim() -> bool:
    """For tensor/sequence parallelism without CUDA: megatron's gathers and reduce-scatters
    (``tensor_parallel.mappings``) and its GlobalMemoryBuffer allocate their outputs on
    ``torch.cuda.current_device()``; here they allocate on the host, and the list forms with
    uneven splits go through :func:`uneven_all_gather`/:func:`uneven_reduce_scatter`. Only the
    ``torch`` global of ``mappings`` and ``GlobalMemoryBuffer.get_tensor`` see the stand-ins.
    Idempotent; returns whether it installed anything."""
    from megatron.core.tensor_parallel import mappings

    if torch.cuda.is_available() or getattr(mappings, "_moe_release_cpu", False):
        return False
    mappings.torch = _Proxy(
        torch,
        cuda=_host_device_torch().cuda,
        # Uneven splits (the all-to-all dispatcher's TP gathers): NCCL takes them, gloo does not.
        distributed=_Proxy(
            torch.distributed,
            all_gather=uneven_all_gather,
            reduce_scatter=uneven_reduce_scatter,
        ),
    )
    mappings._moe_release_cpu = True
    install_attention_cpu_shim()
    return True


def host_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``moe_utils.maybe_move_tensor_to_cpu`` as it behaves on a GPU, for host tensors: the
    result is a copy (the device-to-host transfer), a numpy array when ``as_numpy``."""
    if not torch.is_tensor(tensor):
        return tensor
    if placement.active():
        # As on a GPU: a non-blocking copy into pinned host memory (host tensors stay).
        if not tensor.is_cuda:
            return tensor
        out = tensor.to(torch.device("cpu"), non_blocking=True)
        if record_stream:
            tensor.record_stream(HOST_STREAMS.current_stream())
        return out.numpy() if as_numpy else out
    out = tensor.detach().clone()
    return out.numpy() if as_numpy else out


def host_stream_torch(**extra) -> types.ModuleType:
    """``torch`` with the stream calls of ``torch.cuda`` answered by :class:`HostStream` and
    :data:`HOST_STREAMS` (and the attributes in ``extra`` replaced); everything else is
    torch's."""
    cuda = _Proxy(
        torch.cuda,
        Stream=HostStream,
        Event=HostEvent,
        current_stream=HOST_STREAMS.current_stream,
        stream=HOST_STREAMS.stream,
    )
    return _Proxy(torch, cuda=cuda, **extra)


def dtoh_stream_torch() -> types.ModuleType:
    """``torch`` as the all-to-all dispatcher sees it on the host: the real module, with the
    stream calls of ``torch.cuda`` answered by :class:`HostStream` and :data:`HOST_STREAMS`."""
    return host_stream_torch()


def stream_stand_in_of(module_torch) -> bool:
    """Whether ``module_torch`` (a module's ``torch`` global) is the real torch seen through
    :func:`install_dtoh_stream_cpu_shim`'s proxy, which overrides only the stream calls."""
    cuda = getattr(module_torch, "__dict__", {}).get("cuda")
    return (
        isinstance(module_torch, _Proxy)
        and module_torch._target is torch
        and module_torch._overrides == {"cuda"}
        and isinstance(cuda, _Proxy)
        and cuda._target is torch.cuda
        and cuda._overrides == {"Stream", "Event", "current_stream", "stream"}
    )


def install_mtp_cpu_shim() -> bool:
    """Multi-token prediction's loss bookkeeping (``MTPLossLoggingHelper``) allocates its
    tracker on ``torch.cuda.current_device()``; here on the host. Only the ``torch`` global of
    ``multi_token_prediction`` changes, and only ``cuda.current_device``. Idempotent; returns
    whether it installed anything."""
    from megatron.core.transformer import multi_token_prediction as mtp

    if torch.cuda.is_available() or getattr(mtp, "_moe_release_cpu", False):
        return False
    mtp.torch = _host_device_torch()
    mtp._moe_release_cpu = True
    return True


def install_router_buffers_cpu_shim() -> bool:
    """TopKRouter's constructor allocates its aux-loss and expert-bias buffers
    (``global_tokens_per_expert``, ``ga_steps``, ``local_tokens_per_expert``, ...) on
    ``torch.cuda.current_device()``; here they go to the host. Only ``router``'s ``torch``
    global changes, and only while the constructor runs. Idempotent; returns whether it
    installed anything."""
    from megatron.core.transformer.moe import router

    cls = router.TopKRouter
    if torch.cuda.is_available() or cls.__dict__.get("_moe_release_cpu_buffers", False):
        return False
    _with_host_current_device(router, cls, "__init__")
    cls._moe_release_cpu_buffers = True
    return True


def install_dtoh_stream_cpu_shim() -> bool:
    """The all-to-all dispatcher's dropless path and the shared-expert overlap on the host:
    their side streams (``torch.cuda.Stream``, ``current_stream``, ``stream``, ``wait_stream``,
    ``record_event``) become :class:`HostStream`, and the dispatcher's device-to-host copies of
    the split sizes arrive as numpy arrays, as they do from a GPU. Only the ``torch.cuda`` view
    of ``token_dispatcher`` and ``shared_experts`` and the dispatcher's
    ``maybe_move_tensor_to_cpu`` are replaced. Idempotent; returns whether it
    installed anything."""
    from megatron.core.transformer.moe import shared_experts, token_dispatcher

    if torch.cuda.is_available() or getattr(token_dispatcher, "_moe_release_cpu_streams", False):
        return False
    token_dispatcher.torch = dtoh_stream_torch()
    token_dispatcher.maybe_move_tensor_to_cpu = host_move_tensor_to_cpu
    token_dispatcher._moe_release_cpu_streams = True
    # The shared-expert overlap runs the shared experts on a side stream of its own.
    shared_experts.torch = dtoh_stream_torch()
    return True


def held_comm_buffers(fused_a2a) -> list:
    """fused_a2a's HybridEP and DeepEP buffers in use on any tree, each once: one per process
    group's ranks where the series keys them (its ``_TABLES``), the module globals on the base
    (DeepEP v2's ``_elastic_buffer`` where the tree has it: dev)."""
    tables = getattr(fused_a2a, "_TABLES", None)
    if tables is not None:
        held = [b for t in tables for b in t.in_use()]
    else:
        held = [getattr(fused_a2a, name, None) for name in _BUFFER_GLOBALS]
    return list({id(b): b for b in held if b is not None}.values())


def allocated_comm_buffers(fused_a2a) -> list:
    """Every communication buffer fused_a2a still references, in use or not (the series keeps
    a buffer taken out of use until the explicit release frees it); on the base, those in use."""
    held = getattr(fused_a2a, "_held_buffers", None)
    return held() if held is not None else held_comm_buffers(fused_a2a)


_BUFFER_GLOBALS = ("_hybrid_ep_buffer", "_buffer", "_elastic_buffer")


def teardown_megatron_state() -> None:
    """Drop parallel state and the module-global DeepEP/HybridEP buffers, if imported (the
    references only: a job's end is no collective point, so the emulated DeepEP v2 buffers and
    NCCL EP context go as a process exit takes them, without a collective)."""
    kernels = "moe_release.runtime.kernels"
    for name in (f"{kernels}.deepepv2_emulation", f"{kernels}.ncclep_emulation"):
        emulation = sys.modules.get(name)
        if emulation is not None:
            emulation.release_for_exit()
    fused_a2a = sys.modules.get("megatron.core.transformer.moe.fused_a2a")
    if fused_a2a is not None:
        fused_a2a.reset_hybrid_ep_buffer()
        fused_a2a._buffer = None
        if hasattr(fused_a2a, "_elastic_buffer"):
            fused_a2a._elastic_buffer = None
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None:
        parallel_state.destroy_model_parallel()
