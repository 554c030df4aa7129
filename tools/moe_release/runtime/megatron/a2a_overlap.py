# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""megatron-core's 1F1B A2A-overlap schedule (``overlap_moe_expert_parallel_comm``) on the host.

The schedule is megatron-core's own: ``get_forward_backward_func()`` picks the combined-1F1B path,
which builds a ``TransformerModelChunkSchedulePlan`` per microbatch from the real GPTModel and runs
every layer as ``TransformerLayerSchedulePlan`` nodes. What cannot run on a host is replaced, and
only that: the CUDA streams and events of the schedule modules become
:mod:`moe_release.runtime.cuda.host_streams` stand-ins (sequential, logged),
``Tensor.record_stream`` on a stand-in stream is logged, and the schedules' ``torch.zeros(...,
device="cuda")`` token counters are made on the host.
"""

import sys
from typing import Any, Dict, List

import torch

from moe_release.runtime.cuda.compat import host_stream_torch, host_zeros
from moe_release.runtime.cuda.host_streams import (
    HOST_STREAMS,
    HostStream,
    install_record_stream_stand_in,
)

# The modules of the overlap path that call torch.cuda's stream API (where a base has them:
# upstream dev moved models.common.utils' schedule nodes into fine_grained_callables).
STREAM_MODULES = (
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.pipeline_parallel.combined_1f1b",
    "megatron.core.models.common.model_chunk_schedule_plan",
    "megatron.core.models.common.utils",
    "megatron.core.models.gpt.fine_grained_callables",
)
# The schedules allocate their token counters with device="cuda".
DEVICE_MODULES = ("megatron.core.pipeline_parallel.schedules",)


def install_overlap_cpu_shim() -> List[str]:
    """Give the overlap path's modules the host stream stand-ins (idempotent; no-op with CUDA).

    Returns the modules changed."""
    import importlib
    import importlib.util

    if torch.cuda.is_available():
        return []
    install_record_stream_stand_in()
    changed = []
    for name in STREAM_MODULES + DEVICE_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # the module exists but fails to import
                raise
            continue
        if getattr(module, "_moe_release_host_streams", False):
            continue
        extra = {"zeros": host_zeros} if name in DEVICE_MODULES else {}
        module.torch = host_stream_torch(**extra)
        module._moe_release_host_streams = True
        changed.append(name)
    # The communication stream is a module global, created on first use.
    sys.modules["megatron.core.pipeline_parallel.utils"]._COMM_STREAM = None
    return changed


def host_comm_stream() -> HostStream:
    """The schedule's communication stream as set_streams creates it, named for the log."""
    from megatron.core.pipeline_parallel import utils as pp_utils

    pp_utils.set_streams()
    pp_utils._COMM_STREAM.name = "comm"
    return pp_utils._COMM_STREAM


def layer_node_class():
    """megatron-core's TransformerLayerNode: in models.common.utils in 0.19, in
    models.gpt.fine_grained_callables before that and on upstream dev."""
    try:
        from megatron.core.models.common.utils import TransformerLayerNode
    except ImportError:
        from megatron.core.models.gpt.fine_grained_callables import TransformerLayerNode
    return TransformerLayerNode


def batches(cfg: Dict[str, Any]) -> List[Dict[str, torch.Tensor]]:
    """Seeded microbatches (tokens, positions, labels, causal mask) for this data-parallel
    rank (every pipeline stage of it sees the same microbatches)."""
    from megatron.core import parallel_state

    rank = parallel_state.get_data_parallel_rank()
    out = []
    for mb in range(cfg["microbatches"]):
        g = torch.Generator().manual_seed(cfg["seed"] * 1000003 + rank * 7919 + mb)
        seq = seq_lengths(cfg)[mb]
        data = torch.randint(0, cfg["vocab"], (cfg["mbs"], seq + 1), generator=g)
        pos = torch.arange(seq).unsqueeze(0).expand(cfg["mbs"], seq).contiguous()
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
        out.append(
            dict(
                input_ids=data[:, :-1].contiguous(),
                position_ids=pos,
                labels=data[:, 1:].contiguous(),
                attention_mask=mask[None, None],
            )
        )
    return out


def seq_lengths(cfg: Dict[str, Any]) -> List[int]:
    """Each microbatch's sequence length: cfg['seqs'] (variable-length or packed microbatches:
    a dispatch then has more tokens per rank than the last), else cfg['seq'] for all."""
    return list(cfg.get("seqs") or [cfg["seq"]] * cfg["microbatches"])


