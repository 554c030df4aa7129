# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The golden values: what a recorded run keeps, and the comparison with tolerances."""

from typing import Any, Dict, List


def golden_values(report: Dict[str, Any], command: str) -> Dict[str, Any]:
    """Megatron functional-test format: {metric: {start_step, end_step, step_interval, values}}."""

    def series(values: List[Any]) -> Dict[str, Any]:
        return {
            "start_step": 1,
            "end_step": len(values),
            "step_interval": 1,
            "values": {str(i + 1): v for i, v in enumerate(values)},
        }

    out: Dict[str, Any] = {"_command": command, "_config": report["config"]}
    for variant in ("base", "patched"):
        for rank, r in enumerate(report[variant]):
            suffix = f" ({variant}, rank {rank})"
            out["lm loss" + suffix] = series(r["losses"])
            out["grad norm" + suffix] = series(r["grad_norms"])
            for key in ("held_between_calls", "cold_peak", "warm_peak", "model_and_optimizer"):
                out[f"mem {key.replace('_', ' ')} bytes" + suffix] = series([r[key]])
            out["mem dispatcher-held bytes per layer" + suffix] = series(r["dispatcher_held_bytes"])
    return out


# Tolerances of the golden comparison, and why:
# - losses and grad norms: fp32 on CPU; oneDNN/MKL pick GEMM kernels by CPU (AVX2, AVX-512,
#   AMX), which changes summation order between x86 machines by ~1e-7 relative per op. Over a
#   few steps that stays well under these bounds; a real numerical change is far above them.
# - memory: tensor sizes follow from shapes and routing only; routing can flip on another CPU
#   only for near-tied router logits, which would move dispatched sizes by a few rows. Peaks
#   also depend on when gloo's worker threads drop their buffers (seen: 25 KB of 11 MB).
#   The patched dispatcher-held bytes are the physical floor and must be exactly 0.
# The warm-peak target: the reduction equals what the base's dispatcher state adds to its warm
# peak (a base run dropping it after each MoE layer's forward, explain_warm_peak), within the
# peaks' run-to-run spread (gloo's worker threads free collective buffers asynchronously: up to
# ~0.25% of the peak seen).
WARM_PEAK_RTOL = 0.005

GOLDEN_RTOL = {
    "lm loss": 1e-4,
    "grad norm": 1e-3,
    "mem held between calls bytes": 0.01,
    "mem model and optimizer bytes": 0.0,
    "mem cold peak bytes": 0.02,
    "mem warm peak bytes": 0.02,
    "mem dispatcher-held bytes per layer": 0.01,
}


def compare_golden(golden: Dict[str, Any], actual: Dict[str, Any]) -> List[str]:
    """Differences between golden values and a fresh run beyond GOLDEN_RTOL (empty: match)."""
    problems = []
    for key, want in golden.items():
        if key.startswith("_"):
            continue
        got = actual.get(key)
        if got is None:
            problems.append(f"{key}: missing from the run")
            continue
        metric = key.split(" (")[0]
        rtol = GOLDEN_RTOL[metric]
        for step, w in want["values"].items():
            g = got["values"].get(step)
            if g is None:
                problems.append(f"{key} step {step}: missing")
            elif "dispatcher-held" in metric and "patched" in key and g != 0:
                problems.append(f"{key} step {step}: {g} bytes held, expected exactly 0")
            elif abs(g - w) > rtol * abs(w):
                problems.append(f"{key} step {step}: got {g}, golden {w} (rtol {rtol})")
    return problems
