# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The host stand-ins for CUDA streams and device-to-host copies (cpu_runtime.compat) behave as
the CUDA calls they replace do, where megatron-core's all-to-all dispatcher can tell."""

import numpy as np
import pytest
import torch

from cpu_runtime.compat import HostEvent, HostStream, HostStreams, host_move_tensor_to_cpu


def test_stream_context_switches_and_restores():
    streams = HostStreams()
    side = HostStream()
    assert streams.current_stream() is streams.default
    assert streams.current_stream() != side
    with streams.stream(side):
        assert streams.current_stream() is side
        with streams.stream(None):  # torch.cuda.stream(None) is a no-op
            assert streams.current_stream() is side
    assert streams.current_stream() is streams.default
    with pytest.raises(RuntimeError), streams.stream(side):
        raise RuntimeError("inside")
    assert streams.current_stream() is streams.default


def test_stream_rejects_what_cuda_rejects():
    streams = HostStreams()
    with pytest.raises(TypeError), streams.stream(object()):
        pass
    with pytest.raises(TypeError):
        HostStream().wait_stream(object())


def test_wait_and_events():
    streams = HostStreams()
    side = HostStream()
    side.wait_stream(streams.current_stream())
    assert side.waited == [streams.default]
    event = side.record_event()
    assert isinstance(event, HostEvent) and event.stream is side and event.query()
    event.synchronize()  # host work is synchronous: returns at once
    assert side.record_event(event) is event


@pytest.mark.parametrize("as_numpy", [False, True])
def test_dtoh_copy_is_a_copy(as_numpy):
    src = torch.tensor([3, 1, 2])
    out = host_move_tensor_to_cpu(src, as_numpy=as_numpy, record_stream=True)
    assert isinstance(out, np.ndarray if as_numpy else torch.Tensor)
    assert out.tolist() == [3, 1, 2]
    src[0] = 9  # a device-to-host copy does not alias its source
    assert out.tolist() == [3, 1, 2]
    assert host_move_tensor_to_cpu(None) is None
    arr = np.array([1, 2])
    assert host_move_tensor_to_cpu(arr, as_numpy=True) is arr