def pipeline_sizes(cfg: Dict[str, Any]):
    """(pp, vpp, ep) of a run: cfg['pp'] stages (default 1) of cfg['vpp'] virtual stages
    (default None), EP over the remaining ranks."""
    import torch.distributed as dist

    pp = cfg.get("pp", 1)
    return pp, cfg.get("vpp"), dist.get_world_size() // pp


def overlap_config(cfg: Dict[str, Any]):
    """The GPT config: bf16 (the overlap requires bf16/fp16), no recompute, EP = world size
    (over the pipeline stages with cfg['pp']), and pipeline p2p as Megatron-LM trains."""
    from moe_release.runtime.megatron.moe_harness import gpt_moe_config

    pp, vpp, ep = pipeline_sizes(cfg)
    pipeline = {}
    if pp > 1:
        pipeline = dict(
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            pipeline_dtype=torch.bfloat16,
            # Megatron-LM's training arguments: overlapped, unbatched p2p for an interleaved
            # schedule; batched for 1F1B without interleaving (which refuses the overlap).
            overlap_p2p_comm=vpp is not None,
            batch_p2p_comm=vpp is None,
        )
    return gpt_moe_config(
        cfg,
        ep,
        dtype=torch.bfloat16,
        overlap_moe_expert_parallel_comm=cfg["overlap"],
        **dict(pipeline, **cfg.get("config_overrides", {})),
    )


def build_gpt(cfg: Dict[str, Any]):
    """megatron-core GPTModel on the local spec, every layer MoE, seeded."""
    return build_gpt_chunks(cfg)[0]


def build_gpt_chunks(cfg: Dict[str, Any]) -> List[Any]:
    """One GPTModel per virtual pipeline stage of this rank, as megatron's ``get_model`` builds
    them (pre/post-process by stage, ``vp_stage``); one model without pipelining."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron.core import parallel_state
    from moe_release.runtime.megatron.moe_harness import gpt_model, on_device

    config = overlap_config(cfg)
    spec = get_gpt_layer_local_spec(num_experts=cfg["experts"], moe_grouped_gemm=False)
    pp, vpp, _ = pipeline_sizes(cfg)
    torch.manual_seed(cfg["seed"])
    if pp == 1:
        mtp_spec = None
        if config.mtp_num_layers:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

            from moe_release.runtime.cuda.compat import install_mtp_cpu_shim

            install_mtp_cpu_shim()
            mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
        # As megatron's Float16Module does for a bf16 run: every parameter in bf16.
        return [gpt_model(config, cfg, spec, mtp_spec).bfloat16()]
    chunks = []
    for stage in range(vpp or 1):
        stage_arg = stage if vpp else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=cfg["vocab"],
            max_sequence_length=max(seq_lengths(cfg)),
            position_embedding_type="learned_absolute",
            pre_process=parallel_state.is_pipeline_first_stage(False, vp_stage=stage_arg),
            post_process=parallel_state.is_pipeline_last_stage(False, vp_stage=stage_arg),
            vp_stage=stage_arg,
        )
        chunks.append(on_device(model).bfloat16())
    return chunks


def _loss_func(output: torch.Tensor):
    loss = output.float().sum()
    return loss, torch.tensor(output.numel(), dtype=torch.int), {"loss": loss.detach().clone()}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """megatron's forward_step_func contract: (output or schedule plan, loss function)."""
    batch = next(data_iterator)
    if return_schedule_plan:
        plan = model.build_schedule_plan(**batch)
        return plan, _loss_func
    return model(**batch), _loss_func


