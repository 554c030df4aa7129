# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The fault matrix's parent side: run one cell of
:mod:`moe_release.runtime.megatron.fault_scenarios` (2 rank processes, bounded, always reaped),
collect what each rank logged, and judge and render it. The pass rule (:func:`violations`) and
the table (:func:`markdown`) are what ``scripts/fault_matrix.py`` and
``test_comm_buffer_faults.py`` use."""

import json
import pickle
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from moe_release.runtime.megatron.fault_scenarios import (
    BACKENDS,
    BOUNDS,
    BYTES_JITTER,
    CYCLES,
    DEVICE_BARRIER_TIMEOUT,
    EXIT_BOUND,
    GLOO_TIMEOUT,
    SCENARIOS,
    TEARDOWN_GLOO_TIMEOUT,
    THIS,
    WORLD,
    applies,
)


def run_cell(
    tree: str,
    scenario: str,
    backend: str,
    log: Callable[[str], None] = print,
    world: int = WORLD,
    ranks_per_node: Optional[int] = None,
) -> dict:
    """Run one cell on ``tree`` (``world`` rank processes, bounded, always reaped); its
    measurements. ``ranks_per_node``: the emulated nodes' size (MOE_RELEASE_RANKS_PER_NODE in
    every rank; None: one node)."""
    from moe_release import settings
    from moe_release.runtime.ranks import launcher

    bound = BOUNDS[scenario]
    # Start (import, rendezvous) + the scenario's bound + the exit's, and some slack for a
    # loaded host.
    deadline_s = 60.0 + bound + EXIT_BOUND
    spec = {
        "scenario": scenario,
        "backend": backend,
        "gloo_timeout": TEARDOWN_GLOO_TIMEOUT if scenario in ("c1", "c2") else GLOO_TIMEOUT,
        "device_barrier_timeout": DEVICE_BARRIER_TIMEOUT,
    }
    setup = {"emulate_deep_ep": True, "force_emulation": False, "placement": True}
    with tempfile.TemporaryDirectory(prefix="moe_fault_") as tmp:
        job = Path(tmp)
        (job / "spec.pkl").write_bytes(pickle.dumps(spec))
        port = launcher.free_port()
        zygote = launcher._zygote(tree, setup) if launcher.fork_server_enabled() else None
        procs, logs = [], []
        started = time.time()
        try:
            for rank in range(world):
                env = launcher.rank_env(tree, rank, world, port)
                env["MOE_RELEASE_RANK_ENTRY"] = f"{THIS}:rank_entry"
                env.pop(settings.RANKS_PER_NODE, None)
                if ranks_per_node is not None:
                    env[settings.RANKS_PER_NODE] = str(ranks_per_node)
                forked = zygote.fork(job, rank, env) if zygote is not None else None
                if forked is None:
                    out = open(job / f"rank{rank}.log", "w+b")
                    logs.append(out)
                    forked = subprocess.Popen(
                        [sys.executable, "-m", THIS, str(job)], env=env,
                        cwd=str(launcher.REPO_ROOT), stdout=out, stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )  # fmt: skip
                procs.append(forked)
            exited = _wait(procs, scenario, started + deadline_s, job / "rank0.faults", bound)
        finally:
            for p in procs:
                launcher._kill(p)
            for out in logs:
                out.close()
        cell = _collect(job, procs, exited, spec)
    cell.update(tree=tree, scenario=scenario, backend=backend, bound=bound, world=world,
                ranks_per_node=ranks_per_node)  # fmt: skip
    return cell


def _wait(procs, scenario: str, deadline: float, log0: Path, bound: float) -> List[Optional[float]]:
    """Each rank's exit time (None: killed at the deadline). In c2 the last rank
    (fault_scenarios.faulty_rank) is killed once the others have exited (it only sleeps); in
    c1/c2 rank 0 is killed 3 s past the bound of a teardown that has not returned."""
    exited: List[Optional[float]] = [None] * len(procs)
    checked = 0.0
    while time.time() < deadline:
        if scenario in ("c1", "c2") and exited[0] is None and time.time() - checked > 0.5:
            checked = time.time()
            marks = {m.get("what"): m["t"] for m in _read_log(log0) if m.get("kind") == "marker"}
            if "teardown_start" in marks and "teardown_end" not in marks:
                if checked - marks["teardown_start"] > bound + 3.0:
                    return exited
        for i, p in enumerate(procs):
            if exited[i] is None and p.poll() is not None:
                exited[i] = time.time()
        if scenario == "c2" and all(e is not None for e in exited[:-1]) and exited[-1] is None:
            return exited
        if all(e is not None for e in exited):
            return exited
        time.sleep(0.05)
    return exited


def _read_log(path: Path) -> List[Dict[str, Any]]:
    out = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


_WARNING = re.compile(r"warn|would trap|timed out", re.IGNORECASE)
# Python's warnings module repeats the call site; import-time deprecations are no fault.
_NOISE = re.compile(r"^\s*warnings\.warn\(|DeprecationWarning|FutureWarning|is deprecated")


def _collect(job: Path, procs, exited, spec) -> Dict[str, Any]:
    ranks = []
    for rank, p in enumerate(procs):
        records = _read_log(job / f"rank{rank}.faults")
        result_file = job / f"rank{rank}.json"
        result = json.loads(result_file.read_text()) if result_file.exists() else {}
        output = (
            (job / f"rank{rank}.log").read_text(errors="replace")
            if (job / f"rank{rank}.log").exists()
            else ""
        )
        markers = {m["what"]: m["t"] for m in records if m.get("kind") == "marker"}
        done = markers.get("done")
        killed = exited[rank] is None
        entries = [e for e in records if "op" in e]
        teardown = _between(records, "teardown_start", "teardown_end")
        attempt = _between(records, "attempt_start", "attempt_end")
        ranks.append(
            {
                **result,
                "rc": None if killed else p.returncode,
                "killed": killed,
                "exit_s": None if killed or done is None else exited[rank] - done,
                "collectives": entries,
                "teardown_collectives": teardown,
                "attempt_collectives": attempt,
                "warnings": _warnings(output, records),
                "device_barrier_timeouts": [
                    m for m in records if m.get("kind") == "device_barrier_timeout"
                ],
                "output_tail": output[-1500:],
                "teardown_started": "teardown_start" in markers,
            }
        )
    return {"ranks": ranks}


def _between(records, start: str, end: str) -> List[Dict[str, Any]]:
    """The collectives entered between markers ``start`` and ``end`` (every such span)."""
    out, inside = [], False
    for rec in records:
        if rec.get("kind") == "marker" and rec.get("what") in (start, end):
            inside = rec["what"] == start
        elif inside and "op" in rec:
            out.append(rec)
    return out


def _warnings(output: str, records) -> List[str]:
    lines = [
        line.strip()[:200]
        for line in output.splitlines()
        if _WARNING.search(line) and not _NOISE.search(line)
    ]
    lines += [f"[logger] {m['text'][:200]}" for m in records if m.get("kind") == "warning"]
    seen: Dict[str, None] = {}
    for line in lines:
        seen.setdefault(line, None)
    return list(seen)


# -- the pass rule ---------------------------------------------------------------------------


# HybridEP's destructor, local on every rank: its NVLink buffer and, across nodes, its RDMA
# coordinator's deregistration and frees (deep_ep 94a9f8f internode_doca.cu:698-787).
HYBRIDEP_LOCAL = ("hybridep release_buffer", "hybridep rdma release")
# NCCL EP's ep_finalize (and across teams the GIN window's deregistration after it): upstream's
# own in destroy_model_parallel(), held against the base's cell, not here.
NCCL_EP_FINALIZE = ("ncclep ep_finalize", "ncclep gin window deregister")


def banned(entry: Dict[str, Any]) -> Optional[str]:
    """Why a collective entry breaks the pass rule, or None. A free (``faults.FREES``) runs only
    inside the explicit release; HybridEP's destructor also at the process's exit (local: the
    driver frees the memory then anyway). NCCL EP's ep_finalize is upstream's own in
    destroy_model_parallel(): it is held against the base's cell, not here."""
    from moe_release.runtime.measure.faults import BANNED_CONTEXTS, CONSTRUCTIONS, FREES, LIFECYCLE

    ctx = entry.get("context") or []
    if entry["op"] in (*FREES, *HYBRIDEP_LOCAL) and entry["op"] not in NCCL_EP_FINALIZE:
        if "release" in ctx:
            return None
        if entry["op"] in HYBRIDEP_LOCAL:
            return None if "exit" in ctx else "freed outside the explicit release"
    hit = [c for c in ctx if c in BANNED_CONTEXTS]
    if hit:
        return hit[0]
    if "atexit" in ctx and entry.get("exception_pending"):
        return "atexit after an exception"
    if entry["op"] in LIFECYCLE and entry["op"] not in CONSTRUCTIONS:
        if "autograd" in ctx or "thread" in ctx:
            return "inside a backward"
    return None


