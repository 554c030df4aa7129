# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The ``deep_ep`` package as megatron-core's flex dispatcher imports it, emulated on CPU ranks.

``megatron/core/transformer/moe/fused_a2a.py`` binds DeepEP's kernels at import time
(``from deep_ep import Buffer``, ``HybridEPBuffer``, and on dev ``ElasticBuffer``;
``from deep_ep.utils import EventHandle, EventOverlap``; main in 2026-05 also ``import
hybrid_ep_cpp``, a hybrid-ep build's extension). :func:`install` registers this module as
``deep_ep`` (with ``deep_ep.utils`` and ``hybrid_ep_cpp``) in ``sys.modules`` so that those
imports find the emulations, one module per kernel family, each with its table of outputs
cited to the source it was read from:

* :mod:`moe_release.runtime.kernels.hybridep_emulation` - ``HybridEPBuffer`` (the ``hybridep``
backend);
* :mod:`moe_release.runtime.kernels.deepep_emulation` - the normal-mode ``Buffer`` (``deepep``);
* :mod:`moe_release.runtime.kernels.deepepv2_emulation` - DeepEP v2's ``ElasticBuffer``
(``deepepv2``, dev);

and what they share is :mod:`moe_release.runtime.kernels.emulation_common`. TransformerEngine's NCCL
EP API (the ``ncclep`` backend) is registered by
:mod:`moe_release.runtime.kernels.ncclep_emulation`.

Only torch, the standard library and :mod:`moe_release.runtime.cuda.placement` are imported, so the
package can be registered before megatron-core is first imported. It never activates by itself: call
:func:`install` explicitly (tests, the memory report). A real DeepEP build provides only some of
these classes (``hybrid-ep`` builds: ``Buffer`` and ``HybridEPBuffer``; DeepEP v2 builds:
``ElasticBuffer`` and a legacy ``Buffer``); the emulation provides them all, and the flex
dispatcher's ``moe_flex_dispatcher_backend`` picks one.
"""

import importlib.util
import sys
import types

from moe_release.runtime.kernels import (
    deepep_emulation,
    deepepv2_emulation,
    emulation_common,
    hybridep_emulation,
)
from moe_release.runtime.kernels.deepep_emulation import LEAKED_BUFFERS, Buffer, Config  # noqa: F401
from moe_release.runtime.kernels.deepepv2_emulation import ElasticBuffer, EPHandle  # noqa: F401
from moe_release.runtime.kernels.emulation_common import EventHandle, EventOverlap
from moe_release.runtime.kernels.hybridep_emulation import (  # noqa: F401
    DEEP_EP_SOURCE_COMMIT,
    HybridEPBuffer,
    HybridEPConfig,
    hybrid_ep_buffer_bytes,
)

__all__ = [
    "Buffer",
    "ElasticBuffer",
    "EPHandle",
    "EventHandle",
    "EventOverlap",
    "HybridEPBuffer",
    "install",
    "uninstall",
]

# Marker so callers (and tests) can tell the emulation from a real deep_ep.
IS_CPU_EMULATION = True

# The modules that implement the kernels (each with its output table), and what they share.
KERNEL_MODULES = (hybridep_emulation, deepep_emulation, deepepv2_emulation, emulation_common)


def _real_deep_ep_importable() -> bool:
    current = sys.modules.get("deep_ep")
    if current is not None:
        return not getattr(current, "IS_CPU_EMULATION", False)
    try:
        return importlib.util.find_spec("deep_ep") is not None
    except (ImportError, ValueError):
        return False


def install(force: bool = False) -> types.ModuleType:
    """Register this module as ``deep_ep`` (and ``deep_ep.utils``) in ``sys.modules``.

    Must run before megatron-core's ``fused_a2a`` is imported, which binds the kernels at import
    time. Refuses to shadow an importable real ``deep_ep`` unless ``force``.
    """
    if "megatron.core.transformer.moe.fused_a2a" in sys.modules and not _is_installed():
        raise RuntimeError(
            "megatron.core.transformer.moe.fused_a2a is already imported; install the deep_ep "
            "emulation before the first `import megatron.core`."
        )
    if _real_deep_ep_importable() and not force:
        raise RuntimeError(
            "A real deep_ep is importable; refusing to shadow it with the emulation "
            "(pass force=True to override)."
        )
    module = sys.modules[__name__]
    utils = types.ModuleType("deep_ep.utils")
    utils.EventHandle = EventHandle
    utils.EventOverlap = EventOverlap
    utils.IS_CPU_EMULATION = True
    module.utils = utils
    # A hybrid-ep build also installs its extension as the top-level ``hybrid_ep_cpp``, which
    # megatron-core imported directly in 2026-05 (#4719) for ExtendedMemoryAllocator.
    native = types.ModuleType("hybrid_ep_cpp")
    native.ExtendedMemoryAllocator = hybridep_emulation.ExtendedMemoryAllocator
    native.IS_CPU_EMULATION = True
    sys.modules["deep_ep"] = module
    sys.modules["deep_ep.utils"] = utils
    sys.modules["hybrid_ep_cpp"] = native
    return module


def _is_installed() -> bool:
    return getattr(sys.modules.get("deep_ep"), "IS_CPU_EMULATION", False)


def uninstall() -> None:
    """Remove the emulation from ``sys.modules`` (megatron modules keep what they bound)."""
    if _is_installed():
        sys.modules.pop("deep_ep", None)
        sys.modules.pop("deep_ep.utils", None)
        if getattr(sys.modules.get("hybrid_ep_cpp"), "IS_CPU_EMULATION", False):
            sys.modules.pop("hybrid_ep_cpp", None)
