# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The memory report's rows for the flex dispatcher's communication buffers: their bytes and
what ``reset_fused_a2a_buffers(collective=True)`` returns, and the memory planner's prediction
(``scripts/moe_memory_plan.py``) beside what the run measured.

The buffer rows are a check of the planner: the CPU runtime's HybridEP and DeepEP emulations size
their buffers from their own reading of deep_ep's source (the ``[hybridep buffer]`` and ``[deepep
buffer]`` tables of ``moe_release.runtime.kernels.hybridep_emulation`` and
``moe_release.runtime.kernels.deepep_emulation``), not from the planner, and :func:`compare_terms`
matches the two readings term by term through the source lines each term cites, naming any that
differ.
"""

import os
import re
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from moe_release import backends
from moe_release.report.runs import ranks_per_node_of


def comm_buffer_lines(b: Optional[Dict[str, Any]], p: Optional[Dict[str, Any]]) -> List[str]:
    """Rows for the flex dispatcher's communication buffers and what releasing them returns."""
    if not b or not p:
        return []

    def cell(d: Dict[str, Any], key: str) -> str:
        v = d.get(key)
        return "n/a" if v is None else f"{v:,}"

    rows = [
        ("comm buffers (emulated bytes)", "emulated_bytes"),
        ("  returned by reset_fused_a2a_buffers", "allocator_bytes_released"),
    ]
    if p.get("device_bytes_released") is not None:
        rows.append(("  device memory outside allocator", "device_bytes_released"))
    return [f"{label:34}{cell(b, key):>16}{cell(p, key):>16}{'':>14}" for label, key in rows]


def _field(term: Any, name: str) -> Any:
    """A term's field, whether the term is an object (the planner's ``Term``, the emulations'
    ``BufferTerm``) or a dict (as a run records them)."""
    return term[name] if isinstance(term, dict) else getattr(term, name)


# Short names a source cites for a file (the HybridEP emulation's multi-node table cites
# ``doca.cu`` for ``internode_doca.cu``, to stay within its columns).
FILE_ALIASES = {"doca.cu": "internode_doca.cu"}
# Planner terms no emulation allocates: sized outside the kernel's own source (the HybridEP
# queue pairs' rings live in DOCA, priced from NCCL's doca_gpunetio code); the term check
# names them apart instead of counting them as a mismatch.
NOT_EMULATED = ("DOCA queue pairs (approximate)",)


def cited_lines(source: str) -> Set[Tuple[str, int]]:
    """The (file name, line) pairs a term's source cites: ``buffer/intranode.cu:255,260`` or
    ``configs.cuh:5, deep_ep.cpp:187``; files are compared by name, not by directory."""
    out: Set[Tuple[str, int]] = set()
    for path, spec in re.findall(r"([\w./-]+\.\w+):([\d,-]+)", source):
        name = os.path.basename(path)
        name = FILE_ALIASES.get(name, name)
        for part in spec.strip(",-").split(","):
            if part:
                lo, _, hi = part.partition("-")
                out.update((name, n) for n in range(int(lo), int(hi or lo) + 1))
    return out


