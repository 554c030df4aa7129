# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The CPU runtime's placement rules refuse what CUDA refuses (moe_release.runtime.cuda.placement).

Each case is a program that is wrong on a GPU and must fail here too, or a program CUDA runs
that must keep running (so the rules cannot be satisfied by refusing everything).
"""

import pytest
import torch

from moe_release.runtime.cuda import placement as pl
from moe_release.runtime.cuda.host_streams import HOST_STREAMS, HostStream


@pytest.fixture
def rules():
    pl.SYNCS.clear()
    with pl.rules() as mode:
        yield mode
    pl.SYNCS.clear()


def test_placement_follows_how_a_tensor_is_made(rules):
    on_device = torch.zeros(4, device="cuda")
    assert pl.placement_of(on_device) == pl.DEVICE
    assert on_device.is_cuda and on_device.device == torch.device("cuda", 0)
    assert pl.placement_of(torch.empty(2, device=0)) == pl.DEVICE
    assert pl.placement_of(torch.empty(2, device=on_device.device)) == pl.DEVICE
    host = torch.zeros(4, device="cpu")
    assert pl.placement_of(host) == pl.PAGEABLE and not host.is_cuda
    assert pl.placement_of(torch.empty(4, pin_memory=True, device="cpu")) == pl.PINNED
    assert pl.placement_of(host.pin_memory()) == pl.PINNED
    assert host.pin_memory().is_pinned() and not host.is_pinned()
    # Inherited through ops and views: host in, host out.
    assert pl.placement_of((host * 2)[1:]) == pl.PAGEABLE
    assert pl.placement_of(torch.zeros_like(host)) == pl.PAGEABLE
    assert pl.placement_of(on_device.new_zeros(3)) == pl.DEVICE
    # Moves.
    assert pl.placement_of(host.cuda()) == pl.DEVICE
    assert pl.placement_of(host.to("cuda")) == pl.DEVICE
    assert pl.placement_of(host.to(on_device)) == pl.DEVICE
    assert pl.placement_of(on_device.cpu()) == pl.PAGEABLE
    # torch's _to_copy pins the output of a non-blocking device-to-host copy.
    assert pl.placement_of(on_device.to("cpu", non_blocking=True)) == pl.PINNED


def test_megatron_factories_without_device_land_on_the_host(rules, tmp_path):
    """A factory without device= in megatron's code makes a host tensor, as on a GPU."""
    source = tmp_path / "megatron" / "core" / "fake.py"
    source.parent.mkdir(parents=True)
    source.write_text("import torch\n\ndef make():\n    return torch.zeros(3)\n")
    namespace = {}
    exec(compile(source.read_text(), str(source), "exec"), namespace)
    assert pl.placement_of(namespace["make"]()) == pl.PAGEABLE
    # The harness stands in for device code: its factories are device tensors.
    assert pl.placement_of(torch.zeros(3)) == pl.DEVICE


def test_module_cuda_moves_parameters(rules):
    linear = torch.nn.Linear(4, 4, device="cpu")
    assert pl.placement_of(linear.weight) == pl.PAGEABLE
    linear.cuda()
    assert linear.weight.is_cuda and pl.placement_of(linear.weight) == pl.DEVICE


def test_device_mismatch_raises_as_cuda_does(rules):
    on_device = torch.ones(4, device="cuda")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        on_device + torch.ones(4, device="cpu")
    with pytest.raises(RuntimeError, match="same device"):
        torch.cat([on_device, torch.ones(4, device="cpu")])
    # CUDA takes 0-dim host tensors as scalars, host index tensors and cross-device copies.
    assert (on_device * torch.tensor(2.0, device="cpu")).is_cuda
    assert on_device[torch.tensor([0, 2], device="cpu")].is_cuda
    on_device.copy_(torch.zeros(4, device="cpu"))


def test_seeded_device_mismatch_in_an_op_is_caught(rules):
    """A dispatcher-like function that builds a mask on the host by mistake fails here."""

    def count_tokens(routing_map: torch.Tensor) -> torch.Tensor:
        weights = torch.ones(routing_map.shape[1], device="cpu")  # the seeded bug
        return routing_map.float() @ weights

    with pytest.raises(RuntimeError, match="same device"):
        count_tokens(torch.ones(3, 4, dtype=torch.bool, device="cuda"))


