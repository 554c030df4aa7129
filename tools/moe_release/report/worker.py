# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Rank side of the memory report: a small but real megatron-core MoE training run.

Runs inside ranks spawned by ``moe_release.runtime.ranks.launcher`` (one thread, the tree under test
first on the path, the deep_ep emulation installed before megatron is imported unless the real
kernels run; gloo, or NCCL with the real kernels). The
model is megatron-core's GPTModel on the local (non-TE) layer spec with MoE layers: the real
TopKRouter, MoEFlexTokenDispatcher with the HybridEP manager, SequentialMLP experts, and every
layer checkpointed (full recompute, uniform, one layer per CheckpointFunction). Dense gradients
are all-reduced over the data-parallel group and the model is stepped with torch's AdamW:
megatron's optimizer (``get_megatron_optimizer``) needs its DistributedDataParallel wrapper,
whose grad buffers are allocated on ``torch.cuda.current_device()`` (param_and_grad_buffer.py),
so it does not run on CPU; the GPU run keeps torch's AdamW too, so both run the same job.

Memory is measured at the allocator: on CPU by the counting allocator of
``tools/moe_release/runtime/measure/cpu_memory.py`` (bytes of every tensor storage, on every thread,
since the job started), on CUDA by the caching allocator's counters.
"""

import cProfile
import gc
import pstats
import re
import resource
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from moe_release.runtime.cuda import placement
from moe_release.runtime.measure.cpu_memory import downsample


def _device() -> torch.device:
    """Where the model and its inputs go: the GPU, or on a CPU run under the placement rules
    (moe_release.runtime.cuda.placement) the emulated one (host memory placed as device tensors)."""
    if torch.cuda.is_available() or placement.active():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _memory_device() -> torch.device:
    """Whose allocator the figures come from: CUDA's, else the counting host allocator."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class AllocatorClock:
    """Live allocator bytes at named instants and the peak of each start/end window.

    CPU: the counting allocator of ``tools/moe_release/runtime/measure/cpu_memory.py`` (every
    thread, exact bytes of tensor storage). CUDA: the caching allocator's counters
    (``memory_allocated``, ``max_memory_allocated``) and, for the timeline, its allocation trace.
    """

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            self.mem = torch.cuda
        else:
            from megatron.core.transformer.moe import moe_memory_probe
            from moe_release.runtime.measure import cpu_memory
            from moe_release.runtime.ranks import zygote

            # What megatron-core allocates on import is not the step's: the modules a forked rank
            # has imported already (moe_release.runtime.ranks.zygote) are imported before counting
            # starts in a spawned rank too, so both count the same bytes.
            zygote.preload()
            cpu_memory.install()
            moe_memory_probe.set_host_allocated_bytes(cpu_memory.memory_allocated)
            self.mem = cpu_memory
        self.marks: Dict[str, int] = {}

    def mark(self, label: str) -> None:
        """Name this instant; ``X:start``/``X:end`` pairs also record the peak as ``X:peak``."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.marks[label] = self.mem.memory_allocated()
        if label.endswith(":start"):
            self.mem.reset_peak_memory_stats()
        elif label.endswith(":end"):
            self.marks[label[: -len(":end")] + ":peak"] = self.mem.max_memory_allocated()

    def record(self) -> None:
        """Start a (time, live bytes) timeline: every allocation and free from now on."""
        if self.device.type == "cpu":
            self.mem.start_recording()
            self.t0 = self.mem.now_ns()
        else:
            torch.cuda.synchronize()
            self.baseline = torch.cuda.memory_allocated()
            # No stack capture: only the trace of allocations and frees is needed.
            torch.cuda.memory._record_memory_history(
                enabled="all", context=None, stacks="python", max_entries=2_000_000
            )

    def timeline(self, points: int = 400) -> Dict[str, List[float]]:
        """Stop recording; live bytes over time, downsampled keeping each bucket's maximum."""
        if self.device.type == "cpu":
            times, values = self.mem.stop_recording()
            pts = sorted(zip(times, values))
            t0 = self.t0
        else:
            torch.cuda.synchronize()
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            trace = snapshot["device_traces"][self.device.index or 0]
            pts = cuda_trace_points(trace, self.baseline)
            t0 = pts[0][0] if pts else 0
        return downsample(pts, t0, points)