def _schedule_step(cfg: Dict[str, Any], chunks: list, data: list, vpp) -> list:
    """One step of megatron's ``get_forward_backward_func()`` over ``data``."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        # Interleaved: one iterator per model chunk (each reads every microbatch).
        data_iterator=[iter(data) for _ in chunks] if vpp else iter(data),
        model=chunks,
        num_microbatches=cfg["microbatches"],
        seq_length=cfg["seq"],
        micro_batch_size=cfg["mbs"],
        forward_only=False,
    )


def overlap_run(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Rank side: one training step of cfg['microbatches'] microbatches through megatron's
    ``get_forward_backward_func()``, with overlap on or off (cfg['overlap']); with
    cfg['warm_steps'], that many steps run first (their gradients dropped), so the measured step
    finds the communication buffers made.

    Returns the per-microbatch losses and every parameter gradient; with overlap, what
    :class:`OverlapWatch` saw and the stream-operation log's ``record_stream`` entries; with
    cfg['measure'], the counted allocator's peak over the step (and with cfg['drop'] the bytes
    freed by dropping each finished layer's holders)."""
    import gc

    from megatron.core.transformer.moe import moe_memory_probe as probe
    from moe_release.runtime.cuda.compat import install_attention_cpu_shim
    from moe_release.runtime.measure import cpu_memory
    from moe_release.runtime.megatron.moe_harness import init_megatron

    counter = None
    if cfg.get("measure"):
        cpu_memory.install()
        counter = cpu_memory.memory_allocated
    pp, vpp, ep = pipeline_sizes(cfg)
    init_megatron(ep=ep, pp=pp, vpp=vpp, seed=cfg["seed"])
    install_attention_cpu_shim()
    install_overlap_cpu_shim()
    chunks = build_gpt_chunks(cfg)
    comm = host_comm_stream() if cfg["overlap"] else None
    data = batches(cfg)
    for _ in range(cfg.get("warm_steps", 0)):
        _schedule_step(cfg, chunks, data, vpp)
        for model in chunks:
            for p in model.parameters():
                p.grad = None
    watch = OverlapWatch(counter, drop=cfg.get("drop", False)) if cfg["overlap"] else None
    if watch is not None:
        watch.exclude = set().union(*(probe.model_storage_keys(m) for m in chunks))
        watch.describe = cfg.get("describe", False)
    oplog = None
    if cfg.get("peak_tensors"):
        from moe_release.runtime.measure.peak_tensors import OpLog

        if not (counter and cfg.get("timeline")):
            raise ValueError("peak_tensors needs measure=True and timeline=True")
        oplog = OpLog()
        if watch is not None:
            watch.oplog = oplog
    gc.collect()
    start = counter() if counter else 0
    if counter:
        cpu_memory.reset_peak_memory_stats()
        if cfg.get("timeline"):
            cpu_memory.start_recording(cfg.get("timeline_capacity", 1 << 20))
            t0 = cpu_memory.now_ns()
    from contextlib import nullcontext

    from moe_release.runtime.cuda import placement

    placement.SYNCS.clear()
    try:
        with HOST_STREAMS.record() as ops, oplog if oplog is not None else nullcontext():
            out = _schedule_step(cfg, chunks, data, vpp)
    finally:
        if watch is not None:
            watch.close()
    after = {}
    if counter:
        # What the step leaves allocated once the schedule has returned (the gradients, and
        # anything the schedule's objects still reach): as it returns, and after a garbage
        # collection (reference cycles among the plans are freed only by the collector).
        after["returned"] = cpu_memory.settled(counter) - start
        gc.collect()
        after["collected"] = cpu_memory.settled(counter) - start
    result = {
        "after_step_bytes": after,
        "losses": [d["loss"] for d in out],
        "grads": {
            (f"chunk{i}." if len(chunks) > 1 else "") + n: p.grad.clone()
            for i, model in enumerate(chunks)
            for n, p in model.named_parameters()
            if p.grad is not None
        },
        "pipeline": {"pp": pp, "vpp": vpp, "ep": ep, "chunks": len(chunks)},
        "comm_stream": comm.name if comm is not None else None,
        "record_stream": [op for op in ops if op[0] == "record_stream"],
        "comm_ops": sum(1 for op in ops if "comm" in op[1:2]),
        # The step's device-to-host syncs by (kind, call site) (moe_release.runtime.cuda.placement).
        "syncs": dict(placement.SYNCS),
    }
    if watch is not None:
        result.update(
            layers=watch.layers,
            chunks=watch.chunks,
            tokens_per_expert_ptrs=watch.tokens_per_expert_ptrs,
        )
    if counter:
        result["peak_bytes"] = cpu_memory.max_memory_allocated() - start
        if cfg.get("timeline"):
            recorded = cpu_memory.events_recorded()
            times, values, ptrs, deltas = cpu_memory.stop_recording(events=True)
            order = times.argsort(kind="stable")
            pts = list(zip(times[order].tolist(), (values[order] - start).tolist()))
            result["timeline"] = cpu_memory.downsample(pts, t0, 400)
            if oplog is not None:
                result["peak_tensors"] = _peak_tensors(
                    cfg, oplog, values, ptrs, deltas, recorded, start
                )
    return result


