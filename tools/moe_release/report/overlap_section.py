# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The memory report's 1F1B A2A-overlap section.

The report's model with ``overlap_moe_expert_parallel_comm=True`` (bf16, as the overlap requires; no
recompute, which it forbids), trained for one step of four microbatches through megatron-core's own
combined-1F1B schedule (:mod:`moe_release.runtime.megatron.a2a_overlap`), on the base and on the
patched tree. Per tree, on CPU ranks:

* measured: the counted allocator's peak over the step and its timeline, and what each layer's
  schedule state still reaches when that layer's backward finishes (attributed, per holder);
  repeated for the peak's range (gloo's threads free buffers asynchronously, so the peak of
  identical runs differs by up to ~1%);
* dropped: the same step, dropping each finished layer's holders at that moment; the allocator
  bytes this frees are what the schedule held past last use;
* reference: the same model and microbatches with the overlap off; losses and every parameter
  gradient must be bitwise equal to the overlapped step's.
"""

from typing import Any, Dict, List

from moe_release.runtime.measure import peak_tensors
from moe_release.runtime.ranks.launcher import run_distributed

WORLD = 2
RUNNER = "moe_release.runtime.megatron.a2a_overlap:overlap_run"
# The variants of the section: the default step, and behind options (memory_report.py
# --overlap-pp, --overlap-large) the interleaved pipeline schedule (PP=2 x VPP=2 x EP=2, four
# ranks, eight layers, eight microbatches of 512 tokens) and a larger step (sixteen layers,
# eight microbatches of 512 tokens).
VARIANTS = {
    "step": dict(layers=3, microbatches=4),
    "pp": dict(layers=8, microbatches=8, pp=2, vpp=2, seq=512, mbs=1),
    "large": dict(layers=16, microbatches=8, seq=512, mbs=1),
}


def overlap_config(cfg: Dict[str, Any], variant: str = "step") -> Dict[str, Any]:
    """The overlap run's configuration, from the report's. ``step``: three layers (an odd
    count: the middle layer runs forward and backward in the same phase), four microbatches
    sharing the report's tokens per rank; ``pp`` and ``large``: see VARIANTS."""
    shape = dict(VARIANTS[variant])
    microbatches = shape["microbatches"]
    shape.setdefault("seq", cfg["seq"])
    shape.setdefault("mbs", max(cfg["tokens"] // cfg["seq"] // microbatches, 1))
    return dict(
        {k: cfg[k] for k in ("hidden", "ffn", "heads", "experts", "topk", "vocab", "seed")},
        dispatcher=cfg.get("dispatcher", "flex"),
        backend=cfg["backend"],
        **shape,
    )


def world_of(ocfg: Dict[str, Any]) -> int:
    """Ranks of a run: EP=2 on each pipeline stage."""
    return WORLD * ocfg.get("pp", 1)


def _equal(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    import torch

    return (
        len(a["losses"]) == len(b["losses"])
        and all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"]))
        and a["grads"].keys() == b["grads"].keys()
        and all(torch.equal(a["grads"][k], b["grads"][k]) for k in a["grads"])
    )


def held_past_last_use(layers: List[Dict[str, Any]], key: str = "dropped_bytes") -> List[int]:
    """Per layer index, the largest figure over microbatches."""
    out: Dict[int, int] = {}
    for rec in layers:
        value = rec[key] if key == "dropped_bytes" else sum(rec["bytes"].values())
        out[rec["layer"]] = max(out.get(rec["layer"], 0), value)
    return [out[i] for i in sorted(out)]


def measure(
    base: str,
    patched: str,
    cfg: Dict[str, Any],
    log=print,
    peak_runs: int = 3,
    variant: str = "step",
) -> Dict[str, Any]:
    """Run the section on both trees; figures per rank."""
    ocfg = overlap_config(cfg, variant)
    world = world_of(ocfg)
    section: Dict[str, Any] = {"config": ocfg, "peak_runs": peak_runs, "variant": variant}
    timeout = 900 if variant == "step" else 3000
    for name, tree in (("base", base), ("patched", patched)):
        log(f"overlap section ({variant}): {name}")

        def step(tree=tree, **kw):
            return run_distributed(RUNNER, world, tree, {"cfg": dict(ocfg, **kw)}, timeout)

        # With the op log: which tensors are alive at the peak, by the op that made them.
        # The patched run also looks at the base's peak moments (the same program points).
        moments = {}
        if name == "patched":
            moments = {
                "peak_moments_by_rank": [
                    peak_tensors.peak_moments(r["peak_tensors"]) for r in section["base"]
                ]
            }
        measured = step(overlap=True, measure=True, timeline=True, peak_tensors=True, **moments)
        # The step's peak moves by up to ~1% between identical runs (gloo's worker threads
        # free collective buffers asynchronously): repeat it and report the range.
        peaks = [[r["peak_bytes"] for r in measured]]
        for _ in range(peak_runs - 1):
            peaks.append([r["peak_bytes"] for r in step(overlap=True, measure=True)])
        dropped = step(overlap=True, measure=True, drop=True)
        reference = step(overlap=False)
        section[name] = [
            {
                "peak_bytes": m["peak_bytes"],
                "peak_range": [min(p[rank] for p in peaks), max(p[rank] for p in peaks)],
                # The same step with each finished layer's schedule state dropped at once:
                # what of it is alive at the step's peak is this run's peak below the step's.
                "peak_with_drop": d["peak_bytes"],
                "after_step_bytes": m["after_step_bytes"],
                "held_past_last_use": held_past_last_use(d["layers"]),
                "held_per_microbatch": [
                    [r["dropped_bytes"] for r in d["layers"] if r["microbatch"] == mb]
                    for mb in sorted({r["microbatch"] for r in d["layers"]})
                ],
                "attributed": held_past_last_use(m["layers"], key="bytes"),
                "attributed_by_holder": _by_holder(m["layers"]),
                "chunk_state_bytes": max(sum(c["bytes"].values()) for c in m["chunks"]),
                "bitwise_equal_to_no_overlap": _equal(m, reference[rank]),
                "peak_tensors": m["peak_tensors"],
            }
            for rank, (m, d) in enumerate(zip(measured, dropped))
        ]
        section.setdefault("timeline", {})[name] = measured[0]["timeline"]
        # The last rank: with pipeline stages only the last stage has losses.
        section.setdefault("losses", {})[name] = [float(x) for x in measured[-1]["losses"]]
    section["bitwise_base_patched"] = all(
        x == y for x, y in zip(section["losses"]["base"], section["losses"]["patched"])
    )
    return section


def _by_holder(layers: List[Dict[str, Any]]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for rec in layers:
        for holder, n in rec["bytes"].items():
            out[holder] = max(out.get(holder, 0), n)
    return out


def table(section: Dict[str, Any]) -> str:
    """The section's lines for the report's table."""
    c = section["config"]
    pipeline = ""
    if c.get("pp"):
        pipeline = f", PP={c['pp']} x VPP={c['vpp']} x EP={WORLD} (interleaved)"
    lines = [
        "",
        f"1F1B A2A overlap (overlap_moe_expert_parallel_comm, {c['layers']} MoE layers, bf16,"
        f" {c['microbatches']} microbatches of {c['mbs']}x{c['seq']} tokens, no recompute"
        f"{pipeline}; megatron-core's combined-1F1B schedule on CPU ranks)",
    ]
    head = f"{'':34}{'base':>16}{'patched':>16}"
    for rank, (b, p) in enumerate(zip(section["base"], section["patched"])):
        lines += [f"rank {rank} (bytes)", head]
        runs = section["peak_runs"]
        for label, i in ((f"step peak, min of {runs} runs", 0), ("step peak, max", 1)):
            lines.append(f"{label:34}{b['peak_range'][i]:>16,}{p['peak_range'][i]:>16,}")
        if "peak_with_drop" in b:
            alive = [r["peak_bytes"] - r["peak_with_drop"] for r in (b, p)]
            lines.append(f"{'  of it held past last use':34}{alive[0]:>16,}{alive[1]:>16,}")
            after = [r["after_step_bytes"].get("returned", 0) for r in (b, p)]
            lines.append(f"{'left once the schedule returns':34}{after[0]:>16,}{after[1]:>16,}")
        for i, (x, y) in enumerate(zip(b["held_past_last_use"], p["held_past_last_use"])):
            label = f"held past last use, layer {i}"
            lines.append(f"{label:34}{x:>16,}{y:>16,}")
        lines.append(
            f"{'chunk state after its backward':34}"
            f"{b['chunk_state_bytes']:>16,}{p['chunk_state_bytes']:>16,}"
        )
        for holder, n in b["attributed_by_holder"].items():
            m = p["attributed_by_holder"].get(holder, 0)
            lines.append(f"{'  ' + holder:34}{n:>16,}{m:>16,}")
        if "peak_tensors" in b:
            lines.append("  the peak, explained (bytes alive in base minus patched, by the op")
            lines.append("  that made them: the node running, op, shape, megatron-core function)")
            explained = peak_tensors.explain(b["peak_tensors"], p["peak_tensors"], rows=8)
            lines += ["    " + line for line in explained]
        both = b["bitwise_equal_to_no_overlap"] and p["bitwise_equal_to_no_overlap"]
        eq = "yes" if both else "NO"
        lines.append(f"  overlap on == overlap off (losses, all gradients, bitwise): {eq}")
    lines.append(
        "  (held past last use: allocator bytes freed by dropping a layer's schedule state the"
        " moment its backward finishes, largest over microbatches; of the peak: the step's peak"
        " minus that of the same step dropping it; per holder: bytes its references reach,"
        " autograd graph included)"
    )
    return "\n".join(lines)


def bitwise_ok(section: Dict[str, Any]) -> bool:
    """Overlap on == overlap off on both trees, and base == patched."""
    runs = section["base"] + section["patched"]
    return section["bitwise_base_patched"] and all(r["bitwise_equal_to_no_overlap"] for r in runs)


def targets(section: Dict[str, Any]) -> Dict[str, str]:
    """The overlap section's targets, measured."""
    out = {}
    tag = "" if section.get("variant", "step") == "step" else f" ({section['variant']})"
    for rank, (b, p) in enumerate(zip(section["base"], section["patched"])):
        held = sum(p["held_past_last_use"]) + p["chunk_state_bytes"]
        out[f"overlap{tag} rank {rank} patched held past last use"] = (
            f"{held:,} B (target 0; base {sum(b['held_past_last_use']):,} B): "
            + ("met" if held == 0 else "NOT met")
        )
        (blo, bhi), (plo, phi) = b["peak_range"], p["peak_range"]
        verdict = "met" if phi <= blo else "NOT met" if plo > bhi else "within noise"
        out[f"overlap{tag} rank {rank} step peak"] = (
            f"base {blo:,}-{bhi:,} B, patched {plo:,}-{phi:,} B (target: not above base): "
            + verdict
        )
    ok = bitwise_ok(section)
    out[f"overlap{tag} bitwise (on == off, base == patched)"] = "met" if ok else "NOT met"
    return out


def plot(ax, section: Dict[str, Any]) -> None:
    """The step's live bytes over time, base vs patched (rank 0)."""
    for name in ("base", "patched"):
        tl = section["timeline"].get(name)
        if not tl or not tl["t_ms"]:
            continue
        end = tl["t_ms"][-1] or 1.0
        ax.plot([t / end for t in tl["t_ms"]], [b / 2**20 for b in tl["bytes"]], label=name)
    ax.set_title("rank 0: live bytes during the overlapped step")
    ax.set_xlabel("fraction of the step")
    ax.set_ylabel("MiB above the step's start")
    ax.legend()
