# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""A pytest plugin that runs upstream Megatron-LM's unit tests on CPU ranks over gloo.

Loaded by :mod:`upstream_cpu.run` with ``-p upstream_cpu.plugin`` in every rank's pytest (each
rank of ``torch.distributed.run`` runs pytest, as on upstream's CI), before upstream's
``conftest.py`` files. The host stands in for the GPU; nothing in the checkout is changed:

* **Tests see a device, megatron-core sees the host.** ``torch.cuda.is_available()`` answers
  ``True`` only to code in the checkout's ``tests/`` (so ``skipif(not
  torch.cuda.is_available())`` runs the test, as on a GPU runner) and ``False`` everywhere else,
  so megatron-core keeps the host paths it has.
* **Placement.** ``Tensor.cuda()``/``Module.cuda()`` keep tensors on the host; a
  ``TorchFunctionMode`` turns every ``device=`` naming CUDA (``"cuda"``, ``"cuda:N"``, a CUDA
  ``torch.device``, a bare index as from ``torch.cuda.current_device()``) and ``Tensor.to``'s
  CUDA targets into ``"cpu"``, and drops ``pin_memory``; ``Tensor.to`` is also wrapped
  directly, because the mode is not active where the autograd engine runs a backward (a
  checkpoint's recompute).
* **The device API.** ``set_device`` and ``synchronize`` are no-ops, ``current_device()`` is
  ``0``, ``device_count()`` the local world size; streams and events are the host stand-ins of
  :mod:`cpu_runtime.host_streams`; the CUDA RNG calls use a host generator
  (:func:`cpu_runtime.compat.install_cpu_rng_shim` for ``tensor_parallel.random``).
* **Communication.** ``nccl`` process groups are created as ``gloo`` (``device_ids`` dropped
  from barriers, and group timeouts capped by ``UPSTREAM_CPU_PG_TIMEOUT`` seconds, default 180,
  so a rank left waiting fails instead of hanging for upstream's 30 minutes), and
  ``destroy_model_parallel()`` also destroys the groups it forgets (see :func:`destroy_groups`);
  the uneven all-gathers/reduce-scatters NCCL accepts go through the padded stand-ins of
  :func:`cpu_runtime.compat.install_tensor_parallel_cpu_shim`; the all-to-all dispatcher's
  split sizes arrive as numpy arrays, as its device-to-host copies deliver them on a GPU
  (:func:`cpu_runtime.compat.install_dtoh_stream_cpu_shim`).
* **No downloads.** Upstream's session fixture ``ensure_test_data`` would fetch datasets into
  ``/opt/data``; the plugin gives it a stand-in downloader that fetches nothing (the MoE tests
  use no data sets).
* ``UPSTREAM_CPU_DEEP_EP=emulation`` registers moe-release's CPU emulation of the ``deep_ep``
  kernels (HybridEP and DeepEP, :mod:`cpu_runtime.deep_ep_emulation`), so the flex-dispatcher
  tests run too; off by default, because upstream's checkout does not contain it.

What stays out of reach on the host is what needs Transformer Engine, fp8, or the real
deep_ep/NCCL-EP kernels: those tests skip (or fail) exactly as on a GPU runner without them.

Each rank appends its test outcomes as JSON lines to ``$UPSTREAM_CPU_REPORT_DIR/rank<R>.jsonl``
when that variable is set (:mod:`upstream_cpu.run` aggregates them).
"""

import datetime
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

from cpu_runtime import compat
from cpu_runtime.host_streams import (
    HOST_STREAMS,
    HostEvent,
    HostStream,
    install_record_stream_stand_in,
)

CHECKOUT = Path(os.environ.get("UPSTREAM_CPU_CHECKOUT", os.getcwd())).resolve()
TESTS_DIR = str(CHECKOUT / "tests") + os.sep

_real_is_available = torch.cuda.is_available


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
    """Place every tensor a torch function is asked to put on CUDA on the host instead."""

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
    caller = sys._getframe(1).f_code.co_filename
    if caller.startswith(TESTS_DIR):
        return True
    return _real_is_available()


_real_tensor_to = torch.Tensor.to


def _tensor_to(self, *args, **kwargs):
    # Also outside the mode: torch function modes are not active where the autograd engine runs
    # a backward (e.g. a checkpoint's recompute).
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


def _pg_timeout(timeout: Optional[datetime.timedelta]) -> datetime.timedelta:
    cap = datetime.timedelta(seconds=float(os.environ.get("UPSTREAM_CPU_PG_TIMEOUT", "180")))
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
    """
    n = 0
    while _GROUPS:
        group = _GROUPS.pop()
        try:
            dist.destroy_process_group(group)
            n += 1
        except Exception:  # already destroyed, or the default group is gone
            pass
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
    if os.environ.get("UPSTREAM_CPU_DEEP_EP", "") != "emulation":
        return
    emulation = compat.load_deep_ep_emulation()
    emulation.install()


def install() -> None:
    """Install every stand-in above (idempotent); megatron-core is imported at the end."""
    if getattr(torch.cuda, "_upstream_cpu", False):
        return
    cuda = torch.cuda
    cuda.is_available = is_available
    cuda.device_count = device_count
    cuda.set_device = _set_device
    cuda.current_device = _current_device
    cuda.synchronize = _synchronize
    cuda.Stream = HostStream
    cuda.Event = HostEvent
    cuda.current_stream = HOST_STREAMS.current_stream
    cuda.default_stream = lambda device=None: HOST_STREAMS.default
    cuda.stream = HOST_STREAMS.stream
    cuda.get_rng_state = compat._shadow_get_state
    cuda.set_rng_state = compat._shadow_set_state
    cuda.manual_seed = compat._shadow_manual_seed
    cuda.manual_seed_all = _manual_seed_all
    torch.Tensor.cuda = _tensor_cuda
    torch.Tensor.to = _tensor_to
    torch.nn.Module.cuda = _module_cuda
    install_record_stream_stand_in()
    dist.init_process_group = init_process_group
    dist.new_group = new_group
    dist.barrier = barrier
    HostDeviceMode().__enter__()
    _stub_downloader()
    _install_deep_ep_emulation()
    cuda._upstream_cpu = True

    compat.install_cpu_rng_shim()
    compat.install_tensor_parallel_cpu_shim()
    compat.install_dtoh_stream_cpu_shim()
    _destroy_groups_with_model_parallel()


install()


def pytest_configure(config: pytest.Config) -> None:
    """Register the markers upstream's tests use that its pyproject does not."""
    config.addinivalue_line("markers", "timeout(seconds): pytest-timeout's marker (unused here)")


_OUTCOMES: Dict[str, Dict[str, Any]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Append this rank's outcome of each phase to ``$UPSTREAM_CPU_REPORT_DIR/rank<R>.jsonl``."""
    out_dir = os.environ.get("UPSTREAM_CPU_REPORT_DIR")
    if not out_dir:
        return
    detail = ""
    if report.failed:
        detail = report.longreprtext[-4000:]
    elif report.skipped and isinstance(report.longrepr, tuple):
        detail = report.longrepr[2]
    record = dict(
        nodeid=report.nodeid,
        when=report.when,
        outcome=report.outcome,
        duration=round(report.duration, 3),
        detail=detail,
    )
    path = Path(out_dir) / f"rank{os.environ.get('RANK', '0')}.jsonl"
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