def _peak_tensors(cfg, oplog, values, ptrs, deltas, recorded: int, start: int) -> Dict[str, Any]:
    """What was alive at the step's peak, by the op that made it, and at this rank's entry of
    cfg['peak_moments_by_rank'] (another run's peak moments: runtime.measure.peak_tensors)."""
    from moe_release.runtime.measure import peak_tensors

    if recorded > len(values):
        raise RuntimeError(
            f"the allocator recorded {recorded} events, over the timeline's capacity "
            f"{len(values)}: raise cfg['timeline_capacity']"
        )
    import torch.distributed as dist

    by_rank = cfg.get("peak_moments_by_rank")
    moments = by_rank[dist.get_rank()] if by_rank else ()
    return peak_tensors.summarize(oplog, values, ptrs, deltas, start, moments=moments)


# What a finished layer may still hold, per holder: the layer state's attributes and, per
# schedule node, what detach() kept and the node's inputs and output. The layer's first node
# (attention, router, dispatch preprocess) is "attn" on megatron-core 0.16 and upstream dev.
FIRST_NODE_NAMES = ("pre_dispatch_computation", "attn")
NODE_NAMES = FIRST_NODE_NAMES + ("moe_dispatch", "mlp", "moe_combine")
NODE_HOLDERS = ("before_detached", "detached", "inputs", "output")


def _tensors(value, depth: int = 0):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)) and depth < 3:
        for item in value:
            yield from _tensors(item, depth + 1)


def layer_holders(plan) -> Dict[str, Any]:
    """``{holder: value}`` for everything the layer plan's state and nodes reference."""
    out = {}
    state = getattr(plan, "layer_state", None)
    if state is not None:
        for k, v in vars(state).items():
            if next(_tensors(v), None) is not None:
                out[f"layer_state.{k}"] = v
    for name in NODE_NAMES:
        node = getattr(plan, name, None)
        for attr in NODE_HOLDERS:
            v = getattr(node, attr, None)
            if next(_tensors(v), None) is not None:
                out[f"{name}.{attr}"] = v
    return out


def chunk_holders(plan) -> Dict[str, Any]:
    """``{holder: value}`` for the tensors a model-chunk plan's state references."""
    state = getattr(plan, "_model_chunk_state", None)
    out = {}
    for k, v in vars(state).items() if state is not None else ():
        if k != "model" and next(_tensors(v), None) is not None:
            out[f"chunk_state.{k}"] = v
    return out


def attributed_tensors(holders: Dict[str, Any], exclude: set) -> Dict[str, List[Any]]:
    """As :func:`attributed_bytes`, per holder the storages themselves: ``[nbytes, shape,
    dtype]`` of the first tensor found on each, largest first."""
    from megatron.core.transformer.moe import moe_memory_probe as probe

    out, seen = {}, set(exclude)
    for name, value in holders.items():
        found = probe.reachable_tensors(value)
        mine = [list(v) for key, v in found.items() if key not in seen]
        out[name] = sorted(mine, key=lambda v: -v[0])
        seen.update(found)
    return out


def attributed_bytes(holders: Dict[str, Any], exclude: set) -> Dict[str, int]:
    """Bytes each holder keeps reachable (graph included, as the retained-state probe walks
    it); each storage counts once, for the first holder that reaches it; storages in
    ``exclude`` (the model's) not at all."""
    from megatron.core.transformer.moe import moe_memory_probe as probe

    out, seen = {}, set(exclude)
    for name, value in holders.items():
        found = probe.reachable_storages(value)
        out[name] = sum(n for key, n in found.items() if key not in seen)
        seen.update(found)
    return out


