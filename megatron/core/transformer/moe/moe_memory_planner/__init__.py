# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""MoE memory planner: what the MoE token dispatchers of one rank will hold, priced from the
model and parallel configuration before anything is allocated.

Admission checks and memory estimators (ART's trainer, Megatron-Bridge's estimator) need two
numbers that neither ``torch.cuda.memory_allocated`` nor a learned peak gives them in advance:

* **the communication buffers** of the flex dispatcher, allocated outside PyTorch's caching
  allocator by the kernels: :func:`hybridep_buffer_terms` (HybridEP, intranode NVLink and
  multi-node RDMA), :func:`deepep_buffer_terms` (DeepEP normal mode),
  :func:`deepep_v2_buffer_terms` and :func:`nccl_ep_terms`, term by term, each citing the
  source line that allocates it;
* **the dispatcher state kept between calls**, per MoE layer: :func:`retained_state_terms`
  (routing map, probabilities, the dispatch handle and the autograd graph the differentiable
  dispatched probabilities pin), held by a megatron-core whose dispatchers do not release it
  after combine. megatron-core with moe-release's series releases it and keeps nothing.

:func:`estimate` is the entry point: a ``TransformerConfig`` (or a Mapping of its field names)
and the tokens per rank to a :class:`MoEMemoryEstimate`, every term with its bytes, where it
lives, the source line that sizes it and whether a release frees it, and what the rank gets back
between steps on a tree that releases (:class:`ReleasableBytes`: the buffers
``reset_fused_a2a_buffers(collective=True, group=G)`` frees plus the dispatcher state no longer
held, a share of the device's memory, what it leaves unpriced; 0 where the tree does not
release). The dispatcher state is
that of the *installed* megatron-core: :func:`installed_tree_releases` reads from its code
whether its dispatchers release after combine. Invalid input or a configuration the kernels
refuse is a ValueError naming the field (and the refusing source line). The command that
prints a configuration's terms, unpatched megatron-core beside patched, from flags or a
Megatron-Bridge YAML, is moe-release's ``scripts/moe_memory_plan.py``; this package has none.

Sources (``MODELLED_COMMITS``). deep_ep is read at ``DEEP_EP_COMMIT``, the head of its
``hybrid-ep`` branch; the commit megatron main's CI pins (``de0dd11``) was not available to read,
so where the two differ these figures follow ``DEEP_EP_COMMIT``. TransformerEngine (NCCL EP's
API, the fused permute) is read at ``TRANSFORMER_ENGINE_COMMIT`` (d0067d0), not megatron main's
pin 4329ff8, whose ``ep_bootstrap`` takes neither ``num_topk`` nor ``drop_on_overflow``
(docs/planner.md lists the pins and what differs). Two deep_ep terms depend on the commit: the
unused all-gather buffer (``enable_custom_allgather`` defaults to False at ``DEEP_EP_COMMIT``)
and the rounding of rows to the combine chunk (since deep_ep 4214430). DeepEP's normal mode is
also priced at DeepEP main (``DEEP_EP_MAIN_COMMIT``, 2.1.0: other dispatch/combine configs, EP
48 and 96) when ``deep_ep="main"`` is chosen; the estimate names the source it priced.
Configurations the kernels refuse (HybridEP's ``BufferConfig::is_valid``, DeepEP's group
sizes and SM count) are refused here with the line that refuses them, and HybridEP's
chunk-size environment variables are read as deep_ep reads them (``atoi``, default 64) for
every term they size. megatron-core call sites are cited as in megatron-core 0.19.2. Terms
marked approximate (the DOCA queue pairs of multi-node HybridEP) come from a stored NCCL
version, not deep_ep's submodule pin.

Across NVLink domains (``ranks_per_node``, the domain NCCL's load/store team spans) DeepEP v2
is priced in its hybrid layout and NCCL EP with its per-domain probabilities and GIN buffer.
The terms are the bytes the code asks for; :func:`device_rounding` adds what the device takes
(each ``ncclMemAlloc`` rounded to an assumed 2 MiB cuMem granularity, allocator tensors to 512
B). NCCL EP's routing handle is not a buffer: TransformerEngine's dispatch and combine save it
for backward, so every MoE layer holds one from its forward until its backward, priced per layer
in flight (:attr:`MoEMemoryConfig.moe_layers_in_flight`); its never-freed device communicator of
one domain is listed with its bytes unpriced.

Not modelled: NVSHMEM's own memory (DeepEP across more than 8 ranks), the bytes of NCCL's
communicators, DeepEP's low-latency mode, capacity-factor routing (drop-and-pad keeps
other shapes; the terms are dropless), the retained state of the DeepEP v2 and NCCL EP backends
(their buffers are priced, :func:`deepep_v2_buffer_terms` at ``DEEP_EP_V2_COMMIT``,
:func:`nccl_ep_terms` at ``NCCL_EP_COMMIT``), the MoE layers of MTP, the per-expert padding of
routed rows for FP8, the kernels' limits that depend on the device (its SM count, shared
memory), and everything outside the dispatchers (activations, weights, optimizer state).

