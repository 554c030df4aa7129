# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The memory report's colocated-RL rows: what ``reset_fused_a2a_buffers(collective=True)``
frees on each flex backend between two training steps, beside the memory planner's prediction.

Colocated RL frameworks (vLLM's sleep mode, verl) free NCCL communicator memory between
training and rollout and keep the MoE all-to-all buffers resident. The loop measured here is
theirs with the buffers released: a training step of megatron-core's real MoELayer (EP=2, CPU
gloo ranks, the backend's kernels emulated), every communication buffer released, a rollout
allocating exactly the bytes that freed, then the next training step, which re-creates the
buffers; the same two steps without the release give the reference it must equal bitwise.

Every backend's emulation sizes its buffers from its own reading of the kernels' source, never
from the planner, so each row checks the planner: the bytes the release freed against the
planner's, and for HybridEP and DeepEP, whose emulations list their allocations, the planner's
terms against the emulation's, one by one (``buffer_section.compare_terms``), naming any that
differ.
"""

import gc
from typing import Any, Callable, Dict, List, Optional

from moe_release import backends

TOKENS = 12
EP = 2
BACKENDS = backends.NAMES


def planner_terms(config, tokens: int, ep: int, local_rank: Optional[int] = None) -> list:
    """The tree's memory planner's terms for ``config``'s communication buffers on the rank
    ``local_rank`` (HybridEP's local rank 0 holds flags its peers map; None: a peer)."""
    from megatron.core.transformer.moe import moe_memory_planner as planner

    cfg = planner.MoEMemoryConfig(
        hidden_size=config.hidden_size,
        num_moe_experts=config.num_moe_experts,
        moe_router_topk=config.moe_router_topk,
        num_layers=1,
        expert_model_parallel_size=ep,
        moe_token_dispatcher_type="flex",
        moe_flex_dispatcher_backend=config.moe_flex_dispatcher_backend,
        moe_expert_rank_capacity_factor=config.moe_expert_rank_capacity_factor,
        bf16=config.bf16,
        tokens_per_rank=tokens,
        local_rank=local_rank,
    )
    # The buffers only: NCCL EP's routing handle is one call's, in flight, not a buffer.
    return [t for t in planner.buffer_terms(cfg) if not t.in_flight]


def rank_loop(backend: str, release: bool, tokens: int = TOKENS) -> Dict[str, Any]:
    """Rank side: a training step, (every comm buffer released, a rollout allocating what that
    freed), the next training step. CPU runtime only: the counted allocator measures."""
    import torch
    import torch.distributed as dist

    from megatron.core.transformer.moe import fused_a2a, moe_memory_planner
    from moe_release.report.buffer_section import compare_terms
    from moe_release.runtime.cuda.compat import held_comm_buffers
    from moe_release.runtime.measure import cpu_memory
    from moe_release.runtime.megatron.moe_harness import (
        build_moe_layer,
        init_megatron,
        model_kwargs,
        moe_config,
        train_step,
    )

    cpu_memory.install()
    ep = dist.get_world_size()
    init_megatron(ep=ep)
    config = moe_config(backend, ep, **model_kwargs(backend))
    layer = build_moe_layer(config)
    layer.train()
    out: Dict[str, Any] = {"first": train_step(layer, tokens, 3)}
    if release:
        # The emulation's own reading of the buffers' allocations (HybridEP, DeepEP list them).
        emulated = [t for b in held_comm_buffers(fused_a2a) for t in getattr(b, "terms", ())]
        planned = planner_terms(config, tokens, ep, local_rank=dist.get_rank())
        out["mismatches"] = compare_terms(planned, emulated) if emulated else None
        gc.collect()
        before = cpu_memory.settled()
        fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
        gc.collect()
        freed = before - cpu_memory.settled()
        cpu_memory.reset_peak_memory_stats()
        rollout = torch.ones(max(freed, 0), dtype=torch.uint8)
        # The rollout fits where the buffers were: the process stays at the training level.
        out["rollout_over_training"] = cpu_memory.max_memory_allocated() - before
        del rollout
        out.update(freed=freed, predicted=moe_memory_planner.released_bytes(planned))
    out["second"] = train_step(layer, tokens, 4)
    return out


def steps_equal(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    """Whether two steps' outputs and gradients are bitwise equal (and there are gradients)."""
    import torch

    if a["grads"].keys() != b["grads"].keys() or not a["grads"]:
        return False
    return (
        torch.equal(a["y"], b["y"])
        and torch.equal(a["x_grad"], b["x_grad"])
        and all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"])
    )


def measure_backend(run: Callable[..., List[Any]], tree: str, backend: str) -> Dict[str, Any]:
    """One backend's row: per rank what the release freed, the planner's figure, the planner's
    terms the emulation's reading disagrees with (None where the emulation lists no terms), the
    rollout's peak over the training level, and whether both steps equal the run without
    release.
    ``run(target, world, tree, **kwargs)`` runs the ranks (the launcher, or a test's cache)."""
    target = f"{__name__}:rank_loop"
    kept = run(target, EP, tree, backend=backend, release=False)
    freed = run(target, EP, tree, backend=backend, release=True)
    return {
        "freed": [r["freed"] for r in freed],
        "predicted": [r["predicted"] for r in freed],
        "mismatches": [r["mismatches"] for r in freed],
        "rollout_over_training": [r["rollout_over_training"] for r in freed],
        "bitwise": all(
            steps_equal(k["first"], r["first"]) and steps_equal(k["second"], r["second"])
            for k, r in zip(kept, freed)
        ),
    }


def measure(tree: str, log: Callable[[str], None] = print, run=None) -> Dict[str, Any]:
    """Every backend's row on the patched ``tree``; None for a backend the tree lacks."""
    if run is None:
        from moe_release.runtime.ranks.launcher import run_distributed

        def run(target, world, tree, **kwargs):
            return run_distributed(target, world, tree, kwargs, timeout=300)

    has = backends.available(tree)
    out: Dict[str, Optional[Dict[str, Any]]] = {}
    for backend in BACKENDS:
        if backend in has:
            log(f"colocated RL: {backend}")
            out[backend] = measure_backend(run, tree, backend)
        else:
            out[backend] = None
    return out


def check_text(row: Dict[str, Any]) -> str:
    """Rank 0's check: the bytes freed against the planner's, and the differing terms."""
    mismatches = (row.get("mismatches") or [None])[0]
    if row["freed"][0] == row["predicted"][0] and not mismatches:
        return "agree" + (" (every term)" if mismatches is not None else "")
    diff = row["freed"][0] - row["predicted"][0]
    return f"DIFFER by {diff:+,} B" + "".join(f"; {m}" for m in mismatches or ())


def lines(section: Optional[Dict[str, Any]], version: str = "") -> List[str]:
    """The rows: per backend, rank 0's bytes freed by the release and the planner's figure."""
    if not section:
        return []
    out = [
        "",
        f"colocated RL: a training step, every comm buffer released, a rollout in the freed bytes,"
        f" the next step (MoELayer, EP={EP}, {TOKENS} tokens/rank, CPU runtime)",
        f"{'backend':14}{'freed (rank 0)':>16}{'planner':>16}{'next step':>12}  planner vs the"
        " emulation's reading of the kernels' source",
    ]
    for backend, row in section.items():
        if row is None:
            out.append(f"{backend:14}{'n/a':>16}{'':>16}{'':>12}  not on {version or 'this tree'}")
            continue
        same = "bitwise" if row["bitwise"] else "DIFFERS"
        checked = check_text(row)
        out.append(
            f"{backend:14}{row['freed'][0]:>16,}{row['predicted'][0]:>16,}{same:>12}  {checked}"
        )
    return out
