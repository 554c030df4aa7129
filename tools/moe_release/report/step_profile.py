# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Where a warm step's time goes, base against patched (``memory_report.py --profile``).

The report's step-time ratio compares whole steps; this looks inside them. Both trees run the
report's job without the CPU runtime's placement rules (host tensors: the runtime's own
bookkeeping is not in the figures) under cProfile, warm steps only, in interleaved runs. It
prints, per warm step and rank:

* the calls the patched tree adds (functions by file and name, so a patch that only moves a
  function's lines adds nothing), each with its cProfile time, and the time inside the code
  only the patched tree has (its functions whose callers the base has too);
* the step's own time by kind of code (collectives, which include waiting for the other rank;
  torch's C++ ops; Python of torch, megatron-core and the runtime), median over the steps of
  every run, with its interquartile range;
* each tree's wall and process CPU time per step (under the profiler; the report's timing runs
  measure both without it) and its minor page faults (memory the allocator had to map again).

cProfile inflates small Python calls several times over: the times of added calls are upper
bounds; the call counts are exact.
"""

import statistics
from typing import Any, Callable, Dict, List, Optional, Tuple

from moe_release.report.runtime import log

PROFILE_STEPS = 6

# Kinds of code, by cProfile key (``file:line(name)``, paths from the package down); the first
# that matches.
KINDS: Tuple[Tuple[str, Callable[[str], bool]], ...] = (
    (
        "collectives (incl. waiting for the other rank)",
        lambda k: k.startswith("torch/distributed/"),
    ),
    ("torch C++ ops", lambda k: k.startswith("~:0(") and ("torch" in k or "Tensor" in k)),
    ("torch Python", lambda k: k.startswith("torch/")),
    ("megatron-core Python", lambda k: k.startswith("megatron/")),
    (
        "CPU runtime (kernel emulation, harness)",
        lambda k: k.startswith(("moe_release/runtime/", "moe_release/report/")),
    ),
    ("other (builtins, stdlib)", lambda k: True),
)


def kind_of(key: str) -> str:
    """The :data:`KINDS` name of a cProfile key."""
    return next(name for name, match in KINDS if match(key))


def function_of(key: str) -> str:
    """``file(name)`` of a ``file:line(name)`` key: a function wherever the patch moved it."""
    path, _, rest = key.partition(":")
    return f"{path}({rest.split('(', 1)[1]}" if "(" in rest else key


def measure(base: str, patched: str, cfg: Dict[str, Any], rounds: int = 2) -> Dict[str, Any]:
    """Profiled runs of both trees (placement rules off), interleaved; see the module doc."""
    from moe_release.report.runs import run

    cfg = dict(cfg, steps=max(cfg["steps"], PROFILE_STEPS), measure=False, profile=True)
    runs: Dict[str, List[List[Dict[str, Any]]]] = {"base": [], "patched": []}
    order = [("base", base), ("patched", patched)]
    for r in range(rounds):
        for name, tree in order if r % 2 == 0 else order[::-1]:
            log(f"profile round {r + 1}/{rounds}: {name} (placement rules off)")
            runs[name].append(run(tree, "train", cfg, placement=False))
    return summarize(runs)


def _quartiles(values: List[float]) -> Tuple[float, float, float]:
    if len(values) < 2:
        return (values[0],) * 3 if values else (0.0, 0.0, 0.0)
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return q1, q2, q3


def summarize(runs: Dict[str, List[List[Dict[str, Any]]]]) -> Dict[str, Any]:
    """Per tree: calls per function and warm step (mean over every rank and step), own time by
    kind (quartiles over rank-steps), wall and CPU time; the calls the patched tree adds."""
    out: Dict[str, Any] = {}
    calls: Dict[str, Dict[str, float]] = {}
    inside: Dict[str, Dict[str, float]] = {}
    callers: Dict[str, set] = {}
    for name, tree_runs in runs.items():
        steps = [step for res in tree_runs for rank in res for step in rank["profile"]]
        n = len(steps)
        calls[name], inside[name] = {}, {}
        kinds: Dict[str, List[float]] = {kind: [] for kind, _ in KINDS}
        for step in steps:
            per_kind = dict.fromkeys(kinds, 0.0)
            for key, (ncalls, own, _, by_caller) in step.items():
                fn = function_of(key)
                calls[name][fn] = calls[name].get(fn, 0.0) + ncalls / n
                # Time inside the function, from its callers other than itself (a same-named
                # method one class calls on another would count twice).
                outer: Dict[str, float] = {}
                for c, t in by_caller.items():
                    outer[function_of(c)] = outer.get(function_of(c), 0.0) + t
                entered = sum(t for c, t in outer.items() if c != fn)
                inside[name][fn] = inside[name].get(fn, 0.0) + entered / n
                if name == "patched":
                    callers.setdefault(fn, set()).update(outer)
                per_kind[kind_of(key)] += own
            for kind, seconds in per_kind.items():
                kinds[kind].append(seconds)
        wall = [t for res in tree_runs for rank in res for t in rank["step_times"][1:]]
        cpu = [t for res in tree_runs for rank in res for t in rank["step_cpu_times"][1:]]
        faults = [f for res in tree_runs for rank in res for f in rank["page_faults"][1:]]
        out[name] = {
            "rank_steps": n,
            "kinds": {kind: _quartiles(v) for kind, v in kinds.items()},
            "wall_median": statistics.median(wall),
            "cpu_median": statistics.median(cpu),
            "page_faults": _quartiles(faults),
        }
    added = []
    for fn in set(calls["base"]) | set(calls["patched"]):
        d = calls["patched"].get(fn, 0.0) - calls["base"].get(fn, 0.0)
        if abs(d) < 0.5:
            continue
        per_call = inside["patched"].get(fn, 0.0) / calls["patched"][fn] if d > 0 else None
        added.append({"function": fn, "calls": d, "patched_only": fn not in calls["base"],
                      "seconds": None if per_call is None else d * per_call})  # fmt: skip
    added.sort(key=lambda a: (-(a["seconds"] or 0.0), -abs(a["calls"]), a["function"]))
    out["calls_added"] = added
    # Python only the patched tree has, entered from code the base has too: its total time.
    entries = [
        a for a in added
        if a["patched_only"] and not a["function"].startswith("~")
        and any(c in calls["base"] for c in callers[a["function"]])
    ]  # fmt: skip
    out["patched_only_entries"] = [a["function"] for a in entries]
    out["patched_only_seconds"] = sum(a["seconds"] for a in entries)
    return out


def lines(result: Dict[str, Any], top: Optional[int] = 25) -> List[str]:
    """The profile as text."""
    b, p = result["base"], result["patched"]
    out = [
        "",
        "warm steps under cProfile, placement rules off (host tensors): base vs patched"
        f" ({b['rank_steps']} and {p['rank_steps']} rank-steps)",
        "calls the patched tree adds per warm step and rank (function by file and name; the"
        " time inside those calls, under cProfile):",
    ]
    for a in result["calls_added"][:top]:
        seconds = "" if a["seconds"] is None else f"{a['seconds'] * 1e6:>9,.0f} us"
        out.append(f"  {a['calls']:>+8.1f}  {seconds:>18}  {a['function']}")
    more = len(result["calls_added"]) - (top or 0)
    if top and more > 0:
        out.append(f"  ({more} more)")
    out.append(
        f"  time inside the code only the patched tree has, per warm step and rank: "
        f"{result['patched_only_seconds'] * 1e6:,.0f} us (under cProfile; entered at "
        + ", ".join(result["patched_only_entries"])
        + ")"
    )
    out.append(
        f"{'own time per warm step and rank (ms), median [IQR]':58}{'base':>22}{'patched':>22}"
    )
    for kind, _ in KINDS:
        cells = "".join(
            f"{x['kinds'][kind][1] * 1e3:>9.1f} [{x['kinds'][kind][0] * 1e3:.0f}-"
            f"{x['kinds'][kind][2] * 1e3:.0f}]".rjust(22)
            for x in (b, p)
        )
        out.append(f"  {kind:56}{cells}")
    for label, key in (("wall", "wall_median"), ("process CPU (all threads)", "cpu_median")):
        out.append(
            f"  {label + ' time of a warm step, median (ms)':56}"
            f"{b[key] * 1e3:>22.1f}{p[key] * 1e3:>22.1f}"
        )
    cells = ""
    for x in (b, p):
        q1, q2, q3 = x["page_faults"]
        cells += f"{q2:>9,.0f} [{q1:,.0f}-{q3:,.0f}]".rjust(22)
    out.append(f"  {'minor page faults of a warm step, median [IQR]':56}{cells}")
    return out