def compare_terms(planner_terms: Sequence[Any], emulated_terms: Sequence[Any]) -> List[str]:
    """The planner's buffer terms against the emulation's, matched through the source lines
    they cite: terms citing a common line of the same file are one allocation read twice (a
    connected group on either side, as when one side splits what the other sums); each group
    whose bytes differ is one line naming its terms on both sides, a term the other side has no
    line for included. Empty: the two readings agree byte for byte."""
    terms = [("planner", t) for t in planner_terms] + [("emulation", t) for t in emulated_terms]
    lines = [cited_lines(_field(t, "source")) for _, t in terms]
    parent = list(range(len(terms)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in range(len(terms)):
        for j in range(i + 1, len(terms)):
            if lines[i] & lines[j]:
                parent[root(i)] = root(j)
    groups: Dict[int, List[int]] = {}
    for i in range(len(terms)):
        groups.setdefault(root(i), []).append(i)
    out = []
    for members in groups.values():
        side = {"planner": [], "emulation": []}
        for i in members:
            side[terms[i][0]].append(terms[i][1])
        planned = sum(_field(t, "nbytes") for t in side["planner"])
        emulated = sum(_field(t, "nbytes") for t in side["emulation"])
        if planned != emulated:

            def said(ts: List[Any], nbytes: int) -> str:
                named = " + ".join(repr(_field(t, "name")) for t in ts)
                return f"{named} {nbytes:,} B" if ts else "no term"

            cited = "; ".join(_field(t, "source") for t in side["emulation"] or side["planner"])
            out.append(
                f"planner: {said(side['planner'], planned)}; emulation: "
                f"{said(side['emulation'], emulated)} ({cited})"
            )
    return out


def _as_dicts(terms: Sequence[Any]) -> List[Dict[str, Any]]:
    return [{k: _field(t, k) for k in ("name", "nbytes", "source")} for t in terms]


def buffer_prediction(
    cfg: Dict[str, Any], world: int, rank: Optional[int] = None
) -> Optional[Dict[str, Any]]:
    """The memory planner's prediction for the report's configuration (flex with HybridEP or
    DeepEP): the buffer's bytes and terms, and for HybridEP one call's outputs, with balanced
    routing. ``rank``: the rank priced (HybridEP's local rank 0 also holds the flags its peers
    map); None prices a rank other than local rank 0."""
    backend = cfg["backend"]
    if cfg.get("dispatcher", "flex") != "flex" or backend not in backends.ACCOUNTED:
        return None
    from moe_release.plan.pricing import load_planner

    planner = load_planner()
    mc = planner.MoEMemoryConfig(
        hidden_size=cfg["hidden"], num_moe_experts=cfg["experts"], moe_router_topk=cfg["topk"],
        num_layers=cfg.get("layers", 1), expert_model_parallel_size=world,
        tokens_per_rank=cfg["tokens"], moe_token_dispatcher_type="flex",
        moe_flex_dispatcher_backend=backend, bf16=False, local_rank=rank,
        ranks_per_node=ranks_per_node_of(cfg) or 8,
    )  # fmt: skip
    terms = [t for t in planner.buffer_terms(mc) if not t.in_flight]  # buffers, not a call's
    emulated = [t for t in terms if t.name not in NOT_EMULATED]
    out = {
        "backend": backend,
        "buffer_bytes": planner.total(emulated, planner.OUTSIDE),  # what an emulation allocates
        "terms": _as_dicts(terms),
    }
    if backend == "hybridep":
        # The report's model runs in fp32: 4-byte tokens where HybridEP moves 16-bit ones.
        out["per_call"] = planner.per_call_bytes(mc, token_bytes=4)
    return out


def term_check_lines(planner_terms: Sequence[Any], emulated_terms: Sequence[Any]) -> List[str]:
    """The buffer's term-by-term check: one line when the planner and the emulation's own
    reading of deep_ep's source agree, else one line per differing allocation."""
    if not emulated_terms:
        return ["  buffer terms: n/a (the run recorded none)"]
    apart = [t for t in planner_terms if _field(t, "name") in NOT_EMULATED]
    planner_terms = [t for t in planner_terms if _field(t, "name") not in NOT_EMULATED]
    problems = compare_terms(planner_terms, emulated_terms)
    lines = [f"  buffer terms MISMATCH: {p}" for p in problems]
    if not problems:
        lines = [f"  buffer terms: planner = emulation's reading of deep_ep, {len(emulated_terms)}"
                 " allocations"]  # fmt: skip
    return lines + [f"  planner only (not emulated): {_field(t, 'name')} {_field(t, 'nbytes'):,} B"
                    for t in apart]  # fmt: skip


def hybridep_accounting_lines(
    cfg: Dict[str, Any], patched: Dict[str, Any], world: int, rank: Optional[int] = None
) -> List[str]:
    """Predicted (balanced routing) beside measured for ``rank``'s run: the buffer and, for
    HybridEP, one call's outputs; then the buffer's terms, the planner's against the emulation's
    own."""
    pred = buffer_prediction(cfg, world, rank)
    measured = patched.get("per_call_bytes") or {}
    buffers = patched.get("comm_buffers") or {}
    if pred is None:
        return []
    title = "HybridEP accounting" if pred["backend"] == "hybridep" else "DeepEP accounting"
    lines = [f"{title:34}{'predicted':>16}{'measured':>16}{'meas/pred':>14}"]
    rows = [("  buffer", pred["buffer_bytes"], buffers.get("emulated_bytes"))]
    if buffers.get("device_bytes_released") is not None:
        rows.append(("  buffer (device, outside alloc.)", pred["buffer_bytes"],
                     buffers["device_bytes_released"]))  # fmt: skip
    calls = ("dispatch_tokens", "dispatch_probs", "combine_output") if "per_call" in pred else ()
    for key in calls:
        rows.append((f"  {key} (max call)", pred["per_call"][key], measured.get(key)))
    for label, x, y in rows:
        y_text = "n/a" if y is None else f"{y:,}"
        r = f"{y / x:.3f}" if y is not None and x else ""
        if r == "1.000" and y != x:  # a difference the ratio rounds away: say it in bytes
            r = f"{y - x:+,} B"
        lines.append(f"{label:34}{x:>16,}{y_text:>16}{r:>14}")
    return lines + term_check_lines(pred["terms"], buffers.get("terms") or [])
