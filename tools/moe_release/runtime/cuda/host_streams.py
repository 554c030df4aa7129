# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Host stand-ins for CUDA streams and events, recording the order of stream operations.

On a host every kernel runs synchronously, so a stream is only a name: work "on" it runs at
once, an event is complete as soon as it is recorded and waiting for one returns. What a test
can still check is *which* stream each operation was issued on and in what order, so every
stand-in appends to :data:`HOST_STREAMS`'s ``ops`` log while ``HOST_STREAMS.recording`` is set:

* ``("enter", stream)`` when ``torch.cuda.stream(s)`` makes ``s`` current,
* ``("record", stream, event_id)`` / ``("wait", stream, event_id)`` for events,
* ``("wait_stream", stream, other)``,
* ``("record_stream", stream, storage_ptr, nbytes)`` for ``Tensor.record_stream(s)`` (the call
  that keeps a tensor's memory from being reused before ``s`` is done with it).

Streams appear in the log by name (``default``, ``comm``, ...).

**Ordering.** Each stream also keeps what CUDA would guarantee about the others: a sequence number
per operation issued on it and, per other stream, the last of that stream's operations it has waited
for (through ``wait_stream``, or an event recorded there and waited on here); the host keeps the
same through ``synchronize`` of an event, a stream or the device. The placement rules
(:mod:`moe_release.runtime.cuda.placement`) stamp each tensor written by an op with its stream and
sequence number and refuse a read on another stream (or, for ``item``/``tolist``, on the host) that
is not ordered after that write: the race CUDA would run without a word.
"""

import contextlib
import itertools
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch

_ALL_STREAMS: "weakref.WeakSet" = weakref.WeakSet()  # every HostStream made, for synchronize


class HostStreams:
    """The current-stream bookkeeping of ``torch.cuda`` (``current_stream``, ``stream(...)``)
    for :class:`HostStream`; one default stream per process, as on a device."""

    def __init__(self):
        self.ops: List[Tuple] = []
        self.recording = False
        self.default = HostStream(name="default", streams=self)
        self.current = self.default
        # What the host has waited for: stream -> its last operation known complete.
        self.host_known: Dict[HostStream, int] = {}

    def host_waits_for(self, stream: "HostStream") -> None:
        """The host blocks until everything issued on ``stream`` so far has run."""
        _merge(self.host_known, stream.snapshot())

    def device_synchronize(self) -> None:
        """``torch.cuda.synchronize()``: the host has waited for every stream."""
        for stream in list(_ALL_STREAMS):
            _merge(self.host_known, {stream: stream.seq})

    def ordered_after(self, writer: "HostStream", seq: int, reader=None) -> bool:
        """Whether ``reader`` (a stream; None for the host) is ordered after operation ``seq``
        of ``writer``."""
        if reader is writer:
            return True
        known = self.host_known if reader is None else reader.known
        return known.get(writer, 0) >= seq

    def log(self, *op) -> None:
        if self.recording:
            self.ops.append(op)

    def current_stream(self, device=None) -> "HostStream":
        return self.current

    @contextlib.contextmanager
    def stream(self, stream: Optional["HostStream"]):
        if stream is None:
            yield
            return
        if not isinstance(stream, HostStream):
            raise TypeError(f"stream() expects a stream, got {type(stream).__name__}")
        saved, self.current = self.current, stream
        self.log("enter", stream.name)
        try:
            yield
        finally:
            self.current = saved

    @contextlib.contextmanager
    def record(self):
        """Log stream operations while the block runs; yields the (fresh) log."""
        self.ops = []
        saved, self.recording = self.recording, True
        try:
            yield self.ops
        finally:
            self.recording = saved


class HostEvent:
    """Stand-in for ``torch.cuda.Event`` on the host: complete as soon as it is recorded."""

    _ids = itertools.count()

    def __init__(self, stream: Optional["HostStream"] = None, **kwargs):
        self.stream = stream
        self.id = next(self._ids)

    def record(self, stream: Optional["HostStream"] = None) -> None:
        self.stream = stream or HOST_STREAMS.current
        self.known = self.stream.snapshot()
        HOST_STREAMS.log("record", self.stream.name, self.id)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        from moe_release.runtime.cuda.placement_state import count_sync

        count_sync("event.synchronize")
        _merge(HOST_STREAMS.host_known, getattr(self, "known", {}))

    def wait(self, stream: Optional["HostStream"] = None) -> None:
        stream = stream or HOST_STREAMS.current
        _merge(stream.known, getattr(self, "known", {}))
        HOST_STREAMS.log("wait", stream.name, self.id)


class HostStream:
    """Stand-in for ``torch.cuda.Stream`` on the host: distinct streams compare unequal,
    ``record_event`` returns a (completed) :class:`HostEvent` and ``wait_stream`` records the
    dependency (``waited``) for tests to inspect."""

    _names = itertools.count()

    def __init__(self, device=None, priority: int = 0, name: Optional[str] = None, streams=None):
        self.name = name or f"side{next(self._names)}"
        self.priority = priority
        self.waited: list = []
        self._streams = streams
        self.seq = 0  # operations issued on this stream so far
        self.known: Dict[HostStream, int] = {}  # other stream -> last op waited for
        _ALL_STREAMS.add(self)

    def __hash__(self) -> int:
        return id(self)

    def tick(self) -> int:
        """Issue one operation on this stream; returns its sequence number."""
        self.seq += 1
        return self.seq

    def snapshot(self) -> Dict["HostStream", int]:
        """What an event recorded now would carry: this stream's position and what it knows."""
        out = dict(self.known)
        out[self] = self.seq
        return out

    @staticmethod
    def priority_range() -> Tuple[int, int]:
        """(lowest, highest) priority, as CUDA reports them (lower number = higher)."""
        return 0, -1

    def _log(self, *op) -> None:
        (self._streams or HOST_STREAMS).log(*op)

    def wait_stream(self, stream: "HostStream") -> None:
        if not isinstance(stream, HostStream):
            raise TypeError(f"wait_stream expects a stream, got {type(stream).__name__}")
        self.waited.append(stream)
        _merge(self.known, stream.snapshot())
        self._log("wait_stream", self.name, stream.name)

    def wait_event(self, event: HostEvent) -> None:
        _merge(self.known, getattr(event, "known", {}))
        self._log("wait", self.name, event.id)

    def record_event(self, event: Optional[HostEvent] = None) -> HostEvent:
        event = event or HostEvent(self)
        event.stream = self
        event.known = self.snapshot()
        self._log("record", self.name, event.id)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        from moe_release.runtime.cuda.placement_state import count_sync

        count_sync("stream.synchronize")
        _merge(HOST_STREAMS.host_known, self.snapshot())

    def __repr__(self) -> str:
        return f"HostStream({self.name})"


def _merge(known: Dict["HostStream", int], other: Dict["HostStream", int]) -> None:
    for stream, seq in other.items():
        if known.get(stream, 0) < seq:
            known[stream] = seq


HOST_STREAMS = HostStreams()

_REAL_RECORD_STREAM: Optional[Callable] = None


def _record_stream(tensor: torch.Tensor, stream) -> None:
    from moe_release.runtime.cuda.placement_state import check_record_stream

    check_record_stream(tensor)  # a host tensor raises, as torch's CUDA-only kernel does
    if isinstance(stream, HostStream):
        storage = tensor.untyped_storage()
        HOST_STREAMS.log("record_stream", stream.name, storage.data_ptr(), storage.nbytes())
        return
    _REAL_RECORD_STREAM(tensor, stream)


def install_record_stream_stand_in() -> bool:
    """``Tensor.record_stream(s)`` for a :class:`HostStream` ``s``: logged, nothing else (host
    memory is reused only after Python drops it); under the placement rules
    (:mod:`moe_release.runtime.cuda.placement`) a tensor that would be host memory on a GPU raises,
    as torch's CUDA-only kernel does. Other streams reach torch's own method.
    Idempotent; returns whether it installed anything."""
    global _REAL_RECORD_STREAM
    if _REAL_RECORD_STREAM is not None:
        return False
    _REAL_RECORD_STREAM = torch.Tensor.record_stream
    torch.Tensor.record_stream = _record_stream
    return True
