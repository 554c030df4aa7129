# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The MoE token dispatchers keep nothing of a layer's forward once its combine is done.

Every test drives megatron-core's real MoELayer / dispatcher / manager code from the tree under
test (``MOE_RELEASE_TREE``), on CPU gloo ranks, with only the DeepEP/HybridEP kernels emulated.
Comparisons against the unpatched megatron-core use ``MOE_RELEASE_BASE_TREE``. Retention is
proven with weakrefs after ``gc.collect()`` and by summing the bytes of the tensors the
dispatcher and its manager still reference; each retention test fails on the base tree.
"""

import copy
import functools
import gc
import os
import pickle
import weakref

import pytest

from moe_release import backends, settings
from moe_release.runtime.cuda.placement import added_syncs
from moe_release.runtime.ranks.launcher import DistributedTestError, run_distributed
from tests.unit_tests.release_cases import backport

PATCHED_TREE = settings.tree()
BASE_TREE = settings.base_tree()
THIS = "tests.unit_tests.transformer.moe.test_dispatcher_state_release"

# Skipped without the trees (a plain `pytest` outside scripts/run-tests); under CI a skip fails
# the run (tests/conftest.py).
needs_tree = pytest.mark.skipif(not PATCHED_TREE, reason="needs MOE_RELEASE_TREE")
needs_base = pytest.mark.skipif(
    not PATCHED_TREE or not BASE_TREE, reason="needs MOE_RELEASE_TREE and MOE_RELEASE_BASE_TREE"
)

# (dispatcher, backend, EP). DeepEP needs TPxEP > 1. The all-to-all dispatcher runs dropless
# (what production uses: split sizes copied to the host on a side stream, here the CPU
# runtime's stand-in) and drop-and-pad; the all-gather dispatcher is megatron-core's default.
CONFIGS = [
    ("flex", "hybridep", 1),
    ("flex", "hybridep", 2),
    ("flex", "hybridep", 4),
    ("flex", "deepep", 2),
    ("flex", "deepep", 4),
    ("alltoall", "pad", 1),
    ("alltoall", "dropless", 1),
    ("alltoall", "dropless", 2),
    ("alltoall", "dropless", 4),
    ("allgather", None, 1),
    ("allgather", None, 2),
    ("allgather", None, 4),
]
# The flex backends only some trees have (NCCL EP from 0.19, DeepEP v2 on dev) run where the
# tree under test has them (an n/a column in the compatibility matrix elsewhere).
TREE_BACKENDS = backends.available(PATCHED_TREE) if PATCHED_TREE else frozenset()
CONFIGS += [("flex", b, 2) for b in backends.ONLY_SOME_TREES if b in TREE_BACKENDS]
# Behind the `slow` marker (run with `scripts/run-tests -m slow`): each has an EP2 case by default
# (EP1 of the all-to-all dispatcher runs drop-and-pad, HybridEP keeps its EP4 case).
SLOW_CONFIGS = {
    ("flex", "hybridep", 1),
    ("flex", "deepep", 4),
    ("alltoall", "dropless", 1),
    ("alltoall", "dropless", 4),
    ("allgather", None, 1),
    ("allgather", None, 4),
}
# The release cases (`-m backport`, run against every pinned base): EP2 of each dispatcher, and
# of each flex backend the tree has (DeepEP's only in EP2_ALL).
EP2_FLEX = [f"flex-{b}-ep2" for b in backends.NAMES if b != "deepep" and ("flex", b, 2) in CONFIGS]
EP2_ALL = EP2_FLEX + ["flex-deepep-ep2", "alltoall-dropless-ep2", "allgather-ep2"]


def _tree_source_has(module: str, text: str) -> bool:
    """Whether the tree under test's ``megatron/core/transformer/moe/<module>`` contains
    ``text`` (what a variant needs only some trees have)."""
    path = os.path.join(PATCHED_TREE or "", "megatron", "core", "transformer", "moe", module)
    try:
        with open(path, encoding="utf-8") as f:
            return text in f.read()
    except OSError:
        return False


def _params(configs, slow=SLOW_CONFIGS, tp=False):
    """pytest params of (dispatcher, backend, EP[, variant]) tuples: readable ids, and the slow
    marker on those in ``slow``."""

    def ident(c):
        dispatcher, backend, ep, *variant = c
        parts = [dispatcher, backend, "tp2" if tp else None, f"ep{ep}", *variant]
        return "-".join(p for p in parts if p)

    return [
        pytest.param(*c, id=ident(c), marks=[pytest.mark.slow] if c in slow else [])
        for c in configs
    ]


RECOMPUTE = ["none", "moe_layer_recompute", "checkpoint"]
NUM_LAYERS = 3
HIDDEN = 16


# --------------------------------------------------------------------------------------------
# Rank side: everything below runs inside a gloo rank spawned by dist_utils.run_distributed.
# --------------------------------------------------------------------------------------------


def _setup(ep, tp=1):
    import torch

    from moe_release.runtime.megatron.moe_harness import init_megatron

    init_megatron(ep=ep, tp=tp, seed=1234)
    torch.manual_seed(1234)


def _backend_model(backend) -> dict:
    """What a backend's kernels take: NCCL EP and DeepEP v2 move bf16 payloads only, DeepEP
    v2's combine needs a hidden size that is a multiple of 256 (its JIT kernel's static assert),
    and NCCL EP needs a receive capacity where the tree's manager has no eager mode (0.19.2,
    dev: the config still has moe_ncclep_static_shape)."""
    import dataclasses

    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    if backend == "deepepv2":
        return dict(hidden_size=256, bf16=True, params_dtype=torch.bfloat16)
    if backend == "ncclep":
        out = dict(hidden_size=HIDDEN, bf16=True, params_dtype=torch.bfloat16)
        fields = {f.name for f in dataclasses.fields(TransformerConfig)}
        if "moe_ncclep_static_shape" in fields:
            out["moe_expert_rank_capacity_factor"] = 2.0
        return out
    return dict(hidden_size=HIDDEN)


def _build_layers(dispatcher, backend, ep, num_layers=NUM_LAYERS, recompute="none", tp=1, **extra):
    import torch
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moe_release.runtime.megatron import moe_harness

    kwargs = dict(
        num_layers=num_layers,
        num_attention_heads=4,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_token_dispatcher_type=dispatcher,
        moe_router_dtype="fp32",
        moe_aux_loss_coeff=0.0,
        use_cpu_initialization=True,
        add_bias_linear=False,
        expert_model_parallel_size=ep,
        moe_layer_recompute=recompute == "moe_layer_recompute",
    )
    if tp > 1:
        # The all-gather dispatcher then gathers over TPxEP; sequence parallel as in production.
        kwargs.update(tensor_model_parallel_size=tp, sequence_parallel=True)
    if dispatcher == "flex":
        kwargs["moe_flex_dispatcher_backend"] = backend
    elif dispatcher == "alltoall" and backend == "pad":
        kwargs.update(moe_expert_capacity_factor=2.0, moe_pad_expert_input_to_capacity=True)
    kwargs.update(_backend_model(backend if dispatcher == "flex" else None))
    kwargs.update(extra)
    if isinstance(kwargs.get("params_dtype"), str):  # variants are plain data (pickled to ranks)
        kwargs["params_dtype"] = getattr(torch, kwargs["params_dtype"])
    if isinstance(kwargs.get("attention_backend"), str):
        from megatron.core.transformer.enums import AttnBackend

        kwargs["attention_backend"] = AttnBackend[kwargs["attention_backend"]]
    config = TransformerConfig(**kwargs)
    submodules = moe_harness.local_moe_submodules(4)
    torch.manual_seed(4321)
    layers = []
    for i in range(num_layers):
        layer = moe_harness.on_device(MoELayer(config, submodules))
        layer.set_layer_number(i + 1)
        layer.train()
        layers.append(layer)
    return layers


def _run_stack(layers, x, recompute):
    from megatron.core import tensor_parallel

    h = x
    for layer in layers:
        if recompute == "checkpoint":
            # Full recompute: the whole layer is a checkpointed function, as in TransformerBlock.
            h = tensor_parallel.checkpoint(lambda t, _l=layer: _l(t)[0], False, h)
        else:
            h, _ = layer(h)
    return h


def _input(seed=7, tokens=8, like=None):
    """A rank's [tokens, 2, H] input; ``like`` (a layer) gives H and the dtype."""
    import torch
    import torch.distributed as dist

    hidden = like.config.hidden_size if like is not None else HIDDEN
    dtype = like.config.params_dtype if like is not None else torch.float32
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    return torch.randn(tokens, 2, hidden, generator=g).to(dtype)


