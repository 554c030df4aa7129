# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Which tensors are alive at a step's allocator peak, each named by the op that made it.

The counting allocator (:mod:`moe_release.runtime.measure.cpu_memory`) records every allocation and
free with its block; replaying that log up to the peak gives the blocks alive there, and the bytes
they sum to are the peak above the recording's start, exactly. An :class:`OpLog` (a
``TorchDispatchMode``, so it sees the autograd engine's backward ops too) notes, per op, the data
pointers of its outputs, the op, their shape and dtype, the innermost megatron-core line that ran it
and the phase the caller set (the schedule node running): the first op to finish after a block's
allocation with that block as an output made it. Blocks no op returned (gloo's buffers, allocations
inside C++ kernels) are "not an op output".

Two runs compared at one program point (:func:`explain`) can name one allocation differently:
gloo's threads free buffers asynchronously, so an address freed in one run may be reused there
by a block no op returned. Such rows come in pairs of equal size and opposite sign and cancel
in the sum; the rows that differ for a reason are the same in every run and rank.
"""

import sys
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_release.runtime.measure import cpu_memory

NOT_AN_OP_OUTPUT = "not an op output"
_PACKAGE = "megatron/core/"


def _site() -> str:
    """The innermost megatron-core frame on the stack, ``path:function`` below megatron/core
    (a function, not a line: the patches move lines, and the two trees are compared)."""
    return site_of(sys._getframe(2))


def site_of(frame) -> str:
    """:func:`_site` from ``frame`` outwards."""
    while frame is not None:
        code = frame.f_code
        cut = code.co_filename.find(_PACKAGE)
        if cut >= 0:
            return f"{code.co_filename[cut:]}:{code.co_qualname}"
        frame = frame.f_back
    return "outside megatron-core"


class OpLog(TorchDispatchMode):
    """Notes each op's output storages with the allocator's event count when the op returned.

    ``phase`` is set by the caller (for example the schedule node running); it is recorded
    with each op."""

    def __init__(self):
        super().__init__()
        self.phase = "outside the schedule's layer nodes"
        self.entries: List[Tuple[int, int, Tuple[Any, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        event = cpu_memory.events_recorded()
        outs = out if isinstance(out, (list, tuple)) else (out,)
        site = None
        for t in outs:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            try:
                ptr = t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):
                continue
            if ptr:
                site = site or _site()
                desc = (self.phase, str(func.overloadpacket), tuple(t.shape), str(t.dtype), site)
                self.entries.append((event, ptr, desc))
        return out


def live_at(event: int, ptrs, deltas) -> Tuple[Dict[int, Tuple[int, int]], int]:
    """At an event: ``{ptr: (event index of its allocation, bytes)}`` of the blocks allocated
    since recording started and alive there, and the bytes of blocks allocated before the
    recording and freed by then. The live blocks' bytes minus that are the live bytes' height
    above the recording's start."""
    live: Dict[int, Tuple[int, int]] = {}
    freed_older = 0
    for i, (ptr, delta) in enumerate(zip(ptrs[: event + 1].tolist(), deltas[: event + 1].tolist())):
        if delta > 0:
            live[ptr] = (i, delta)
        elif live.pop(ptr, None) is None:
            freed_older -= delta
    return live, freed_older


def attribute(live: Dict[int, Tuple[int, int]], log: OpLog) -> List[Dict[str, Any]]:
    """The live blocks grouped by what made them: ``{phase, op, shape, dtype, site, count,
    bytes}``, largest first. A block goes to the first logged op returning it after its
    allocation."""
    by_ptr: Dict[int, List[Tuple[int, Tuple[Any, ...]]]] = {}
    for event, ptr, desc in log.entries:
        if ptr in live:
            by_ptr.setdefault(ptr, []).append((event, desc))
    count: Counter = Counter()
    size: Counter = Counter()
    for ptr, (allocated, nbytes) in live.items():
        desc = next(
            (d for e, d in by_ptr.get(ptr, ()) if e > allocated),
            (NOT_AN_OP_OUTPUT, "", (), "", ""),
        )
        count[desc] += 1
        size[desc] += nbytes
    keys = ("phase", "op", "shape", "dtype", "site")
    rows = [dict(zip(keys, d), count=count[d], bytes=size[d]) for d in size]
    return sorted(rows, key=lambda r: -r["bytes"])


def phase_maxima(values, log: OpLog) -> Dict[str, Tuple[int, int]]:
    """Per phase, the highest event while it ran: ``{phase: (live bytes, event index)}``. An
    event belongs to the phase of the first logged op returning after it."""
    import numpy as np

    out: Dict[str, Tuple[int, int]] = {}
    # Runs of events by the phase of the op returning after them: [start, end) per logged op.
    bounds = [0] + [e for e, _, _ in log.entries] + [len(values)]
    phases = [d[0] for _, _, d in log.entries] + [log.phase]
    for (lo, hi), phase in zip(zip(bounds, bounds[1:]), phases):
        hi = min(hi, len(values))
        if hi <= lo:
            continue
        i = lo + int(np.argmax(values[lo:hi]))
        if phase not in out or values[i] > out[phase][0]:
            out[phase] = (int(values[i]), i)
    return out


def moment_of(event: int, log: OpLog) -> Optional[List[Any]]:
    """A point of the program, the same in two runs of one schedule: ``[phase, k]``, the
    ``k``-th logged op of ``phase`` (the op returning first after ``event``)."""
    import bisect

    events = [e for e, _, _ in log.entries]
    m = bisect.bisect_right(events, event)
    if m == len(events):
        return None
    phase = log.entries[m][2][0]
    return [phase, sum(1 for _, _, d in log.entries[:m] if d[0] == phase)]


