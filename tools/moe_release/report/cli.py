# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Side-by-side memory report: unpatched megatron-core against the moe-release series.

One invocation runs the same small MoE training job (megatron-core GPTModel, MoE layers with
the flex dispatcher and HybridEP, every layer checkpointed, EP=2) on the pristine base
and on the patched tree, in separate processes with the same seeds, and prints per rank: memory
held between calls, cold and warm peaks (allocator level), bytes each MoE layer's dispatcher
keeps alive between calls, the median step time of interleaved timing runs, and whether losses
and gradients are bitwise equal. A sweep over layers x tokens shows how retained memory grows
with work. Figures go to JSON and a PNG next to it; `--record-golden` writes golden values.

Where it runs (``--device``, ``--kernels``; see :func:`resolve_runtime`): on a host without a
GPU, CPU tensors over gloo with the deep_ep emulation, measured by the counting CPU allocator.
With a GPU, CUDA tensors measured by CUDA's caching-allocator statistics, with the real deep_ep
kernels over NCCL where deep_ep is installed and there is a GPU per rank, and otherwise the
emulation on CUDA tensors over gloo (ranks may share one GPU).
"""

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from moe_release import backends
from moe_release.common import REPO_ROOT
from moe_release.report import colocated_section, overlap_section, step_profile
from moe_release.report.config import (
    DISPATCHERS,
    GOLDEN_CONFIG,
    MAIN,
    QUICK,
    SWEEP_LAYERS,
    SWEEP_TOKENS,
    base_label,
    tree_version,
    trees,
)
from moe_release.report.golden import golden_values
from moe_release.report.render import plot, table, targets
from moe_release.report.runs import WORLD, run
from moe_release.report.runtime import (
    CPU,
    ReportError,
    Runtime,
    log,
    probe_machine,
    resolve_runtime,
)
from moe_release.report.stats import bitwise_equal, summarize, timing


def _nodes(text: Optional[str]) -> Optional[Tuple[int, int]]:
    """``--nodes NxR`` as (N, R); None without it."""
    if text is None:
        return None
    try:
        n, r = (int(x) for x in text.lower().split("x"))
    except ValueError:
        n = r = 0
    if n < 1 or r < 1:
        raise ReportError(f"--nodes {text}: expected NxR, e.g. 2x2")
    return n, r


def measure(base: str, patched: str, cfg: Dict[str, Any], runtime: Runtime = CPU) -> Dict[str, Any]:
    """One measured run per variant: memory figures, timelines, and bitwise comparison."""
    runs = {}
    for name, tree in (("base", base), ("patched", patched)):
        log(f"measured run: {name} ({Path(tree).name})")
        runs[name] = run(tree, "train", dict(cfg, measure=True, timeline=True, grads=True), runtime)
    return {
        "base": [summarize(r) for r in runs["base"]],
        "patched": [summarize(r) for r in runs["patched"]],
        "timeline": {k: runs[k][0].get("timeline") for k in runs},
        "bitwise": bitwise_equal(runs["base"], runs["patched"]),
    }


def explain_warm_peak(
    base: str,
    cfg: Dict[str, Any],
    layers: int,
    ref: List[int],
    runtime: Runtime = CPU,
    per_layer: bool = True,
) -> List[Dict[str, Any]]:
    """Where the warm-peak reduction comes from, measured on the base, per rank.

    The base's dispatcher state of a layer lives from that layer's dispatch to its next one. Runs of
    the base drop it at chosen moments (:class:`moe_release.report.worker.DropAfterBackward`):
    ``after_forward``, all of it, the moment each MoE layer's (recomputed) forward returns, where
    the release drops it; ``previous_step``, what each layer still holds from the last step, before
    each warm step; ``after_backward``, what each layer's finished backward left (its recomputed
    graph, input and ``.grad``), the moment that backward is done. Each figure is the base's warm
    peak (``ref``, per rank, from its measured run) minus that run's; with ``per_layer``,
    ``after_backward`` also layer by layer (the peak moves, so those do not add
    up)."""
    log("warm peak explained: the base, its held state dropped")
    every = list(range(layers))

    def lowered(**drop) -> List[int]:
        res = run(base, "train", dict(cfg, measure=True, **drop), runtime)
        return [ref[rank] - summarize(r)["warm_peak"] for rank, r in enumerate(res)]

    previous = lowered(drop_held=every)
    after = lowered(drop_after_backward=every)
    forward = lowered(drop_after_forward=every)
    out = [
        {
            "base_warm_peak": ref[rank],
            "previous_step": previous[rank],
            "after_backward": a,
            "after_forward": forward[rank],
        }
        for rank, a in enumerate(after)
    ]
    for i in every if per_layer else ():
        for rank, n in enumerate(lowered(drop_after_backward=[i])):
            out[rank].setdefault("after_backward_per_layer", []).append(n)
    return out


def _profile(
    base: str, patched: str, cfg: Dict[str, Any], rounds: int, out: Path, runtime: Runtime
) -> int:
    """``--profile``: :mod:`.step_profile`'s comparison, printed and written as JSON."""
    if runtime.device != "cpu":
        print("memory_report: --profile runs on the CPU runtime; add --device cpu", file=sys.stderr)
        return 2
    result = step_profile.measure(base, patched, cfg, rounds)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_profile.json").write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(step_profile.lines(result)))
    print(f"\nwrote {out / 'step_profile.json'}")
    return 0