class OverlapWatch:
    """Observes megatron-core's overlap schedule without changing what it runs.

    Wraps (and on :meth:`close` restores) ``TransformerModelChunkSchedulePlan.__init__`` and
    ``run``, ``TransformerLayerSchedulePlan.__init__`` and ``TransformerLayerNode.forward`` /
    ``backward`` with calls that first run the original, then look:

    * at each layer's finished backward (its ``pre_dispatch_computation`` node's, ``attn``'s
      before 0.19, backward returned): the bytes each holder of that layer plan still reaches
      (:func:`attributed_bytes`) and which of the tensors the layer's forward stored are still
      alive (weak references); with ``drop`` the allocator bytes freed by dropping them all,
      which is what "held past last use" costs;
    * at the end of each chunk run with a backward: the chunk state's bytes, and whether the
      pre/post-process nodes still reference the chunk state.
    """

    def __init__(self, counter=None, drop: bool = False):
        import weakref

        from megatron.core.models.common import model_chunk_schedule_plan as mcsp

        self.weakref = weakref
        self.counter = counter
        self.drop = drop
        self.exclude: set = set()
        self.describe = False  # with each finished layer's holders, their tensors' shapes
        self.oplog = None  # a peak_tensors.OpLog to name the running node in
        self.layers: List[Dict[str, Any]] = []
        self.chunks: List[Dict[str, Any]] = []
        self.tokens_per_expert_ptrs: List[int] = []
        self._chunk_count = 0
        self._stage = None
        self._layer_info: Dict[int, Dict[str, Any]] = {}
        self._saved = []
        watch = self

        def wrap(cls, name, make):
            # Inherited (e.g. TransformerLayerNode.forward on megatron-core 0.16): restored by
            # deleting the wrapper.
            own = cls.__dict__.get(name)
            self._saved.append((cls, name, own))
            setattr(cls, name, make(own if own is not None else getattr(cls, name)))

        def chunk_init(original):
            def __init__(plan, *args, **kwargs):
                watch._building = watch._chunk_count
                watch._layer_index = 0
                watch._chunk_count += 1
                model = args[0] if args else kwargs.get("model")
                # The virtual pipeline stage of the chunk (None without virtual stages).
                watch._stage = getattr(model, "vp_stage", None)
                original(plan, *args, **kwargs)
                plan._watch_microbatch = watch._building
                plan._watch_stage = watch._stage
                # Strong references until the chunk's run ends (the plan holds them that long
                # too): whether release_state detaches them from the chunk state is checked.
                nodes = (plan.pre_process, plan.post_process)
                plan._watch_nodes = [n for n in nodes if n is not None]

            return __init__

        def layer_init(original):
            def __init__(plan, *args, **kwargs):
                original(plan, *args, **kwargs)
                watch._layer_info[id(plan.layer_state)] = {
                    "microbatch": watch._building,
                    "stage": watch._stage,
                    "layer": watch._layer_index,
                    "plan": watch.weakref.ref(plan),
                    "refs": {},
                }
                watch._layer_index += 1

            return __init__

        def node_forward(original):
            def forward(node, *inputs):
                with watch._phase(node, "forward"):
                    out = original(node, *inputs)
                watch._after_forward(node)
                return out

            return forward

        def node_backward(original):
            def backward(node, *grads):
                info = watch._layer_info.get(id(node.layer_state))
                with watch._phase(node, "backward"):
                    out = original(node, *grads)
                if node.name in FIRST_NODE_NAMES and info is not None:
                    watch._layer_finished(info)
                return out

            return backward

        def chunk_run(original):
            def run(f_plan, b_plan, *args, **kwargs):
                out = original.__func__(f_plan, b_plan, *args, **kwargs)
                if b_plan is not None:
                    watch._chunk_finished(b_plan)
                return out

            return staticmethod(run)

        wrap(mcsp.TransformerModelChunkSchedulePlan, "__init__", chunk_init)
        wrap(mcsp.TransformerModelChunkSchedulePlan, "run", chunk_run)
        wrap(mcsp.TransformerLayerSchedulePlan, "__init__", layer_init)
        node_class = layer_node_class()
        wrap(node_class, "forward", node_forward)
        wrap(node_class, "backward", node_backward)

    def _phase(self, node, direction: str):
        """With an op log (cfg['peak_tensors']), name the ops run inside ``node`` by
        microbatch, virtual stage, layer, node and direction."""
        from contextlib import contextmanager

        @contextmanager
        def phase():
            log = self.oplog
            info = self._layer_info.get(id(getattr(node, "layer_state", None)))
            if log is None or info is None:
                yield
                return
            outer = log.phase
            stage = "" if info["stage"] is None else f" stage {info['stage']}"
            log.phase = (
                f"microbatch {info['microbatch']}{stage} layer {info['layer']} "
                f"{node.name} {direction}"
            )
            try:
                yield
            finally:
                log.phase = outer

        return phase()

    def close(self) -> None:
        for cls, name, original in reversed(self._saved):
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)
        self._saved = []

    def _after_forward(self, node) -> None:
        info = self._layer_info.get(id(node.layer_state))
        if info is None:
            return
        refs = info["refs"]
        if node.name == "moe_dispatch":
            # What dispatch stored: the probs before and after detach (the non-detached one
            # carries the dispatch's graph and ctx).
            refs["dispatched_probs (graph)"] = self.weakref.ref(node.before_detached[-1])
            refs["dispatched_probs (detached)"] = self.weakref.ref(node.detached[-1])
        elif node.name == "mlp":
            dispatcher = self._dispatcher_of(node)
            manager = getattr(dispatcher, "_comm_manager", None)
            tpe = getattr(manager, "tokens_per_expert", None)
            if isinstance(tpe, torch.Tensor) and type(manager).__name__ == "_HybridEPManager":
                refs["tokens_per_expert"] = self.weakref.ref(tpe)
                self.tokens_per_expert_ptrs.append(tpe.untyped_storage().data_ptr())

    def _dispatcher_of(self, node):
        plan = self._layer_info[id(node.layer_state)]["plan"]()
        mlp = getattr(getattr(plan, "layer", None), "mlp", None)
        return getattr(mlp, "token_dispatcher", None)

    def _layer_finished(self, info) -> None:
        import gc

        plan = info["plan"]()
        holders = layer_holders(plan) if plan is not None else {}
        record = {
            "microbatch": info["microbatch"],
            "stage": info["stage"],
            "layer": info["layer"],
            "bytes": attributed_bytes(holders, self.exclude),
            "alive": {k: r() is not None for k, r in info["refs"].items()},
        }
        if self.describe:
            record["tensors"] = attributed_tensors(holders, self.exclude)
        if self.drop and self.counter is not None:
            gc.collect()
            before = self._settled()
            if plan is not None:
                for k in list(vars(plan.layer_state)):
                    setattr(plan.layer_state, k, None)
                for name in NODE_NAMES:
                    node = getattr(plan, name, None)
                    if hasattr(node, "before_detached"):
                        node.before_detached, node.detached = tuple(), tuple()
                        node.inputs = node.output = None
            del holders
            gc.collect()
            record["dropped_bytes"] = before - self._settled()
        self.layers.append(record)

    def _settled(self) -> int:
        from moe_release.runtime.measure.cpu_memory import settled

        return settled(self.counter)

    def _chunk_finished(self, plan) -> None:
        holders = chunk_holders(plan)
        nodes = getattr(plan, "_watch_nodes", [])
        plan._watch_nodes = []
        self.chunks.append(
            {
                "microbatch": getattr(plan, "_watch_microbatch", None),
                "stage": getattr(plan, "_watch_stage", None),
                "bytes": attributed_bytes(holders, self.exclude),
                "nodes_hold_chunk_state": [
                    getattr(n, "chunk_state", None) is not None for n in nodes
                ],
            }
        )