def unmatched(cell: Dict[str, Any], lifecycle_only: bool = True) -> List[Dict[str, Any]]:
    """Collectives not every member rank of their group entered as often (on a GPU: a rank
    waiting alone). ``lifecycle_only``: barriers and the buffers' device-side collectives."""
    from moe_release.runtime.measure.faults import LIFECYCLE

    counts: Dict[tuple, Dict[int, int]] = {}
    for rank, r in enumerate(cell["ranks"]):
        for e in r["collectives"]:
            if e["ranks"] is None or len(e["ranks"]) < 2:
                continue
            if lifecycle_only and e["op"] not in LIFECYCLE:
                continue
            key = (tuple(e["ranks"]), e["op"])
            counts.setdefault(key, {m: 0 for m in e["ranks"]})
            counts[key][rank] = counts[key].get(rank, 0) + 1
    return [
        {"ranks": list(k[0]), "op": k[1], "per_rank": v}
        for k, v in sorted(counts.items())
        if len(set(v.values())) > 1
    ]


def summary(cell: Dict[str, Any]) -> Dict[str, Any]:
    """The figures of a cell the pass rule and the table read (also the golden values)."""
    ranks = cell["ranks"]
    s = cell["scenario"]
    expect_exit_code = 1 if s in ("b", "f", "g-exc") else 0
    flat = None
    if s in ("d", "e", "h") and all(len(r.get("bytes") or []) == CYCLES + 1 for r in ranks):
        flat = [
            (r["bytes"][CYCLES] - r["bytes"][1])
            - (r["kernel_leaks"][CYCLES] - r["kernel_leaks"][1])
            for r in ranks
        ]
    exits = []
    for i, r in enumerate(ranks):
        if s == "c2" and i == len(ranks) - 1:
            exits.append(None)  # killed by design (fault_scenarios.faulty_rank)
            continue
        exits.append(r["exit_s"] if not r["killed"] else float("inf"))
    teardown = [max(r.get("teardown_s") or [0.0]) if r.get("teardown_s") else None for r in ranks]
    if s in ("c1", "c2") and ranks[0].get("teardown_started") and not ranks[0].get("teardown_s"):
        teardown[0] = float("inf")  # killed inside its teardown: its exit is not measured
        exits[0] = None
    return {
        "scenario_s": [r.get("scenario_s") for r in ranks],
        "teardown_s": teardown,
        "teardown_waits": [
            sum(1 for e in r["teardown_collectives"] if e["op"] in _lifecycle()) for r in ranks
        ],
        "exit_s": exits,
        "rc": [r["rc"] for r in ranks],
        "expect_rc": expect_exit_code,
        "bytes": [r.get("bytes") for r in ranks],
        "growth": flat,
        "buffers_alive": [r.get("buffers_alive") for r in ranks],
        "leaked_bytes": [r.get("leaked_bytes") for r in ranks],
        "banned": sorted(
            {f"{e['op']} ({banned(e)})" for r in ranks for e in r["collectives"] if banned(e)}
        ),  # fmt: skip
        "unmatched": [f"{u['op']} on {u['ranks']}: {u['per_rank']}" for u in unmatched(cell)],
        "device_barrier_timeouts": sum(len(r["device_barrier_timeouts"]) for r in ranks),
        "collectives": [len(r["collectives"]) for r in ranks],
        "warnings": sorted({w for r in ranks for w in r["warnings"]}),
        "threads_left": sorted({t for r in ranks for t in r.get("threads_left") or []}),
        "dispatcher_bytes": [r.get("dispatcher_bytes") for r in ranks],
        "release_api": ranks[0].get("release_api"),
        "unfinished": [
            _last_error(r["output_tail"])
            for r in ranks
            if "scenario_s" not in r and not r["killed"]
        ],
        "buffers_made": ranks[0].get("buffers_made"),
        # m, n: what the explicit release raised on each rank (None: it returned), the bytes
        # the attempt freed, the collectives it entered
        "refused": [r.get("refused") for r in ranks],
        "freed_by_attempt": [r.get("freed_by_attempt") for r in ranks],
        "attempt_collectives": [len(r.get("attempt_collectives") or []) for r in ranks],
    }