Imports only the standard library (:func:`installed_tree_releases` imports the installed
megatron-core when called).

The package, by section (each module imports only those above it):

* ``sources``: the deep_ep, DeepEP v2, TransformerEngine and NCCL EP commits the terms cite
  (``MODELLED_COMMITS``);
* ``terms``: :class:`Term` and the byte arithmetic;
* ``hybridep``, ``deepep``, ``deepep_v2``, ``nccl_ep``: one module per flex backend's buffers;
* ``retained``: the dispatcher state an unpatched megatron-core keeps between calls;
* ``config``: :class:`MoEMemoryConfig` and its checks;
* ``plan``: a configuration's terms, refusals and per-call bytes;
* ``api``: :func:`estimate` and the installed tree.

Every public name of these modules is importable from the package itself.
"""

from .api import (
    CONFIG_FIELDS,
    DEFAULT_DEVICE_MEMORY,
    DISPATCHER_CLASSES,
    NEEDED_FIELDS,
    RELEASE_HOOK,
    ConfigLike,
    MoEMemoryEstimate,
    ReleasableBytes,
    buffer_source,
    config_from,
    estimate,
    estimate_config,
    installed_tree_releases,
    not_priced,
)
from .config import (
    GPT_LAYER_SPECS,
    LAYER_CHARS,
    LAYER_TYPES,
    MAX_PATTERN_LAYERS,
    TRANSFORMER_CONFIG,
    MoEMemoryConfig,
    check_positive,
    is_real,
    parse_moe_layer_freq,
    parse_pipeline_layout,
)
from .deepep import (
    DEEPEP_COMBINE_CONFIGS,
    DEEPEP_DISPATCH_CONFIGS,
    DEEPEP_MAIN_COMBINE_CONFIGS,
    DEEPEP_MAIN_DISPATCH_CONFIGS,
    DEEPEP_NVL_META,
    DEEPEP_SOURCE,
    DEEPEP_WORKSPACE,
    DEFAULT_DEEPEP_SMS,
    MAX_TOPK,
    NUM_MAX_NVL_PEERS,
    SOURCE_META_BYTES,
    DeepEPSource,
    deepep_buffer_terms,
    deepep_emulated_bytes,
    deepep_nvl_bytes,
    deepep_rdma_bytes,
)
from .deepep_v2 import (
    DEEPEP_V2_MAX_CHANNELS,
    DEEPEP_V2_WORKSPACE,
    deepep_v2_buffer_terms,
    deepep_v2_refusal,
)
from .hybridep import (
    ALLOCATOR_TEST_BYTES,
    CHUNK_ENV,
    DEFAULT_BLOCKS_PREPROCESSING,
    DEFAULT_CHUNK,
    DEFAULT_MULTINODE_BLOCKS,
    HYBRIDEP_MAX_MULTINODE_ROWS,
    HYBRIDEP_MAX_TX_DEPTH,
    MIN_ROWS,
    TMP_STATE_BYTES,
    HybridEPLayout,
    env_chunk,
    hybridep_buffer_terms,
    hybridep_handle_terms,
    hybridep_refusal,
    hybridep_rows,
    hybridep_rows_after,
)
from .nccl_ep import (
    NCCL_EP_DEFAULT_SMS,
    NCCL_EP_HANDLE_HELD_BY,
    NCCL_EP_MAX_TOKENS_PER_RANK,
    NCCL_EP_RDMA_CHUNK,
    nccl_ep_capacity,
    nccl_ep_gin_bytes,
    nccl_ep_handle_bytes,
    nccl_ep_terms,
)
from .plan import (
    buffer_terms,
    expert_working_set,
    hybridep_growth,
    hybridep_layout,
    kernel_refusal,
    kernel_warnings,
    layer_shape,
    measured_retained_bytes,
    per_call_bytes,
    recompute_combine_floor,
)
from .retained import (
    BACKENDS,
    DISPATCHERS,
    FLEX_BACKENDS,
    RECOMPUTE_MODES,
    LayerShape,
    deepep_internode_handle_terms,
    retained_chain_terms,
    retained_state_terms,
)
from .sources import (
    DEEP_EP_COMMIT,
    DEEP_EP_MAIN_COMMIT,
    DEEP_EP_SOURCES,
    DEEP_EP_V2_COMMIT,
    MODELLED_COMMITS,
    NCCL_EP_COMMIT,
    SRC,
    TRANSFORMER_ENGINE_COMMIT,
)
from .terms import (
    ALLOCATOR,
    BF16,
    FP32,
    HOST,
    INT32,
    INT64,
    INT_MAX,
    NCCL_GRANULARITY,
    OUTSIDE,
    TORCH_BLOCK,
    Term,
    device_rounding,
    released_bytes,
    total,
)

__all__ = [
    "CONFIG_FIELDS",
    "DEFAULT_DEVICE_MEMORY",
    "DISPATCHER_CLASSES",
    "NEEDED_FIELDS",
    "RELEASE_HOOK",
    "ConfigLike",
    "MoEMemoryEstimate",
    "ReleasableBytes",
    "buffer_source",
    "config_from",
    "estimate",
    "estimate_config",
    "installed_tree_releases",
    "not_priced",
    "GPT_LAYER_SPECS",
    "LAYER_CHARS",
    "LAYER_TYPES",
    "MAX_PATTERN_LAYERS",
    "TRANSFORMER_CONFIG",
    "MoEMemoryConfig",
    "check_positive",
    "is_real",
    "parse_moe_layer_freq",
    "parse_pipeline_layout",
    "DEEPEP_COMBINE_CONFIGS",
    "DEEPEP_DISPATCH_CONFIGS",
    "DEEPEP_MAIN_COMBINE_CONFIGS",
    "DEEPEP_MAIN_DISPATCH_CONFIGS",
    "DEEPEP_NVL_META",
    "DEEPEP_SOURCE",
    "DEEPEP_WORKSPACE",
    "DEFAULT_DEEPEP_SMS",
    "MAX_TOPK",
    "NUM_MAX_NVL_PEERS",
    "SOURCE_META_BYTES",
    "DeepEPSource",
    "deepep_buffer_terms",
    "deepep_emulated_bytes",
    "deepep_nvl_bytes",
    "deepep_rdma_bytes",
    "DEEPEP_V2_WORKSPACE",
    "deepep_v2_buffer_terms",
    "ALLOCATOR_TEST_BYTES",
    "CHUNK_ENV",
    "DEFAULT_BLOCKS_PREPROCESSING",
    "DEFAULT_CHUNK",
    "DEFAULT_MULTINODE_BLOCKS",
    "HYBRIDEP_MAX_MULTINODE_ROWS",
    "HYBRIDEP_MAX_TX_DEPTH",
    "MIN_ROWS",
    "TMP_STATE_BYTES",
    "HybridEPLayout",
    "env_chunk",
    "hybridep_buffer_terms",
    "hybridep_handle_terms",
    "hybridep_refusal",
    "hybridep_rows",
    "hybridep_rows_after",
    "nccl_ep_capacity",
    "nccl_ep_terms",
    "buffer_terms",
    "expert_working_set",
    "hybridep_growth",
    "hybridep_layout",
    "kernel_refusal",
    "layer_shape",
    "measured_retained_bytes",
    "per_call_bytes",
    "recompute_combine_floor",
    "BACKENDS",
    "DISPATCHERS",
    "FLEX_BACKENDS",
    "RECOMPUTE_MODES",
    "LayerShape",
    "retained_chain_terms",
    "retained_state_terms",
    "DEEP_EP_COMMIT",
    "DEEP_EP_MAIN_COMMIT",
    "DEEP_EP_SOURCES",
    "DEEP_EP_V2_COMMIT",
    "NCCL_EP_COMMIT",
    "SRC",
    "ALLOCATOR",
    "BF16",
    "FP32",
    "HOST",
    "INT32",
    "INT64",
    "INT_MAX",
    "OUTSIDE",
    "Term",
    "released_bytes",
    "total",
    "DEEPEP_V2_MAX_CHANNELS",
    "deepep_v2_refusal",
    "NCCL_EP_DEFAULT_SMS",
    "NCCL_EP_MAX_TOKENS_PER_RANK",
    "NCCL_EP_RDMA_CHUNK",
    "nccl_ep_gin_bytes",
    "nccl_ep_handle_bytes",
    "kernel_warnings",
    "NCCL_GRANULARITY",
    "TORCH_BLOCK",
    "device_rounding",
    "MODELLED_COMMITS",
    "TRANSFORMER_ENGINE_COMMIT",
    "NCCL_EP_HANDLE_HELD_BY",
    "deepep_internode_handle_terms",
]