def test_record_stream_on_a_host_tensor_raises(rules):
    stream = HostStream(name="compute")
    with pytest.raises(NotImplementedError, match="aten::record_stream.*'CPU' backend"):
        torch.empty(3, dtype=torch.int64, device="cpu", pin_memory=True).record_stream(stream)
    with pytest.raises(NotImplementedError, match="aten::record_stream"):
        torch.zeros(3, device="cpu").record_stream(stream)
    with HOST_STREAMS.record() as ops:
        torch.zeros(3, device="cuda").record_stream(stream)
    assert [op[0] for op in ops] == ["record_stream"]


def test_numpy_of_a_device_tensor_raises(rules):
    with pytest.raises(TypeError, match="can't convert cuda:0 device type tensor to numpy"):
        torch.ones(2, device="cuda").numpy()
    assert torch.ones(2, device="cuda").cpu().numpy().tolist() == [1.0, 1.0]


def test_host_syncs_are_counted_with_their_call_site(rules):
    on_device = torch.arange(4, device="cuda")
    on_device.sum().item()
    on_device.tolist()
    bool(on_device[0])
    on_device.cpu()
    on_device.to("cpu", non_blocking=True)  # not a sync: the copy is queued
    torch.arange(3, device="cpu").tolist()  # host tensor: no device involved
    torch.cuda.synchronize()
    kinds = sorted(kind for kind, _ in pl.SYNCS.elements())
    assert kinds == ["bool", "copy to host", "item", "tolist", "torch.cuda.synchronize"]
    assert all(site.startswith("test_placement.py:") for _, site in pl.SYNCS)


def test_rules_are_off_outside_the_block():
    host = torch.zeros(2)
    assert not host.is_cuda and not pl.active()


def test_rules_hold_inside_the_backward(rules):
    """A custom autograd function's backward runs under the rules too."""

    class HostGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * torch.ones(grad.shape, device="cpu")  # the seeded bug

    x = torch.ones(3, device="cuda", requires_grad=True)
    with pytest.raises(RuntimeError, match="same device"):
        HostGrad.apply(x).sum().backward()


def test_a_read_on_another_stream_without_a_wait_is_a_race(rules):
    """The host streams order operations as CUDA does: a tensor written on a side stream and
    read on the default stream without wait_stream/wait_event fails; with either, it runs."""
    side = HostStream(name="side")
    with HOST_STREAMS.stream(side):
        produced = torch.ones(4, device="cuda") * 2
    with pytest.raises(pl.StreamOrderError, match="written on stream 'side' without waiting"):
        produced + 1
    HOST_STREAMS.current.wait_stream(side)
    assert (produced + 1).is_cuda
    with HOST_STREAMS.stream(side):
        again = produced * 3
        event = side.record_event()
    with pytest.raises(pl.StreamOrderError):
        again.sum()
    HOST_STREAMS.current.wait_event(event)
    again.sum()