def _last_error(output: str) -> str:
    """The last line of a rank's traceback (its exception), or of its output."""
    lines = [line for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "Exception" in line or "Fault" in line:
            return line.strip()[-300:]
    return (lines[-1].strip() if lines else "no output")[-300:]


def _lifecycle():
    from moe_release.runtime.measure.faults import LIFECYCLE

    return LIFECYCLE


def _num(x) -> float:
    return -1.0 if x is None else float(x)


def violations(scenario: str, s: Dict[str, Any], base: Optional[Dict[str, Any]]) -> List[str]:
    """The pass rule for one cell's :func:`summary` ``s`` (``base``: the unpatched base's
    summary of the same cell, or None): each broken rule with its figure."""
    bound = BOUNDS[scenario]
    out = [f"a rank failed before its last point: {e}" for e in s.get("unfinished") or ()]
    for rank, t in enumerate(s["scenario_s"]):
        if t is not None and t > bound:
            out.append(f"rank {rank} ran {t:.1f} s, over the {bound:.0f} s bound")
    for rank, t in enumerate(s["teardown_s"]):
        if t is not None and t > bound:
            out.append(f"rank {rank}'s teardown took {_secs(t)} (bound {bound:.0f} s)")
    if base is not None and max(s["teardown_waits"]) > max(base["teardown_waits"]):
        out.append(
            f"destroy_model_parallel() entered {max(s['teardown_waits'])} peer waits "
            f"(the base's teardown: {max(base['teardown_waits'])})"
        )
    for rank, (t, rc) in enumerate(zip(s["exit_s"], s["rc"])):
        if t is None:
            continue
        if t > EXIT_BOUND:
            out.append(
                f"rank {rank} exited {_secs(t)} after its last point (bound {EXIT_BOUND:.0f} s)"
            )
        elif rc != s["expect_rc"]:
            out.append(f"rank {rank} exited with {rc} (expected {s['expect_rc']})")
    if s["growth"] is not None and any(abs(g) > BYTES_JITTER for g in s["growth"]):
        out.append(f"device bytes grew from cycle 1 to {CYCLES}: {s['growth']} B")
    if s["banned"]:
        out.append(f"collectives from a banned context: {s['banned']}")
    if s["device_barrier_timeouts"]:
        out.append(f"{s['device_barrier_timeouts']} device barrier(s) timed out (a GPU traps)")
    if len(s["unmatched"]) > len(base["unmatched"] if base else []):
        out.append(f"collectives entered by one rank alone: {s['unmatched']}")
    if scenario == "d":
        alive = [sum((a or {}).values()) for a in s["buffers_alive"]]
        if max(alive) > 1:
            out.append(f"after 5 aborts {alive} buffers alive per rank (the current step's: 1)")
    if scenario in ("m", "n") and s.get("release_api"):
        if not all(s["refused"]):
            out.append(f"the explicit release {_ATTEMPT[scenario]} returned: {s['refused']}")
        freed = [f for f in s["freed_by_attempt"] if f is not None and abs(f) > BYTES_JITTER]
        if freed:
            out.append(f"the refused release freed {s['freed_by_attempt']} B")
        if scenario == "n" and any(s["attempt_collectives"]):
            out.append(f"off the main thread it entered collectives: {s['attempt_collectives']}")
    if scenario == "i" and base is not None:
        mine, theirs = (
            max(map(_num, s["dispatcher_bytes"])),
            max(map(_num, base["dispatcher_bytes"])),
        )
        if mine > theirs + BYTES_JITTER:
            out.append(f"the dispatcher holds {mine:,.0f} B after the offload (base {theirs:,.0f})")
    if base is not None:
        known = None not in base["leaked_bytes"]  # None: the base's rank failed first
        if known and sum(map(_num, s["leaked_bytes"])) > sum(map(_num, base["leaked_bytes"])):
            out.append(f"leaked {s['leaked_bytes']} B (base {base['leaked_bytes']})")
        if len(s["threads_left"]) > len(base["threads_left"]):
            out.append(f"threads left: {s['threads_left']} (base {base['threads_left']})")
    return out


_ATTEMPT = {"m": "with a live autograd graph", "n": "off the main thread"}


def _secs(t: float) -> str:
    return "past the deadline (killed)" if t == float("inf") else f"{t:.2f} s"


# -- the table -------------------------------------------------------------------------------


def cell_text(scenario: str, s: Dict[str, Any], base: Optional[Dict[str, Any]]) -> str:
    """One table cell: the verdict and the figures that decide it."""
    bad = violations(scenario, s, base)
    figures = []
    if s["teardown_s"] and any(t is not None for t in s["teardown_s"]):
        figures.append("teardown " + "/".join(_short(t) for t in s["teardown_s"]))
    if any(t is not None for t in s["exit_s"]):
        figures.append("exit " + "/".join(_short(t) for t in s["exit_s"]))
    if s["growth"] is not None:
        figures.append("growth " + "/".join(f"{g:+,}" for g in s["growth"]) + " B")
    if scenario == "i":
        figures.append("held " + "/".join(f"{_num(b):,.0f}" for b in s["dispatcher_bytes"]) + " B")
    if scenario == "h" and not s["release_api"]:
        figures.append("no release API")
    alive = [sum((a or {}).values()) for a in s["buffers_alive"]]
    figures.append(f"alive {'/'.join(map(str, alive))}")
    if s["banned"]:
        figures.append("banned: " + ", ".join(s["banned"]))
    if s["unmatched"]:
        figures.append(f"alone: {len(s['unmatched'])}")
    verdict = "FAIL" if bad else "pass"
    return f"**{verdict}** " + "; ".join(figures)


def _short(t) -> str:
    if t is None:
        return "-"
    return "killed" if t == float("inf") else f"{t:.2f}s"


def markdown(rows: Dict[str, Dict[str, Dict[str, Any]]], base_row: str) -> str:
    """The matrix as markdown: a table per backend, a row per tree, a column per scenario."""
    lines = []
    for backend in BACKENDS:
        scenarios = [s for s in SCENARIOS if applies(s, backend)]
        present = [t for t in rows if any(f"{s}/{backend}" in rows[t] for s in scenarios)]
        if not present:
            continue
        lines += ["", f"### {backend}", "", "| tree | " + " | ".join(scenarios) + " |"]
        lines.append("|---" * (len(scenarios) + 1) + "|")
        for tree in present:
            cells = []
            for s in scenarios:
                summ = rows[tree].get(f"{s}/{backend}")
                base = rows.get(base_row, {}).get(f"{s}/{backend}") if tree != base_row else None
                cells.append("n/a" if summ is None else cell_text(s, summ, base))
            lines.append(f"| {tree} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
