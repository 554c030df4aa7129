# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The report's statistics: bitwise equality of two runs, per-rank summaries, host syncs,
and the interleaved timing runs with their bootstrap confidence intervals."""

import random
import statistics
from typing import Any, Dict, List, Optional, Tuple

from moe_release.report.config import TIMING_STEPS
from moe_release.report.runs import run
from moe_release.report.runtime import (
    CPU,
    Runtime,
    log,
)


def bitwise_equal(a: List[Dict[str, Any]], b: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Compare losses, grad norms, gradients and updated parameters of two runs, every rank."""
    import torch

    losses = all(x["losses"] == y["losses"] for x, y in zip(a, b))
    norms = all(x["grad_norms"] == y["grad_norms"] for x, y in zip(a, b))
    grads = params = 0
    mismatched = []
    for x, y in zip(a, b):
        for kind in ("grads", "params"):
            if x[kind].keys() != y[kind].keys():
                mismatched.append(f"rank {x['rank']} {kind}: different names")
                continue
            for name in x[kind]:
                if torch.equal(x[kind][name], y[kind][name]):
                    if kind == "grads":
                        grads += 1
                    else:
                        params += 1
                else:
                    mismatched.append(f"rank {x['rank']} {kind} {name}")
    return {
        "losses": losses,
        "grad_norms": norms,
        "tensors_equal": grads + params,
        "mismatched": mismatched,
        "all": losses and norms and not mismatched,
    }


def summarize(res: Dict[str, Any]) -> Dict[str, Any]:
    """Per-rank memory figures of one measured run."""
    marks = res["marks"]
    steps = len(res["losses"])
    warm = [marks[f"step{s}:peak"] for s in range(1, steps)]
    return {
        "held_between_calls": marks[f"step{steps - 1}:end"],
        "held_after_first_call": marks["step0:end"],
        "model_and_optimizer": marks["built"],
        "cold_peak": marks["step0:peak"],
        "warm_peak": max(warm) if warm else None,
        "dispatcher_held_bytes": res["dispatcher_held_bytes"],
        "dispatcher_attribution": res["attribution"],
        "comm_buffers": res.get("comm_buffers"),
        "per_call_bytes": res.get("per_call_bytes"),
        "losses": res["losses"],
        "grad_norms": res["grad_norms"],
        # "kind @ file:line" -> count (JSON keys); the placement rules count them on CPU.
        "syncs": {
            f"{kind} @ {site}": n for (kind, site), n in sorted(res.get("syncs", {}).items())
        },
    }


def sync_counter(summary: Dict[str, Any]):
    from moe_release.runtime.cuda.placement import sync_counts

    return sync_counts({tuple(k.split(" @ ", 1)): n for k, n in summary["syncs"].items()})


def sync_lines(base: Dict[str, Any], patched: Dict[str, Any]) -> List[str]:
    """One warm step's device-to-host syncs by kind and file, base vs patched."""
    b, p = sync_counter(base), sync_counter(patched)
    lines = [f"{'host syncs in a warm step (kind @ file)':50}{'base':>8}{'patched':>8}"]
    for kind, where in sorted(set(b) | set(p)):
        label = f"  {kind} @ {where}"
        lines.append(f"{label:50}{b[(kind, where)]:>8}{p[(kind, where)]:>8}")
    return lines