class _Identity(torch.autograd.Function):
    """What megatron's copy_to_tensor_model_parallel_region is at TP=1: the input, as is."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_an_alias_made_on_another_stream_writes_nothing(rules):
    """A view, or an autograd Function that returns its input (the shared experts' overlap at
    TP=1), launches no kernel: it neither reads nor writes, on whichever stream it is made. A
    kernel reading the alias, or a write through it, still races."""
    x = torch.ones(16, 16, device="cuda") * 1
    side = HostStream(name="side")
    side.wait_stream(HOST_STREAMS.current)
    with HOST_STREAMS.stream(side):
        _Identity.apply(x)
        view = x.view(-1)
        x.contiguous()
    x.index_select(0, torch.arange(3, device="cuda"))
    # The other way round (the shared experts' _BackwardStreamWait): a tensor written on the
    # side stream, aliased on the default stream, read again only on the side stream.
    with HOST_STREAMS.stream(side):
        made = x * 2
    alias = _Identity.apply(made).view_as(made)
    with pytest.raises(pl.StreamOrderError, match="written on stream 'side'"):
        alias + 1
    with HOST_STREAMS.stream(side):
        view.mul_(2)
    with pytest.raises(pl.StreamOrderError, match="written on stream 'side'"):
        x.sum()
    with HOST_STREAMS.stream(side):
        torch.add(x, 1, out=view.view(16, 16))
    HOST_STREAMS.current.wait_stream(side)
    x.sum()
    with HOST_STREAMS.stream(side):
        torch.mul(x, 1, out=view.view(16, 16))
    with pytest.raises(pl.StreamOrderError, match="written on stream 'side'"):
        x.sum()


def test_autograd_flags_read_nothing(rules):
    """``requires_grad_``, ``retain_grad`` and ``detach_`` set autograd metadata and launch no
    kernel (upstream dev's full-recompute replay calls ``requires_grad_`` on the default stream
    on a segment input the comm stream wrote): no read. A kernel reading the tensor still
    races, and the flag itself is set."""
    side = HostStream(name="side")
    side.wait_stream(HOST_STREAMS.current)
    with HOST_STREAMS.stream(side):
        made = torch.ones(4, device="cuda") * 2
    made.requires_grad_(True)
    assert made.requires_grad
    made.view(-1).retain_grad()
    made.detach().detach_()
    with pytest.raises(pl.StreamOrderError, match="written on stream 'side'"):
        made.sum()


def test_a_host_read_of_a_pending_copy_is_a_race(rules):
    """A non-blocking device-to-host copy lands later: reading it on the host before an event
    or stream synchronize is a race on a GPU (the DtoH-stream pattern)."""
    side = HostStream(name="dtoh")
    on_device = torch.arange(4, device="cuda")
    side.wait_stream(HOST_STREAMS.current)
    with HOST_STREAMS.stream(side):
        copy = on_device.to("cpu", non_blocking=True)
        done = side.record_event()
    with pytest.raises(pl.StreamOrderError, match="on the host"):
        copy.tolist()
    done.synchronize()
    assert copy.tolist() == [0, 1, 2, 3]


def test_device_random_ops_draw_from_the_device_generator(rules):
    """Dropout on a device tensor draws from the device generator, as on a GPU: a recompute
    that restores only the host RNG state (wrong on CUDA) gets another mask; restoring
    torch.cuda's state (what megatron's CheckpointFunction does) gets the same."""
    x = torch.ones(64, device="cuda")
    host_state, device_state = torch.get_rng_state(), torch.cuda.get_rng_state()
    first = torch.nn.functional.dropout(x, p=0.5)
    torch.set_rng_state(host_state)  # the wrong restore
    assert not torch.equal(torch.nn.functional.dropout(x, p=0.5), first)
    torch.cuda.set_rng_state(device_state)
    assert torch.equal(torch.nn.functional.dropout(x, p=0.5), first)
    # Host tensors keep drawing from the host generator.
    torch.set_rng_state(host_state)
    a = torch.rand(4, device="cpu")
    torch.set_rng_state(host_state)
    assert torch.equal(torch.rand(4, device="cpu"), a)


def test_current_device_is_the_emulated_gpu(rules):
    assert torch.cuda.current_device() == 0
    assert pl.placement_of(torch.zeros(1, device=torch.cuda.current_device())) == pl.DEVICE


def test_no_stream_is_capturing(rules):
    """What CUDA answers outside a graph capture (torch's own query needs a CUDA driver)."""
    assert torch.cuda.is_current_stream_capturing() is False


def test_every_form_of_tensor_to(rules):
    """Tensor.to's positional forms, as nn.Module.to calls it: to(device, None, non_blocking)."""
    host = torch.ones(2, device="cpu")
    assert host.to("cuda", None, False).is_cuda
    assert host.to(torch.device("cuda"), torch.float64, True).dtype == torch.float64
    assert pl.placement_of(host.to(torch.float16)) == pl.PAGEABLE
    assert host.to(torch.float32, False, True) is not host
    module = torch.nn.Linear(2, 2, device="cpu").to(torch.device("cuda"))
    assert module.weight.is_cuda
    assert torch.nn.Linear(2, 2).weight.is_cuda  # kaiming_uniform_ reaches the mode by keyword


def test_cuda_memory_stats_come_from_the_counting_allocator(rules, monkeypatch):
    """torch.cuda.memory_allocated of the emulated GPU is the counting host allocator's figure,
    and mem_get_info's free memory the emulated device's total less it; without that counter
    both are refused (torch would answer 0 without a CUDA context)."""
    from moe_release.runtime.cuda import placement
    from moe_release.runtime.measure import cpu_memory

    cpu_memory.install()
    before = torch.cuda.memory_allocated()
    free_before, total = torch.cuda.mem_get_info()
    block = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    assert torch.cuda.memory_allocated() - before == 1 << 20
    free, total_after = torch.cuda.mem_get_info()
    assert total == total_after == placement.DEVICE_MEMORY and free_before - free == 1 << 20
    torch.cuda.reset_peak_memory_stats()
    del block
    assert torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated() == 1 << 20
    assert torch.cuda.mem_get_info()[0] == free_before
    monkeypatch.setattr(cpu_memory, "installed", lambda: False)
    with pytest.raises(RuntimeError, match="needs the counting host allocator"):
        torch.cuda.memory_allocated()
    with pytest.raises(RuntimeError, match="needs the counting host allocator"):
        torch.cuda.mem_get_info()