def event_of(moment: List[Any], log: OpLog, values) -> Optional[int]:
    """This run's highest event while the op at a :func:`moment_of` ran (from the previous op's
    return to its own): not an offset into it, as the two runs may free different blocks
    there (None if the phase ran fewer ops)."""
    import numpy as np

    phase, k = moment[:2]
    seen = 0
    for m, (e, _, d) in enumerate(log.entries):
        if d[0] != phase:
            continue
        if seen == k:
            # Entries of one op share its event count: the op's events start after the
            # previous op's.
            first = m
            while first > 0 and log.entries[first - 1][0] == e:
                first -= 1
            begin = log.entries[first - 1][0] if first else 0
            end = min(e, len(values))
            if end <= begin:
                return None
            return begin + int(np.argmax(values[begin:end]))
        seen += 1
    return None


def _at(event: int, value: int, start: int, ptrs, deltas, log: OpLog) -> Dict[str, Any]:
    live, freed_older = live_at(event, ptrs, deltas)
    return {"bytes": value - start, "freed_older": freed_older, "rows": attribute(live, log)}


def summarize(
    log: OpLog, values, ptrs, deltas, start: int, top: int = 6, moments=()
) -> Dict[str, Any]:
    """The step's peak and, at the highest moment of each of the ``top`` highest phases, the
    live blocks by what made them, with that moment (:func:`moment_of`); and the live blocks at
    each of ``moments`` (another run's: the same program point, to compare two trees there,
    :func:`explain`)."""
    maxima = phase_maxima(values, log)
    ranked = sorted(maxima, key=lambda p: -maxima[p][0])[:top]
    at = {}
    for phase in ranked:
        value, event = maxima[phase]
        at[phase] = dict(_at(event, value, start, ptrs, deltas, log), moment=moment_of(event, log))
    aligned = {}
    for moment in moments:
        event = event_of(moment, log, values)
        if event is not None:
            aligned[moment[0]] = _at(event, int(values[event]), start, ptrs, deltas, log)
    return {
        "peak_bytes": maxima[ranked[0]][0] - start if ranked else 0,
        "peak_phase": ranked[0] if ranked else None,
        "phases": {p: v - start for p, (v, _) in maxima.items()},
        "at": at,
        "at_moments": aligned,
    }


def peak_moments(summary: Dict[str, Any]) -> List[List[Any]]:
    """The moments of a :func:`summarize`'s phase maxima, to pass to another run."""
    return [v["moment"] for v in summary["at"].values() if v.get("moment")]


def explain(base: Dict[str, Any], patched: Dict[str, Any], rows: int = 12) -> List[str]:
    """Lines comparing two trees' :func:`summarize` of one rank: where each peak fell, and at
    the base's peak (the patched run given its moments: the same program point) and, where it
    fell elsewhere, at the patched tree's peak phase (each tree's highest moment of it), what
    was alive in one tree and not in the other, by the op that made it (the rows sum to the
    difference there)."""
    lines = []
    for name, s in (("base", base), ("patched", patched)):
        lines.append(f"{name} peak {s['peak_bytes']:,} B during: {s['peak_phase']}")
    for phase in dict.fromkeys((base["peak_phase"], patched["peak_phase"])):
        b = base["at"].get(phase)
        p = patched.get("at_moments", {}).get(phase)
        where = f"at the base's peak ({phase}, the same op in both)"
        if p is None or phase != base["peak_phase"]:
            p = patched["at"].get(phase)
            where = f"at the highest moment of {phase} in each"
        if b is None or p is None:
            got = {k: v["phases"].get(phase) for k, v in (("base", base), ("patched", patched))}
            lines.append(f"{where}: {got} (not attributed)")
            continue
        diff = difference(b["rows"], p["rows"])
        older = b["freed_older"] - p["freed_older"]
        lines.append(
            f"{where}: base {b['bytes']:,} B, patched {p['bytes']:,} B, difference"
            f" {b['bytes'] - p['bytes']:,} B = {sum(r['difference'] for r in diff):,} B alive in"
            f" one and not the other, less {older:,} B of older blocks freed"
        )
        for r in diff[:rows]:
            lines.append(
                f"  {r['difference']:>+12,}  {r['phase']} | {r['op']} {r['shape']} "
                f"{r['dtype'].replace('torch.', '')} | {r['site']}"
            )
        if len(diff) > rows:
            rest = sum(r["difference"] for r in diff[rows:])
            lines.append(f"  {rest:>+12,}  ({len(diff) - rows} more rows)")
    return lines


def difference(base: List[Dict[str, Any]], patched: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Rows alive at one peak and not (or less) at the other, by what made them: bytes in the
    base, in the patched tree, and base minus patched (they sum to the peaks' difference)."""
    keys = ("phase", "op", "shape", "dtype", "site")
    table: Dict[Tuple[Any, ...], List[int]] = {}
    for i, rows in enumerate((base, patched)):
        for r in rows:
            # (A shape read back from JSON is a list.)
            key = tuple(tuple(r[k]) if isinstance(r[k], list) else r[k] for k in keys)
            table.setdefault(key, [0, 0])[i] += r["bytes"]
    out = [
        dict(zip(keys, k), base=b, patched=p, difference=b - p)
        for k, (b, p) in table.items()
        if b != p
    ]
    return sorted(out, key=lambda r: -abs(r["difference"]))