def cuda_trace_points(trace: List[Dict[str, Any]], baseline: int) -> List[Tuple[int, int]]:
    """(time ns, live bytes) after each allocation and completed free of a CUDA allocator trace.

    ``trace`` is one device's ``torch.cuda.memory._snapshot()["device_traces"]`` entry list
    (``action``, ``size``, ``time_us``); ``baseline`` is ``memory_allocated()`` when recording
    started. Segment events (the cache reserving or returning memory) do not change allocated
    bytes; a free counts when it completes, as in ``memory_allocated``. A trace without
    ``time_us`` (older torch) is placed by event order instead.
    """
    live = baseline
    pts = []
    for i, event in enumerate(trace):
        action = event["action"]
        if action == "alloc":
            live += event["size"]
        elif action == "free_completed":
            live -= event["size"]
        else:
            continue
        pts.append((int(event.get("time_us", i)) * 1000, live))
    return pts


def _dispatcher_overrides(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Config fields for a dispatcher other than the flex one (the harness's default) and for
    multi-token prediction layers."""
    dispatcher = cfg.get("dispatcher", "flex")
    out = {} if dispatcher == "flex" else {"moe_token_dispatcher_type": dispatcher}
    if cfg.get("mtp_layers"):
        out["mtp_num_layers"] = cfg["mtp_layers"]
    return out


def build_model(cfg: Dict[str, Any]):
    """megatron-core GPTModel with MoE layers on the local spec, checkpointing every layer."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )

    from moe_release.runtime.megatron.moe_harness import gpt_model, gpt_moe_config

    config = gpt_moe_config(
        cfg,
        dist.get_world_size(),
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
        **_dispatcher_overrides(cfg),
        **cfg.get("config_overrides", {}),
    )
    spec = get_gpt_layer_local_spec(num_experts=cfg["experts"], moe_grouped_gemm=False)
    mtp_spec = None
    if config.mtp_num_layers:
        # Multi-token prediction: one more MoE layer per MTP depth, run after the decoder. Its
        # stand-in is installed only here: importing the MTP module earlier moves an allocation
        # out of the model's counted bytes, which would shift the golden figures.
        from moe_release.runtime.cuda.compat import install_mtp_cpu_shim

        install_mtp_cpu_shim()
        mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    return gpt_model(config, cfg, spec, mtp_spec).to(_device())


def _batch(cfg: Dict[str, Any], step: int):
    """Seeded tokens for this rank and step; labels are the next token."""
    g = torch.Generator().manual_seed(cfg["seed"] * 1000003 + dist.get_rank() * 7919 + step)
    mbs, seq = max(cfg["tokens"] // cfg["seq"], 1), cfg["seq"]
    data = torch.randint(0, cfg["vocab"], (mbs, seq + 1), generator=g)
    pos = torch.arange(seq).unsqueeze(0).expand(mbs, seq).contiguous()
    # An explicit causal mask (True = masked): megatron's default one is built on "cuda".
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    dev = _device()
    tensors = (data[:, :-1].contiguous(), pos, data[:, 1:].contiguous(), mask)
    return tuple(t.to(dev) for t in tensors)


def _reduce_grads(model) -> float:
    """All-reduce dense gradients over data parallel; return the global gradient norm."""
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_group()
    dense_sq = torch.zeros(1, dtype=torch.float64, device=_device())
    expert_sq = torch.zeros(1, dtype=torch.float64, device=_device())
    for p in model.parameters():
        if p.grad is None:
            continue
        if getattr(p, "allreduce", True):
            dist.all_reduce(p.grad, group=dp)
            p.grad.div_(dist.get_world_size(dp))
            dense_sq += p.grad.double().pow(2).sum()
        else:
            expert_sq += p.grad.double().pow(2).sum()
    # Dense gradients are identical on every rank after the all-reduce: count them once.
    dist.all_reduce(expert_sq)
    return float((dense_sq + expert_sq).sqrt())


def _sync() -> None:
    """Wait for queued GPU work, so host timers measure it."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class ReleaseTimer:
    """Wall time spent inside the dispatchers' release calls (``reset_transient_forward_state``,
    where the tree has it), per step: the release's direct cost, measured in the patched run."""

    def __init__(self, model):
        from megatron.core.transformer.moe import moe_memory_probe as probe

        self.elapsed = 0.0
        self.calls = 0
        self.active = False
        for _, dispatcher in probe.find_moe_dispatchers(model):
            release = getattr(dispatcher, "reset_transient_forward_state", None)
            if release is not None:
                dispatcher.reset_transient_forward_state = self._timed(release)
                self.active = True

    def _timed(self, release):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return release(*args, **kwargs)
            finally:
                self.elapsed += time.perf_counter() - t0
                self.calls += 1

        return timed

    def take(self) -> Optional[float]:
        """Seconds spent in release calls since the last take (None where there are none)."""
        out, self.elapsed = self.elapsed, 0.0
        return out if self.active else None


class DispatchSizes:
    """The largest allocator bytes of one HybridEP dispatch's and combine's outputs over the
    run: the measured per-call figures the HybridEP accounting predicts. Wraps (and on
    :meth:`close` restores) the dispatcher module's ``hybrid_ep_dispatch``/``_combine``."""

    KEYS = {"hybrid_ep_dispatch": ("dispatch_tokens", "dispatch_probs"),
            "hybrid_ep_combine": ("combine_output",)}  # fmt: skip

    def __init__(self):
        from megatron.core.transformer.moe import token_dispatcher

        self.module = token_dispatcher
        self.max: Dict[str, int] = {}
        self.saved = {}
        for name in self.KEYS:
            fn = getattr(token_dispatcher, name, None)
            if fn is not None:
                self.saved[name] = fn
                setattr(token_dispatcher, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            values = out if isinstance(out, tuple) else (out,)
            for key, t in zip(self.KEYS[name], values):
                if isinstance(t, torch.Tensor):
                    self.max[key] = max(self.max.get(key, 0), t.numel() * t.element_size())
            return out

        return wrapped

    def close(self) -> Dict[str, int]:
        for name, fn in self.saved.items():
            setattr(self.module, name, fn)
        return dict(self.max)


def drop_held_state(model, layers: List[int]) -> None:
    """Drop what the dispatchers of the MoE layers numbered in ``layers`` hold from the last
    step (as the release would have), before the next step starts: on the base, the step's
    peak then shows what that held state adds to it."""
    from megatron.core.transformer.moe import moe_memory_probe as probe

    for i, (_, dispatcher) in enumerate(probe.find_moe_dispatchers(model)):
        if i in layers:
            probe.release_delta(dispatcher, _memory_device())


class DropAfterBackward:
    """On the base, drop what the dispatchers of the MoE layers numbered in ``layers`` hold
    as soon as their layer's backward has finished (as the release would have): when MoE
    layer j re-runs its forward inside the backward (full recompute), every later layer's
    backward is done. The step's peak then shows what that state adds to it."""

    def __init__(self, model, layers: List[int], after_forward: bool = False):
        self.moe = [m for m in model.modules() if hasattr(m, "token_dispatcher")]
        self.layers = set(layers)
        self.in_backward = False
        self.dropped: set = set()
        for j, module in enumerate(self.moe):
            module.register_forward_pre_hook(self._hook(j))
            if after_forward:
                # Also the moment the layer's (recomputed) forward returns: its combine is done.
                module.register_forward_hook(self._after_forward(j))

    def _after_forward(self, j: int):
        def post_forward(module, args, output):
            if j in self.layers:
                from megatron.core.transformer.moe import moe_memory_probe as probe

                probe.release_delta(module.token_dispatcher, _memory_device())

        return post_forward

    def _hook(self, j: int):
        def pre_forward(module, args):
            if self.in_backward:
                for i in range(j + 1, len(self.moe)):
                    self._drop(i)

        return pre_forward

    def _drop(self, i: int) -> None:
        from megatron.core.transformer.moe import moe_memory_probe as probe

        if i in self.layers and i not in self.dropped:
            self.dropped.add(i)
            probe.release_delta(self.moe[i].token_dispatcher, _memory_device())

    def backward(self, loss: torch.Tensor) -> None:
        self.in_backward, self.dropped = True, set()
        try:
            loss.backward()
        finally:
            self.in_backward = False


def _run_steps(
    cfg, model, opt, clock, mark, losses, norms, times, releases, syncs
) -> Dict[str, Any]:
    """Run the steps; per step its process CPU time (every thread) and minor page faults, and
    with ``cfg["profile"]`` each warm step's cProfile rows (:func:`profile_rows`)."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from moe_release.runtime.cuda import placement

    last = cfg["steps"] - 1
    timer = ReleaseTimer(model)
    profiler: Optional[cProfile.Profile] = None
    profiles: List[Dict[str, Any]] = []
    faults: List[int] = []
    cpu_times: List[float] = []
    after_backward = cfg.get("drop_after_backward")
    after_forward = cfg.get("drop_after_forward")
    dropper = None
    if after_backward is not None or after_forward is not None:
        layers = after_forward if after_forward is not None else after_backward
        dropper = DropAfterBackward(model, layers, after_forward=after_forward is not None)
    for step in range(cfg["steps"]):
        tokens, pos, labels, mask = _batch(cfg, step)
        gc.collect()
        if step > 0 and cfg.get("drop_held") is not None:
            drop_held_state(model, cfg["drop_held"])
        dist.barrier()
        if clock and cfg.get("timeline") and step == last:
            clock.record()
        if step == last:
            placement.SYNCS.clear()  # the last step's host syncs (CPU runs: placement rules)
        mark(f"step{step}:start")
        _sync()
        if cfg.get("profile") and step > 0:  # warm steps only, one profile each
            profiler = cProfile.Profile()
            profiler.enable()
        minflt = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        c0 = time.process_time()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, pos, attention_mask=mask, labels=labels).float().mean()
        if dropper is not None:
            dropper.backward(loss)
        else:
            loss.backward()
        norms.append(_reduce_grads(model))
        opt.step()
        # As megatron's training loop does after logging: the aux-loss tracker starts afresh.
        get_moe_metrics_tracker().clear()
        losses.append(float(loss.detach()))
        del loss
        _sync()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - minflt)
        if profiler is not None:
            profiler.disable()
            profiles.append(profile_rows(profiler))
            profiler = None
        releases.append(timer.take())
        if step == last:
            syncs.update(placement.SYNCS)
        mark(f"step{step}:end")
        if clock and cfg.get("timeline") and step == last:
            clock.timeline_result = clock.timeline()
    out: Dict[str, Any] = {"page_faults": faults, "step_cpu_times": cpu_times}
    if cfg.get("profile"):
        out["profile"] = profiles
    return out


def profile_rows(profiler: cProfile.Profile) -> Dict[str, Tuple[int, float, float, dict]]:
    """Per function (``file:line(name)``, paths from the package down, no object addresses):
    calls, own seconds, cumulative seconds, and per caller the cumulative seconds of the calls
    it made."""

    def key(path: str, line: int, name: str) -> str:
        for marker in ("/moe_release/", "/megatron/", "/torch/"):
            if marker in path:
                path = path[path.index(marker) + 1 :]
                break
        return f"{path}:{line}({re.sub(' at 0x[0-9a-f]+', '', name)})"

    rows = {}
    for func, (_, calls, own, cum, callers) in pstats.Stats(profiler).stats.items():
        k = key(*func)
        prev = rows.get(k, (0, 0.0, 0.0, {}))
        by_caller = dict(prev[3])
        for caller, stat in callers.items():
            c = key(*caller)
            by_caller[c] = by_caller.get(c, 0.0) + stat[3]
        rows[k] = (prev[0] + calls, prev[1] + own, prev[2] + cum, by_caller)
    return rows


def train(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Build the model and run cfg['steps'] steps; losses, norms, memory, timing, held state."""
    from megatron.core.transformer.moe import moe_memory_probe as probe
    from moe_release.runtime.cuda import compat as cpu_compat
    from moe_release.runtime.megatron.moe_harness import init_megatron

    if torch.cuda.is_available():
        # Base and patched must agree bitwise on a GPU too: deterministic kernels (index_add_
        # and scatter-add otherwise accumulate with atomics). An op without a deterministic
        # kernel warns rather than stops the report; the bitwise row then says so.
        torch.use_deterministic_algorithms(True, warn_only=True)
    init_megatron(ep=dist.get_world_size(), seed=cfg["seed"])
    cpu_compat.install_attention_cpu_shim()
    torch.manual_seed(cfg["seed"])
    clock = AllocatorClock(_memory_device()) if cfg["measure"] else None
    losses: List[float] = []
    norms: List[float] = []
    times: List[float] = []
    out: Dict[str, Any] = {"rank": dist.get_rank()}
    mark = clock.mark if clock else (lambda label: None)
    mark("init")
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    mark("built")
    releases: List[Optional[float]] = []
    syncs: Dict[Tuple[str, str], int] = {}
    sizes = DispatchSizes() if cfg["measure"] else None
    try:
        # The collector runs only between steps (explicitly, at each step's start): when an
        # automatic collection frees a cycle of an autograd graph inside a step depends on the
        # process's history, and moved the measured peaks between two runs of one job by up to
        # ~200 KB; every run now frees the same garbage at the same points.
        gc.disable()
        try:
            out.update(
                _run_steps(cfg, model, opt, clock, mark, losses, norms, times, releases, syncs)
            )
        finally:
            gc.enable()
    finally:
        if sizes is not None:
            out["per_call_bytes"] = sizes.close()
    gc.collect()
    mark("held")
    if clock:
        layers = probe.probe_model(model)
        out["attribution"] = [
            {"name": r.name, "pinned_bytes": r.pinned_bytes, "by_kind": r.by_kind()} for r in layers
        ]
        # What the allocator gets back when each layer's dispatcher references are dropped,
        # layer by layer: the bytes the dispatcher alone kept alive between calls.
        for i, (_, dispatcher) in enumerate(probe.find_moe_dispatchers(model)):
            probe.release_delta(dispatcher, clock.device)
            mark(f"released{i}")
        marks = clock.marks
        out["marks"] = dict(marks)
        held = [marks["held"]] + [marks[f"released{i}"] for i in range(len(layers))]
        out["dispatcher_held_bytes"] = [held[i] - held[i + 1] for i in range(len(layers))]
        out["comm_buffers"] = comm_buffer_release(clock)
        if cfg.get("timeline"):
            out["timeline"] = clock.timeline_result
    if cfg.get("grads"):
        named = list(model.named_parameters())
        out["grads"] = {n: p.grad.detach().cpu().clone() for n, p in named if p.grad is not None}
        out["params"] = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    out.update(losses=losses, grad_norms=norms, step_times=times, release_times=releases)
    out["syncs"] = syncs
    return out


def comm_buffer_release(clock) -> Dict[str, Any]:
    """The flex dispatcher's communication buffers before and after
    ``reset_fused_a2a_buffers(collective=True)`` (where the tree has it): the bytes the
    emulation allocates for them (counted by the allocator), and on a GPU the device memory
    outside the caching allocator that the release returns (``mem_get_info``), which is where
    the real deep_ep buffers live."""
    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.cuda.compat import held_comm_buffers

    buffers = held_comm_buffers(fused_a2a)
    emulated = [
        b.memory.nbytes for b in buffers if isinstance(getattr(b, "memory", None), torch.Tensor)
    ]
    out: Dict[str, Any] = {"buffers": len(buffers), "emulated_bytes": sum(emulated)}
    # The emulation's own reading of each buffer's allocations (HybridEP, DeepEP), which the
    # report checks the planner's terms against.
    out["terms"] = [
        {"name": t.name, "nbytes": t.nbytes, "source": t.source}
        for b in buffers
        for t in getattr(b, "terms", None) or ()
    ]
    release = getattr(fused_a2a, "reset_fused_a2a_buffers", None)
    if release is None:
        out.update(allocator_bytes_released=None, device_bytes_released=None)
        return out
    del buffers
    cuda = clock.device.type == "cuda"
    gc.collect()
    _sync()
    before = clock.mem.memory_allocated()
    free_before = torch.cuda.mem_get_info(clock.device)[0] if cuda else None
    release(collective=True, group=torch.distributed.group.WORLD)
    gc.collect()
    _sync()
    out["allocator_bytes_released"] = before - clock.mem.memory_allocated()
    if cuda:
        # Device memory returned outside the caching allocator (what the allocator itself
        # returned is in allocator_bytes_released; cached blocks stay reserved).
        freed = torch.cuda.mem_get_info(clock.device)[0] - free_before
        out["device_bytes_released"] = freed
    else:
        out["device_bytes_released"] = None
    return out


def sweep(cfg: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One measured two-step run (cold, warm) per (layers, tokens) point, in one process."""
    results = []
    for layers, tokens in cfg["points"]:
        point = dict(cfg, layers=layers, tokens=tokens, steps=2, measure=True, timeline=False)
        res = train(point)
        results.append(
            {
                "layers": layers,
                "tokens": tokens,
                "held": res["marks"]["held"],
                "built": res["marks"]["built"],
                "dispatcher_held_bytes": res["dispatcher_held_bytes"],
                "warm_peak": res["marks"]["step1:peak"],
                "losses": res["losses"],
            }
        )
        _teardown()
    return results


def _teardown() -> None:
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    from moe_release.runtime.cuda.compat import teardown_megatron_state

    teardown_megatron_state()
    # Sized by the number of layers of the model that first used it.
    destroy_moe_metrics_tracker()
    gc.collect()
