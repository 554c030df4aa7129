# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The report at seed 000's shape, in the production-shape mode (``run-report
--production-shape``).

Seed 000 (Qwen3.6-35B-A3B with random weights, 8 layers, CP2/EP2, HybridEP, the MoE layer
recomputed, bf16, 105,153 tokens on rank 1 and 89,600 on rank 0; OpenPipe ART's own release measured
on two H200s) as far as the CPU runtime's production-shape mode
(``moe_release.runtime.shapes.production_shape``: FakeTensor data, real routing integers, live bytes
counted per storage) can express it: megatron-core's TransformerBlock (GPTModel's decoder) of real
TransformerLayers whose attention is left out (IdentityOp), each an RMSNorm and a real MoELayer
(TopKRouter, MoEFlexTokenDispatcher on the HybridEP emulation, SequentialMLP experts), EP2 over
gloo, two forward-backward calls per tree on balanced routing. Printed per rank, base beside
patched: memory held between calls, what each layer's dispatcher state frees, the warm peak and the
dispatcher's share of it, beside the planner's ``estimate()`` and the seed's H200 figures
(attributed), every difference named term by term; then a 40-MoE-layer point.
"""

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from moe_release.common import REPO_ROOT

SEED_SHAPE = dict(hidden=2048, experts=256, topk=8, ffn=768, layers=8)
SEED_TOKENS = (89_600, 105_153)  # rank 0, rank 1 (seed 000: "rank 1 (105,153 tokens)")
TINY_SHAPE = dict(hidden=16, experts=4, topk=2, ffn=32, layers=2)
TINY_TOKENS = (12, 16)
GB = 1e9  # the seed prints decimal GB (its 1.92 GB of router state is 7 x 273.5 MB)

# Seed 000, OpenPipe ART's own release of _HybridEPManager's routing_map, token_probs and
# dispatched_probs, measured on two H200s (not this code): rank 1 held 19.30 -> 10.91 GB between
# calls; rank 0 held 7.78 GB less; of the warm call's freeing, 7.37 GB at each layer's dispatch
# (dispatched_probs and the handle) and 1.03 GB of router state in setup_metadata.
SEED = {
    "source": "seed 000: OpenPipe ART's own release code on two H200s, not this code",
    "held_base_rank1": 19.30 * GB,
    "held_patched_rank1": 10.91 * GB,
    "held_drop_rank0": 7.78 * GB,
    "freed_at_dispatch": 7.37 * GB,
    "freed_at_setup_metadata": 1.03 * GB,
    "peak_drop_rank1": (44.44 - 40.71) * GB,
    "warm_peak_drop_rank1": (45.03 - 41.31) * GB,
}

NOT_SEEN = (
    "Not seen by the mode: the caching allocator's reserve and fragmentation (figures are live "
    "bytes, CUDA's memory_allocated, not memory_reserved), record_stream delays (a freed block "
    "waits for its streams on a GPU; here it is free at once), fused kernels' own saved tensors "
    "(the layers are megatron's local, unfused modules; no TE, no flash attention), memory "
    "outside PyTorch (the HybridEP buffer is counted here because the emulation allocates it "
    "through torch; on a GPU it is outside the allocator; NCCL, NVSHMEM and CUDA contexts not at "
    "all). Not expressed: CP2 (megatron's context parallelism needs TE attention, and the "
    "attention is left out: the ranks' token counts stand for the CP split), the attention or "
    "GDN layers, embeddings, output layer and loss, LoRA, the optimizer, and unequal token counts "
    "in one job: HybridEP's routing-map all-gather takes each rank's own row count as every "
    "rank's (deep_ep 94a9f8f executor.cu:33-51, NCCL all_gather_into_tensor or the custom "
    "all-gather into [N x ranks, E]); the emulation refuses unequal counts, naming each rank's, "
    "so each rank's figures come from a job with its count on both ranks."
)

SEED_DIFFERENCES = (
    "  Why the seed differs: its figures are rounded to 0.01 GB and come from another model and "
    "code (Qwen3.6-35B-A3B with LoRA, attention and GDN layers, TE kernels, CP2 with unequal "
    "token counts in one job, ART's release of three manager fields, CUDA's allocator); its "
    "peaks fall mid-backward where 7 layers' router state and 5 layers' leaf gradients are "
    "alive; this model's peak (full expert weight gradients, no attention) falls where its own "
    "tensors put it (each rank's split above names the op, the layer and the terms); the warm "
    "peak equals the cold one on both trees here, so every layer's dispatch has replaced the "
    "previous call's state before the peak. Not attributed term by term: the seed does not "
    "print its terms."
)

# Measured attribute (dropped in this order) -> the planner's terms it frees.
ATTRIBUTE_TERMS = {
    "_HybridEPManager.token_probs": ("token_probs [T, E] fp32",),
    "_HybridEPManager.routing_map": ("routing_map [T, E] bool",),
    "_HybridEPManager.tokens_per_expert": ("tokens_per_expert [L] int64",),
    "_HybridEPManager.dispatched_probs": ("dispatched_probs [P] fp32", "handle: *",
                                          "recompute input leaf [T, H]", "its .grad [T, H]"),
}  # fmt: skip
# Measured attributes the planner does not price, and why.
NOT_PRICED = {
    "_HybridEPManager.over_budget": "a 1-byte flag made at construction (token_dispatcher.py:1054, "
    "so counted with the parameters) and accumulated in place: no dispatch frees it, both trees "
    "keep it",
}


def planner_estimate(
    shape: Dict[str, int], tokens: int, layers: int, releases: bool, rank: Optional[int] = None
):
    """The planner's ``estimate()`` (loaded by path, as ``scripts/moe_memory_plan.py`` does) of
    the measured configuration; ``rank``: the local rank whose buffer is priced."""
    from moe_release.plan.pricing import planner

    config = dict(
        hidden_size=shape["hidden"], num_moe_experts=shape["experts"],
        moe_router_topk=shape["topk"], num_layers=layers, expert_model_parallel_size=2,
        moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep",
        recompute_granularity="selective", recompute_modules=["moe"], bf16=True,
    )  # fmt: skip
    return planner.estimate(config, tokens, releases=releases, local_rank=rank)


def collect(
    trees: Dict[str, str], shape: Dict[str, int], tokens: Sequence[int], timeout: float = 3000.0
) -> Dict[str, Any]:
    """Measure ``shape`` on EP2 ranks of each tree (``{"base": path, "patched": path}``): per
    distinct token count one job with that count on both ranks; rank ``r``'s figures come from
    the job with ``tokens[r]``."""
    from moe_release.runtime.shapes.production_shape_run import run_calls

    jobs: Dict[tuple, List[Dict[str, Any]]] = {}
    seconds: Dict[str, float] = {}
    for kind, tree in trees.items():
        for n in sorted(set(tokens)):
            start = time.monotonic()
            jobs[(kind, n)] = run_calls(tree, 2, timeout=timeout, tokens=n, peak_origins=True,
                                        **shape)  # fmt: skip
            seconds[f"{kind} T={n}"] = time.monotonic() - start
    ranks = []
    for rank, n in enumerate(tokens):
        row: Dict[str, Any] = {"rank": rank, "tokens": n}
        for kind in trees:
            row[kind] = jobs[(kind, n)][rank]
        for kind, releases in (("planner_base", False), ("planner_patched", True)):
            est = planner_estimate(shape, n, shape["layers"], releases, rank)
            row[kind] = {
                "per_layer": est.dispatcher_state_bytes_per_layer,
                "total": est.dispatcher_state_bytes,
                "buffer": est.buffer_bytes,
                "terms": [(t.name, t.nbytes) for t in est.dispatcher_state or ()],
            }
        ranks.append(row)
    return {"shape": dict(shape), "tokens": list(tokens), "ranks": ranks, "seconds": seconds}


def _held_parts(r: Dict[str, Any]) -> Dict[str, int]:
    held = r["held"][-1]
    return {"held": held, "params": r["params"], "buffers": r["buffers"],
            "state": held - r["params"] - r["buffers"]}  # fmt: skip


def _gb(b: float) -> str:
    return f"{b / GB:.3f} GB"


def _b(b: int) -> str:
    return f"{b:,}"


def _span(values: Sequence[int]) -> str:
    lo, hi = min(values), max(values)
    return _b(lo) if lo == hi else f"{_b(lo)}-{_b(hi)}"


def term_table(row: Dict[str, Any]) -> List[tuple]:
    """Layer 1's measured attributes, in the order dropped, beside the planner terms each
    frees: ``(attribute, measured bytes, planner bytes, planner term names)``."""
    terms = dict(row["planner_base"]["terms"])
    table = []
    for attr, measured in row["base"]["per_attribute"][0].items():
        names = ATTRIBUTE_TERMS.get(attr, ())
        priced = sum(
            v for k, v in terms.items()
            if any(k == n or (n.endswith("*") and k.startswith(n[:-1])) for n in names)
        )  # fmt: skip
        table.append((attr, measured, priced, names))
    return table


def routed_rows(tokens: int, shape: Dict[str, int], rank: int, ep: int = 2) -> int:
    """Token-expert rows ``rank``'s experts receive under the balanced routing, every rank
    sending ``tokens`` (the job's); the planner takes T x top-k."""
    import torch

    from moe_release.runtime.shapes.production_shape import BalancedRouting

    e, k = shape["experts"], shape["topk"]
    local = e // ep
    rows = 0
    for src in range(ep):
        idx = BalancedRouting().indices(src, 1, tokens, e, k)
        counts = torch.bincount(idx.flatten(), minlength=e)
        rows += int(counts[rank * local : (rank + 1) * local].sum())
    return rows


def explained(row: Dict[str, Any], shape: Dict[str, int]) -> List[tuple]:
    """Layer 1's measured-minus-planner bytes, term by term: ``(what, bytes)``."""
    out = []
    for attr, measured, _, names in term_table(row):
        if not names:
            out.append((f"{attr}: {NOT_PRICED.get(attr, 'not priced by the planner')}", measured))
        elif attr.endswith(".dispatched_probs"):
            p = routed_rows(row["tokens"], shape, row["rank"])
            n = row["tokens"] * shape["topk"]
            out.append((f"dispatched_probs [P] fp32: P = {p:,} rows routed here, the planner's "
                        f"T x k = {n:,}", (p - n) * 4))  # fmt: skip
    per_layer = row["base"]["per_layer"][0] - row["planner_base"]["per_layer"]
    out.append(("not explained", per_layer - sum(b for _, b in out)))
    return out


def peak_split(row: Dict[str, Any], call: int = -1) -> List[tuple]:
    """The peak of ``call`` (the warm one by default), base minus patched, by what made the
    bytes alive at each tree's peak (the call and megatron-core function,
    :meth:`LiveBytes.peak_origins`): ``(what, base bytes, patched bytes)`` where they differ,
    largest difference first. They sum to the difference of the peaks."""
    b = row["base"]["peak_origins"][call]
    p = row["patched"]["peak_origins"][call]
    rows = [(k, b.get(k, 0), p.get(k, 0)) for k in sorted(set(b) | set(p))]
    rows = [r for r in rows if r[1] != r[2]]
    return sorted(rows, key=lambda r: (-abs(r[1] - r[2]), r[0]))


# Where a peak's dispatcher state is made -> the planner's per-layer terms it can be ("handle: *"
# every handle term together).
SITE_TERMS = {
    "megatron/core/transformer/moe/moe_utils.py:topk_routing_with_score_function": (
        "routing_map [T, E] bool", "token_probs [T, E] fp32"),
    "megatron/core/transformer/moe/fused_a2a.py:HybridEPDispatch.forward": (
        "dispatched_probs [P] fp32", "tokens_per_expert [L] int64", "handle: *"),
    "megatron/core/tensor_parallel/random.py:CheckpointFunction.backward": ("its .grad [T, H]",),
    # The recomputed layer's input: the checkpoint's leaf is a detached view of it.
    "megatron/core/transformer/transformer_layer.py:TransformerLayer._forward_pre_mlp_layernorm": (
        "recompute input leaf [T, H]",),
}  # fmt: skip


def peak_terms(row: Dict[str, Any], shape: Dict[str, int], what: str, diff: int) -> str:
    """``diff`` (a row of :func:`peak_split`) as whole layers times planner terms of its site:
    ``"= k layers x (terms) [+ k' layers x (terms')]"`` (layers whose backward has run hold
    more of a dispatch's state than the others), with the routing's difference from the
    planner's T x k; "not a whole number ..." where no such sum fits."""
    import itertools

    site = what.split(" | ", 1)[-1]
    names = SITE_TERMS.get(site)
    if not names or diff <= 0:
        return ""
    terms = dict(row["planner_base"]["terms"])
    sizes = {n: sum(v for k, v in terms.items() if k.startswith(n[:-1])) if n.endswith("*")
             else terms.get(n, 0) for n in names}  # fmt: skip
    p = routed_rows(row["tokens"], shape, row["rank"])
    n = row["tokens"] * shape["topk"]
    subsets = [c for r in range(1, len(names) + 1) for c in itertools.combinations(names, r)]

    def unit(subset):  # planner bytes, measured bytes per layer
        priced = sum(sizes[t] for t in subset)
        routed = (p - n) * 4 if "dispatched_probs [P] fp32" in subset else 0
        return priced, priced + routed

    layers = shape["layers"]
    for count in (1, 2):
        for chosen in itertools.combinations(subsets, count):
            units = [unit(c) for c in chosen]
            for ks in itertools.product(range(1, layers + 1), repeat=count):
                if sum(ks) > layers or sum(k * u[1] for k, u in zip(ks, units)) != diff:
                    continue
                parts = [f"{k} layer{'s' if k > 1 else ''} x ({' + '.join(c)})"
                         for k, c in zip(ks, chosen)]  # fmt: skip
                priced = sum(k * u[0] for k, u in zip(ks, units))
                text = f"= {' + '.join(parts)}: {priced:,} by the planner"
                if priced != diff:
                    text += (f"; P = {p:,} rows routed here, the planner's T x k = {n:,}: "
                             f"{diff - priced:+,} B")  # fmt: skip
                return text
    return "not a whole number of layers' planner terms"


def _peak_rows(row: Dict[str, Any], shape: Dict[str, int], shown: int = 8) -> List[str]:
    if "peak_origins" not in row["base"]:
        return []
    split = peak_split(row)
    lines = [
        "  warm peak, base - patched, by what made the bytes alive at each peak (they sum to the "
        "difference):",
        f"    base's peak after {row['base']['peak_sites'][-1]}",
        f"    patched's peak after {row['patched']['peak_sites'][-1]}",
    ]
    for what, b, p in split[:shown]:
        lines.append(f"    {b - p:>+16,}  {what} (base {_b(b)}, patched {_b(p)})")
        terms = peak_terms(row, shape, what, b - p)
        if terms:
            lines.append(f"    {'':>16}    {terms}")
    rest = split[shown:]
    if rest:
        lines.append(f"    {sum(b - p for _, b, p in rest):>+16,}  {len(rest)} other origins")
    lines.append(f"    {sum(b - p for _, b, p in split):>+16,}  in all")
    return lines


def _term_rows(row: Dict[str, Any], shape: Dict[str, int]) -> List[str]:
    lines = []
    for attr, measured, priced, names in term_table(row):
        note = ", ".join(names) if names else "not priced"
        lines.append(f"    {attr:<36} {_b(measured):>15} {_b(priced):>15} {measured - priced:>+12,}"
                     f"  {note}")  # fmt: skip
    lines.append(
        f"    measured - planner, per layer: "
        f"{row['base']['per_layer'][0] - row['planner_base']['per_layer']:+,} B ="
    )
    for what, nbytes in explained(row, shape):
        lines.append(f"      {nbytes:>+6,} B  {what}")
    return lines


def _beside_seed(data: Dict[str, Any]) -> List[str]:
    """The seed's H200 figures beside this run's (the seed has 8 MoE layers: at another depth
    only that is said)."""
    out: List[str] = []
    if data["shape"]["layers"] != SEED_SHAPE["layers"]:
        return [f"Seed 000 has {SEED_SHAPE['layers']} MoE layers: not compared with this "
                f"{data['shape']['layers']}-layer run."]  # fmt: skip
    out.append(f"Beside {SEED['source']}:")
    last = data["ranks"][-1]
    drop = _held_parts(last["base"])["held"] - _held_parts(last["patched"])["held"]
    out.append(f"  rank 1 held between calls: seed {_gb(SEED['held_base_rank1'])} -> "
               f"{_gb(SEED['held_patched_rank1'])} (-{_gb(SEED['held_base_rank1'] - SEED['held_patched_rank1'])}); "  # noqa: E501
               f"here -{_gb(drop)}; planner -{_gb(last['planner_base']['total'])}")  # fmt: skip
    if len(data["ranks"]) > 1:
        first = data["ranks"][0]
        d0 = _held_parts(first["base"])["held"] - _held_parts(first["patched"])["held"]
        out.append(f"  rank 0 held between calls: seed -{_gb(SEED['held_drop_rank0'])}; here "
                   f"-{_gb(d0)}; planner -{_gb(first['planner_base']['total'])}")  # fmt: skip
    out.append(f"  rank 1 warm peak: seed -{_gb(SEED['warm_peak_drop_rank1'])}; here "
               f"-{_gb(last['base']['peaks'][-1] - last['patched']['peaks'][-1])}")  # fmt: skip
    attrs = {attr: measured for attr, measured, _, _ in term_table(last)}
    layers = data["shape"]["layers"]
    setup = layers * sum(
        attrs.get(f"_HybridEPManager.{a}", 0) for a in ("routing_map", "token_probs")
    )
    dispatch = layers * attrs.get("_HybridEPManager.dispatched_probs", 0)
    out.append(
        f"  rank 1, where the warm call frees it: seed {_gb(SEED['freed_at_setup_metadata'])} "
        f"in setup_metadata, here {_gb(setup)} (routing_map + token_probs, x {layers} "
        f"layers); seed {_gb(SEED['freed_at_dispatch'])} at dispatch, here {_gb(dispatch)} "
        f"(dispatched_probs, the handle and the recompute leaf + .grad its graph holds)"
    )
    out.append(SEED_DIFFERENCES)
    return out


def render(data: Dict[str, Any], forty: Optional[Dict[str, Any]] = None) -> str:
    """The section's text."""
    s, out = data["shape"], []
    out.append(
        f"Production-shape report: TransformerBlock of {s['layers']} TransformerLayers (MoE, "
        f"attention left out), hidden {s['hidden']}, {s['experts']} experts, top-{s['topk']}, "
        f"expert FFN {s['ffn']}, EP2, HybridEP (emulated), MoE recomputed, bf16, balanced "
        f"routing; megatron-core 0.19.2 base vs patched; live bytes"
    )
    for row in data["ranks"]:
        b, p = _held_parts(row["base"]), _held_parts(row["patched"])
        pb, pp = row["planner_base"], row["planner_patched"]
        out.append("")
        out.append(f"rank {row['rank']} ({row['tokens']:,} tokens)        {'base':>16} "
                   f"{'patched':>16} {'base - patched':>16}")  # fmt: skip
        for label, key in (("memory held between calls", "held"), ("  parameters", "params"),
                           ("  communication buffers", "buffers"),
                           ("  dispatcher state (the rest)", "state")):  # fmt: skip
            out.append(f"  {label:<30} {_b(b[key]):>16} {_b(p[key]):>16} "
                       f"{_b(b[key] - p[key]):>16}")  # fmt: skip
        out.append(f"  {'  planner: buffers':<30} {_b(pb['buffer']):>16} {_b(pp['buffer']):>16}")
        out.append(f"  {'  planner: dispatcher state':<30} {_b(pb['total']):>16} "
                   f"{_b(pp['total']):>16} {_b(pb['total'] - pp['total']):>16}")  # fmt: skip
        out.append(f"  {'per layer, freed by dispatch':<30} {_span(row['base']['per_layer']):>16} "
                   f"{_span(row['patched']['per_layer']):>16}")  # fmt: skip
        out.append(f"  {'  planner, per layer':<30} {_b(pb['per_layer']):>16} "
                   f"{_b(pp['per_layer']):>16}")  # fmt: skip
        wb, wp = row["base"]["peaks"][-1], row["patched"]["peaks"][-1]
        cb, cp = row["base"]["peaks"][0], row["patched"]["peaks"][0]
        out.append(f"  {'cold peak':<30} {_b(cb):>16} {_b(cp):>16} {_b(cb - cp):>16}")
        out.append(f"  {'warm peak':<30} {_b(wb):>16} {_b(wp):>16} {_b(wb - wp):>16}  "
                   f"(the dispatcher's share)")  # fmt: skip
        out.extend(_peak_rows(row, s))
        out.append("  layer 1, term by term: attribute (dropped in this order)   measured   "
                   "planner   difference")  # fmt: skip
        out.extend(_term_rows(row, s))
    out.append("")
    out.extend(_beside_seed(data))
    if forty:
        out.append("")
        out.append(forty["text"])
    out.append("")
    out.append(NOT_SEEN)
    out.append("")
    out.append("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in data["seconds"].items()))
    return "\n".join(out)


def forty_layer_point(data: Dict[str, Any], layers: int = 40) -> Dict[str, Any]:
    """The ``layers``-MoE-layer point by per-layer scaling of the measured run (every layer's
    state is the same size, so the held state is per layer x layers), beside the planner's
    estimate at that depth."""
    if data["shape"]["layers"] == layers:
        return {"layers": layers, "text": f"{layers}-MoE-layer point: this run (above)."}
    lines = [f"{layers}-MoE-layer point (per-layer scaling of the {data['shape']['layers']}-layer "
             f"run, not a {layers}-layer run):"]  # fmt: skip
    for row in data["ranks"]:
        scaled = {}
        for kind in ("base", "patched"):
            per = row[kind]["per_layer"]
            scaled[kind] = round(sum(per) / len(per) * layers)
        est = planner_estimate(data["shape"], row["tokens"], layers, False)
        lines.append(f"  rank {row['rank']}: dispatcher state freed by dispatch, all layers: base "
                     f"{_b(scaled['base'])} ({_gb(scaled['base'])}), patched "
                     f"{_b(scaled['patched'])}; planner {_b(est.dispatcher_state_bytes)} "
                     f"({_gb(est.dispatcher_state_bytes)}), patched 0")  # fmt: skip
    return {"layers": layers, "text": "\n".join(lines)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="run-report --production-shape", description=__doc__)
    parser.add_argument("--tiny", action="store_true", help="the tiny shape (seconds)")
    parser.add_argument("--layers", type=int, default=None, help="MoE layers (default 8)")
    parser.add_argument("--out", default=str(REPO_ROOT / ".build/report"))
    args = parser.parse_args(argv)
    shape = dict(TINY_SHAPE if args.tiny else SEED_SHAPE)
    if args.layers:
        shape["layers"] = args.layers
    tokens = TINY_TOKENS if args.tiny else SEED_TOKENS
    from moe_release import settings

    trees = {"base": settings.base_tree(required=True), "patched": settings.tree(required=True)}
    data = collect(trees, shape, tokens)
    forty = forty_layer_point(data)
    text = render(data, forty)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "production_shape.txt").write_text(text + "\n")
    (out / "production_shape.json").write_text(json.dumps(data, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
