# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The report rendered: the side-by-side table, the timing lines, the targets and the plot."""

from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional

from moe_release.report import buffer_section, colocated_section, overlap_section
from moe_release.report.config import SWEEP_LAYERS, dispatcher_label
from moe_release.report.golden import WARM_PEAK_RTOL
from moe_release.report.runs import world_of
from moe_release.report.runtime import (
    CPU,
    Runtime,
)
from moe_release.report.stats import sync_counter, sync_lines


def fmt_bytes(n: Optional[int]) -> str:
    return "-" if n is None else f"{n:,}"


def ratio(a: Optional[int], b: Optional[int]) -> str:
    return "-" if not a or b is None else f"{b / a:.3f}"


def table(report: Dict[str, Any]) -> str:
    """The side-by-side table, one block per rank."""
    lines = []
    cfg = report["config"]
    lines.append(
        f"megatron-core {report['versions']['base']} vs {report['versions']['patched']}"
        f" | GPTModel, {cfg['layers']} MoE layers ({dispatcher_label(cfg)} dispatcher),"
        + (f" {cfg['mtp_layers']} MTP layer(s)," if cfg.get("mtp_layers") else "")
        + f" {cfg['experts']} experts top-{cfg['topk']},"
        f" hidden {cfg['hidden']}, {cfg['tokens']} tokens/rank, EP={world_of(cfg)}{_nodes(cfg)},"
        f" full recompute, {cfg['steps']} steps"
        f"\nruns on: {Runtime(**report.get('runtime', asdict(CPU))).describe()}"
    )
    head = f"{'':34}{'base':>16}{'patched':>16}{'patched/base':>14}"
    for rank, (b, p) in enumerate(zip(report["base"], report["patched"])):
        lines += ["", f"rank {rank} (bytes, allocator level)", head]
        for key, label in (
            ("held_between_calls", "memory held between calls"),
            ("cold_peak", "cold peak (incl. held before)"),
            ("warm_peak", "warm peak (incl. held before)"),
        ):
            cells = f"{fmt_bytes(b[key]):>16}{fmt_bytes(p[key]):>16}{ratio(b[key], p[key]):>14}"
            lines.append(f"{label:34}{cells}")
        explained = report.get("warm_peak_explained")
        if explained:
            e = explained[rank]
            running = e["after_forward"] - e["after_backward"] - e["previous_step"]
            lines += [
                "  base's dispatcher state at its warm peak (base peak - peak of a base run that"
                " drops it):",
                f"{'    all of it (dropped after forward)':34}{e['after_forward']:>16,}",
                f"{'    held from the previous step':34}{e['previous_step']:>16,}",
                f"{'    of layers whose backward ended':34}{e['after_backward']:>16,}",
            ]
            for i, n in enumerate(e.get("after_backward_per_layer", [])):
                lines.append(f"{'      MoE layer ' + str(i) + ' alone':34}{n:>16,}")
            lines.append(f"{'    of the layer in its backward':34}{running:>16,}")
        for i, (x, y) in enumerate(zip(b["dispatcher_held_bytes"], p["dispatcher_held_bytes"])):
            lines.append(f"{'dispatcher-held, MoE layer ' + str(i):34}{x:>16,}{y:>16,}{'':>14}")
        lines += buffer_section.comm_buffer_lines(b.get("comm_buffers"), p.get("comm_buffers"))
        if b.get("syncs") is not None and p.get("syncs") is not None:
            lines += sync_lines(b, p)
        lines += buffer_section.hybridep_accounting_lines(cfg, p, world_of(cfg), rank)
    lines += timing_lines(report["timing"])
    eq = report["bitwise"]
    lines.append(
        f"losses bitwise equal: {'yes' if eq['losses'] else 'NO'}; grad norms: "
        f"{'yes' if eq['grad_norms'] else 'NO'}; gradients and updated parameters: "
        f"{eq['tensors_equal']} tensors equal, {len(eq['mismatched'])} differ"
    )
    if report.get("sweep"):
        lines += ["", "sweep: memory held between calls (rank 0, bytes) / dispatcher-held total"]
        lines.append(f"{'layers x tokens':20}{'base':>26}{'patched':>26}")
        for b, p in zip(report["sweep"]["base"], report["sweep"]["patched"]):
            lines.append(
                f"{str(b['layers']) + ' x ' + str(b['tokens']):20}"
                f"{b['held']:>14,} / {sum(b['dispatcher_held_bytes']):>9,}"
                f"{p['held']:>14,} / {sum(p['dispatcher_held_bytes']):>9,}"
            )
    if report.get("overlap"):
        lines.append(overlap_section.table(report["overlap"]))
    for section in report.get("overlap_more", {}).values():
        lines.append(overlap_section.table(section))
    lines += colocated_section.lines(report.get("colocated"), report["versions"]["patched"])
    lines += ["", "targets:"] + [f"  {k}: {v}" for k, v in report["targets"].items()]
    return "\n".join(lines)