class _Tracker:
    """Weakrefs to what a forward hands the dispatcher: the router (= checkpoint) inputs,
    router probabilities and the dispatch handles/probabilities, on every call, recompute
    included."""

    def __init__(self, layers):
        self.refs = {"input": [], "probs": [], "handle": [], "dispatched_probs": []}
        self.inputs = []  # weakrefs to the inputs, to look up their .grad before they die
        self.grad_refs = []
        for layer in layers:
            layer.router.register_forward_hook(self._router_hook)
            disp = layer.token_dispatcher
            if hasattr(disp, "_comm_manager"):
                self._wrap_dispatch(disp._comm_manager)

    def _router_hook(self, module, args, output):
        x = args[0]
        self.refs["input"].append(weakref.ref(x))
        self.inputs.append(weakref.ref(x))
        self.refs["probs"].append(weakref.ref(output[0]))

    def _wrap_dispatch(self, manager):

        original = manager.dispatch

        def dispatch(*args, **kwargs):
            out = original(*args, **kwargs)
            for item in _handle_tensors(manager):
                self.refs["handle"].append(weakref.ref(item))
            probs = getattr(manager, "dispatched_probs", None)
            if probs is not None:
                self.refs["dispatched_probs"].append(weakref.ref(probs))
            return out

        manager.dispatch = dispatch

    def collect_grads(self):
        """Weakrefs to the .grad of every recorded input still alive (the checkpoint leaves)."""
        for ref in self.inputs:
            x = ref()
            if x is not None and x.grad is not None:
                self.grad_refs.append(weakref.ref(x.grad))

    def alive(self):
        gc.collect()
        counts = {k: sum(r() is not None for r in v) for k, v in self.refs.items()}
        counts["input_grad"] = sum(r() is not None for r in self.grad_refs)
        counts["recorded"] = {k: len(v) for k, v in self.refs.items()}
        return counts


def _handle_tensors(manager):
    """The tensors of a manager's dispatch handle: HybridEP's and DeepEP's tuple, DeepEP v2's
    EPHandle fields, NCCL EP's EpBuffer handle_mem."""
    import torch

    handle = getattr(manager, "handle", None)
    if handle is None and getattr(manager, "_buffer", None) is not None:
        return [manager._buffer.handle_mem]
    if isinstance(handle, tuple):
        return [t for t in handle if torch.is_tensor(t)]
    if handle is not None and not torch.is_tensor(handle):
        return [t for t in vars(handle).values() if torch.is_tensor(t)]
    return [handle] if torch.is_tensor(handle) else []


def _tensors(obj, depth=0, seen=None):
    import torch

    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 3:
        return
    seen.add(id(obj))
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item, depth + 1, seen)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth + 1, seen)


