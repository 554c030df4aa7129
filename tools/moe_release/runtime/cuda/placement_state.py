# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""What the placement rules (:mod:`moe_release.runtime.cuda.placement`) and the host streams
(:mod:`.host_streams`) share: whether the rules are in force, each storage's
placement mark as the streams read it, and the host-sync counter with the two checks the stream
stand-ins call (:func:`count_sync`, :func:`check_record_stream`).

Below both: the rules install the streams into ``torch.cuda``, and the streams count their
``synchronize`` and refuse ``record_stream`` of a host tensor through this module, so neither
imports the other. :mod:`moe_release.runtime.cuda.placement` imports what it uses of this, so
``placement.SYNCS``, ``placement.placement_of``, ``placement.count_sync`` and the placement
names (``DEVICE``, ``PINNED``, ``PAGEABLE``) stay where their callers read them.
"""

import collections
import os
import sys
import threading
from typing import Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

DEVICE = "device"
PINNED = "pinned"
PAGEABLE = "pageable"

_ATTR = "_moe_release_placement"  # on the storage: (placement, call site that made it)
_DEVICE_MARK = (DEVICE, "")

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_RUNTIME_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def placement_of(tensor: torch.Tensor) -> str:
    """The tensor's placement on a GPU (``device`` unless something made it a host tensor)."""
    try:
        return getattr(tensor.untyped_storage(), _ATTR, _DEVICE_MARK)[0]
    except (RuntimeError, NotImplementedError):  # e.g. a tensor without storage
        return DEVICE


class _State(threading.local):
    mode: Optional[TorchFunctionMode] = None  # the rules' PlacementMode while they are in force


_STATE = _State()


# ---------------------------------------------------------------------------------------------
# Host syncs


SYNCS: "collections.Counter[Tuple[str, str]]" = collections.Counter()


def call_site(skip_runtime: bool = True) -> str:
    """``file:line`` of the first frame outside torch (and this runtime)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_TORCH_DIR) and not (skip_runtime and name.startswith(_RUNTIME_DIR)):
            return f"{_short(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _short(path: str) -> str:
    cut = path.rfind("megatron" + os.sep)
    if cut >= 0:
        return path[cut:]
    return os.path.basename(path)


def check_record_stream(tensor: torch.Tensor) -> None:
    """Raise as torch does for ``record_stream`` on a host tensor (only a CUDA kernel exists).

    Called by the ``Tensor.record_stream`` stand-in (:mod:`.host_streams`)."""
    if _STATE.mode is not None and placement_of(tensor) != DEVICE:
        raise NotImplementedError(
            "Could not run 'aten::record_stream' with arguments from the 'CPU' backend. "
            "'aten::record_stream' is only available for these backends: [CUDA, ...]. "
            f"(CPU runtime placement rule: this tensor would be {placement_of(tensor)} host "
            f"memory on a GPU; record_stream at {call_site()})"
        )


def count_sync(kind: str) -> None:
    """Count one device-to-host synchronization of ``kind`` at the caller's call site."""
    if _STATE.mode is not None:
        SYNCS[(kind, call_site())] += 1