def _ci(t: Dict[str, Any]) -> str:
    lo, hi = t["ratio_ci95"]
    return f"95% CI {lo:.3f}-{hi:.3f}"


def _release_cells(t: Dict[str, Any]) -> str:
    return (
        f"{t['release_seconds_median'] * 1e6:>10,.0f} us  {100 * t['release_fraction_median']:.3f}%"
        f" of the step (max {100 * t['release_fraction_max']:.3f}%)"
    )


def timing_lines(t: Dict[str, Any]) -> List[str]:
    """The timing rows: median warm step times and their ratio, the time inside the release
    calls; on the CPU runtime with the placement rules on and off, and their difference."""
    rounds = ", ".join(f"{x:.3f}" for x in t["round_ratios"])
    off = t.get("rules_off")
    if off is None:  # a GPU run: no placement rules to take out
        lines = [
            "",
            f"{'median warm step time (s)':34}{t['median']['base']:>16.4f}"
            f"{t['median']['patched']:>16.4f}{t['ratio']:>14.3f}",
            f"  ({len(t['samples']['base'])} warm steps per variant from {len(t['round_ratios'])}"
            f" interleaved rounds; a step lasts as long as its slowest rank; per-round ratios "
            f"{rounds})",
            f"  step time ratio patched/base {t['ratio']:.3f}, {_ci(t)}",
        ]
        if t.get("release_fraction_median") is not None:
            lines.append(
                f"  inside the release calls (patched), per step and rank:{_release_cells(t)}"
            )
        return lines
    book = t["bookkeeping"]
    book_label = "  the rules' bookkeeping (on - off)"
    lines = [
        "",
        f"{'median warm step time (s)':34}{'base':>16}{'patched':>16}{'patched/base':>14}",
    ]
    for label, x in (("  placement rules on", t), ("  placement rules off", off)):
        lines.append(
            f"{label:34}{x['median']['base']:>16.4f}{x['median']['patched']:>16.4f}"
            f"{x['ratio']:>14.3f}  {_ci(x)}"
        )
    lines += [
        f"{book_label:34}{'':>32}{book['ratio']:>+14.3f}",
        f"  ({len(t['samples']['base'])} warm steps per variant and setting from"
        f" {len(t['round_ratios'])} interleaved rounds; a step lasts as long as its slowest rank;"
        f" per-round ratios, rules on: {rounds}; rules off: "
        + ", ".join(f"{x:.3f}" for x in off["round_ratios"])
        + ")",
    ]
    for label, x in (("rules on", t), ("rules off", off)):
        cpu = x.get("cpu_median")
        if cpu:
            lines.append(
                f"  CPU time of a warm step, both ranks, {label} (s):"
                f" base {cpu['base']:.4f}, patched {cpu['patched']:.4f},"
                f" patched/base {cpu['patched'] / cpu['base']:.3f}"
            )
    if t.get("release_fraction_median") is not None and off.get("release_fraction_median"):
        lines += [
            "inside the release calls (patched), median per step and rank:",
            f"{'  placement rules on':34}{_release_cells(t)}",
            f"{'  rules off: the release itself':34}{_release_cells(off)}",
            f"{book_label:34}"
            f"{book['release_seconds_median'] * 1e6:>10,.0f} us"
            f"  {100 * book['release_fraction_median']:.3f}% of the step",
            "  (rules off, megatron's is_cuda branches take their host path: the release skips"
            " the record_stream a GPU makes per device tensor it drops)",
        ]
    lines.append(
        "values with the placement rules off equal those with them on (losses, both trees): "
        + ("yes" if t["rules_off_losses_equal"] else "NO")
    )
    return lines