def held_state_bytes(dispatcher):
    """Bytes of the per-forward tensors a dispatcher (and its manager) still references.

    Everything reachable through instance attributes, tuples and dicts counts, except the
    persistent ones built at construction (over-budget flag, static index tensors).
    """
    from megatron.core.transformer.moe.moe_memory_probe import PERSISTENT_ATTRS

    owners = [dispatcher]
    if getattr(dispatcher, "_comm_manager", None) is not None:
        owners.append(dispatcher._comm_manager)
    total, storages = 0, set()
    for owner in owners:
        for name, value in vars(owner).items():
            if name in PERSISTENT_ATTRS or name in ("config", "group", "shared_experts"):
                continue
            for t in _tensors(value):
                key = t.untyped_storage().data_ptr()
                if key in storages:
                    continue
                storages.add(key)
                total += t.untyped_storage().nbytes()
    return total


def _grads(layers, x):
    out = {"input": x.grad.clone()}
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            out[f"{i}.{name}"] = None if p.grad is None else p.grad.clone()
    return out


# Production configurations beyond the plain router and routed experts, by name (the rank side
# looks them up, so the cached jobs key on a string).
VARIANTS = {
    # The router's auxiliary losses all at once: their autograd side paths touch the probs.
    "aux_losses": dict(
        moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
        moe_aux_loss_coeff=[1e-2, 1e-2, 1e-2],
        moe_z_loss_coeff=1e-3,
    ),
    "shared_experts": dict(moe_shared_expert_intermediate_size=32),
    "shared_experts_overlap": dict(
        moe_shared_expert_intermediate_size=32, moe_shared_expert_overlap=True
    ),
    "drop_and_pad": dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
    # Token dropping without padding (DeepEP does not pad to capacity in 0.19.2).
    "capacity": dict(moe_expert_capacity_factor=1.0),
    # main's batch-invariant permutation: the all-to-all keeps an inverse map for its combine.
    # The config's checks of the rest of the model (bf16, FlashAttention 3, a GEMM backend
    # without DeepGEMM) are met; an MoE layer alone runs no attention.
    "batch_invariant": dict(
        batch_invariant_mode=True,
        batch_invariant_backend="te_native",
        bf16=True,
        params_dtype="bfloat16",
        attention_backend="flash",
        attention_dropout=0.0,
        flash_attention_version=3,
    ),
}


def rank_train(
    dispatcher,
    backend,
    ep,
    recompute,
    compile_=False,
    steps=2,
    tp=1,
    variant=None,
    seed_sync=False,
    seed_mismatch=False,
):
    """Forward+backward ``steps`` times through a stack of MoE layers.

    Returns the losses, outputs and gradients of the last step, the weakref census after the
    step with everything dropped, the bytes each layer's dispatcher still holds, and the
    device-to-host syncs of the last step by kind and call site. ``seed_sync`` adds an
    ``.item()`` to every combine (the seeded defect the sync comparison must catch);
    ``seed_mismatch`` hands the dispatchers a routing map in host memory (the placement rules
    must refuse it as CUDA would).
    """
    import torch

    _setup(ep, tp)
    extra = dict(VARIANTS[variant]) if variant else {}
    layers = _build_layers(dispatcher, backend, ep, recompute=recompute, tp=tp, **extra)
    runners = layers
    if compile_:
        runners = [torch.compile(layer, backend="aot_eager") for layer in layers]
    from moe_release.runtime.cuda import placement

    tracker = _Tracker(layers)
    # What the probe attributes to each dispatcher before any forward (the over-budget flag,
    # static index tensors) is persistent, not per-step state.
    persistent = [_probe(layer, i, exclude=None)[1] for i, layer in enumerate(layers)]
    if seed_sync:
        _seed_host_sync(layers)
    if seed_mismatch:
        _seed_host_routing_map(layers)
    result = {}
    for step in range(steps):
        # The host syncs of the last (warm) step, forward and backward
        # (moe_release.runtime.cuda.placement).
        placement.SYNCS.clear()
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        x = _input(seed=step, like=layers[0]).requires_grad_()
        out = _run_stack(runners, x, recompute)
        loss = (out.float() ** 2).sum()
        loss.backward()
        tracker.collect_grads()
        result.update(
            loss=loss.detach().clone(), output=out.detach().clone(), grads=_grads(layers, x)
        )
        del x, out, loss
    result["syncs"] = dict(placement.SYNCS)
    result["alive"] = tracker.alive()
    result["held_bytes"] = [held_state_bytes(layer.token_dispatcher) for layer in layers]
    result["probe_bytes"] = [
        _probe(layer, i, exclude=persistent[i])[0] for i, layer in enumerate(layers)
    ]
    return result


def _seed_host_sync(layers):
    """A defect on the hot path: every combine reads a device scalar on the host."""
    for layer in layers:
        dispatcher = layer.token_dispatcher
        combine = dispatcher.token_combine

        def token_combine(hidden_states, *args, _combine=combine, **kwargs):
            hidden_states.float().abs().sum().item()  # the seeded sync
            return _combine(hidden_states, *args, **kwargs)

        dispatcher.token_combine = token_combine


def _seed_host_routing_map(layers):
    """A defect on the hot path: the router's routing map lands in host memory."""
    for layer in layers:
        router_forward = layer.router.forward

        def forward(*args, _forward=router_forward, **kwargs):
            probs, routing_map = _forward(*args, **kwargs)
            return probs, routing_map.cpu()  # the seeded host tensor

        layer.router.forward = forward


def rank_train_modes(dispatcher, backend, ep, recomputes, tp=1, variant=None):
    """rank_train for each recompute mode in turn, in one process (spawning ranks and
    importing megatron cost more than the runs themselves)."""
    from moe_release.runtime.cuda.compat import teardown_megatron_state

    out = {}
    for recompute in recomputes:
        out[recompute] = rank_train(dispatcher, backend, ep, recompute, tp=tp, variant=variant)
        teardown_megatron_state()
        gc.collect()
    return out