def timing(
    base: str, patched: str, cfg: Dict[str, Any], rounds: int, runtime: Runtime = CPU
) -> Dict[str, Any]:
    """Interleaved timing runs (base, patched, patched, base, ...): median warm step time and
    the time inside the release calls.

    On the CPU runtime each round runs both trees twice, with the placement rules
    (:mod:`moe_release.runtime.cuda.placement`, the runtime's usual setting) and without them (host
    tensors, as ``MOE_RELEASE_PLACEMENT=0``), in the order base on, patched on, base off,
    patched off, reversed every other round. The top-level figures are those with the rules on;
    ``rules_off`` holds the same figures without them and ``bookkeeping`` the difference, on -
    off: what the rules' own bookkeeping adds to the step ratio and to the release calls.
    """
    # Unmeasured runs (no allocator counter, no timeline) of more steps than the measured one.
    cfg = dict(cfg, steps=max(cfg["steps"], TIMING_STEPS), measure=False)
    settings: Tuple[Optional[bool], ...] = (True, False) if runtime.device == "cpu" else (None,)
    raw = {rules: _TimingSamples() for rules in settings}
    losses: Dict[Tuple[str, Optional[bool]], List[List[float]]] = {}
    order = [(n, t, rules) for rules in settings for n, t in (("base", base), ("patched", patched))]
    for r in range(rounds):
        # Alternate which variant goes first, so an order effect cancels out.
        for name, tree, rules in order if r % 2 == 0 else order[::-1]:
            label = name if rules is None else f"{name}, placement rules {'on' if rules else 'off'}"
            log(f"timing round {r + 1}/{rounds}: {label}")
            res = run(tree, "train", cfg, runtime, placement=rules)
            raw[rules].add(name, res, r)
            losses[(name, rules)] = [rk["losses"] for rk in res]
    out = raw[settings[0]].summary()
    if False in raw:
        off = raw[False].summary()
        out["rules_off"] = off
        out["bookkeeping"] = {
            key: None if out[key] is None or off[key] is None else out[key] - off[key]
            for key in ("ratio", "release_seconds_median", "release_fraction_median")
        }
        # The rules only place tensors and check them: every value is the same without them.
        out["rules_off_losses_equal"] = all(
            losses[(name, True)] == losses[(name, False)] for name in ("base", "patched")
        )
    return out


class _TimingSamples:
    """The warm steps of one setting's timing runs, and what :func:`timing` reports of them."""

    def __init__(self):
        self.samples: Dict[str, List[float]] = {"base": [], "patched": []}
        self.cpu: Dict[str, List[float]] = {"base": [], "patched": []}
        self.release_seconds: List[float] = []
        self.release_fractions: List[float] = []
        self.round_medians: List[Dict[str, float]] = []

    def add(self, name: str, res: List[Dict[str, Any]], round_index: int) -> None:
        """One run's ranks: step 0 (cold) is left out; a step lasts as long as its slowest
        rank; its CPU time is both ranks' process time together."""
        steps = len(res[0]["step_times"])
        per_step = [max(rk["step_times"][s] for rk in res) for s in range(1, steps)]
        self.samples[name].extend(per_step)
        if all("step_cpu_times" in rk for rk in res):
            self.cpu[name].extend(
                sum(rk["step_cpu_times"][s] for rk in res) for s in range(1, steps)
            )
        if len(self.round_medians) <= round_index:
            self.round_medians.append({})
        self.round_medians[round_index][name] = statistics.median(per_step)
        if name == "patched":
            # The release's direct cost: time inside its calls, per rank and step.
            for rk in res:
                for s in range(1, steps):
                    spent = (rk.get("release_times") or [None] * steps)[s]
                    if spent is not None:
                        self.release_seconds.append(spent)
                        self.release_fractions.append(spent / rk["step_times"][s])

    def summary(self) -> Dict[str, Any]:
        med = {k: statistics.median(v) for k, v in self.samples.items()}
        seconds, fractions = self.release_seconds, self.release_fractions
        return {
            "samples": self.samples,
            "median": med,
            "ratio": med["patched"] / med["base"],
            "ratio_ci95": bootstrap_ratio_ci(self.samples["base"], self.samples["patched"]),
            "round_ratios": [m["patched"] / m["base"] for m in self.round_medians],
            "cpu_median": (
                {k: statistics.median(v) for k, v in self.cpu.items()}
                if all(self.cpu.values())
                else None
            ),
            "release_seconds_median": statistics.median(seconds) if seconds else None,
            "release_fraction_median": statistics.median(fractions) if fractions else None,
            "release_fraction_max": max(fractions) if fractions else None,
        }


def bootstrap_ratio_ci(
    base: List[float], patched: List[float], resamples: int = 2000, seed: int = 0
) -> Tuple[float, float]:
    """95% percentile-bootstrap interval of median(patched) / median(base), each variant's
    warm steps resampled with replacement (seeded, so a report is reproducible)."""
    rng = random.Random(seed)
    ratios = sorted(
        statistics.median(rng.choices(patched, k=len(patched)))
        / statistics.median(rng.choices(base, k=len(base)))
        for _ in range(resamples)
    )
    return ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]
