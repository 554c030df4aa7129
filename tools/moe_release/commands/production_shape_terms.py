#!/usr/bin/env python3
# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Seed 000's MoE layer in the production-shape mode: what stays alive after backward, term by
term, beside the planner's terms for the same configuration (docs/planner.md).

    eval "$(python scripts/moe_release.py trees)"   # MOE_RELEASE_TREE, MOE_RELEASE_BASE_TREE
    python scripts/production_shape_terms.py flex:hybridep [--recompute] [--layers 2]
        [--routing random:3]

Hidden 2048, 256 experts, top-8, 105,153 tokens per rank, EP2, bf16, fp32 router; each tree
(base, patched) on 2 gloo ranks (``moe_release.runtime.shapes.retained_origins.run_origins``).
"""

import argparse
import sys
from typing import List, Optional

from moe_release.commands.registry import Command, register

SEED = dict(ep=2, tokens=105153, hidden=2048, experts=256, topk=8, ffn=768, dtype="bfloat16")


def planner_lines(dispatcher: str, backend, recompute: bool, layers: int, releases: bool,
                  rank: int) -> list:  # fmt: skip
    """The planner's terms for the measured configuration (this repository's planner)."""
    from moe_release.plan.pricing import load_planner

    planner = load_planner()

    cfg = dict(hidden_size=SEED["hidden"], num_moe_experts=SEED["experts"],
               moe_router_topk=SEED["topk"], num_layers=layers,
               expert_model_parallel_size=SEED["ep"], moe_token_dispatcher_type=dispatcher,
               moe_flex_dispatcher_backend=backend or "deepep", moe_router_dtype="fp32",
               bf16=True)  # fmt: skip
    if recompute:
        cfg.update(recompute_granularity="selective", recompute_modules=["moe"])
    est = planner.estimate(cfg, SEED["tokens"], releases=releases, local_rank=rank)
    out = [f"{t.nbytes:>15,}  buffer: {t.name} ({t.where})" for t in est.buffers]
    for t in est.dispatcher_state or ():
        out.append(f"{t.nbytes:>15,}  per layer: {t.name}")
    for t in est.dispatcher_state_chain:
        out.append(f"{t.nbytes:>15,}  per layer but the last: {t.name}")
    out.append(f"{est.buffer_bytes + est.buffer_pinned_host_bytes:>15,}  buffers in all")
    out.append(f"{est.dispatcher_state_bytes or 0:>15,}  dispatcher state, {layers} layer(s)")
    return out


def main(argv: Optional[List[str]] = None, prog: Optional[str] = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("dispatcher", help="flex:hybridep, flex:deepep, alltoall or allgather")
    parser.add_argument("--recompute", action="store_true", help="recompute the MoE layer")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--routing", default="balanced", help="balanced or random:SEED")
    parser.add_argument("--trees", default="base,patched")
    args = parser.parse_args(argv)
    from moe_release.runtime.shapes.retained_origins import format_terms, run_origins

    dispatcher, _, backend = args.dispatcher.partition(":")
    routing = {"kind": "balanced"}
    if args.routing.startswith("random:"):
        routing = {"kind": "random", "seed": int(args.routing.split(":", 1)[1])}
    from moe_release import settings

    trees = {"base": settings.base_tree(), "patched": settings.tree()}
    for kind in args.trees.split(","):
        if not trees.get(kind):
            sys.exit(f"production_shape_terms: no {kind} tree (eval scripts/moe_release.py trees)")
        runs = run_origins(trees[kind], 2, timeout=1500, mode="fake", dispatcher=dispatcher,
                           backend=backend or None, layers=args.layers, recompute=args.recompute,
                           routing=routing, sites=True, **SEED)  # fmt: skip
        for r in runs:
            print(f"== {kind}, rank {r['rank']}: retained {r['retained']:,} B = buffers "
                  f"{r['buffers']:,} + state {r['state']:,} ({r['seconds']:.0f} s)")  # fmt: skip
            print(format_terms(r["origins"]["terms"], 0))
            print(f"-- planner ({'releases' if kind == 'patched' else 'keeps'}), rank {r['rank']}")
            print("\n".join(planner_lines(dispatcher, backend or None, args.recompute,
                                          args.layers, kind == "patched", r["rank"])))  # fmt: skip
    return 0


def run(args: argparse.Namespace) -> int:
    """:func:`main` on the words after the command's name."""
    return main(args.argv, prog=args.prog)


register(
    Command(
        name="production-shape-terms",
        help="what stays alive after backward in the production-shape mode, term by term",
        run=run,
        aliases=('production_shape_terms',),
        own_parser=True,
    )
)
