# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The repository's report of a configuration: every MoE memory term on one rank, the unpatched
megatron-core (whose dispatchers keep their state between calls) beside the patched tree (which
releases it), composed from the shipped :func:`estimate_config` of each; and the table."""

from dataclasses import asdict
from typing import Dict, Optional

from moe_release.plan.pricing import planner

MoEMemoryConfig = planner.MoEMemoryConfig
GiB = 1024**3


def plan(
    cfg: MoEMemoryConfig, held_rows: Optional[int] = None, device_memory: Optional[int] = None
) -> Dict[str, object]:
    """Every MoE memory term of ``cfg`` on one rank, base (unpatched megatron-core) beside
    patched (this series), as one JSON-able dict: the shipped estimate of a tree that keeps the
    dispatcher state and of one that releases it. For HybridEP also what a call grows against
    a buffer of ``held_rows`` per rank already held. ``totals.in_flight_*``: what the MoE
    layers hold from their forward until their backward (NCCL EP's routing handle), per layer
    and at the step's peak, base and patched alike. ``releasable``: what a rank of the patched
    tree gets back between steps, as a share of ``device_memory`` bytes (None: the planner's
    default, 80 GiB); the base gets back nothing. ``modelled_commits``: the commit of each
    library the planner was read at. A configuration the kernels refuse is a ValueError citing
    the line that refuses it (``kernel_refusal``)."""
    base = planner.estimate_config(cfg, releases=False, device_memory=device_memory)
    patched = planner.estimate_config(cfg, releases=True, device_memory=device_memory)
    back = patched.releasable
    shape = planner.layer_shape(cfg)
    flex = cfg.moe_token_dispatcher_type == "flex"
    group = cfg.group_size if flex else cfg.expert_model_parallel_size
    out = {
        "config": dict(asdict(cfg), recompute_modules=list(cfg.recompute_modules)),
        "derived": {
            "tokens_per_rank": cfg.tokens,
            "dispatcher_group": group,
            "local_experts": shape.local_experts,
            "expert_columns": shape.experts,
            "routed_rows": shape.routed_rows,
            "moe_layers_per_rank": base.moe_layers,
            "moe_layers_per_pipeline_rank": cfg.rank_moe_layers(),
            "recompute": shape.recompute,
            "deep_ep_source": cfg.deep_ep,
            "deep_ep_commit": planner.DEEP_EP_SOURCES[cfg.deep_ep],
            "deep_ep_v2_commit": planner.DEEP_EP_V2_COMMIT,
            "nccl_ep_commit": planner.NCCL_EP_COMMIT,
            "transformer_engine_commit": planner.TRANSFORMER_ENGINE_COMMIT,
            "moe_layers_in_flight": base.moe_layers_in_flight,
        },
        "modelled_commits": dict(planner.MODELLED_COMMITS),
        "buffers": [asdict(t) for t in base.buffers],
        "buffers_device_rounding": [asdict(t) for t in base.buffer_device_rounding],
        "warnings": list(base.warnings),
        "retained_per_layer": [asdict(t) for t in base.dispatcher_state or ()],
        "retained_per_layer_but_the_last": [asdict(t) for t in base.dispatcher_state_chain],
        "totals": {
            "buffers_outside_allocator": base.buffer_bytes,
            "buffers_outside_allocator_device": base.buffer_device_bytes,
            "buffers_pinned_host": base.buffer_pinned_host_bytes,
            "buffers_released": patched.buffer_released_bytes,  # the base has no release
            "retained_per_layer_base": base.dispatcher_state_bytes_per_layer,
            "retained_per_layer_patched": patched.dispatcher_state_bytes_per_layer,
            "retained_between_calls_base": base.dispatcher_state_bytes,
            "retained_between_calls_patched": patched.dispatcher_state_bytes,
            "releasable_base": base.releasable_bytes,
            "releasable_patched": patched.releasable_bytes,
            "in_flight_per_layer": base.in_flight_bytes_per_layer,
            "in_flight_between_forward_and_backward": base.in_flight_bytes,
        },
        "releasable": dict(
            asdict(back),
            not_priced=list(back.not_priced),
            buffers=back.buffers,
            dispatcher_state=back.dispatcher_state,
            total=back.total,
            device_bytes=back.device_bytes,
            device_share=back.device_share,
        ),
    }
    if flex and cfg.moe_flex_dispatcher_backend == "hybridep":
        out["derived"]["hybridep_rows"] = planner.hybridep_rows(cfg.tokens)
        out["per_call"] = planner.per_call_bytes(cfg)
        out["growth"] = planner.hybridep_growth(cfg, held_rows)
    out["expert_working_set"] = planner.expert_working_set(cfg)
    return out


def format_plan(result: Dict[str, object]) -> str:
    """The plan as a table: every term, its bytes, where it lives, its source."""
    d, tot = result["derived"], result["totals"]
    c = result["config"]
    head = (
        f"MoE memory plan: {c['moe_token_dispatcher_type']}"
        + (
            f"/{c['moe_flex_dispatcher_backend']}"
            if c["moe_token_dispatcher_type"] == "flex"
            else ""
        )
        + f", H={c['hidden_size']}, {c['num_moe_experts']} experts top-{c['moe_router_topk']},"
        f" group {d['dispatcher_group']}, T={d['tokens_per_rank']:,} tokens/rank,"
        f" {d['moe_layers_per_rank']} MoE layers/rank, recompute {d['recompute']}"
    )
    commits = ", ".join(
        f"{name} {commit[:7]}" for name, commit in result["modelled_commits"].items()
    )
    lines = [head, f"modelled at: {commits}", f"{'term':52}{'bytes':>16}  {'where':18} source"]

    def rows(terms):
        for t in terms:
            lines.append(f"  {t['name'][:50]:50}{t['nbytes']:>16,}  {t['where']:18} {t['source']}")

    if result["buffers"]:
        backend = result["config"]["moe_flex_dispatcher_backend"]
        source = {
            "deepepv2": f"DeepEP epv2-release {d['deep_ep_v2_commit'][:7]}",
            "ncclep": f"NCCL EP, nccl-extensions {d['nccl_ep_commit'][:7]}",
        }.get(backend, f"deep_ep {d.get('deep_ep_source', 'hybrid-ep')} {d['deep_ep_commit'][:7]}")
        lines.append(f"communication buffers ({source}), base = patched:")
        rows([t for t in result["buffers"] if not t["in_flight"]])
        flight = [t for t in result["buffers"] if t["in_flight"]]
        if flight:
            lines.append(
                "held by each MoE layer from its forward until its backward (allocator; "
                f"{d['moe_layers_in_flight']} MoE layers in flight at the step's peak):"
            )
            rows(flight)
        if result["buffers_device_rounding"]:
            lines.append("what the device takes beyond the bytes asked for (device column only):")
            rows(result["buffers_device_rounding"])
    if "growth" in result:
        g = result["growth"]
        held = "none" if g["held_rows"] is None else f"{g['held_rows']:,} rows"
        lines.append(f"HybridEP buffer growth against the held buffer ({held}):")
        lines.append(f"  {'rows per rank needed':50}{g['needed_rows']:>16,}")
        lines.append(f"  {'allocated (outside the allocator)':50}{g['growth_bytes']:>16,}")
    if "per_call" in result:
        lines.append("one HybridEP call's outputs (allocator):")
        lines += [f"  {k:50}{v:>16,}" for k, v in result["per_call"].items()]

    def num(value) -> str:
        return f"{value:>16,}" if value is not None else f"{'not modelled':>16}"

    if tot["retained_per_layer_base"] is None:
        lines.append("dispatcher state kept between calls: not modelled for this backend")
    else:
        lines.append("dispatcher state kept per MoE layer between calls, base (patched: 0):")
    rows(result["retained_per_layer"])
    if result["retained_per_layer_but_the_last"]:
        lines.append("  and, reached from the next layer's graph (every MoE layer but the last):")
        rows(result["retained_per_layer_but_the_last"])
    lines += [
        f"{'':52}{'base':>16}{'patched':>16}",
        f"{'buffers outside the allocator':52}{tot['buffers_outside_allocator']:>16,}"
        f"{tot['buffers_outside_allocator']:>16,}",
        f"{'  as the device sees them (rounded)':52}"
        f"{tot['buffers_outside_allocator_device']:>16,}"
        f"{tot['buffers_outside_allocator_device']:>16,}",
        f"{'retained per MoE layer (allocator)':52}{num(tot['retained_per_layer_base'])}"
        f"{num(tot['retained_per_layer_patched'])}",
        f"{'retained between calls, all MoE layers':52}"
        f"{num(tot['retained_between_calls_base'])}{num(tot['retained_between_calls_patched'])}",
    ]
    if tot["in_flight_per_layer"]:
        held = tot["in_flight_between_forward_and_backward"]
        label = f"held forward to backward, {d['moe_layers_in_flight']} MoE layers in flight"
        lines.append(f"{label:52}{held:>16,}{held:>16,}")
    if "releasable" in result:
        lines.append(release_line(result["releasable"]))
    return "\n".join(lines)


def release_line(r: Dict[str, object]) -> str:
    """The plan's last line: what one rank of the patched tree gets back between steps (for a
    colocated loop's rollout; the base, with no release, gets back 0): the buffers
    ``reset_fused_a2a_buffers(collective=True, group=G)`` frees, by kind, plus the dispatcher
    state no longer held between calls, their total, the device's part of it as a share of the
    device's memory, and what the total leaves unpriced."""
    memory = r["device_memory"]
    size = f"{memory // GiB} GiB" if memory % GiB == 0 else f"{memory:,} B"
    state = r["dispatcher_state"]
    state_text = "not modelled" if state is None else f"{state:,} B"
    line = (
        f"per rank, back for rollout (patched; base 0): collective buffer release "
        f"{r['buffers']:,} B (device {r['buffers_device']:,} + pinned host "
        f"{r['buffers_pinned_host']:,}) + dispatcher state no longer held between calls "
        f"{state_text} = {r['total']:,} B; on the device {r['device_bytes']:,} B = "
        f"{r['device_share']:.2%} of {size}"
    )
    if r["not_priced"]:
        line += "; not priced: " + "; ".join(r["not_priced"])
    return line
