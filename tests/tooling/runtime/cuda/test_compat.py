# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The host stand-ins for CUDA streams and device-to-host copies (runtime.cuda.compat) behave as
the CUDA calls they replace do, where megatron-core's all-to-all dispatcher can tell."""

import numpy as np
import pytest
import torch

from moe_release.runtime.cuda.compat import (
    HostEvent,
    HostStream,
    HostStreams,
    dtoh_stream_torch,
    host_move_tensor_to_cpu,
    stream_stand_in_of,
)


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


def test_stream_proxy_overrides_only_the_stream_calls():
    view = dtoh_stream_torch()
    assert stream_stand_in_of(view) and not stream_stand_in_of(torch)
    assert isinstance(view.cuda.Stream(), HostStream)
    assert view.cuda.is_available is torch.cuda.is_available  # everything else is torch's
    assert view.zeros is torch.zeros
    wider = type(view)(torch, cuda=view.cuda, zeros=torch.ones)
    assert not stream_stand_in_of(wider)


def rank_uneven_collectives():
    """Rank side: uneven all_gather/reduce_scatter against what NCCL would return."""
    import torch.distributed as dist

    from moe_release.runtime.cuda.compat import uneven_all_gather, uneven_reduce_scatter

    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [r + 1 for r in range(world)]  # rank r holds r + 1 rows

    def rows(r, n, scale=1.0):
        return torch.arange(n * 3, dtype=torch.float32).view(n, 3) * scale + 100 * r

    parts = [torch.empty(n, 3) for n in sizes]
    uneven_all_gather(parts, rows(rank, sizes[rank]))
    gathered = all(torch.equal(p, rows(r, n)) for r, (p, n) in enumerate(zip(parts, sizes)))
    # Every rank contributes rows(src, sizes[dst], src + 1) for each destination dst.
    inputs = [rows(rank, n, rank + 1) for n in sizes]
    out = torch.empty(sizes[rank], 3)
    uneven_reduce_scatter(out, inputs)
    want = sum(rows(src, sizes[rank], src + 1) for src in range(world))
    even = torch.empty(2, 3)
    uneven_all_gather([even, torch.empty(2, 3)], torch.full((2, 3), float(rank)))
    return {"gathered": gathered, "reduced": torch.equal(out, want), "even": even.tolist()}


def test_uneven_collectives_match_the_nccl_semantics():
    from moe_release.runtime.ranks.launcher import run_distributed

    results = run_distributed(
        "tests.tooling.runtime.cuda.test_compat:rank_uneven_collectives", 2, "/nonexistent",
        emulate_deep_ep=False, timeout=120,
    )  # fmt: skip
    for res in results:
        assert res["gathered"] and res["reduced"]
        assert res["even"] == [[0.0] * 3] * 2
