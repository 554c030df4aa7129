# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""How the report runs a job: a :mod:`.worker` function on :data:`WORLD` ranks over one tree,
through the CPU runtime's launcher (:func:`run`). The report's command (:mod:`.cli`) and the step
profile (:mod:`.step_profile`) both run through it."""

import contextlib
from typing import Any, Dict, List, Optional

from moe_release import settings
from moe_release.report.runtime import CPU, Runtime

WORKER = "moe_release.report.worker"
WORLD = 2


def world_of(cfg: Dict[str, Any]) -> int:
    """The ranks a configuration runs on: ``nodes`` (emulated nodes x ranks per node,
    ``--nodes``), else :data:`WORLD` on one node."""
    nodes = cfg.get("nodes")
    return nodes[0] * nodes[1] if nodes else WORLD


def ranks_per_node_of(cfg: Dict[str, Any]) -> Optional[int]:
    """The emulated nodes' size (``MOE_RELEASE_RANKS_PER_NODE`` in every rank), None: one node."""
    nodes = cfg.get("nodes")
    return nodes[1] if nodes else None


def run(
    tree: str,
    target: str,
    cfg: Dict[str, Any],
    runtime: Runtime = CPU,
    timeout: float = 900,
    placement: Optional[bool] = None,
) -> List[Any]:
    """Run a worker function on :func:`world_of` ``cfg`` ranks over the given tree (on its
    emulated nodes), where ``runtime`` says; ``placement=False`` runs CPU ranks without the
    placement rules (host tensors)."""
    from moe_release.runtime.ranks.launcher import run_distributed

    emulated = runtime.kernels == "emulation"
    per_node = ranks_per_node_of(cfg)
    layout = (
        settings.override(settings.RANKS_PER_NODE, str(per_node))
        if per_node
        else contextlib.nullcontext()
    )
    with layout:
        return run_distributed(
            f"{WORKER}:{target}",
            world_of(cfg),
            tree,
            kwargs={"cfg": cfg},
            timeout=timeout,
            emulate_deep_ep=emulated,
            device=runtime.device,
            backend=runtime.backend,
            force_emulation=emulated,
            placement=placement,
        )
