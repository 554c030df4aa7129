# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The host stand-ins for CUDA streams and events the overlap schedule runs on
(moe_release.runtime.cuda.host_streams, moe_release.runtime.megatron.a2a_overlap): sequential,
and logged in order."""

import pytest
import torch

from moe_release.runtime.cuda.host_streams import (
    HOST_STREAMS,
    HostEvent,
    HostStream,
    install_record_stream_stand_in,
)


def test_operations_are_logged_in_order_while_recording():
    comm = HostStream(name="comm")
    event = HostEvent()
    comm.wait_stream(HOST_STREAMS.default)  # not recording yet: not logged
    with HOST_STREAMS.record() as ops:
        event.record()  # on the current (default) stream
        with HOST_STREAMS.stream(comm):
            event.wait(HOST_STREAMS.current_stream())
            comm.record_event(event)
        event.wait()
    assert ops == [
        ("record", "default", event.id),
        ("enter", "comm"),
        ("wait", "comm", event.id),
        ("record", "comm", event.id),
        ("wait", "default", event.id),
    ]
    assert event.stream is comm and event.query()
    assert not HOST_STREAMS.recording and HOST_STREAMS.current_stream() is HOST_STREAMS.default


def test_stream_constructor_takes_cuda_arguments():
    low, high = HostStream.priority_range()
    s = HostStream(device="cuda", priority=high)
    assert s.priority == high and s.name.startswith("side") and s != HostStream()
    HostEvent(enable_timing=False).synchronize()


def test_record_stream_is_logged_for_host_streams_only():
    install_record_stream_stand_in()
    assert not install_record_stream_stand_in()  # idempotent
    t = torch.zeros(8)
    comm = HostStream(name="comm")
    with HOST_STREAMS.record() as ops:
        t.record_stream(comm)
    assert ops == [("record_stream", "comm", t.untyped_storage().data_ptr(), 32)]
    # Anything else reaches torch's own method, which refuses a non-stream as it always did.
    with pytest.raises(RuntimeError, match="unknown parameter type"):
        t.record_stream(object())


def rank_shim_scope():
    """Rank side: the overlap shim swaps only the stream calls (and the schedules' "cuda"
    zeros) of the overlap modules, and nothing else of torch."""
    import importlib

    from moe_release.runtime.megatron import a2a_overlap

    changed = a2a_overlap.install_overlap_cpu_shim()
    assert a2a_overlap.install_overlap_cpu_shim() == []  # idempotent
    views = {}
    for name in a2a_overlap.STREAM_MODULES + a2a_overlap.DEVICE_MODULES:
        view = importlib.import_module(name).torch
        views[name] = (
            sorted(view._overrides),
            sorted(view.cuda._overrides),
            view.cuda.is_available is torch.cuda.is_available,
            view.matmul is torch.matmul,
        )
    schedules = importlib.import_module("megatron.core.pipeline_parallel.schedules")
    zeros = schedules.torch.zeros([], dtype=torch.int, device="cuda")
    from moe_release.runtime.cuda import placement

    return {
        "changed": changed,
        "views": views,
        # Host memory, placed as a device tensor by the placement rules.
        "zeros_device": str(zeros.untyped_storage().device),
        "zeros_placement": placement.placement_of(zeros),
    }


def test_overlap_shim_replaces_only_stream_calls(dist_job, patched_tree):
    from moe_release.runtime.megatron import a2a_overlap

    res = dist_job(f"{__name__}:rank_shim_scope", 1, patched_tree)[0]
    assert res["changed"] == list(a2a_overlap.STREAM_MODULES + a2a_overlap.DEVICE_MODULES)
    cuda_calls = ["Event", "Stream", "current_stream", "stream"]
    for name, (overrides, cuda, untouched, matmul) in res["views"].items():
        extra = ["zeros"] if name in a2a_overlap.DEVICE_MODULES else []
        assert overrides == sorted(["cuda"] + extra), name
        assert cuda == cuda_calls and untouched and matmul, name
    assert res["zeros_device"] == "cpu" and res["zeros_placement"] == "device"
