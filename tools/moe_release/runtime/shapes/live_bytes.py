# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The bytes a run holds: every storage alive, by the op and the source line that made it, and
the comparison of two runs' allocation traces."""

import contextlib
import sys
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from moe_release import settings

# ---------------------------------------------------------------------------------------------
# Bytes


class LiveBytes:
    """Live bytes of the storages ops returned: weak references to each storage and a running
    total of the live ones' ``nbytes`` (a storage resized to 0 counts 0): a storage's bytes
    are added when an op first returns or reads it, re-read whenever an op touches it again or
    it is resized (:meth:`watching_resizes`), and subtracted when it dies. ``trace`` holds
    ``(op, live bytes)`` after each op while ``recording``. With ``MOE_RELEASE_LIVE_BYTES_CHECK``
    set, every :meth:`live` is checked against the sum over all storages (:meth:`exact`)."""

    def __init__(self) -> None:
        self._refs: Dict[int, weakref.ref] = {}
        self._sizes: Dict[int, int] = {}
        self._total = 0
        self.check = settings.live_bytes_check()
        self.trace: List[Tuple[str, int]] = []
        self.recording = False
        self.peak = 0
        # With ``sites`` a list, each trace entry's innermost megatron-core or emulation line.
        self.sites: Optional[List[str]] = None
        # The op that returned each tracked storage first (``made_by``), and with ``made_at`` a
        # dict, its innermost megatron-core or emulation line (for the retained bytes' origins).
        self.made_by: Dict[int, str] = {}
        self.made_at: Optional[Dict[int, str]] = None
        # With ``made_in`` a dict (:meth:`follow_peak`): per storage the call it was made in
        # (``call``, set by the caller) and its megatron-core function; ``peak_storages`` then
        # holds, after :meth:`peak_origins`, what was alive at the recording's peak.
        self.call = 0
        self.made_in: Optional[Dict[int, Tuple[int, str]]] = None
        self.peak_storages: Optional[Dict[int, Tuple[int, Optional[Tuple[int, str]]]]] = None
        self.peak_site = ""
        self.context: Optional[Callable[[], str]] = None  # added to ``peak_site``
        self._peak_pending = False

    def _gone(self, r, key: int) -> None:
        if self._refs.get(key) is r:
            if self._peak_pending:
                self._take_peak()
            del self._refs[key]
            self._total -= self._sizes.pop(key)
            self.made_by.pop(key, None)
            if self.made_at is not None:
                self.made_at.pop(key, None)
            if self.made_in is not None:
                self.made_in.pop(key, None)

    # -- what is alive at the peak --------------------------------------------------------
    def follow_peak(self) -> None:
        """From now on note where each new storage is made and keep, for every new peak, the
        storages alive there: taken when the first byte is freed after it (before anything
        else can be allocated, as allocations come from ops and each op raises the peak)."""
        self.made_in = {}
        self.reset_peak()

    def reset_peak(self) -> None:
        self.peak = 0
        self.peak_storages = None
        self.peak_site = ""
        self._peak_pending = False

    def _take_peak(self) -> None:
        made_in = self.made_in or {}
        self.peak_storages = {k: (n, made_in.get(k)) for k, n in self._sizes.items()}
        self._peak_pending = False

    def peak_origins(self) -> Dict[str, int]:
        """The bytes alive at the peak by ``"this call" | "an earlier call"`` and the
        megatron-core function that made them
        (:func:`moe_release.runtime.measure.peak_tensors.site_of`);
        they sum to the peak."""
        if self._peak_pending:
            self._take_peak()
        out: Dict[str, int] = {}
        for n, made in (self.peak_storages or {}).values():
            if made is None:
                label = "before the peak was followed (the parameters)"
            else:
                when = "this call" if made[0] == self.call else "an earlier call"
                label = f"{when} | {made[1]}"
            out[label] = out.get(label, 0) + n
        return out

    def track(self, t: torch.Tensor, op: str = "?") -> None:
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        self.track_storage(s, op)

    def track_storage(self, s, op: str = "?") -> None:
        """Count storage ``s`` (from now on), or re-read its size if counted."""
        key = id(s)
        ref = self._refs.get(key)
        if ref is not None:
            if ref() is s:
                n = s.nbytes()
                if n < self._sizes[key] and self._peak_pending:
                    self._take_peak()
                self._total += n - self._sizes[key]
                self._sizes[key] = n
                return
            self._total -= self._sizes.pop(key)  # dead, its callback not run yet

        self_ref = weakref.ref(self)

        def gone(r, key=key, self_ref=self_ref):
            counter = self_ref()
            if counter is not None:
                counter._gone(r, key)

        self._refs[key] = weakref.ref(s, gone)
        self._sizes[key] = n = s.nbytes()
        self._total += n
        self.made_by[key] = op
        if self.made_at is not None:
            self.made_at[key] = _site()
        if self.made_in is not None:
            from moe_release.runtime.measure.peak_tensors import site_of

            self.made_in[key] = (self.call, site_of(sys._getframe(1)))

    @contextlib.contextmanager
    def watching_resizes(self):
        """Re-read a counted storage's size after ``UntypedStorage.resize_`` (megatron frees
        memory so, e.g. ``untyped_storage().resize_(0)``), which reaches no dispatch mode."""
        original = torch.UntypedStorage.resize_
        self_ref = weakref.ref(self)

        def resize_(storage, size):
            out = original(storage, size)
            counter = self_ref()
            if counter is not None and id(storage) in counter._refs:
                counter.track_storage(storage)
            return out

        torch.UntypedStorage.resize_ = resize_
        try:
            yield self
        finally:
            torch.UntypedStorage.resize_ = original

    def exact(self) -> int:
        """The sum of every live counted storage's ``nbytes``, read now."""
        total = 0
        for ref in list(self._refs.values()):
            s = ref()
            if s is not None:
                total += s.nbytes()
        return total

    def live(self) -> int:
        if self.check:
            exact = self.exact()
            if exact != self._total:
                raise AssertionError(f"live bytes: running total {self._total:,}, sum {exact:,}")
        return self._total

    def storages(self) -> List[Any]:
        return [s for s in (r() for r in list(self._refs.values())) if s is not None]

    def keyed(self) -> Dict[int, Any]:
        """The live storages by key (``id`` of the storage object, as ``made_by`` keys them)."""
        out = {}
        for key, ref in list(self._refs.items()):
            s = ref()
            if s is not None:
                out[key] = s
        return out

    def note(self, func, args, kwargs, out, inputs: Optional[List[torch.Tensor]] = None) -> None:
        """Count the storages ``func`` read (``inputs``: its argument tensors, if known) and
        returned; while ``recording``, the live bytes after it."""
        outs = _tensors(out)
        op = str(func)
        for t in (_tensors((args, kwargs)) if inputs is None else inputs) + outs:
            self.track(t, op)
        if self.recording and outs:  # an op returning no tensor allocates nothing
            live = self.live()
            if live > self.peak and self.made_in is not None:
                from moe_release.runtime.measure.peak_tensors import site_of

                self._peak_pending = True
                phase = "backward" if torch._C._current_autograd_node() is not None else "forward"
                extra = f", {self.context()}" if self.context else ""
                self.peak_site = f"{op} at {site_of(sys._getframe(1))} ({phase}{extra})"
            self.peak = max(self.peak, live)
            self.trace.append((str(func), live))
            if self.sites is not None:
                self.sites.append(_site())