def targets(report: Dict[str, Any]) -> Dict[str, str]:
    """The issue's targets, measured."""
    out = {}
    for rank, (b, p) in enumerate(zip(report["base"], report["patched"])):
        retained = sum(b["dispatcher_held_bytes"])
        drop = b["held_between_calls"] - p["held_between_calls"]
        out[f"rank {rank} patched dispatcher-held bytes"] = (
            f"{sum(p['dispatcher_held_bytes'])} (target 0): "
            + ("met" if sum(p["dispatcher_held_bytes"]) == 0 else "NOT met")
        )
        out[f"rank {rank} held-between-calls reduction"] = (
            f"{drop:,} B vs base retained state {retained:,} B: "
            + ("met" if drop >= retained else "NOT met")
        )
        explained = report.get("warm_peak_explained")
        if explained:
            wdrop = b["warm_peak"] - p["warm_peak"]
            e = explained[rank]
            accounted = e["after_forward"]
            tol = WARM_PEAK_RTOL * b["warm_peak"]
            out[f"rank {rank} warm peak reduction"] = (
                f"{wdrop:,} B vs the base's dispatcher state alive at its peak {accounted:,} B "
                f"(target: equal within {tol:,.0f} B): "
                + ("met" if abs(wdrop - accounted) <= tol else "NOT met")
            )
        if b.get("syncs") is not None and p.get("syncs") is not None:
            added = sum((sync_counter(p) - sync_counter(b)).values())
            out[f"rank {rank} host syncs added by the series"] = f"{added} (target 0): " + (
                "met" if added == 0 else "NOT met"
            )
    if report.get("overlap"):
        out.update(overlap_section.targets(report["overlap"]))
    for section in report.get("overlap_more", {}).values():
        out.update(overlap_section.targets(section))
    t = report["timing"]
    # On the CPU runtime the release's own figures are those without the placement rules' own
    # bookkeeping (timing: the same runs with the rules off).
    own = t.get("rules_off") or t
    setting = " (placement rules off)" if "rules_off" in t else ""
    r = own["ratio"]
    ci = own.get("ratio_ci95")
    ci_text = f", 95% CI {ci[0]:.3f}-{ci[1]:.3f}" if ci else ""
    # A ratio above the target whose 95% interval still reaches below it is noise of the
    # shared host, not a measured slowdown; the release's own cost (below) is the direct figure.
    verdict = "met" if r <= 1.02 else "within noise" if ci and ci[0] <= 1.02 else "NOT met"
    out["step time ratio patched/base" + setting] = f"{r:.3f}{ci_text} (target <= 1.02): " + verdict
    frac = own.get("release_fraction_median")
    if frac is not None:
        # The direct figure: what the release itself costs, free of the host's timing noise.
        out["time inside the release calls" + setting] = (
            f"{100 * frac:.3f}% of a step (target <= 2%): " + ("met" if frac <= 0.02 else "NOT met")
        )
    return out


def plot(report: Dict[str, Any], path: Path) -> None:
    """Memory over one warm step (base vs patched) and the sweep, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    overlap = report.get("overlap")
    fig, axes = plt.subplots(1, 3 if overlap else 2, figsize=(19 if overlap else 13, 4.8))
    if overlap:
        overlap_section.plot(axes[2], overlap)
    ax = axes[0]
    for name, style in (("base", "-"), ("patched", "-")):
        tl = report["timeline"].get(name)
        if tl and tl["t_ms"]:
            # Time as a fraction of the step, so runs of different speed line up.
            end = tl["t_ms"][-1] or 1.0
            ax.plot([t / end for t in tl["t_ms"]], [b / 2**20 for b in tl["bytes"]], style,
                    label=f"{name} ({end:.0f} ms)")  # fmt: skip
    ax.set_title("rank 0: live allocator bytes during the last (warm) step")
    ax.set_xlabel("fraction of the step")
    ax.set_ylabel("MiB")
    ax.legend()
    ax = axes[1]
    sweep = report.get("sweep")
    if sweep:
        for name, marker in (("base", "o"), ("patched", "s")):
            for layers in SWEEP_LAYERS:
                pts = [p for p in sweep[name] if p["layers"] == layers]
                ax.plot(
                    [p["tokens"] for p in pts],
                    [sum(p["dispatcher_held_bytes"]) / 2**20 for p in pts],
                    marker=marker,
                    linestyle="-" if name == "base" else "--",
                    label=f"{name}, {layers} layers",
                )
        ax.set_xscale("log", base=2)
        ax.set_title("dispatcher-held memory between calls (rank 0)")
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("MiB")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _nodes(cfg: Dict[str, Any]) -> str:
    """The table header's words for a multi-node run (``--nodes``); empty on one node."""
    nodes = cfg.get("nodes")
    return f" over {nodes[0]} emulated nodes of {nodes[1]} ranks" if nodes else ""
