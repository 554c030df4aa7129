# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Catch, on a CPU-only machine, tensor factories that would land on the host under CUDA.

On the host every tensor is on "cpu", so a ``torch.zeros(n)`` next to CUDA inputs only fails
on a GPU (device mismatch). :class:`FactoryPlacement` is a ``TorchFunctionMode`` that records
each factory call (``torch.zeros``, ``torch.tensor``, ``torch.arange``, ...) made from code in
the watched files without an explicit ``device=``; ``*_like`` and ``Tensor.new_*`` inherit the
device of their input and are not factories here.
"""

import sys
from pathlib import Path
from typing import Iterable, List, Tuple

import torch
from torch.overrides import TorchFunctionMode

FACTORIES = frozenset(
    {
        torch.zeros,
        torch.ones,
        torch.full,
        torch.empty,
        torch.tensor,
        torch.arange,
        torch.rand,
        torch.randn,
        torch.randint,
        torch.eye,
        torch.linspace,
        torch.as_tensor,
    }
)


class FactoryPlacement(TorchFunctionMode):
    """Record factory calls without ``device=`` made directly from ``files``."""

    def __init__(self, files: Iterable[str]):
        super().__init__()
        self.files = {str(Path(f).resolve()) for f in files}
        self.calls = 0
        self.missing: List[Tuple[str, int, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES:
            caller = sys._getframe(1)
            if str(Path(caller.f_code.co_filename).resolve()) in self.files:
                self.calls += 1
                if kwargs.get("device") is None:
                    self.missing.append(
                        (Path(caller.f_code.co_filename).name, caller.f_lineno, func.__name__)
                    )
        return func(*args, **kwargs)
