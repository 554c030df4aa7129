# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The one import hook of the kernels' emulations: register them before megatron-core imports.

:func:`load_deep_ep_emulation` imports :mod:`moe_release.runtime.kernels.deepep_module`, which
imports only torch, so registering it as ``deep_ep`` does not import megatron-core first;
:func:`install_kernel_emulations` registers every flex backend's kernels a tree calls.
"""

import importlib
import types
from typing import Optional

EMULATION_MODULE = "moe_release.runtime.kernels.deepep_module"


def load_deep_ep_emulation() -> types.ModuleType:
    """Import the deep_ep kernel emulation (:mod:`.deepep_module`) without megatron.

    Registering it as ``deep_ep`` is left to its ``install()``.
    """
    return importlib.import_module(EMULATION_MODULE)


def install_kernel_emulations(tree: Optional[str], force: bool = False) -> None:
    """Register every flex backend's kernels before megatron-core is imported: DeepEP's
    ``deep_ep`` package (HybridEP, DeepEP, DeepEP v2) and, where ``tree``'s fused_a2a calls
    TransformerEngine's NCCL EP, the ``transformer_engine.pytorch.ep`` of the TE commit whose
    signatures it calls (:func:`moe_release.runtime.kernels.ncclep_emulation.api_for_tree`)."""
    load_deep_ep_emulation().install(force=force)
    from moe_release.runtime.kernels import ncclep_emulation

    api = ncclep_emulation.api_for_tree(tree) if tree else None
    if api is not None:
        ncclep_emulation.install(api)
