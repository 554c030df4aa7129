# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""A pytest plugin that runs upstream Megatron-LM's unit tests on CPU ranks over gloo.

Loaded by :mod:`moe_release.upstream_tests.run` with ``-p moe_release.upstream_tests.plugin`` in
every rank's pytest (each rank of ``torch.distributed.run`` runs pytest, as on upstream's CI),
before upstream's ``conftest.py`` files. The host stands in for the GPU; nothing in the checkout is
changed:

* **Tests see a device, megatron-core sees the host.** ``torch.cuda.is_available()`` answers
  ``True`` only to code in the checkout's ``tests/`` (so ``skipif(not
  torch.cuda.is_available())`` runs the test, as on a GPU runner) and ``False`` everywhere else,
  so megatron-core keeps the host paths it has.
* **Placement: CUDA's rules on the host** (default; ``UPSTREAM_CPU_PLACEMENT=0``, ``run.py
  --no-placement``, turns them off). The CPU runtime's placement rules
  (:func:`moe_release.runtime.cuda.placement.install`) give every tensor the placement it would have
  on a GPU and refuse what CUDA refuses: ``device="cuda"``/``cuda:N``/an index, ``.cuda()``,
  ``.to("cuda")``, ``Module.cuda()`` make device tensors (the tests' inputs), a factory without
  ``device=`` in megatron-core makes a pageable host tensor (``pin_memory=True`` a pinned one),
  ``.is_cuda``/``.device``/``.is_pinned()`` answer by placement; ``record_stream`` on a host tensor
  raises torch's ``NotImplementedError``, an op mixing device and host tensors raises CUDA's
  device-mismatch error, ``.numpy()`` of a device tensor raises. They also answer
  ``torch.cuda.current_device()`` (0), ``synchronize``, ``current_stream``/``default_stream``/
  ``stream``/``Stream``/``Event`` (the host stand-ins of
  :mod:`moe_release.runtime.cuda.host_streams`), and run a backward with the rules in force
  (``Tensor.backward``/``torch.autograd.backward``, a checkpoint's recompute included), so
  ``Tensor.to`` needs no wrapping. Without them (the plugin's earlier placement, for comparison): a
  ``TorchFunctionMode`` turns every ``device=`` naming CUDA and ``Tensor.to``'s CUDA targets into
  ``"cpu"`` and drops ``pin_memory``, ``Tensor.cuda()``/``Module.cuda()`` keep tensors where they
  are, ``Tensor.to`` is wrapped directly (the mode is not active where the autograd engine runs a
  backward), and the stream calls are the same host stand-ins.
* **The device API.** ``set_device`` is a no-op, ``device_count()`` the local world size,
  ``get_device_properties``/``get_device_capability``/``get_device_name`` describe an H100
  (compute capability 9.0, as upstream's runners; without Transformer Engine only the tests'
  fp8-recipe lists read it); the CUDA RNG calls use a host generator
  (:func:`moe_release.runtime.cuda.compat.install_cpu_rng_shim` for ``tensor_parallel.random``).
* **Communication.** ``nccl`` process groups are created as ``gloo`` (``device_ids`` dropped
  from barriers, and group timeouts capped by ``UPSTREAM_CPU_PG_TIMEOUT`` seconds, default 180, so a
  rank left waiting fails instead of hanging for upstream's 30 minutes), and
  ``destroy_model_parallel()`` also destroys the groups it forgets, but those an emulated
  communication buffer is bound to (see :func:`destroy_groups`); the
  uneven all-gathers/reduce-scatters NCCL accepts go through the padded stand-ins of
  :func:`moe_release.runtime.cuda.compat.install_tensor_parallel_cpu_shim`; the all-to-all
  dispatcher's split sizes arrive as numpy arrays, as its device-to-host copies deliver them on a
  GPU (:func:`moe_release.runtime.cuda.compat.install_dtoh_stream_cpu_shim`).
* **No downloads.** Upstream's session fixture ``ensure_test_data`` would fetch datasets into
  ``/opt/data``; the plugin gives it a stand-in downloader that fetches nothing (the MoE tests
  use no data sets).
* ``UPSTREAM_CPU_DEEP_EP=emulation`` registers moe-release's CPU emulation of the ``deep_ep``
  kernels (HybridEP and DeepEP, :mod:`moe_release.runtime.kernels.deepep_module`), so the
  flex-dispatcher tests run too; off by default, because upstream's checkout does not contain it.
* ``UPSTREAM_CPU_TE=local`` (``run.py --te-local-spec``) runs the tests that need Transformer
  Engine only for its modules on megatron-core's local ones: to the checkout's tests (only to
  them) ``is_te_min_version`` answers as TE :data:`TE_VERSION_FOR_TESTS` would, and
  ``get_gpt_decoder_block_spec``/``get_gpt_mtp_block_spec`` asked for TE, and
  ``get_gpt_layer_with_transformer_engine_spec``, give the local spec. Off by default: it
  changes what those tests test (local linears and attention instead of TE's), not the
  dispatchers and schedules they exercise. Tests that need TE itself (fp8, TE >= 2.3's
  fusions, its NCCL-EP and op-fuser APIs) still skip.
* ``UPSTREAM_CPU_STREAM_ORDER=0`` (``run.py --no-stream-order``) keeps the placement rules but
  not their stream-ordering check (see :func:`_without_stream_order`).
* ``UPSTREAM_CPU_FP32_GEMM=1`` (``run.py --fp32-gemm``) runs half-precision GEMMs in float32,
  rounded once (see :class:`Fp32GemmMode`): on a host without native bf16 the A2A-overlap
  tests' bf16 attention would otherwise take hours.

What stays out of reach on the host is what needs Transformer Engine, fp8, or the real
deep_ep/NCCL-EP kernels: those tests skip (or fail) exactly as on a GPU runner without them.

Each rank appends its test outcomes (a module that fails to collect included, as one failed
entry named by its file) as JSON lines to ``$UPSTREAM_CPU_REPORT_DIR/rank<R>.jsonl``
when that variable is set (:mod:`moe_release.upstream_tests.run` aggregates them).
"""

import datetime
import inspect
import json
import os
import sys
import types
from pathlib import Path
from typing import Any, Dict, Optional

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from moe_release import settings
from moe_release.runtime.cuda import compat, placement
from moe_release.runtime.cuda.host_streams import (
    HOST_STREAMS,
    HostEvent,
    HostStream,
    install_record_stream_stand_in,
)
from moe_release.runtime.kernels.install import install_kernel_emulations

CHECKOUT = Path(settings.upstream_cpu_checkout()).resolve()
TESTS_DIR = str(CHECKOUT / "tests") + os.sep
# The placement rules (default) or the plugin's own CUDA-to-host mode (UPSTREAM_CPU_PLACEMENT=0).
PLACEMENT = settings.upstream_cpu_placement()
# What the checkout's tests see as Transformer Engine's version under UPSTREAM_CPU_TE=local: the
# lowest the A2A-overlap schedule tests ask for; below 2.3, so no fp8 recipe is parametrized.
TE_VERSION_FOR_TESTS = "1.9.0"

_real_is_available = torch.cuda.is_available


def _from_tests(depth: int = 2) -> bool:
    """Whether the caller's caller (``depth`` frames up) is code in the checkout's tests/."""
    return sys._getframe(depth).f_code.co_filename.startswith(TESTS_DIR)


def _is_cuda_device(device: Any) -> bool:
    """Whether ``device`` names a CUDA device (a bare int is a CUDA index, as in torch)."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _host(device: Any) -> Any:
    return "cpu" if _is_cuda_device(device) else device


class HostDeviceMode(TorchFunctionMode):
    """Without the placement rules: place every tensor a torch function is asked to put on CUDA
    on the host instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)
        if func is _real_tensor_to and len(args) > 1:
            args = (args[0], *(_host(a) for a in args[1:]))
        elif func is torch.Tensor.pin_memory:
            return args[0]
        return func(*args, **kwargs)


def is_available() -> bool:
    """``torch.cuda.is_available()``: ``True`` for the checkout's tests, else the real answer."""
    if _from_tests():
        return True
    return _real_is_available()


_real_tensor_to = torch.Tensor.to


def _tensor_to(self, *args, **kwargs):
    # Without the placement rules, also outside the mode: torch function modes are not active
    # where the autograd engine runs a backward (e.g. a checkpoint's recompute).
    if "device" in kwargs and _is_cuda_device(kwargs["device"]):
        kwargs["device"] = "cpu"
    return _real_tensor_to(self, *(_host(a) for a in args), **kwargs)


def _tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return self


def _module_cuda(self, device=None):
    return self


def device_count() -> int:
    """One "device" per local rank, as on a GPU node."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


# One function object per replaced attribute: torch._dynamo keys its rules by object.
def _set_device(device: Any) -> None:
    return None


def _synchronize(device: Any = None) -> None:
    return None


def _current_device() -> int:
    return 0


def _manual_seed_all(seed: int) -> None:
    compat._shadow_manual_seed(seed)


# What a device query answers: an H100 (upstream's runners), 80 GiB.
DEVICE_PROPERTIES = types.SimpleNamespace(
    name="NVIDIA H100 80GB HBM3 (upstream_cpu host stand-in)",
    major=9,
    minor=0,
    total_memory=80 * 2**30,
    multi_processor_count=132,
    is_integrated=False,
    is_multi_gpu_board=False,
    warp_size=32,
)


def _get_device_properties(device: Any = None) -> types.SimpleNamespace:
    return DEVICE_PROPERTIES


def _get_device_capability(device: Any = None) -> tuple:
    return DEVICE_PROPERTIES.major, DEVICE_PROPERTIES.minor


def _get_device_name(device: Any = None) -> str:
    return DEVICE_PROPERTIES.name


def _pg_timeout(timeout: Optional[datetime.timedelta]) -> datetime.timedelta:
    cap = datetime.timedelta(seconds=settings.upstream_cpu_pg_timeout())
    return cap if timeout is None else min(timeout, cap)


def _gloo_backend(backend: Any) -> Any:
    if backend is None:
        return None
    name = str(backend).lower()
    return "gloo" if "nccl" in name or name == "cuda" else backend


_real_init_process_group = dist.init_process_group
_real_new_group = dist.new_group
_real_barrier = dist.barrier


def init_process_group(backend=None, *args, **kwargs):
    """``torch.distributed.init_process_group`` with NCCL replaced by gloo."""
    kwargs["timeout"] = _pg_timeout(kwargs.get("timeout"))
    return _real_init_process_group(_gloo_backend(backend) or "gloo", *args, **kwargs)


_GROUPS: list = []


def new_group(*args, **kwargs):
    """``torch.distributed.new_group`` with NCCL (and its ``pg_options``) replaced by gloo."""
    if "backend" in kwargs:
        kwargs["backend"] = _gloo_backend(kwargs["backend"])
    if kwargs.get("pg_options") is not None and kwargs.get("backend") in (None, "gloo"):
        kwargs["pg_options"] = None
    kwargs["timeout"] = _pg_timeout(kwargs.get("timeout"))
    group = _real_new_group(*args, **kwargs)
    if isinstance(group, dist.ProcessGroup):
        _GROUPS.append(group)
    return group


def destroy_groups() -> int:
    """Destroy the groups created since the last call; returns how many.

    Every gloo group owns a few threads and sockets; megatron-core's
    ``destroy_model_parallel()`` only forgets its groups, so over a session of tests that each
    initialize model parallelism (dozens of groups each) eight ranks pile up over a thousand
    threads each, which on a small host stalls the run.

    A group an emulated communication buffer is still bound to is kept, forgotten only, as
    ``destroy_model_parallel()`` leaves it on a GPU: fused_a2a reuses a buffer while its group
    lives (a re-initialization on the same ranks), and destroying the group here would make every
    such re-initialization look like an abort.
    """
    from moe_release.runtime.measure import faults

    bound = {id(getattr(b, "group", None)) for b in list(faults.BUFFERS)}
    n = 0
    kept = []
    while _GROUPS:
        group = _GROUPS.pop()
        if id(group) in bound:
            kept.append(group)
            continue
        try:
            dist.destroy_process_group(group)
            n += 1
        except Exception:  # already destroyed, or the default group is gone
            pass
    _GROUPS.extend(reversed(kept))
    return n


def _destroy_groups_with_model_parallel() -> None:
    from megatron.core import parallel_state

    original = parallel_state.destroy_model_parallel

    def destroy_model_parallel(*args, **kwargs):
        result = original(*args, **kwargs)
        destroy_groups()
        return result

    destroy_model_parallel.__wrapped__ = original
    destroy_model_parallel.__doc__ = original.__doc__
    parallel_state.destroy_model_parallel = destroy_model_parallel


def barrier(group=None, async_op=False, device_ids=None):
    """``torch.distributed.barrier`` without ``device_ids`` (gloo has no devices)."""
    return _real_barrier(group=group, async_op=async_op)


def _stub_downloader() -> None:
    name = "tests.test_utils.python_scripts.download_unit_tests_dataset"
    module = types.ModuleType(name)

    def download_and_extract_asset(assets_dir: Path) -> bool:
        print(f"upstream_cpu: not downloading test data into {assets_dir}")
        return False

    module.download_and_extract_asset = download_and_extract_asset
    sys.modules[name] = module


def _install_deep_ep_emulation() -> None:
    if settings.upstream_cpu_deep_ep() != "emulation":
        return
    # The checkout under test is the working directory (run.py starts pytest there).
    install_kernel_emulations(settings.tree() or os.getcwd())


def _te_local_specs() -> None:
    """``UPSTREAM_CPU_TE=local``: the checkout's tests see Transformer Engine
    :data:`TE_VERSION_FOR_TESTS` in ``is_te_min_version`` and get megatron-core's local specs
    where they ask for TE's (see the module docstring). Everyone else sees the real answers."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from packaging.version import Version

    from megatron.core import utils as mcore_utils

    real_min_version = mcore_utils.is_te_min_version

    def is_te_min_version(version, check_equality=True):
        if not _from_tests():
            return real_min_version(version, check_equality)
        te, wanted = Version(TE_VERSION_FOR_TESTS), Version(version)
        return te >= wanted if check_equality else te > wanted

    is_te_min_version.__wrapped__ = real_min_version
    mcore_utils.is_te_min_version = is_te_min_version

    def without_te(original, flag="use_transformer_engine"):
        signature = inspect.signature(original)

        def spec(*args, **kwargs):
            if _from_tests():
                bound = signature.bind(*args, **kwargs)
                bound.arguments[flag] = False
                args, kwargs = bound.args, bound.kwargs
            return original(*args, **kwargs)

        spec.__wrapped__ = original
        spec.__name__ = original.__name__
        return spec

    for name in ("get_gpt_decoder_block_spec", "get_gpt_mtp_block_spec"):
        setattr(specs, name, without_te(getattr(specs, name)))

    te_spec = specs.get_gpt_layer_with_transformer_engine_spec
    te_params = inspect.signature(specs.get_gpt_layer_with_transformer_engine_submodules)
    local_params = inspect.signature(specs.get_gpt_layer_local_submodules).parameters

    def get_gpt_layer_with_transformer_engine_spec(*args, **kwargs):
        if not _from_tests():
            return te_spec(*args, **kwargs)
        bound = te_params.bind(*args, **kwargs)
        local = {k: v for k, v in bound.arguments.items() if k in local_params}
        return specs.get_gpt_layer_local_spec(**local)

    get_gpt_layer_with_transformer_engine_spec.__wrapped__ = te_spec
    specs.get_gpt_layer_with_transformer_engine_spec = get_gpt_layer_with_transformer_engine_spec
    _local_attention_with_mla()
    _local_norm_on_the_device()


def _local_attention_with_mla() -> None:
    """The local spec's core attention, ``DotProductAttention``, does not take the head sizes
    multi-latent attention passes (``k_channels``, ``v_channels``: only TE's attention does), so
    on the local spec every MLA model fails to build; upstream's A2A-overlap tests all use MLA.
    Under ``UPSTREAM_CPU_TE=local`` the local spec's core attention accepts them: queries and
    keys of any head size (its matmuls take them as they come; MLA passes its softmax scale)
    and an output of ``v_channels`` per head. Without them it is ``DotProductAttention``."""
    from megatron.core.models import backends
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LocalDotProductAttention(DotProductAttention):
        """``DotProductAttention`` that also takes MLA's ``k_channels``/``v_channels``."""

        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    def core_attention(self) -> type:
        return LocalDotProductAttention

    backends.LocalSpecProvider.core_attention = core_attention


def _local_norm_on_the_device() -> None:
    """The local spec's norm, ``WrappedTorchNorm``, is a ``torch.nn`` norm made on the host in
    float32, as megatron-core's training loop expects (it moves the model with ``.cuda()`` and
    casts it); TE's ``TENorm``, which the tests ask for, is made on the current device in
    ``params_dtype``, and the A2A-overlap tests never move their models. Under
    ``UPSTREAM_CPU_TE=local`` the local norm is made as TE's is."""
    from megatron.core.transformer import torch_norm

    cls = torch_norm.WrappedTorchNorm
    real_new = cls.__new__

    def __new__(cls, config, *args, **kwargs):
        norm = real_new(cls, config, *args, **kwargs)
        return norm.to(device=torch.cuda.current_device(), dtype=config.params_dtype)

    __new__.__wrapped__ = real_new
    cls.__new__ = __new__


class Fp32GemmMode(TorchDispatchMode):
    """``UPSTREAM_CPU_FP32_GEMM=1``: a half-precision GEMM (``mm``, ``bmm``, ``addmm``,
    ``baddbmm`` with every tensor bf16, or every one fp16) runs in float32 and is rounded once
    to its dtype, as a GPU's tensor cores accumulate it in float32. On a host without native
    bf16 (AVX2), torch's own bf16 GEMM runs some 30 times slower than float32, too slow for
    upstream's GPU-sized tests (the A2A-overlap layer's attention alone). A dispatch mode, below
    autograd: the backward's GEMMs (autograd's own formulas) are covered too."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Below the torch functions: what runs here is not one (the placement rules, a torch
        # function mode, must not see the aten ops of an autograd formula or these casts).
        with torch._C.DisableTorchFunction():
            if func in _GEMMS:
                dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor)}
                if len(dtypes) == 1 and dtypes <= _HALF:
                    up = tuple(a.float() if isinstance(a, torch.Tensor) else a for a in args)
                    return func(*up, **kwargs).to(dtypes.pop())
            return func(*args, **kwargs)


_HALF = frozenset({torch.bfloat16, torch.float16})
_GEMMS = frozenset(
    {
        torch.ops.aten.mm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.baddbmm.default,
    }
)


def _without_stream_order() -> None:
    """``UPSTREAM_CPU_STREAM_ORDER=0``: the placement rules without their stream-ordering check
    (a read on another stream not ordered after its write), to see past a race a test itself
    runs (upstream's layer-level A2A-overlap tests hand the backward a gradient made on the
    default stream to a node on the communication stream, with no wait). A workaround until
    :mod:`runtime.cuda.placement` has a switch of its own: it replaces its ``_check_read``."""
    placement._check_read = lambda tensor, reader, func: None


def _install_host_device_mode() -> None:
    """Without the placement rules: CUDA placed on the host by :class:`HostDeviceMode`, the
    stream calls answered by the host stand-ins."""
    cuda = torch.cuda
    cuda.current_device = _current_device
    cuda.synchronize = _synchronize
    cuda.Stream = HostStream
    cuda.Event = HostEvent
    cuda.current_stream = HOST_STREAMS.current_stream
    cuda.default_stream = lambda device=None: HOST_STREAMS.default
    cuda.stream = HOST_STREAMS.stream
    torch.Tensor.cuda = _tensor_cuda
    torch.Tensor.to = _tensor_to
    torch.nn.Module.cuda = _module_cuda
    install_record_stream_stand_in()
    HostDeviceMode().__enter__()


def install() -> None:
    """Install every stand-in above (idempotent); megatron-core is imported at the end, after
    the placement rules (its import-time tensors are host tensors, as on a GPU)."""
    if getattr(torch.cuda, "_upstream_cpu", False):
        return
    cuda = torch.cuda
    cuda.is_available = is_available
    cuda.device_count = device_count
    cuda.set_device = _set_device
    cuda.get_device_properties = _get_device_properties
    cuda.get_device_capability = _get_device_capability
    cuda.get_device_name = _get_device_name
    cuda.get_rng_state = compat._shadow_get_state
    cuda.set_rng_state = compat._shadow_set_state
    cuda.manual_seed = compat._shadow_manual_seed
    cuda.manual_seed_all = _manual_seed_all
    if PLACEMENT:
        # current_device, synchronize, the streams and events, record_stream: the rules' own.
        if not placement.install():
            raise RuntimeError("upstream_cpu: the placement rules did not install")
        if not settings.upstream_cpu_stream_order():
            _without_stream_order()
    else:
        _install_host_device_mode()
    dist.init_process_group = init_process_group
    dist.new_group = new_group
    dist.barrier = barrier
    _stub_downloader()
    _install_deep_ep_emulation()
    cuda._upstream_cpu = True

    compat.install_cpu_rng_shim()
    compat.install_tensor_parallel_cpu_shim()
    compat.install_dtoh_stream_cpu_shim()
    _destroy_groups_with_model_parallel()
    if settings.upstream_cpu_te() == "local":
        _te_local_specs()
    if settings.upstream_cpu_fp32_gemm():
        Fp32GemmMode().__enter__()


install()


def pytest_configure(config: pytest.Config) -> None:
    """Register the markers upstream's tests use that its pyproject does not."""
    config.addinivalue_line("markers", "timeout(seconds): pytest-timeout's marker (unused here)")


_OUTCOMES: Dict[str, Dict[str, Any]] = {}


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A module that fails to collect (e.g. a parametrization that asks the device a question)
    is reported as one failed entry, named by its file."""
    if report.failed:
        _record(report, "collect")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Append this rank's outcome of each phase to ``$UPSTREAM_CPU_REPORT_DIR/rank<R>.jsonl``."""
    _record(report, report.when)


def _record(report, when: str) -> None:
    out_dir = settings.upstream_cpu_report_dir()
    if not out_dir:
        return
    detail = ""
    if report.failed:
        detail = report.longreprtext[-4000:]
    elif report.skipped and isinstance(report.longrepr, tuple):
        detail = report.longrepr[2]
    record = dict(
        nodeid=report.nodeid,
        when=when,
        outcome=report.outcome,
        duration=round(getattr(report, "duration", 0.0) or 0.0, 3),
        detail=detail,
    )
    path = Path(out_dir) / f"rank{os.environ.get('RANK', '0')}.jsonl"
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