def main(argv: Optional[List[str]] = None, prog: Optional[str] = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO_ROOT / ".build" / "report"), help="output dir")
    parser.add_argument(
        "--quick", action="store_true", help="small run, no sweep, one overlap peak run (for tests)"
    )
    parser.add_argument("--no-sweep", action="store_true", help="skip the layers x tokens sweep")
    parser.add_argument(
        "--rounds", type=int, default=6, help="interleaved timing rounds (even: order alternates)"
    )
    parser.add_argument("--record-golden", metavar="PATH", help="write golden values to PATH")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="instead of the report: cProfile the warm steps of base and patched (placement "
        "rules off, --rounds interleaved runs each) and print where their time goes",
    )
    parser.add_argument(
        "--dispatcher",
        default="flex",
        choices=DISPATCHERS,
        help="MoE token dispatcher (default: flex; alltoall runs dropless)",
    )
    parser.add_argument(
        "--mtp-layers",
        type=int,
        default=0,
        metavar="N",
        help="add N multi-token-prediction layers (each with its own MoE layer)",
    )
    parser.add_argument(
        "--backend",
        default="hybridep",
        choices=backends.NAMES,
        help="flex dispatcher backend, one both trees have (default: hybridep)",
    )
    parser.add_argument(
        "--no-overlap",
        action="store_true",
        help="skip the 1F1B A2A-overlap section (overlap_moe_expert_parallel_comm)",
    )
    parser.add_argument(
        "--overlap-pp",
        action="store_true",
        help="add the overlap section's interleaved pipeline run (PP=2 x VPP=2 x EP=2, 4 ranks, "
        "8 layers, 8 microbatches of 512 tokens; minutes)",
    )
    parser.add_argument(
        "--overlap-large",
        action="store_true",
        help="add the overlap section's larger step (16 layers, 8 microbatches of 512 tokens; "
        "minutes)",
    )
    parser.add_argument(
        "--no-colocated",
        action="store_true",
        help="skip the colocated-RL section (every comm buffer released between two steps, per "
        "flex backend; CPU runtime only)",
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where tensors live (auto: cuda when a GPU is visible)",
    )
    parser.add_argument(
        "--kernels",
        default="auto",
        choices=("auto", "emulation", "deep_ep"),
        help="dispatch kernels (auto: real deep_ep on a GPU per rank when installed)",
    )
    parser.add_argument(
        "--nodes",
        metavar="NxR",
        help="run on N emulated nodes of R ranks each (CPU runtime; e.g. 2x2: EP=4, each "
        "backend's multi-node path); the sweep, overlap and colocated sections stay on one node "
        "and are left out",
    )
    args = parser.parse_args(argv)
    try:
        nodes = _nodes(args.nodes)
        world = nodes[0] * nodes[1] if nodes else WORLD
        runtime = resolve_runtime(args.device, args.kernels, world, *probe_machine())
        if nodes and runtime.device != "cpu":
            raise ReportError("--nodes: emulated nodes are the CPU runtime's; add --device cpu")
        if nodes and args.record_golden:
            raise ReportError("--nodes: golden values are of one node of 2 ranks")
        if args.record_golden and runtime.device != "cpu":
            raise ReportError(
                "--record-golden: golden values hold CPU-allocator figures; add --device cpu"
            )
        if args.record_golden and (args.dispatcher, args.backend, args.mtp_layers) != (
            "flex",
            "hybridep",
            0,
        ):
            raise ReportError("--record-golden: golden values are for flex/hybridep, no MTP")
        if args.dispatcher != "flex" and args.backend != "hybridep":
            raise ReportError(f"--backend {args.backend}: only the flex dispatcher has backends")
    except ReportError as exc:
        print(f"memory_report: {exc}", file=sys.stderr)
        return 2
    log(f"runs on: {runtime.describe()}")

    started = time.monotonic()
    if runtime.device == "cpu":
        from moe_release.runtime.measure import cpu_memory

        cpu_memory.build()
    base, patched = trees()
    if args.dispatcher == "flex":
        for name, tree in (("base", base), ("patched", patched)):
            has = backends.available(tree)
            if args.backend not in has:
                print(
                    f"memory_report: --backend {args.backend}: the {name} tree ({tree}) has no "
                    f"such flex backend (it has {', '.join(sorted(has)) or 'none'})",
                    file=sys.stderr,
                )
                return 2
    if args.record_golden:
        cfg = dict(GOLDEN_CONFIG)
    else:
        cfg = dict(QUICK if args.quick else MAIN)
    cfg["backend"] = args.backend
    multiple = backends.get(args.backend).hidden_multiple
    if args.dispatcher == "flex" and cfg["hidden"] % multiple:
        hidden = -(-cfg["hidden"] // multiple) * multiple
        log(f"hidden {cfg['hidden']} -> {hidden}: {args.backend}'s kernels take a multiple of "
            f"{multiple}")  # fmt: skip
        cfg["hidden"] = hidden
    if args.dispatcher != "flex":
        cfg["dispatcher"] = args.dispatcher
    if args.mtp_layers:
        cfg["mtp_layers"] = args.mtp_layers
    if nodes:
        cfg["nodes"] = list(nodes)
        args.no_sweep = args.no_overlap = args.no_colocated = True
    if args.profile:
        return _profile(base, patched, cfg, args.rounds, Path(args.out), runtime)
    report: Dict[str, Any] = {
        "config": cfg,
        "versions": {
            "base": base_label(base),
            "patched": tree_version(patched),
        },
        "trees": {"base": base, "patched": patched},
        "runtime": asdict(runtime),
    }
    report.update(measure(base, patched, cfg, runtime))
    if not args.record_golden:
        layers = cfg["layers"] + cfg.get("mtp_layers", 0)
        ref = [r["warm_peak"] for r in report["base"]]
        report["warm_peak_explained"] = explain_warm_peak(
            base, cfg, layers, ref, runtime, per_layer=not args.quick
        )
    rounds = 1 if args.quick or args.record_golden else args.rounds
    report["timing"] = timing(base, patched, cfg, rounds, runtime)
    if not (args.quick or args.no_sweep or args.record_golden):
        points = [(layer, tok) for layer in SWEEP_LAYERS for tok in SWEEP_TOKENS]
        report["sweep"] = {}
        for name, tree in (("base", base), ("patched", patched)):
            log(f"sweep: {name}, {len(points)} points")
            res = run(tree, "sweep", dict(cfg, points=points), runtime, timeout=1800)
            report["sweep"][name] = res[0]
    if not (args.no_overlap or args.record_golden):
        # --quick: one peak run per tree, not the range of three.
        runs = 1 if args.quick else 3
        report["overlap"] = overlap_section.measure(base, patched, cfg, log=log, peak_runs=runs)
        more = [v for v, on in (("pp", args.overlap_pp), ("large", args.overlap_large)) if on]
        if more:
            report["overlap_more"] = {
                v: overlap_section.measure(base, patched, cfg, log=log, variant=v) for v in more
            }
    if not (args.no_colocated or args.record_golden) and runtime.device == "cpu":
        # Measured by the counted CPU allocator, so the CPU runtime only.
        report["colocated"] = colocated_section.measure(patched, log)
    report["targets"] = targets(report)
    report["wall_s"] = round(time.monotonic() - started, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory_report.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, out / "memory_report.png")
    text = table(report)
    (out / "memory_report.txt").write_text(text + "\n")
    print(text)
    print(f"\nwrote {out / 'memory_report.json'}, {out / 'memory_report.png'} "
          f"({report['wall_s']} s)")  # fmt: skip
    if args.record_golden:
        command = "python scripts/memory_report.py --record-golden " + args.record_golden
        path = Path(args.record_golden)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(golden_values(report, command), indent=2) + "\n")
        print(f"wrote golden values to {path}")
    sections = ([report["overlap"]] if "overlap" in report else []) + list(
        report.get("overlap_more", {}).values()
    )
    overlap_ok = all(overlap_section.bitwise_ok(s) for s in sections)
    colocated_ok = all(r is None or r["bitwise"] for r in report.get("colocated", {}).values())
    return 0 if report["bitwise"]["all"] and overlap_ok and colocated_ok else 1
