# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Where the memory report runs: tensor device, dispatch kernels and process-group backend,
chosen from the request (``--device``, ``--kernels``) and what the machine has."""

import importlib.util
import sys
import time
from dataclasses import dataclass
from typing import Optional, Tuple


def log(msg: str) -> None:
    """Progress on stderr."""
    print(f"[memory-report {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class ReportError(Exception):
    """A request the report cannot honour; printed as one line, exit status 2."""


@dataclass(frozen=True)
class Runtime:
    """Where the ranks run: tensor device, kernels, process-group backend."""

    device: str  # "cpu" or "cuda"
    kernels: str  # "emulation" or "deep_ep"
    backend: str  # "gloo" or "nccl"

    def describe(self) -> str:
        """One phrase for the table header."""
        if self.kernels == "deep_ep" and self.backend == "gloo":
            return (
                "CUDA, deep_ep kernels, the ranks sharing one GPU (process group over gloo), "
                "CUDA caching-allocator statistics"
            )
        if self.kernels == "deep_ep":
            return "CUDA, deep_ep kernels over NCCL, CUDA caching-allocator statistics"
        if self.device == "cuda":
            return (
                "CUDA tensors, deep_ep emulation over gloo (host-staged), "
                "CUDA caching-allocator statistics"
            )
        return "CPU, deep_ep emulation over gloo, counting CPU allocator"


def resolve_runtime(
    device: str, kernels: str, world: int, cuda_devices: int, deep_ep: Optional[str]
) -> Runtime:
    """Choose device, kernels and backend from the request and what the machine has.

    ``device``: "auto" | "cpu" | "cuda"; ``kernels``: "auto" | "emulation" | "deep_ep";
    ``cuda_devices``: visible GPUs; ``deep_ep``: None if no deep_ep is importable, else which
    of its surfaces megatron's HybridEP backend needs is missing ("" when none is). "auto"
    prefers a GPU, and on a GPU the real kernels when they can run: a GPU per rank (NCCL
    refuses two ranks on one GPU) and a deep_ep with ``HybridEPBuffer``. ``kernels="deep_ep"``
    with fewer GPUs than ranks shares them: the process group is gloo (NCCL refuses a duplicate
    GPU), the kernels' own transfers go over CUDA IPC between processes on one device.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ReportError(f"--device {device}: expected auto, cpu or cuda")
    if kernels not in ("auto", "emulation", "deep_ep"):
        raise ReportError(f"--kernels {kernels}: expected auto, emulation or deep_ep")
    if device == "auto":
        device = "cuda" if cuda_devices else "cpu"
    if device == "cuda" and not cuda_devices:
        raise ReportError(
            "--device cuda: no CUDA device is visible (torch.cuda.device_count() = 0)"
        )
    real_ok = device == "cuda" and deep_ep == "" and cuda_devices >= world
    if kernels == "deep_ep" and not real_ok:
        if device != "cuda":
            why = "the real kernels need CUDA; use --device cuda on a GPU machine"
        elif deep_ep is None:
            why = "deep_ep is not importable"
        elif deep_ep:
            why = f"the installed deep_ep lacks {deep_ep} (HybridEP is on its hybrid-ep branch)"
        else:  # fewer GPUs than ranks: they share them, over gloo
            return Runtime(device, kernels, "gloo")
        raise ReportError(f"--kernels deep_ep: {why}")
    if kernels == "auto":
        kernels = "deep_ep" if real_ok else "emulation"
    return Runtime(device, kernels, "nccl" if kernels == "deep_ep" else "gloo")


def probe_machine() -> Tuple[int, Optional[str]]:
    """(visible CUDA devices, deep_ep status as :func:`resolve_runtime` takes it)."""
    import torch

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not cuda or importlib.util.find_spec("deep_ep") is None:
        return cuda, None
    try:
        import deep_ep
    except Exception as exc:  # an installed but broken extension: use the emulation
        log(f"deep_ep is installed but does not import ({exc}); using the emulation")
        return cuda, None
    return cuda, "" if hasattr(deep_ep, "HybridEPBuffer") else "HybridEPBuffer"


CPU = Runtime("cpu", "emulation", "gloo")
