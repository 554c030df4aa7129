# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Allocator-level host memory accounting: the CPU counterpart of torch.cuda memory stats.

``cpu_memory_counter.cpp`` wraps c10's CPU allocator and counts, across all threads, the bytes
of every CPU tensor storage allocated after :func:`install` and not yet freed, the peak since
the last reset, and optionally a (time, live bytes) timeline. It is compiled once per torch build
with the system C++ compiler (under a second) into ``.build/cpu_memory/`` and loaded with
ctypes. Tensors allocated before :func:`install` are not counted (their frees are not either).

Why not the alternatives: the profiler's CPU memory events miss allocations and frees made on
other threads (gloo and autograd workers), so their running sum drifts; glibc ``mallinfo2``
also counts every malloc'd Python and C++ object.
"""

import ctypes
import hashlib
import os
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from moe_release import settings
from moe_release.common import REPO_ROOT

SOURCE = Path(__file__).with_name("cpu_memory_counter.cpp")

_lib: Optional[ctypes.CDLL] = None


def _library_path() -> Path:
    torch_dir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    key = hashlib.sha256(
        SOURCE.read_bytes() + f"{torch.__version__}|{abi}|{torch_dir}".encode()
    ).hexdigest()[:16]
    return REPO_ROOT / ".build" / "cpu_memory" / key / "libmoe_cpu_memory.so"


def build() -> Path:
    """Compile the counter if this torch build has no copy yet; returns the library path."""
    lib = _library_path()
    if lib.exists():
        return lib
    torch_dir = Path(torch.__file__).parent
    lib.parent.mkdir(parents=True, exist_ok=True)
    cxx = settings.cxx() or sysconfig.get_config_var("CXX") or "g++"
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp) / lib.name
        cmd = [
            *cxx.split(), "-O2", "-shared", "-fPIC", "-std=c++17",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-I{torch_dir / 'include'}", str(SOURCE), f"-L{torch_dir / 'lib'}", "-lc10",
            f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", str(out),
        ]  # fmt: skip
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed:\n{result.stderr[-3000:]}")
        os.replace(out, lib)  # atomic: concurrent builders never load a partial file
    return lib


def _load() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(str(build()))
        for name in (
            "moe_counter_current",
            "moe_counter_peak",
            "moe_counter_allocations",
            "moe_counter_now_ns",
            "moe_counter_stop_recording",
            "moe_counter_events",
        ):
            getattr(lib, name).restype = ctypes.c_longlong
        lib.moe_counter_start_recording.argtypes = [ctypes.c_longlong]
        lib.moe_counter_copy_timeline.argtypes = [
            ctypes.POINTER(ctypes.c_longlong),
            ctypes.POINTER(ctypes.c_longlong),
            ctypes.c_longlong,
        ]
        lib.moe_counter_copy_events.argtypes = lib.moe_counter_copy_timeline.argtypes
        _lib = lib
    return _lib


def install() -> None:
    """Count every CPU allocation from now on (idempotent)."""
    if not _load().moe_counter_install():
        raise RuntimeError("another CPU allocator with higher priority is installed")


def installed() -> bool:
    """Whether this process counts CPU allocations."""
    return _lib is not None and bool(_lib.moe_counter_install())


def memory_allocated() -> int:
    """Bytes of CPU tensor storage allocated since install() and still alive."""
    return _load().moe_counter_current()


def settled(read=memory_allocated, tries: int = 200, quiet: int = 5) -> int:
    """``read()`` once ``quiet`` reads 1 ms apart in a row agree: gloo's worker threads free the
    buffers of finished collectives a moment after the work completes, later on a loaded host
    (two agreeing reads were not enough under CI's load: a 1,856 B collective buffer was still
    counted once)."""
    import time

    last, same = read(), 0
    for _ in range(tries):
        time.sleep(0.001)
        now = read()
        same = same + 1 if now == last else 0
        if same >= quiet:
            return now
        last = now
    return last


def max_memory_allocated() -> int:
    """Peak of memory_allocated() since the last reset_peak_memory_stats()."""
    return _load().moe_counter_peak()


def reset_peak_memory_stats() -> None:
    """Start a new peak at the current value."""
    _load().moe_counter_reset_peak()


def allocations() -> int:
    """Number of allocations counted so far."""
    return _load().moe_counter_allocations()


def now_ns() -> int:
    """The timeline's clock (steady clock, ns)."""
    return _load().moe_counter_now_ns()


def start_recording(capacity: int = 1 << 20) -> None:
    """Record (time, live bytes) after each allocation and free, up to ``capacity`` entries."""
    _load().moe_counter_start_recording(capacity)


def stop_recording(events: bool = False):
    """Stop recording; the (times ns, live bytes) recorded, and with ``events`` each event's
    block pointer and signed size: (times, live bytes, pointers, sizes) as int64 arrays."""
    lib = _load()
    n = lib.moe_counter_stop_recording()
    times = (ctypes.c_longlong * n)()
    values = (ctypes.c_longlong * n)()
    lib.moe_counter_copy_timeline(times, values, n)
    if not events:
        return list(times), list(values)
    import numpy as np

    ptrs = (ctypes.c_longlong * n)()
    deltas = (ctypes.c_longlong * n)()
    lib.moe_counter_copy_events(ptrs, deltas, n)
    # Arrays: a long step records millions of events.
    return tuple(np.ctypeslib.as_array(a).copy() for a in (times, values, ptrs, deltas))


def events_recorded() -> int:
    """Events recorded since start_recording (the index the next one gets)."""
    return _load().moe_counter_events()


def downsample(pts: List[Tuple[int, int]], t0: int, points: int) -> Dict[str, List[float]]:
    """Time in ms since t0 and, per bucket of about len/points samples, the maximum bytes."""
    size = max(len(pts) // points, 1)
    t_ms, out = [], []
    for i in range(0, len(pts), size):
        chunk = pts[i : i + size]
        t_ms.append((chunk[0][0] - t0) / 1e6)
        out.append(max(b for _, b in chunk))
    return {"t_ms": t_ms, "bytes": out}