def _probe(layer, index, exclude):
    """Bytes the retained-state probe (moe_memory_probe) attributes to the layer's dispatcher:
    direct references and everything their autograd graphs pin, model-owned storages and the
    roots in ``exclude`` left out. Also returns the root paths seen."""
    from megatron.core.transformer.moe import moe_memory_probe as probe

    gc.collect()
    report = probe.attribute_layer(
        f"layer{index}", layer.token_dispatcher, probe.model_storage_keys(layer)
    )
    exclude = exclude or set()
    retained = sum(
        p.nbytes
        for p in report.pinned
        if not p.shared_with_model and p.path.split(" <- ")[0] not in exclude
    )
    return retained, set(report.direct)


def rank_edge_cases(dispatcher, backend, ep):
    """Two outstanding forwards, releases while backward is pending, double release, release
    before any dispatch, deepcopy/pickle of a layer after a forward."""
    import torch

    _setup(ep)
    (layer,) = _build_layers(dispatcher, backend, ep, num_layers=1)
    disp = layer.token_dispatcher
    res = {}
    # Release before any dispatch, twice.
    disp.reset_transient_forward_state()
    disp.reset_transient_forward_state()

    def fwd(seed):
        x = _input(seed=seed, like=layer).requires_grad_()
        out, _ = layer(x)
        return x, (out.float() ** 2).sum()

    # Reference: each forward followed by its backward.
    ref = []
    for seed in (1, 2):
        layer.zero_grad(set_to_none=True)
        x, loss = fwd(seed)
        loss.backward()
        ref.append((x.grad.clone(), [p.grad.clone() for p in layer.parameters()]))
    # Two outstanding forwards; explicit releases while both backwards are pending; then each
    # backward twice (retain_graph, then final).
    layer.zero_grad(set_to_none=True)
    xa, la = fwd(1)
    xb, lb = fwd(2)
    disp.reset_transient_forward_state()
    disp.reset_transient_forward_state()
    res["held_after_release_pending"] = held_state_bytes(disp)
    ok = True
    for x, loss, (rx, rp) in ((xa, la, ref[0]), (xb, lb, ref[1])):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        loss.backward(retain_graph=True)
        g1 = (x.grad.clone(), [p.grad.clone() for p in layer.parameters()])
        layer.zero_grad(set_to_none=True)
        x.grad = None
        loss.backward()
        g2 = (x.grad.clone(), [p.grad.clone() for p in layer.parameters()])
        for g in (g1, g2):
            ok &= torch.equal(g[0], rx) and all(torch.equal(a, b) for a, b in zip(g[1], rp))
    res["outstanding_grads_equal"] = ok
    del xa, xb, la, lb
    # After a forward the dispatcher's state must deepcopy and pickle: a tensor still held with
    # autograd history refuses both ("Only Tensors created explicitly by the user ...").
    # Process groups never copy, on any tree, so they are left out.
    x, loss = fwd(3)
    del x, loss
    state = [_copyable_state(disp)]
    if hasattr(disp, "_comm_manager"):
        state.append(_copyable_state(disp._comm_manager))
    for name, op in (("deepcopy", copy.deepcopy), ("pickle", pickle.dumps)):
        try:
            op(state)
            res[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - the message is the result
            res[name] = f"{type(exc).__name__}: {exc}"[:200]
    res["held_end"] = held_state_bytes(disp)
    return res


def _copyable_state(obj):
    import torch.distributed as dist

    # DeepEP v2's manager keeps the (persistent) communication buffer, a process-group holder.
    skip = ("config", "shared_experts", "cuda_dtoh_stream", "_comm_manager", "buffer")
    return {
        k: v for k, v in vars(obj).items() if k not in skip and not isinstance(v, dist.ProcessGroup)
    }


def rank_static_budget(ep, tokens=8):
    """HybridEP's static per-rank budget (moe_expert_rank_capacity_factor) through
    MoEFlexTokenDispatcher alone: the config requires the TE op fuser, whose fused experts need
    TE, so a stand-in expert (rows scaled by their probs) sits between dispatch and combine.
    Returns the output and input grad, the bytes the dispatcher holds afterwards, whether the
    router-side tensors are still reachable, and whether over_budget survived."""
    import torch
    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_layer import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

    from moe_release.runtime.megatron import moe_harness

    _setup(ep)
    config = moe_harness.moe_config(
        "hybridep",
        ep,
        num_experts=4,
        hidden=HIDDEN,
        moe_expert_rank_capacity_factor=1.5,
        use_transformer_engine_op_fuser=True,
    )
    local, rank = 4 // ep, dist.get_rank()
    dispatcher = MoEFlexTokenDispatcher(
        local, list(range(rank * local, (rank + 1) * local)), config, get_default_pg_collection()
    )
    g = torch.Generator().manual_seed(11 + rank)
    logits = torch.randn(tokens, 4, generator=g)
    top = logits.topk(2, dim=1).indices
    routing_map = torch.zeros(tokens, 4, dtype=torch.bool).scatter(1, top, True)
    probs = (torch.softmax(logits, -1) * routing_map).requires_grad_()
    x = torch.randn(tokens, HIDDEN, generator=g).requires_grad_()
    refs = [weakref.ref(probs), weakref.ref(x)]
    hidden, p = dispatcher.dispatch_preprocess(x, routing_map, probs)
    hidden, p = dispatcher.token_dispatch(hidden, p)
    hidden, tokens_per_expert, p = dispatcher.dispatch_postprocess(hidden, p)
    y = hidden * p.unsqueeze(-1).to(hidden.dtype)
    y = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(y)))
    y.float().pow(2).sum().backward()
    out = {"output": y.detach().clone(), "input_grad": x.grad.clone()}
    del x, probs, hidden, p, y, tokens_per_expert
    gc.collect()
    manager = dispatcher._comm_manager
    out.update(
        held=held_state_bytes(dispatcher),
        alive=sum(r() is not None for r in refs),
        over_budget=torch.is_tensor(getattr(manager, "over_budget", None)),
    )
    return out


