#!/usr/bin/env python3
# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""HybridEP memory budget for a model and parallel configuration, predicted before anything is
allocated: the intranode buffer by term (outside PyTorch's allocator), its growth against a held
buffer, one call's dispatch/combine outputs, the experts' routed working set and the recompute
combine floor. ``--json`` prints the same as one JSON object.

The accounting is the overlay module ``megatron/core/transformer/moe/hybridep_memory.py``
(loaded from this repository; it imports no megatron-core or torch).
"""

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import List, Optional

MODULE = Path(__file__).resolve().parents[1] / "megatron/core/transformer/moe/hybridep_memory.py"


def load_accounting():
    """The accounting module, by file path."""
    spec = importlib.util.spec_from_file_location("hybridep_memory", MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit status 2
        print(f"hybridep_memory: {message}", file=sys.stderr)
        sys.exit(2)


def budget(acc, cfg, held_rows: Optional[int], recompute_extent: Optional[int]) -> dict:
    """Everything the command prints, as one dict."""
    rows = acc.buffer_rows(cfg.tokens_per_rank)
    out = {
        "config": {
            "hidden": cfg.hidden,
            "experts": cfg.num_experts,
            "topk": cfg.topk,
            "ep": cfg.ep,
            "etp": cfg.etp,
            "tokens_per_rank": cfg.tokens_per_rank,
            "nodes": cfg.nodes,
            "imbalance": cfg.imbalance,
            "combine_chunk": acc.combine_chunk(),
        },  # fmt: skip
        "buffer_rows": rows,
        "buffer_rows_total": rows * cfg.group_size,
        "buffer_bytes": acc.buffer_bytes(cfg)["total"],
        "buffer_terms": acc.buffer_bytes(cfg),
        "growth": acc.growth_bytes(cfg, held_rows),
        "per_call": acc.per_call_bytes(cfg),
        "expert_working_set": acc.expert_working_set(cfg),
    }
    if recompute_extent is not None:
        out["recompute_combine_floor"] = acc.recompute_combine_floor(recompute_extent, cfg.hidden)
    return out


def table(b: dict) -> str:
    """The budget as a table."""
    c = b["config"]
    g = b["growth"]
    lines = [
        f"HybridEP memory (intranode), H={c['hidden']}, {c['experts']} experts top-{c['topk']},"
        f" ETPxEP={c['etp']}x{c['ep']}, {c['tokens_per_rank']} tokens/rank,"
        f" imbalance {c['imbalance']}, combine chunk {c['combine_chunk']}",
        f"{'buffer rows per rank / in group':40}{b['buffer_rows']:>16,}"
        f"{b['buffer_rows_total']:>16,}",
        "buffer (outside the PyTorch allocator), bytes:",
    ]
    for term, n in b["buffer_terms"].items():
        lines.append(f"  {term:38}{n:>16,}")
    held = "none" if g["held_rows"] is None else f"{g['held_rows']:,} rows"
    lines += [
        f"growth against held buffer ({held}):",
        f"  {'grows':38}{str(g['grows']):>16}",
        f"  {'allocated':38}{g['growth_bytes']:>16,}",
        f"  {'peak, old kept while new allocated':38}{g['transient_peak_holding_old']:>16,}",
        f"  {'peak, old dropped first':38}{g['transient_peak_dropping_old']:>16,}",
        "one call (inside the allocator), bytes:",
    ]
    lines += [f"  {k:38}{v:>16,}" for k, v in b["per_call"].items()]
    w = b["expert_working_set"]
    lines += [
        "experts' routed working set (rows / BF16 bytes):",
        f"  {'balanced':38}{w['balanced_rows']:>16,}{w['balanced_bytes']:>16,}",
        f"  {'with imbalance':38}{w['rows']:>16,}{w['bytes']:>16,}",
        f"  {'worst case (EP x balanced)':38}{w['worst_rows']:>16,}{w['worst_bytes']:>16,}",
    ]
    if "recompute_combine_floor" in b:
        lines.append(f"{'recompute combine floor, bytes':40}{b['recompute_combine_floor']:>16,}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point."""
    p = _Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, required=True, help="hidden size H")
    p.add_argument("--experts", type=int, required=True, help="routed experts")
    p.add_argument("--topk", type=int, required=True, help="experts per token")
    p.add_argument("--ep", type=int, default=1, help="expert-model-parallel size")
    p.add_argument("--etp", type=int, default=1, help="expert tensor-parallel size")
    p.add_argument("--tokens-per-rank", type=int, required=True, help="tokens per rank and call")
    p.add_argument("--nodes", type=int, default=1, help="nodes of the group (1 is modelled)")
    p.add_argument("--imbalance", type=float, default=1.0, help="routed rows vs balanced")
    p.add_argument("--held-rows", type=int, help="rows per rank of a buffer already held")
    p.add_argument("--recompute-extent", type=int, help="restored extent P for the floor")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    acc = load_accounting()
    try:
        cfg = acc.HybridEPMemoryConfig(
            hidden=args.hidden, num_experts=args.experts, topk=args.topk, ep=args.ep,
            etp=args.etp, tokens_per_rank=args.tokens_per_rank, nodes=args.nodes,
            imbalance=args.imbalance,
        )  # fmt: skip
        if args.held_rows is not None and args.held_rows <= 0:
            raise ValueError(f"held-rows must be positive, got {args.held_rows}")
        b = budget(acc, cfg, args.held_rows, args.recompute_extent)
    except ValueError as exc:
        print(f"hybridep_memory: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(b, indent=1) if args.json else table(b))
    return 0


if __name__ == "__main__":
    sys.exit(main())
