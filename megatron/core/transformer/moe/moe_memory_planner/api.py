# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The public estimate: a ``TransformerConfig`` (or a Mapping of its fields) and the tokens per
rank to a :class:`MoEMemoryEstimate`, with the dispatcher state of the installed
megatron-core."""

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .config import MoEMemoryConfig
from .deepep import NUM_MAX_NVL_PEERS
from .plan import buffer_terms, hybridep_layout, kernel_refusal, kernel_warnings, layer_shape
from .retained import BACKENDS, retained_chain_terms, retained_state_terms
from .sources import DEEP_EP_SOURCES, DEEP_EP_V2_COMMIT, NCCL_EP_COMMIT
from .terms import HOST, NCCL_GRANULARITY, OUTSIDE, Term, device_rounding, released_bytes, total

if TYPE_CHECKING:  # only for the annotations: the planner imports the standard library alone
    from megatron.core.transformer.transformer_config import TransformerConfig


# The dispatcher classes of megatron/core/transformer/moe/token_dispatcher.py, by
# moe_token_dispatcher_type.
DISPATCHER_CLASSES = {
    "allgather": "MoEAllGatherTokenDispatcher",
    "alltoall": "MoEAlltoAllTokenDispatcher",
    "flex": "MoEFlexTokenDispatcher",
}
# The hook a releasing tree's dispatchers call at the end of combine_postprocess (megatron-core
# with moe-release's series; upstream's dev branch has reset_transient_forward_state() but does
# not call it after combine).
RELEASE_HOOK = "_maybe_reset_transient_forward_state"


def installed_tree_releases(dispatcher_type: str) -> bool:
    """Whether the installed megatron-core's dispatcher of ``dispatcher_type`` (allgather,
    alltoall, flex) releases its per-forward state once combine is done: its
    ``combine_postprocess`` calls ``_maybe_reset_transient_forward_state``. Read from the
    installed code (imports ``megatron.core.transformer.moe.token_dispatcher``, and so torch);
    nothing is built or run."""
    import inspect

    from megatron.core.transformer.moe import token_dispatcher

    if dispatcher_type not in DISPATCHER_CLASSES:
        raise ValueError(
            f"moe_token_dispatcher_type: {dispatcher_type!r} is not one of "
            f"{', '.join(DISPATCHER_CLASSES)}"
        )
    cls = getattr(token_dispatcher, DISPATCHER_CLASSES[dispatcher_type])
    code = getattr(inspect.unwrap(cls.combine_postprocess), "__code__", None)
    return code is not None and RELEASE_HOOK in code.co_names


# The device memory a rank's releasable bytes are a share of when none is given: no field of the
# configuration names the GPU, so an 80 GiB device (H100 or A100 80GB) is assumed.
DEFAULT_DEVICE_MEMORY = 80 * 1024**3


@dataclass(frozen=True)
class ReleasableBytes:
    """What one rank gets back between steps (for a colocated loop's rollout) on a tree that
    releases; all 0 on one that does not (no collective release, the state kept).

    Attributes:
        buffers_device: device bytes of the communication buffers
            ``reset_fused_a2a_buffers(collective=True, group=G)`` frees (outside PyTorch's
            allocator): the terms a release frees, not those held in flight.
        buffers_pinned_host: pinned host bytes it frees.
        state_device: device bytes of the dispatcher state an unpatched tree keeps between
            calls and this one releases after combine (PyTorch's allocator: back in its cache,
            to the device after ``torch.cuda.empty_cache()``); None: not modelled.
        state_pinned_host: pinned host bytes of that state; None: not modelled.
        device_memory: the device's memory, bytes (:data:`DEFAULT_DEVICE_MEMORY` unless given).
        not_priced: what the release returns that these bytes leave out, one line each.
    """

    buffers_device: int = 0
    buffers_pinned_host: int = 0
    state_device: Optional[int] = 0
    state_pinned_host: Optional[int] = 0
    device_memory: int = DEFAULT_DEVICE_MEMORY
    not_priced: Tuple[str, ...] = ()

    @property
    def buffers(self) -> int:
        """Bytes the collective release frees, device and pinned host."""
        return self.buffers_device + self.buffers_pinned_host

    @property
    def dispatcher_state(self) -> Optional[int]:
        """Bytes of dispatcher state no longer held between calls (None: not modelled)."""
        if self.state_device is None or self.state_pinned_host is None:
            return None
        return self.state_device + self.state_pinned_host

    @property
    def total(self) -> int:
        """Buffers + dispatcher state (what is not modelled counts 0: see ``not_priced``)."""
        return self.buffers + (self.dispatcher_state or 0)

    @property
    def device_bytes(self) -> int:
        """The device's part of :attr:`total` (pinned host memory is not device memory)."""
        return self.buffers_device + (self.state_device or 0)

    @property
    def device_share(self) -> float:
        """:attr:`device_bytes` as a fraction of :attr:`device_memory`."""
        return self.device_bytes / self.device_memory


@dataclass(frozen=True)
class MoEMemoryEstimate:
    """What the MoE layers of one rank hold, term by term (:func:`estimate`).

    Attributes:
        config: the configuration priced (TransformerConfig's field names).
        buffers: the flex dispatcher's communication buffers, one :class:`Term` each (bytes,
            where they live: ``OUTSIDE`` PyTorch's allocator or ``HOST`` pinned memory, the
            source line that sizes them, whether a release of the buffers frees them); empty
            for the all-gather and all-to-all dispatchers. Allocated at the first dispatch, held
            until released; one set per rank, whatever the number of layers.
        buffer_source: the source and commit the buffer terms were read from.
        releases: whether the tree priced releases its dispatchers' per-forward state after
            combine (megatron-core with moe-release's series) or keeps it between calls.
        dispatcher_state: what one MoE layer's dispatcher keeps between calls, in PyTorch's
            allocator (or pinned host memory): empty where the tree releases it; None where it
            is not modelled (the DeepEP v2 and NCCL EP backends).
        dispatcher_state_chain: without recompute, what a later layer's retained graph adds
            through each earlier layer's combine (every MoE layer but the last).
        moe_layers: MoE layers of the pipeline rank that builds the most.
        warnings: limits the backend documents but does not enforce, one line each
            (:func:`kernel_warnings`): priced as given.
        moe_layers_in_flight: MoE layer forwards whose backward has not run at the step's peak
            (:attr:`MoEMemoryConfig.moe_layers_in_flight`): each holds the ``in_flight``
            terms.
        releasable: what the rank gets back between steps (:class:`ReleasableBytes`): the
            buffers the collective release frees and the dispatcher state the tree no longer
            holds; all 0 where ``releases`` is False.

    ``buffers`` are the bytes the code asks for; :attr:`buffer_device_rounding` adds what the
    device takes beyond them (:func:`device_rounding`). A term with ``in_flight`` (NCCL EP's
    routing handle) is held by each MoE layer from its forward until its backward, in PyTorch's
    allocator (:attr:`in_flight_bytes`), and not counted in :attr:`buffer_bytes` or
    :attr:`buffer_released_bytes`: between steps nothing holds it.
    """

    config: MoEMemoryConfig
    buffers: Tuple[Term, ...]
    buffer_source: str
    releases: bool
    dispatcher_state: Optional[Tuple[Term, ...]]
    dispatcher_state_chain: Tuple[Term, ...]
    moe_layers: int
    warnings: Tuple[str, ...] = ()
    releasable: ReleasableBytes = field(default_factory=ReleasableBytes)
    moe_layers_in_flight: int = 1

    @property
    def in_flight_bytes_per_layer(self) -> int:
        """Bytes one MoE layer holds from its forward until its backward (``in_flight``)."""
        return total([t for t in self.buffers if t.in_flight])

    @property
    def in_flight_bytes(self) -> int:
        """Bytes the ``in_flight`` terms take at the step's peak: per layer x
        :attr:`moe_layers_in_flight`; 0 between steps."""
        return self.in_flight_bytes_per_layer * self.moe_layers_in_flight

    @property
    def releasable_bytes(self) -> int:
        """What the rank gets back between steps, in all (:attr:`ReleasableBytes.total`)."""
        return self.releasable.total

    @property
    def buffer_device_rounding(self) -> Tuple[Term, ...]:
        """What each buffer allocation takes on the device beyond the bytes it asks for."""
        return tuple(device_rounding(self.buffers))

    @property
    def buffer_device_bytes(self) -> int:
        """:attr:`buffer_bytes` as the device sees them: each NCCL allocation rounded to the
        cuMem granularity (2 MiB assumed)."""
        return self.buffer_bytes + total(self.buffer_device_rounding, OUTSIDE)

    @property
    def buffer_bytes(self) -> int:
        """Device bytes of the communication buffers, outside PyTorch's allocator."""
        return total(self.buffers, OUTSIDE)

    @property
    def buffer_pinned_host_bytes(self) -> int:
        """Pinned host bytes of the communication buffers."""
        return total(self.buffers, HOST)

    @property
    def buffer_released_bytes(self) -> int:
        """Bytes (device and pinned host) a release of the buffers gives back: 0 where the
        tree does not release (an unpatched megatron-core has no collective release)."""
        return released_bytes(self.buffers) if self.releases else 0

    @property
    def dispatcher_state_bytes_per_layer(self) -> Optional[int]:
        """Bytes one MoE layer's dispatcher keeps between calls (None: not modelled)."""
        return None if self.dispatcher_state is None else total(self.dispatcher_state)

    @property
    def dispatcher_state_bytes(self) -> Optional[int]:
        """Bytes every MoE layer of the rank keeps between calls (None: not modelled)."""
        per_layer = self.dispatcher_state_bytes_per_layer
        if per_layer is None:
            return None
        chain = total(self.dispatcher_state_chain) * max(self.moe_layers - 1, 0)
        return per_layer * self.moe_layers + chain


def buffer_source(cfg: MoEMemoryConfig) -> str:
    """The source and commit ``cfg``'s buffer terms are read from ("" without buffers)."""
    if cfg.moe_token_dispatcher_type != "flex":
        return ""
    backend = cfg.moe_flex_dispatcher_backend
    if backend == "deepepv2":
        return f"DeepEP epv2-release {DEEP_EP_V2_COMMIT}"
    if backend == "ncclep":
        return f"NCCL EP nccl-extensions {NCCL_EP_COMMIT}"
    return f"deep_ep {cfg.deep_ep} {DEEP_EP_SOURCES[cfg.deep_ep]}"


def not_priced(cfg: MoEMemoryConfig, buffers: Sequence[Term]) -> List[str]:
    """What the collective release of ``cfg``'s buffers returns, or the patched tree no longer
    holds, that the planner does not price, one line each (empty where everything is): NVSHMEM's
    own memory (DeepEP past 8 ranks: only ``num_rdma_bytes`` is priced), DOCA's own (HybridEP
    across nodes: its buffers and queue pairs are priced), NCCL's communicators (DeepEP v2 and
    NCCL EP), the cuMem rounding of ``ncclMemAlloc`` (assumed, not in the byte-exact total) and
    the dispatcher state of the backends whose state is not modelled."""
    if cfg.moe_token_dispatcher_type != "flex":
        return []
    backend = cfg.moe_flex_dispatcher_backend
    out = []
    peers = min(cfg.ranks_per_node, NUM_MAX_NVL_PEERS)  # DeepEP's node (plan.buffer_terms)
    if backend == "deepep" and cfg.group_size > peers:
        out.append(
            "NVSHMEM's own memory beyond num_rdma_bytes (DeepEP across "
            f"{cfg.group_size // peers} nodes)"
        )
    nodes = hybridep_layout(cfg).nodes if backend == "hybridep" else 1
    if nodes > 1:
        out.append(
            "DOCA's own memory beyond the RDMA buffers and queue pairs priced (HybridEP across "
            f"{nodes} nodes)"
        )
    if backend not in BACKENDS:
        out.append("NCCL's communicator memory")
    freed = [t for t in buffers if t.released and not t.in_flight]
    rounding = total(device_rounding(freed), OUTSIDE)
    if rounding:
        out.append(
            f"ncclMemAlloc's rounding to the cuMem granularity (+{rounding:,} B at an assumed "
            f"{NCCL_GRANULARITY // 2**20} MiB)"
        )
    if backend not in BACKENDS:
        out.append(f"the dispatcher state (not modelled for {backend})")
    return out


def _releasable(
    cfg: MoEMemoryConfig,
    buffers: Sequence[Term],
    state: Optional[Sequence[Term]],
    chain: Sequence[Term],
    device_memory: int,
) -> ReleasableBytes:
    """What a releasing tree gives back: ``buffers`` the collective release frees, and the
    ``state`` (per MoE layer) and ``chain`` (every MoE layer but the last) an unpatched tree
    would keep between calls (None: not modelled)."""
    freed = [t for t in buffers if t.released and not t.in_flight]
    host = total(freed, HOST)
    state_device: Optional[int] = None
    state_host: Optional[int] = None
    if state is not None:
        n = cfg.moe_layers_per_rank
        held = total(state) * n + total(chain) * max(n - 1, 0)
        state_host = total(state, HOST) * n + total(chain, HOST) * max(n - 1, 0)
        state_device = held - state_host
    return ReleasableBytes(
        buffers_device=total(freed) - host,
        buffers_pinned_host=host,
        state_device=state_device,
        state_pinned_host=state_host,
        device_memory=device_memory,
        not_priced=tuple(not_priced(cfg, buffers)),
    )


def estimate_config(
    cfg: MoEMemoryConfig, releases: Optional[bool] = None, device_memory: Optional[int] = None
) -> MoEMemoryEstimate:
    """:func:`estimate` of a :class:`MoEMemoryConfig`. ``releases`` None: read from the
    installed megatron-core (:func:`installed_tree_releases`); ``device_memory`` None:
    :data:`DEFAULT_DEVICE_MEMORY`."""
    if device_memory is None:
        device_memory = DEFAULT_DEVICE_MEMORY
    if type(device_memory) is not int or device_memory <= 0:
        raise ValueError(
            f"device_memory: must be a positive number of bytes, got {device_memory!r}"
        )
    refusal = kernel_refusal(cfg)
    if refusal:
        raise ValueError(refusal)
    dispatcher = cfg.moe_token_dispatcher_type
    if releases is None:
        releases = installed_tree_releases(dispatcher)
    flex = dispatcher == "flex"
    backend = cfg.moe_flex_dispatcher_backend if flex else None
    kept: Optional[Tuple[Term, ...]] = None  # what an unpatched tree keeps per MoE layer
    kept_chain: Tuple[Term, ...] = ()
    if backend in (None,) + BACKENDS:
        shape = layer_shape(cfg)
        group = cfg.group_size if flex else cfg.expert_model_parallel_size
        nodes = max(group // cfg.ranks_per_node, 1)
        kept = tuple(retained_state_terms(shape, dispatcher, backend, nodes))
        kept_chain = tuple(retained_chain_terms(shape, dispatcher, backend))
    buffers = tuple(buffer_terms(cfg))
    if releases:
        state = None if kept is None else ()
        chain: Tuple[Term, ...] = ()
        releasable = _releasable(cfg, buffers, kept, kept_chain, device_memory)
    else:
        state, chain = kept, kept_chain
        releasable = ReleasableBytes(device_memory=device_memory)
    return MoEMemoryEstimate(
        config=cfg,
        buffers=buffers,
        buffer_source=buffer_source(cfg),
        releases=releases,
        dispatcher_state=state,
        dispatcher_state_chain=chain,
        moe_layers=cfg.moe_layers_per_rank,
        warnings=tuple(kernel_warnings(cfg)),
        releasable=releasable,
        moe_layers_in_flight=cfg.moe_layers_in_flight,
    )


# TransformerConfig fields the estimate reads; any other field of the config is not read.
CONFIG_FIELDS = tuple(
    f.name
    for f in fields(MoEMemoryConfig)
    if f.name not in ("tokens_per_rank", "seq_length", "micro_batch_size", "ranks_per_node",
                      "routed_rows_factor", "deep_ep", "bf16", "local_rank")
)  # fmt: skip


# What the caller's config is: a megatron-core TransformerConfig or a Mapping of its fields.
ConfigLike = Union["TransformerConfig", Mapping[str, Any]]
# Fields the estimate cannot do without (a TransformerConfig of a dense model has no experts).
NEEDED_FIELDS = ("hidden_size", "num_moe_experts", "moe_router_topk", "num_layers")


def _field(config: ConfigLike, name: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


def config_from(
    config: ConfigLike,
    tokens_per_rank: int,
    ranks_per_node: int = 8,
    routed_rows_factor: float = 1.0,
    deep_ep: str = "hybrid-ep",
    local_rank: Optional[int] = None,
) -> MoEMemoryConfig:
    """The :class:`MoEMemoryConfig` of a megatron-core ``TransformerConfig`` (its fields read
    with getattr) or a Mapping of the same field names; a field it lacks or holds None takes
    TransformerConfig's default. ``bf16`` or ``fp16`` set: 16-bit activations. A
    ``PipelineParallelLayerLayout`` is read from what it was built from. ValueError names the
    field."""
    missing = [name for name in NEEDED_FIELDS if _field(config, name) is None]
    if missing:
        raise ValueError(f"{missing[0]}: needed, got None or nothing (an MoE model's field)")
    values: Dict[str, Any] = {}
    for name in CONFIG_FIELDS:
        value = _field(config, name)
        if value is None:
            continue
        if name == "pipeline_model_parallel_layout" and hasattr(value, "input_data"):
            value = value.input_data  # megatron's PipelineParallelLayerLayout
        if name == "pipeline_model_parallel_layout" and isinstance(value, (list, tuple)):
            value = [[getattr(t, "name", t) for t in stage] for stage in value]  # LayerType
        if name in ("recompute_modules", "moe_layer_freq") and isinstance(value, list):
            value = tuple(value)
        values[name] = value
    values["bf16"] = bool(_field(config, "bf16") or _field(config, "fp16"))
    return MoEMemoryConfig(
        **values,
        tokens_per_rank=tokens_per_rank,
        ranks_per_node=ranks_per_node,
        routed_rows_factor=routed_rows_factor,
        deep_ep=deep_ep,
        local_rank=local_rank,
    )


def estimate(
    config: ConfigLike,
    tokens_per_rank: int,
    *,
    ranks_per_node: int = 8,
    routed_rows_factor: float = 1.0,
    deep_ep: str = "hybrid-ep",
    releases: Optional[bool] = None,
    local_rank: Optional[int] = None,
    device_memory: Optional[int] = None,
) -> MoEMemoryEstimate:
    """The MoE memory one rank of ``config`` holds, before anything is allocated: the flex
    dispatcher's communication buffers and the dispatcher state the tree keeps between calls.

    Args:
        config: a megatron-core ``TransformerConfig``, or a Mapping of its field names
            (``hidden_size``, ``num_moe_experts``, ``moe_router_topk`` and ``num_layers`` are
            needed; the parallel sizes, pipeline split, ``moe_layer_freq``, dispatcher and
            backend, recompute, ``bf16``/``fp16`` are read where given).
        tokens_per_rank: tokens one MoE layer's dispatcher receives per call on this rank
            (``seq_length x micro_batch_size / (TP x CP)`` with sequence parallelism).
        ranks_per_node: ranks of one NVLink domain (8 on an HGX node, 72 on GB200 NVL72).
        routed_rows_factor: rows this rank's experts receive, as a multiple of balanced
            routing (``tokens_per_rank x top-k``); at most EP.
        deep_ep: the deep_ep source DeepEP's normal mode is priced at: ``hybrid-ep``
            (``DEEP_EP_COMMIT``) or ``main`` (``DEEP_EP_MAIN_COMMIT``).
        releases: whether the tree releases its dispatchers' state after combine; None reads
            it from the installed megatron-core (:func:`installed_tree_releases`).
        local_rank: the rank priced (its rank within the NVLink domain counts): HybridEP's
            local rank 0 allocates 3 x 8 B of flags its peers map; None prices a peer.
        device_memory: the device's memory in bytes, which ``releasable`` gives its share of
            (None: :data:`DEFAULT_DEVICE_MEMORY`, 80 GiB; the config names no GPU).

    Returns:
        A :class:`MoEMemoryEstimate`: every term with its bytes, where it lives and the source
        line that sizes it (HybridEP's and DeepEP's buffers from deep_ep at ``DEEP_EP_COMMIT``
        or ``DEEP_EP_MAIN_COMMIT``, DeepEP v2's at ``DEEP_EP_V2_COMMIT``, NCCL EP's at
        ``NCCL_EP_COMMIT``; its ``buffer_source`` names the one used), what the MoE layers
        hold from their forward until their backward (``in_flight_bytes``: NCCL EP's routing
        handle, per layer in flight) and what the rank gets back between steps
        (``releasable``, ``releasable_bytes``: 0 where ``releases`` is False).

    Raises:
        ValueError: a field missing or out of range, or a configuration the kernels refuse,
            named with the line that refuses it.
        ImportError: ``releases`` None where megatron-core (and torch) cannot be imported.

    Not modelled: NVSHMEM's own memory, NCCL communicators, the cuMem fabric granularity,
    DeepEP's low-latency mode, capacity-factor routing (the estimate is dropless), the MoE
    layers of MTP, per-expert padding of routed rows for FP8, the device-dependent limits of
    the kernels (SM count, shared memory), activations, weights and optimizer state, and the
    dispatcher state of the DeepEP v2 and NCCL EP backends (``dispatcher_state`` is None).
    HybridEP's chunk sizes are read from the environment, as deep_ep reads them.
    """
    cfg = config_from(
        config, tokens_per_rank, ranks_per_node, routed_rows_factor, deep_ep, local_rank
    )
    return estimate_config(cfg, releases, device_memory)