def rank_cudagraph_replay(dispatcher, backend, ep, variant=None, impl="transformer_engine"):
    """Partial CUDA-graph flow on CPU: the attributes listed in ``cudagraph_attrs`` are read
    right after the preprocess (capture) and written back before dispatch (replay), after the
    previous forward's release. The result must equal the eager forward; and the automatic
    release must be skipped while a stream is capturing. ``impl="local"``: megatron's own
    partial graphs (TransformerLayer._get_token_dispatcher_attrs / _restore_token_dispatcher_attrs,
    every tensor of ``cudagraph_attrs`` at capture), which set no ``valid_cudagraph_attrs``."""
    import torch

    from megatron.core.transformer.moe import token_dispatcher as td

    _setup(ep)
    extra = dict(VARIANTS[variant]) if variant else {}
    (layer,) = _build_layers(dispatcher, backend, ep, num_layers=1, **extra)
    disp = layer.token_dispatcher
    x = _input()
    with torch.no_grad():
        eager, _ = layer(x)
        probs, routing_map = layer.route(x)
        hidden, pp = layer.preprocess(x, probs, routing_map)
        captured = {}
        for name in disp.cudagraph_attrs:
            obj = disp
            for part in name.split("."):
                obj = getattr(obj, part, None)
            if torch.is_tensor(obj):
                captured[name] = obj
        # moe_utils records which attributes the capture returned; a replay restores only those.
        # The local implementation keeps the names on the layer, not on the dispatcher.
        if impl == "transformer_engine":
            disp.valid_cudagraph_attrs = [n for n in disp.cudagraph_attrs if n in captured]
        # Tensor attributes of the preprocess the capture did not return (probs on branches up
        # to core_r0.18.0, where it is not in the all-to-all's cudagraph_attrs) must survive.
        uncaptured = {
            a: getattr(disp, a)
            for a in ("probs",)
            if impl == "transformer_engine"
            and a not in captured
            and torch.is_tensor(getattr(disp, a, None))
        }
        disp.reset_transient_forward_state()  # what the previous forward's combine did
        kept = all(getattr(disp, a, None) is v for a, v in uncaptured.items())
        for name, value in captured.items():
            owner = disp
            *path, leaf = name.split(".")
            for part in path:
                owner = getattr(owner, part)
            setattr(owner, leaf, value)
        out, _ = layer.dispatch(hidden, pp)
        out, _ = layer.routed_experts_compute(out, _)
        out = layer.postprocess(layer.combine(out), None)
    res = {
        "equal": torch.equal(out, eager),
        "captured": sorted(captured),
        "uncaptured": sorted(uncaptured),
        "uncaptured_kept": kept,
    }
    disp.valid_cudagraph_attrs = None
    # While capturing, the release after combine is skipped. Only token_dispatcher's view of
    # torch.cuda claims a capture; the rest of megatron keeps seeing the real (absent) CUDA.
    from tests.unit_tests.transformer.moe.moe_cpu_harness import capturing

    calls = []
    with capturing(td, calls), torch.no_grad():
        layer(x)
    res["capture_checked"] = bool(calls)
    res["held_while_capturing"] = held_state_bytes(disp)
    return res


def rank_manager_units():
    """Managers built with __new__ (no bootstrap, no comm library): each backend's release
    drops exactly the per-forward fields and keeps the persistent ones."""
    import torch

    from megatron.core.transformer.moe import token_dispatcher as td

    res = {}
    t = lambda: torch.ones(4)  # noqa: E731

    m = td._NCCLEPManager.__new__(td._NCCLEPManager)
    m._bootstrapped, m._max_tokens_per_rank, m._recv_capacity = True, 64, 256
    m.num_local_tokens = 8
    m.token_probs, m.token_indices, m.dispatched_probs, m.tokens_per_expert = t(), t(), t(), t()
    m._buffer = object()
    m.reset_transient_forward_state()
    m.reset_transient_forward_state()
    res["ncclep"] = {k: getattr(m, k) is None for k in vars(m)}
    res["ncclep_kept"] = (
        m._bootstrapped,
        m._max_tokens_per_rank,
        m._recv_capacity,
        m.num_local_tokens,
    )

    for drop_and_pad in (False, True):
        h = td._HybridEPManager.__new__(td._HybridEPManager)
        h.drop_and_pad = drop_and_pad
        h.over_budget = torch.zeros(1, dtype=torch.bool)
        h.pad_multiple = 16
        h.routing_map, h.token_probs, h.dispatched_probs = t(), t(), t()
        h.handle = (t(), t())
        h.tokens_per_expert, h.num_permuted_tokens = t(), 32
        h._original_num_tokens, h._padded_num_tokens = 8, 16
        h.reset_transient_forward_state()
        res[f"hybridep_dp{int(drop_and_pad)}"] = {
            k: (v is None) for k, v in vars(h).items() if k != "over_budget"
        }
        res[f"hybridep_dp{int(drop_and_pad)}_over_budget"] = torch.is_tensor(h.over_budget)

    d = td._DeepepManager.__new__(td._DeepepManager)
    for name in (
        "token_probs",
        "token_indices",
        "tokens_per_expert",
        "dispatched_indices",
        "dispatched_probs",
        "dispatched_routing_map",
        "reversed_mapping_for_combine",
        "pad_offsets",
    ):
        setattr(d, name, t())
    d.handle = object()
    d.hidden_shape_before_permute = torch.Size([8, 16])
    d.reset_transient_forward_state()
    res["deepep"] = {k: v is None for k, v in vars(d).items()}
    return res


# --------------------------------------------------------------------------------------------
# Test side.
# --------------------------------------------------------------------------------------------


@functools.cache
def _train_modes(tree, dispatcher, backend, ep, tp=1, variant=None):
    kwargs = dict(
        dispatcher=dispatcher,
        backend=backend,
        ep=ep,
        recomputes=RECOMPUTE,
        tp=tp,
        variant=variant,
    )
    return run_distributed(f"{THIS}:rank_train_modes", ep * tp, tree, kwargs, timeout=600)