def _site() -> str:
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        ours = "megatron/core" in name or "moe_release/runtime" in name
        if ours and "production_shape" not in name:
            return f"{name.rsplit('/', 2)[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def bytes_of(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors``."""
    seen: Dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[id(s)] = s.nbytes()
    return sum(seen.values())


def _tensors(tree) -> List[torch.Tensor]:
    """The tensors in an op's arguments or outputs (tuples, lists and dicts of them), in
    ``tree_flatten``'s order: a walk of those three containers only, which is all aten's
    schemas hold, for a fraction of the general pytree's cost."""
    found: List[torch.Tensor] = []
    _collect(tree, found)
    return found


def _collect(x, found: List[torch.Tensor]) -> None:
    if isinstance(x, torch.Tensor):
        found.append(x)
    elif isinstance(x, (tuple, list)):
        for v in x:
            _collect(v, found)
    elif isinstance(x, dict):
        for v in x.values():
            _collect(v, found)


def compare_traces(real: List[Tuple[str, int]], fake: List[Tuple[str, int]]) -> Optional[str]:
    """None if the two ``(op, live bytes)`` sequences agree, else where they first differ."""
    for i, (r, f) in enumerate(zip(real, fake)):
        if r != f:
            lo = max(0, i - 3)
            return (
                f"op {i}: real {r} vs production-shape {f} (before: {real[lo:i]}; "
                f"production-shape before: {fake[lo:i]})"
            )
    if len(real) != len(fake):
        return f"real ran {len(real)} ops, production-shape {len(fake)}"
    return None
