# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""A term (one allocation: its bytes, where they live, the line that sizes them) and the byte
arithmetic every backend's pricing shares."""

from dataclasses import dataclass
from typing import Optional, Sequence

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
    ``released`` is False for what the kernel's destroy leaves allocated."""

    name: str
    nbytes: int
    where: str
    source: str
    note: str = ""
    released: bool = True


def total(terms: Sequence[Term], where: Optional[str] = None) -> int:
    """Bytes of ``terms`` (of those living ``where`` only, if given)."""
    return sum(t.nbytes for t in terms if where is None or t.where == where)


def released_bytes(terms: Sequence[Term]) -> int:
    """Bytes a release of these buffers gives back, device and pinned host: every term but
    those the kernel's destroy leaves allocated."""
    return sum(t.nbytes for t in terms if t.released)


def _up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


INT_MAX = 2**31 - 1  # the kernels' configs are C ints


def _a32(n: int) -> int:
    return _up(n, 32)


def _a256(n: int) -> int:
    return _up(n, 256)