def _train(tree, dispatcher, backend, ep, recompute, compile_=False, tp=1, variant=None):
    if not compile_:
        modes = _train_modes(tree, dispatcher, backend, ep, tp, variant)
        return [res[recompute] for res in modes]
    return _train_one(tree, dispatcher, backend, ep, recompute, compile_)


@functools.cache
def _train_one(tree, dispatcher, backend, ep, recompute, compile_=False):
    kwargs = dict(dispatcher=dispatcher, backend=backend, ep=ep, recompute=recompute)
    kwargs["compile_"] = compile_
    return run_distributed(f"{THIS}:rank_train", ep, tree, kwargs, timeout=600)


@needs_tree
@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("dispatcher,backend,ep", backport(_params(CONFIGS), *EP2_ALL))
def test_nothing_of_the_forward_outlives_backward(dispatcher, backend, ep, recompute):
    """After forward+backward through (checkpointed) MoE layers, no checkpoint input, its
    .grad, router probability, dispatch handle or dispatched probability is reachable, and
    the dispatchers hold 0 bytes of per-forward state."""
    _assert_released(dispatcher, _train(PATCHED_TREE, dispatcher, backend, ep, recompute))


def _assert_released(dispatcher, results, kept=0):
    for rank, res in enumerate(results):
        alive, recorded = dict(res["alive"]), res["alive"]["recorded"]
        alive.pop("recorded")
        assert recorded["input"] > 0 and recorded["probs"] > 0
        if dispatcher == "flex":
            assert recorded["handle"] > 0 and recorded["dispatched_probs"] > 0
        assert alive == dict.fromkeys(alive, 0), f"rank {rank}: still reachable {alive}"
        assert res["held_bytes"] == [kept] * NUM_LAYERS, f"rank {rank}: {res['held_bytes']}"
        assert res["probe_bytes"] == [kept] * NUM_LAYERS, f"rank {rank}: {res['probe_bytes']}"


def rank_dropless_streams(ep):
    """One dropless all-to-all forward on the host stand-in for the DtoH side stream: which
    stream the copies ran on, what it waited for, and what type the split sizes arrived as."""
    import numpy as np

    from megatron.core.transformer.moe import token_dispatcher as td

    _setup(ep)
    (layer,) = _build_layers("alltoall", "dropless", ep, num_layers=1)
    disp = layer.token_dispatcher
    stream = td.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream
    stream.waited.clear()
    layer(_input())
    return {
        "stream": type(stream).__name__,
        "waited": [s.name for s in stream.waited],
        "splits_numpy": all(
            isinstance(getattr(disp, a), np.ndarray) for a in ("input_splits", "output_splits")
        ),
        "sync_point": disp.cuda_sync_point,
    }


@needs_tree
def test_dropless_alltoall_runs_on_the_stream_stand_in():
    """The dropless all-to-all path really takes the side-stream branch on CPU: the copies run
    on a HostStream that waited for the default stream, and the split sizes arrive as numpy
    arrays, as from a GPU."""
    for res in run_distributed(f"{THIS}:rank_dropless_streams", 2, PATCHED_TREE, dict(ep=2)):
        assert res["stream"] == "HostStream"
        assert res["waited"] == ["default"]
        assert res["splits_numpy"]
        assert res["sync_point"] != "no_sync"


