# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""A term (one allocation: its bytes, where they live, the line that sizes them) and the byte
arithmetic every backend's pricing shares."""

from dataclasses import dataclass
from typing import List, Optional, Sequence

# Where a term's bytes live.
OUTSIDE = "outside allocator"  # cudaMalloc, CUDA IPC, cuMem or NVSHMEM, by deep_ep
ALLOCATOR = "allocator"  # PyTorch's caching allocator
HOST = "pinned host"  # cudaMallocHost: host memory, not device

BF16 = 2
FP32 = 4
INT32 = 4
INT64 = 8


@dataclass(frozen=True)
class Term:
    """One allocation: its name, bytes, where it lives and the source line that sizes it;
    ``released`` is False for what the kernel's destroy leaves allocated; ``alloc`` names the
    one device allocation several terms share (rounded as one, :func:`device_rounding`);
    ``in_flight`` marks what each MoE layer holds from its forward until its backward frees it
    (priced per layer in flight), not a buffer."""

    name: str
    nbytes: int
    where: str
    source: str
    note: str = ""
    released: bool = True
    alloc: str = ""
    in_flight: bool = False


def total(terms: Sequence[Term], where: Optional[str] = None) -> int:
    """Bytes of ``terms`` (of those living ``where`` only, if given)."""
    return sum(t.nbytes for t in terms if where is None or t.where == where)


def released_bytes(terms: Sequence[Term]) -> int:
    """Bytes a release of these buffers gives back, device and pinned host: every term but
    those the kernel's destroy leaves allocated and those a layer holds in flight (freed by
    its backward, not by a release)."""
    return sum(t.nbytes for t in terms if t.released and not t.in_flight)


# What the device sees of an allocation, beyond the bytes asked for:
# ncclMemAlloc rounds to cuMemGetAllocationGranularity(..., RECOMMENDED) (NCCL
# src/allocator.cc, ncclMemAlloc), 2 MiB on Hopper (an assumption the planner cannot measure);
# PyTorch's caching allocator rounds every block to 512 bytes (c10/cuda/CUDACachingAllocator.cpp,
# kMinBlockSize and round_size).
NCCL_GRANULARITY = 2 * 1024 * 1024
TORCH_BLOCK = 512


def device_rounding(terms: Sequence[Term], granularity: int = NCCL_GRANULARITY) -> List[Term]:
    """The bytes each allocation of ``terms`` takes on the device beyond what it asks for, one
    term each: an NCCL allocation (the terms sharing its ``alloc``) rounded up to
    ``granularity``, a caching-allocator tensor to 512 bytes. Allocations whose rounding the
    planner does not know (deep_ep's cudaMalloc and IPC buffers) add nothing."""
    out: List[Term] = []
    shared: dict = {}
    for t in terms:
        if t.alloc:
            shared[t.alloc] = shared.get(t.alloc, 0) + t.nbytes
        elif t.where == ALLOCATOR and t.nbytes % TORCH_BLOCK:
            extra = _up(t.nbytes, TORCH_BLOCK) - t.nbytes
            out.append(Term(f"device rounding: {t.name}", extra, ALLOCATOR,
                            "CUDACachingAllocator.cpp round_size", "512-byte blocks",
                            in_flight=t.in_flight))  # fmt: skip
    for alloc, nbytes in shared.items():
        extra = _up(nbytes, granularity) - nbytes
        if extra:
            out.append(Term(f"device rounding: {alloc}", extra, OUTSIDE,
                            "NCCL allocator.cc ncclMemAlloc",
                            f"cuMem granularity {granularity:,} B (assumed)"))  # fmt: skip
    return out


def _up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


INT_MAX = 2**31 - 1  # the kernels' configs are C ints


def _a32(n: int) -> int:
    return _up(n, 32)


def _a256(n: int) -> int:
    return _up(n, 256)
