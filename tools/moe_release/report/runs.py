# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""How the report runs a job: a :mod:`.worker` function on :data:`WORLD` ranks over one tree,
through the CPU runtime's launcher (:func:`run`). The report's command (:mod:`.cli`) and the step
profile (:mod:`.step_profile`) both run through it."""

from typing import Any, Dict, List, Optional

from moe_release.report.runtime import CPU, Runtime

WORKER = "moe_release.report.worker"
WORLD = 2


def run(
    tree: str,
    target: str,
    cfg: Dict[str, Any],
    runtime: Runtime = CPU,
    timeout: float = 900,
    placement: Optional[bool] = None,
) -> List[Any]:
    """Run a worker function on WORLD ranks over the given tree, where ``runtime`` says;
    ``placement=False`` runs CPU ranks without the placement rules (host tensors)."""
    from moe_release.runtime.ranks.launcher import run_distributed

    emulated = runtime.kernels == "emulation"
    return run_distributed(
        f"{WORKER}:{target}",
        WORLD,
        tree,
        kwargs={"cfg": cfg},
        timeout=timeout,
        emulate_deep_ep=emulated,
        device=runtime.device,
        backend=runtime.backend,
        force_emulation=emulated,
        placement=placement,
    )