@needs_tree
@pytest.mark.parametrize("ep", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_dropless_alltoall_agrees_with_allgather(ep):
    """The stand-in is faithful: the same layers on the dropless all-to-all path and on the
    all-gather dispatcher give the same loss, outputs and gradients (up to summation order)."""
    import torch

    a2a = _train(PATCHED_TREE, "alltoall", "dropless", ep, "none")
    ag = _train(PATCHED_TREE, "allgather", None, ep, "none")
    for a, b in zip(a2a, ag):
        assert torch.allclose(a["loss"], b["loss"], rtol=1e-5)
        assert torch.allclose(a["output"], b["output"], rtol=1e-5, atol=1e-6)
        for name in a["grads"]:
            assert torch.allclose(a["grads"][name], b["grads"][name], rtol=1e-4, atol=1e-6), name


# TP=2 x EP=2 with sequence parallel (4 ranks): the all-gather dispatcher gathers over TPxEP.
TP_CONFIGS = [("allgather", None, 2), ("alltoall", "dropless", 2), ("flex", "hybridep", 2)]
TP_DEFAULT = ("allgather", None, 2)  # the others with -m slow


@needs_base
@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize(
    "dispatcher,backend,ep", _params(TP_CONFIGS, slow=set(TP_CONFIGS) - {TP_DEFAULT}, tp=True)
)
def test_tp2_sequence_parallel(dispatcher, backend, ep, recompute):
    """With TP=2 and sequence parallel as well: nothing of the forward outlives backward, and
    loss, outputs and gradients are bitwise those of the unpatched megatron-core."""
    patched = _train(PATCHED_TREE, dispatcher, backend, ep, recompute, tp=2)
    _assert_released(dispatcher, patched)
    for p, b in zip(patched, _train(BASE_TREE, dispatcher, backend, ep, recompute, tp=2)):
        _assert_bitwise(p, b)


# (dispatcher, backend, EP, variant): each variant with each dispatcher it applies to, at EP2.
# Not here: HybridEP's static budget (moe_expert_rank_capacity_factor) needs the TE op fuser
# (0.19.2 validates it), whose 256-row alignment only TE's fused grouped MLP accepts, so it
# runs through the dispatcher alone (test_hybridep_static_budget_releases); DeepEP does not pad
# to capacity (0.19.2 refuses moe_pad_expert_input_to_capacity with it).
VARIANT_CONFIGS = [
    ("flex", "hybridep", 2, "aux_losses"),
    ("flex", "deepep", 2, "aux_losses"),
    ("alltoall", "dropless", 2, "aux_losses"),
    ("allgather", None, 2, "aux_losses"),
    ("flex", "hybridep", 2, "shared_experts"),
    ("alltoall", "dropless", 2, "shared_experts"),
    ("allgather", None, 2, "shared_experts"),
    ("flex", "hybridep", 2, "shared_experts_overlap"),
    ("alltoall", "dropless", 2, "shared_experts_overlap"),
    ("flex", "hybridep", 2, "drop_and_pad"),
    ("flex", "deepep", 2, "capacity"),
    ("alltoall", "dropless", 2, "capacity"),
]
if _tree_source_has("token_dispatcher.py", "batch_invariant_inverse_permutation_mapping"):
    VARIANT_CONFIGS.append(("alltoall", "dropless", 2, "batch_invariant"))  # main


def _kept_bytes(dispatcher, backend, ep, variant):
    """Per-layer bytes the release keeps by design: HybridEP in drop-and-pad mode keeps
    tokens_per_expert (int64 per local expert, from static shapes), which a CUDA-graph replay
    of the preprocess reuses. No graph hangs off it."""
    if (dispatcher, backend, variant) == ("flex", "hybridep", "drop_and_pad"):
        return 4 // ep * 8
    return 0


# One dispatcher per variant runs by default; the others with -m slow.
DEFAULT_VARIANTS = {
    ("flex", "hybridep", 2, "aux_losses"),
    ("allgather", None, 2, "shared_experts"),
    ("alltoall", "dropless", 2, "shared_experts_overlap"),
    ("flex", "hybridep", 2, "drop_and_pad"),
    ("flex", "deepep", 2, "capacity"),
    ("alltoall", "dropless", 2, "batch_invariant"),
}


@needs_base
@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize(
    "dispatcher,backend,ep,variant",
    _params(VARIANT_CONFIGS, slow=set(VARIANT_CONFIGS) - DEFAULT_VARIANTS),
)
def test_production_variants(dispatcher, backend, ep, variant, recompute):
    """Auxiliary losses, shared experts (with and without overlap), drop-and-pad and
    HybridEP's static budget: nothing of the forward outlives backward, and loss, outputs and
    gradients are bitwise those of the unpatched megatron-core."""
    patched = _train(PATCHED_TREE, dispatcher, backend, ep, recompute, variant=variant)
    _assert_released(dispatcher, patched, kept=_kept_bytes(dispatcher, backend, ep, variant))
    base = _train(BASE_TREE, dispatcher, backend, ep, recompute, variant=variant)
    for p, b in zip(patched, base):
        _assert_bitwise(p, b)


def _assert_bitwise(a, b):
    import torch

    assert torch.equal(a["loss"], b["loss"])
    assert torch.equal(a["output"], b["output"])
    assert a["grads"].keys() == b["grads"].keys()
    for name in a["grads"]:
        ga, gb = a["grads"][name], b["grads"][name]
        assert (ga is None) == (gb is None), name
        assert ga is None or torch.equal(ga, gb), name


@pytest.mark.guard
@needs_base
@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("dispatcher,backend,ep", backport(_params(CONFIGS), *EP2_FLEX))
def test_bitwise_equal_to_base(dispatcher, backend, ep, recompute):
    """Loss, outputs and every gradient are bitwise those of the unpatched megatron-core."""
    patched = _train(PATCHED_TREE, dispatcher, backend, ep, recompute)
    base = _train(BASE_TREE, dispatcher, backend, ep, recompute)
    for p, b in zip(patched, base):
        _assert_bitwise(p, b)


@pytest.mark.guard
@needs_base
@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("dispatcher,backend,ep", backport(_params(CONFIGS), "flex-hybridep-ep2"))
def test_series_adds_no_host_sync(dispatcher, backend, ep, recompute):
    """The release adds no device-to-host synchronization to a training step: per kind
    (``.item()``, ``.tolist()``, blocking copies to the host, stream/event/device
    synchronize) and file, the patched step syncs no more often than the base's."""
    patched = _train(PATCHED_TREE, dispatcher, backend, ep, recompute)
    base = _train(BASE_TREE, dispatcher, backend, ep, recompute)
    assert added_syncs(patched, base) == []


@needs_tree
def test_seeded_host_sync_is_caught():
    """The comparison above is not vacuous: an ``.item()`` seeded into every combine is
    reported with its call site."""
    kwargs = dict(dispatcher="flex", backend="hybridep", ep=2, recompute="none")
    clean = _train(PATCHED_TREE, "flex", "hybridep", 2, "none")
    seeded = run_distributed(
        f"{THIS}:rank_train", 2, PATCHED_TREE, dict(kwargs, seed_sync=True), timeout=600
    )
    added = added_syncs(seeded, clean)
    assert len(added) == 2, added
    assert all(f"{NUM_LAYERS} x item @ test_dispatcher_state_release.py" in a for a in added)


@needs_tree
def test_seeded_device_mismatch_is_caught():
    """A routing map handed to the dispatcher in host memory fails here as it would on a GPU
    (CUDA's device-mismatch error, from the CPU runtime's placement rules)."""
    kwargs = dict(dispatcher="flex", backend="hybridep", ep=2, recompute="none")
    with pytest.raises(DistributedTestError, match="Expected all tensors to be on the same"):
        run_distributed(
            f"{THIS}:rank_train", 2, PATCHED_TREE, dict(kwargs, seed_mismatch=True), timeout=300
        )


@pytest.mark.guard
@needs_base
@pytest.mark.parametrize(
    "dispatcher,backend,ep", [("flex", "hybridep", 1), ("flex", "hybridep", 2)]
)
def test_bitwise_equal_to_base_compiled(dispatcher, backend, ep):
    """The same under torch.compile(backend="aot_eager") (graph breaks allowed)."""
    try:
        base = _train(BASE_TREE, dispatcher, backend, ep, "none", compile_=True)
    except AssertionError as exc:
        pytest.skip(f"the base tree does not compile this path: {str(exc)[-300:]}")
    patched = _train(PATCHED_TREE, dispatcher, backend, ep, "none", compile_=True)
    for p, b in zip(patched, base):
        _assert_bitwise(p, b)
        assert b["held_bytes"] != [0] * NUM_LAYERS  # the base still retains under compile
        assert p["held_bytes"] == [0] * NUM_LAYERS


EDGE_CONFIGS = [c for c in CONFIGS if c[2] <= 2]


@needs_tree
@pytest.mark.parametrize("dispatcher,backend,ep", _params(EDGE_CONFIGS))
def test_release_edge_cases(dispatcher, backend, ep):
    """Release before any dispatch, twice, and while two backwards are pending: gradients are
    unchanged (retain_graph repeated); the state afterwards deep-copies and pickles."""
    for res in run_distributed(
        f"{THIS}:rank_edge_cases",
        ep,
        PATCHED_TREE,
        dict(dispatcher=dispatcher, backend=backend, ep=ep),
    ):
        assert res["outstanding_grads_equal"]
        assert res["held_after_release_pending"] == 0
        assert res["held_end"] == 0
        assert res["deepcopy"] == "ok"
        assert res["pickle"] == "ok"


@needs_tree
@needs_base
def test_hybridep_static_budget_releases():
    """HybridEP with the static budget (moe_expert_rank_capacity_factor): after combine and
    backward the dispatcher holds nothing of the forward and pins neither the input nor the
    probs; over_budget (persistent) stays; outputs and gradients equal the base's bitwise."""
    import torch

    patched = run_distributed(f"{THIS}:rank_static_budget", 2, PATCHED_TREE, dict(ep=2))
    base = run_distributed(f"{THIS}:rank_static_budget", 2, BASE_TREE, dict(ep=2))
    for p, b in zip(patched, base):
        assert p["held"] == 0 and p["alive"] == 0, (p["held"], p["alive"])
        assert p["over_budget"]
        assert torch.equal(p["output"], b["output"])
        assert torch.equal(p["input_grad"], b["input_grad"])


# NCCL-EP needs its library (absent on CPU); its manager's release is unit-tested below.
CUDAGRAPH_CONFIGS = [
    ("flex", "hybridep", 1, None),
    ("flex", "deepep", 2, None),
    ("flex", "hybridep", 2, "drop_and_pad"),
    ("alltoall", "dropless", 2, None),
    ("alltoall", "pad", 1, None),
    ("allgather", None, 2, None),
]


@needs_tree
@pytest.mark.parametrize(
    "dispatcher,backend,ep,variant",
    backport(_params(CUDAGRAPH_CONFIGS, slow=()), "alltoall-dropless-ep2"),
)
def test_cudagraph_attrs_survive_release(dispatcher, backend, ep, variant):
    """Capture reads cudagraph_attrs after preprocess and replay writes them back before
    dispatch; a release in between breaks neither, and keeps what the capture did not return
    (the all-to-all's probs on core_r0.18.0 and older). No release while a stream captures."""
    kwargs = dict(dispatcher=dispatcher, backend=backend, ep=ep, variant=variant)
    for res in run_distributed(f"{THIS}:rank_cudagraph_replay", ep, PATCHED_TREE, kwargs):
        assert res["equal"]
        assert res["captured"]
        assert res["uncaptured_kept"], res["uncaptured"]
        assert res["capture_checked"]
        assert res["held_while_capturing"] > 0


@needs_tree
@pytest.mark.tree_has(
    "megatron/core/transformer/transformer_layer.py", "_local_cudagraph_attr_names"
)
@pytest.mark.parametrize(
    "dispatcher,backend,ep,variant",
    [("alltoall", "dropless", 2, None), ("flex", "hybridep", 2, None)],
)
def test_local_cudagraph_replay_restores_what_the_release_drops(dispatcher, backend, ep, variant):
    """Megatron's local partial CUDA graphs set no valid_cudagraph_attrs: the release then drops
    every tensor it lists, and the replay restores every tensor of cudagraph_attrs it captured.
    So each attribute the release drops must be one of cudagraph_attrs (main appends the
    batch-invariant mapping there), or the replayed forward reads None. Only on trees with
    local partial graphs (0.19.2, main)."""
    kwargs = dict(dispatcher=dispatcher, backend=backend, ep=ep, variant=variant, impl="local")
    for res in run_distributed(f"{THIS}:rank_cudagraph_replay", ep, PATCHED_TREE, kwargs):
        assert res["equal"] and res["captured"], res
        assert res["capture_checked"] and res["held_while_capturing"] > 0, res


@needs_tree
def test_manager_release_without_bootstrap():
    """NCCL-EP (no library here), HybridEP and DeepEP managers built with __new__: the release
    drops the per-forward fields and keeps buffers, bootstrap and drop-and-pad sizes."""
    (res,) = run_distributed(f"{THIS}:rank_manager_units", 1, PATCHED_TREE)
    nccl = res["ncclep"]
    for name in (
        "token_probs",
        "token_indices",
        "dispatched_probs",
        "tokens_per_expert",
        "_buffer",
    ):
        assert nccl[name], name
    assert res["ncclep_kept"] == (True, 64, 256, 8)
    dropless, dropped = res["hybridep_dp0"], res["hybridep_dp1"]
    for name in ("routing_map", "token_probs", "dispatched_probs", "handle", "_padded_num_tokens"):
        assert dropless[name] and dropped[name], name
    assert dropless["tokens_per_expert"] and dropless["num_permuted_tokens"]
    assert not dropped["tokens_per_expert"] and not dropped["num_permuted_tokens"]
    assert not dropless["pad_multiple"] and res["hybridep_dp0_over_budget"]
    deepep = res["deepep"]
    assert not deepep.pop("hidden_shape_before_permute")
    assert all(deepep.values()), deepep


# --------------------------------------------------------------------------------------------
# Numbers for the patch notes: bytes held per layer and step time, base vs patched.
# --------------------------------------------------------------------------------------------