def layer_level_run(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Rank side: ``TransformerLayerSchedulePlan.run`` driven directly on one MoE layer that
    serves two microbatches: mb0's forward alone, then mb1's forward overlapped with mb0's
    backward, then mb1's backward (cfg['interleave']); or each microbatch's forward and
    backward in turn. Upstream gradients are ones. Returns what mb0's layer plan still holds
    once its backward finished, whether mb1's forward state survived it, and the gradients."""
    from megatron.core.models.common.model_chunk_schedule_plan import (
        TransformerLayerSchedulePlan as LayerPlan,
    )

    from moe_release.runtime.cuda.compat import install_attention_cpu_shim
    from moe_release.runtime.megatron.moe_harness import init_megatron

    init_megatron(ep=torch.distributed.get_world_size(), seed=cfg["seed"])
    install_attention_cpu_shim()
    install_overlap_cpu_shim()
    model = build_gpt(dict(cfg, layers=1, overlap=True))
    host_comm_stream()
    plans = [model.build_schedule_plan(**b) for b in batches(dict(cfg, microbatches=2))]
    inputs = [p.pre_process.forward() for p in plans]
    layers = [p.get_layer(0) for p in plans]
    out: Dict[str, Any] = {}
    if cfg["interleave"]:
        y0, _ = LayerPlan.run(layers[0], None, f_input=inputs[0])
        y1, _ = LayerPlan.run(layers[1], layers[0], f_input=inputs[1], b_grad=torch.ones_like(y0))
        out["mb0_holders"] = sorted(layer_holders(layers[0]))
        out["mb1_forward_state"] = sorted(layer_holders(layers[1]))
        LayerPlan.run(None, layers[1], b_grad=torch.ones_like(y1))
    else:
        for layer, x in zip(layers, inputs):
            y, _ = LayerPlan.run(layer, None, f_input=x)
            LayerPlan.run(None, layer, b_grad=torch.ones_like(y))
    out["outputs"] = [y0.detach().clone(), y1.detach().clone()] if cfg["interleave"] else None
    out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out
