# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""A model and parallel configuration (:class:`MoEMemoryConfig`, in TransformerConfig's field
names), its checks, and the readers of megatron's pipeline layout and ``moe_layer_freq``."""

import ast
import math
import re
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

from .hybridep import DEFAULT_BLOCKS_PREPROCESSING
from .retained import FLEX_BACKENDS
from .sources import DEEP_EP_SOURCES
from .terms import INT_MAX, _cdiv


@dataclass(frozen=True)
class MoEMemoryConfig:
    """A model and parallel configuration, in TransformerConfig's field names.

    ``tokens_per_rank`` (T) defaults to ``seq_length x micro_batch_size / (TP x CP)``: the tokens
    an MoE layer's dispatcher receives per call with sequence parallelism (``/ CP`` without it:
    ``sequence_parallel=False``). ``ranks_per_node`` is
    the NVLink domain HybridEP detects (8 on an HGX node); the group spans
    ``ceil(ETP x EP / ranks_per_node)`` of them. ``routed_rows_factor`` scales the rows a rank's
    experts receive against balanced routing (T x top-k), at most EP (every routed pair of the
    group on one rank). ``moe_layer_freq`` is Megatron's: N (layer i is MoE when i % N == 0), a
    0/1 list of ``num_layers`` entries, or a pattern string such as ``"([0]*3+[1]*58)"``
    (stored as the tuple). ``deep_ep`` names the deep_ep source priced (:data:`DEEP_EP_SOURCES`).
    ``local_rank``: the rank priced within its NVLink domain; HybridEP's local rank 0 holds 24 B
    of flags more than its peers (None: a rank other than 0).
    """

    hidden_size: int
    num_moe_experts: int
    moe_router_topk: int
    num_layers: int
    seq_length: Optional[int] = None
    micro_batch_size: int = 1
    tensor_model_parallel_size: int = 1
    context_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    pipeline_model_parallel_layout: Union[None, str, Tuple[Tuple[str, ...], ...]] = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    moe_layer_freq: Union[int, Tuple[int, ...]] = 1
    moe_token_dispatcher_type: str = "allgather"
    moe_flex_dispatcher_backend: str = "deepep"
    moe_flex_dispatcher_num_sms: Optional[int] = None
    moe_hybridep_num_sms_preprocessing: int = DEFAULT_BLOCKS_PREPROCESSING
    moe_permute_fusion_into_hybridep: bool = False
    moe_permute_fusion: bool = False
    moe_router_dtype: Optional[str] = None
    moe_expert_rank_capacity_factor: Optional[float] = None
    moe_ncclep_zero_copy: bool = False
    recompute_granularity: Optional[str] = None
    recompute_modules: Sequence[str] = ("core_attn",)
    bf16: bool = True
    sequence_parallel: bool = True
    tokens_per_rank: Optional[int] = None
    ranks_per_node: int = 8
    routed_rows_factor: float = 1.0
    deep_ep: str = "hybrid-ep"
    local_rank: Optional[int] = None

    def __post_init__(self):
        object.__setattr__(
            self, "moe_layer_freq", parse_moe_layer_freq(self.moe_layer_freq, self.num_layers)
        )
        if self.pipeline_model_parallel_layout is not None:
            layout = parse_pipeline_layout(self.pipeline_model_parallel_layout)
            object.__setattr__(self, "pipeline_model_parallel_layout", layout)
        for name in (
            "hidden_size",
            "num_moe_experts",
            "moe_router_topk",
            "num_layers",
            "micro_batch_size",
            "tensor_model_parallel_size",
            "context_parallel_size",
            "pipeline_model_parallel_size",
            "expert_model_parallel_size",
            "moe_hybridep_num_sms_preprocessing",
            "ranks_per_node",
        ):
            check_positive(name, getattr(self, name))
        for name in (
            "seq_length",
            "virtual_pipeline_model_parallel_size",
            "num_layers_in_first_pipeline_stage",
            "num_layers_in_last_pipeline_stage",
            "expert_tensor_parallel_size",
            "tokens_per_rank",
            "moe_flex_dispatcher_num_sms",
        ):
            if getattr(self, name) is not None:
                check_positive(name, getattr(self, name))
        if self.tokens_per_rank is None and self.seq_length is None:
            raise ValueError("seq_length: needed (or tokens_per_rank)")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(
                f"sequence_parallel: must be true or false, got {self.sequence_parallel!r}"
            )
        if self.tokens_per_rank is None and (self.seq_length * self.micro_batch_size) % (
            self._token_split
        ):
            raise ValueError(
                "seq_length: seq_length x micro_batch_size must divide by "
                + ("TP x CP" if self.sequence_parallel else "CP")
            )
        if self.moe_token_dispatcher_type not in ("allgather", "alltoall", "flex"):
            raise ValueError(
                f"moe_token_dispatcher_type: {self.moe_token_dispatcher_type!r} is not one of "
                "allgather, alltoall, flex"
            )
        if self.moe_flex_dispatcher_backend not in FLEX_BACKENDS:
            raise ValueError(
                f"moe_flex_dispatcher_backend: {self.moe_flex_dispatcher_backend!r} is not one "
                f"of {', '.join(FLEX_BACKENDS)}"
            )
        factor = self.moe_expert_rank_capacity_factor
        if factor is not None and not (is_real(factor) and factor > 0):
            raise ValueError(f"moe_expert_rank_capacity_factor: must be positive, got {factor!r}")
        for name in (
            "bf16",
            "moe_ncclep_zero_copy",
            "moe_permute_fusion_into_hybridep",
            "moe_permute_fusion",
            "account_for_embedding_in_pipeline_split",
            "account_for_loss_in_pipeline_split",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        modules = self.recompute_modules
        if not isinstance(modules, (list, tuple)) or not all(isinstance(m, str) for m in modules):
            raise ValueError(f"recompute_modules: must be a list of module names, got {modules!r}")
        if self.deep_ep not in DEEP_EP_SOURCES:
            raise ValueError(
                f"deep_ep: {self.deep_ep!r} is not one of {', '.join(DEEP_EP_SOURCES)}"
            )
        if self.moe_router_dtype not in (None, "fp32", "fp64"):
            raise ValueError(
                f"moe_router_dtype: {self.moe_router_dtype!r} is not one of fp32, fp64"
            )
        if self.recompute_granularity not in (None, "selective", "full"):
            raise ValueError(
                f"recompute_granularity: {self.recompute_granularity!r} is not one of "
                "selective, full"
            )
        if self.num_moe_experts % self.expert_model_parallel_size:
            raise ValueError(
                f"expert_model_parallel_size: {self.expert_model_parallel_size} does not divide "
                f"the {self.num_moe_experts} experts"
            )
        if self.moe_router_topk > self.num_moe_experts:
            raise ValueError(
                f"moe_router_topk: {self.moe_router_topk} exceeds the {self.num_moe_experts} "
                "experts"
            )
        self._check_pipeline()
        if self.group_size > self.ranks_per_node and self.group_size % self.ranks_per_node:
            raise ValueError(
                f"ranks_per_node: {self.ranks_per_node} does not divide the dispatcher group "
                f"of {self.group_size} ranks (ETP x EP)"
            )
        rf = self.routed_rows_factor
        if not (is_real(rf) and 0 < rf <= self.expert_model_parallel_size):
            raise ValueError(
                f"routed_rows_factor: must be a number above 0 and at most EP "
                f"({self.expert_model_parallel_size}: every routed pair of the group on one rank), "
                f"got {rf!r}"
            )
        if factor is not None and factor * self.tokens * self.moe_router_topk >= 2**63:
            raise ValueError(
                f"moe_expert_rank_capacity_factor: {factor!r} x {self.tokens} tokens x top-"
                f"{self.moe_router_topk} overflows NCCL EP's 64-bit receive capacity"
            )

    @property
    def etp(self) -> int:
        """Expert tensor-parallel size (TransformerConfig defaults it to TP)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def group_size(self) -> int:
        """The flex dispatcher's group: ETP x EP ranks (``tp_ep_group``)."""
        return self.etp * self.expert_model_parallel_size

    @property
    def tokens(self) -> int:
        """T: tokens per MoE layer call on this rank."""
        if self.tokens_per_rank is not None:
            return self.tokens_per_rank
        return self.seq_length * self.micro_batch_size // self._token_split

    @property
    def _token_split(self) -> int:
        """The ranks a micro-batch's tokens are split over before the MoE layer: CP, and TP with
        sequence parallelism (without it each TP rank holds the whole sequence)."""
        tp = self.tensor_model_parallel_size if self.sequence_parallel else 1
        return tp * self.context_parallel_size

    def _check_pipeline(self) -> None:
        """Megatron's checks of the pipeline split (transformer_config.py, layout module)."""
        pp, vpp, layout = (
            self.pipeline_model_parallel_size,
            self.virtual_pipeline_model_parallel_size,
            self.pipeline_model_parallel_layout,
        )
        first, last = (
            self.num_layers_in_first_pipeline_stage,
            self.num_layers_in_last_pipeline_stage,
        )
        if pp * (vpp or 1) > MAX_PATTERN_LAYERS:
            raise ValueError(
                f"pipeline_model_parallel_size: {pp * (vpp or 1):,} pipeline stages (PP x VPP) "
                "are more than any model has layers"
            )
        emb, loss = (
            self.account_for_embedding_in_pipeline_split,
            self.account_for_loss_in_pipeline_split,
        )
        if (emb or loss) and (first is not None or last is not None):
            raise ValueError(
                "account_for_embedding_in_pipeline_split: not with num_layers_in_first/last_"
                f"pipeline_stage ({TRANSFORMER_CONFIG}:1923-1932)"
            )
        if layout is not None:
            if first is not None or last is not None or emb or loss:
                raise ValueError(
                    "pipeline_model_parallel_layout: cannot be set with num_layers_in_first/last_"
                    f"pipeline_stage or account_for_* ({TRANSFORMER_CONFIG}:1939-1953)"
                )
            where = "megatron/core/transformer/pipeline_parallel_layer_layout.py"
            if len(layout) % pp:
                raise ValueError(
                    f"pipeline_model_parallel_layout: {len(layout)} stages do not divide over "
                    f"PP {pp} ({where}:40-44)"
                )
            if vpp is not None and vpp != len(layout) // pp:
                raise ValueError(
                    f"virtual_pipeline_model_parallel_size: {vpp}, but the layout has "
                    f"{len(layout) // pp} stages per pipeline rank ({TRANSFORMER_CONFIG}:1973-1979)"
                )
            decoders = sum(stage.count("decoder") for stage in layout)
            if decoders != self.num_layers:
                raise ValueError(
                    f"pipeline_model_parallel_layout: {decoders} decoder layers for num_layers "
                    f"{self.num_layers} ({where}:106-109)"
                )
            return
        if first is None and last is None:
            stages = pp * (vpp or 1)
            total = self.num_layers + emb + loss  # the embedding and loss as layers
            if total % stages:
                raise ValueError(
                    "pipeline_model_parallel_size: must divide num_layers"
                    + (" + the embedding/loss layers" if emb or loss else "")
                    + (f" (x {vpp} virtual stages)" if vpp else "")
                )
            if total // stages == 0 and emb + loss > 0:
                raise ValueError(
                    "account_for_embedding_in_pipeline_split: a stage would hold fewer than 0 "
                    "layers (megatron/core/transformer/transformer_block.py:185-196)"
                )
            return
        middle, middle_stages = self.num_layers, pp
        for name, n, lines in (("first", first, ":2000-2011"), ("last", last, ":2019-2030")):
            if n is None:
                continue
            if vpp and n % vpp:
                raise ValueError(
                    f"num_layers_in_{name}_pipeline_stage: {n} does not divide into {vpp} virtual "
                    f"stages ({TRANSFORMER_CONFIG}{lines})"
                )
            middle, middle_stages = middle - n, middle_stages - 1
        if bool(middle) != bool(middle_stages) or middle < 0:
            raise ValueError(
                f"num_layers_in_first_pipeline_stage: {middle} middle layers for {middle_stages} "
                f"middle stages ({TRANSFORMER_CONFIG}:2035-2039)"
            )
        if middle_stages > 0 and (middle % middle_stages or (middle // middle_stages) % (vpp or 1)):
            raise ValueError(
                f"num_layers_in_first_pipeline_stage: {middle} middle layers do not divide over "
                f"{middle_stages} middle stages"
                + (f" x {vpp} virtual" if vpp else "")
                + f" ({TRANSFORMER_CONFIG}:2043-2062)"
            )

    def _stage_decoders(self) -> List[int]:
        """Decoder layers of each pipeline stage in layer order: stage v x PP + r is virtual
        stage v of rank r (megatron's get_transformer_layer_offset / the layout's flatten)."""
        pp, vpp = self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size or 1
        if self.pipeline_model_parallel_layout is not None:
            return [stage.count("decoder") for stage in self.pipeline_model_parallel_layout]
        first, last = (
            self.num_layers_in_first_pipeline_stage,
            self.num_layers_in_last_pipeline_stage,
        )
        if first is None and last is None:
            emb = self.account_for_embedding_in_pipeline_split
            loss = self.account_for_loss_in_pipeline_split
            counts = [(self.num_layers + emb + loss) // (pp * vpp)] * (pp * vpp)
            counts[0] -= emb  # the first stage's first layer is the embedding
            counts[-1] -= loss  # the last stage's last, the loss
            return counts
        middle_stages = pp - (first is not None) - (last is not None)
        middle = self.num_layers - (first or 0) - (last or 0)
        per_rank = [middle // middle_stages if middle_stages > 0 else 0] * pp
        if first is not None:
            per_rank[0] = first
        if last is not None:
            per_rank[-1] = last
        return [per_rank[r] // vpp for _ in range(vpp) for r in range(pp)]

    def stage_moe_layers(self) -> List[int]:
        """MoE layers of each pipeline stage in layer order (stage v x PP + r is virtual stage v
        of rank r): the decoder layers of each stage (:meth:`_stage_decoders`: even, uneven
        first/last stages, or ``pipeline_model_parallel_layout``), layer i MoE when
        ``moe_layer_freq`` says so (``i % N == 0``, or the pattern's entry, as
        ``gpt_layer_specs.py`` reads it)."""
        freq = self.moe_layer_freq
        counts = []
        first = 0
        for n in self._stage_decoders():
            end = first + n
            if isinstance(freq, int):
                counts.append(_cdiv(end, freq) - _cdiv(first, freq))
            else:
                counts.append(sum(freq[first:end]))
            first = end
        return counts

    def rank_moe_layers(self) -> List[int]:
        """MoE layers each pipeline rank builds (all its virtual stages)."""
        pp = self.pipeline_model_parallel_size
        counts = [0] * pp
        for s, n in enumerate(self.stage_moe_layers()):
            counts[s % pp] += n
        return counts

    @property
    def moe_layers_per_rank(self) -> int:
        """MoE layers of the pipeline rank that builds the most (:meth:`rank_moe_layers`)."""
        return max(self.rank_moe_layers())

    @property
    def moe_layers_in_flight(self) -> int:
        """MoE layer forwards whose backward has not yet run, at the training step's peak, on
        the pipeline rank that holds the most: what a term held from a layer's forward to its
        backward is multiplied by. A recomputed MoE layer runs its forward without autograd and
        again in its backward: 1 (full recompute as one layer per checkpoint, as the retained
        state assumes). Otherwise without pipelining, every MoE layer of the rank
        (one micro-batch at a time); with 1F1B, PP - r micro-batches on rank r (its warmup,
        ``schedules.py:957``, and the steady state's forward); interleaved, the warmup of
        ``schedules.py:964-965`` (micro-batch groups of PP) and one more virtual micro-batch,
        through the steady state, each of the MoE layers of its model chunk
        (:func:`_interleaved_in_flight`). Megatron main d98e8a64ddf3; enough micro-batches to
        reach the steady state are assumed (the configuration does not say how many)."""
        if self.recompute != "none":
            return 1
        pp = self.pipeline_model_parallel_size
        stages = self.stage_moe_layers()
        vpp = len(stages) // pp
        if pp == 1:
            return sum(stages)
        if vpp == 1:
            return max(stages[r] * (pp - r) for r in range(pp))
        return max(
            _interleaved_in_flight([stages[v * pp + r] for v in range(vpp)], pp, r)
            for r in range(pp)
        )

    @property
    def recompute(self) -> str:
        """``selective`` when the MoE layer is recomputed, ``full``, or ``none``."""
        if self.recompute_granularity == "full":
            return "full"
        if self.recompute_granularity == "selective" and "moe" in self.recompute_modules:
            return "selective"
        return "none"


def _interleaved_in_flight(chunks: Sequence[int], pp: int, rank: int) -> int:
    """The most MoE layer forwards pipeline rank ``rank`` holds without their backward under
    megatron's interleaved schedule, its model chunks holding ``chunks`` MoE layers each: the
    forward of virtual micro-batch k runs chunk (k mod (PP x V)) // PP and the backward of j the
    reverse chunk (``get_schedule_table``, ``get_model_chunk_id``, schedules.py:989, 1244-1248);
    the warmup runs (PP - r - 1) x 2 + (V - 1) x PP forwards (schedules.py:964-965), then each
    step one forward and one backward. Simulated over two whole periods of the steady state."""
    v = len(chunks)
    period = pp * v
    warmup = (pp - rank - 1) * 2 + (v - 1) * pp

    def forward(k: int) -> int:
        return chunks[(k % period) // pp]

    def backward(j: int) -> int:
        return chunks[v - 1 - (j % period) // pp]

    held = sum(forward(k) for k in range(warmup))
    most = held
    for j in range(2 * period):
        held += forward(warmup + j)
        most = max(most, held)
        held -= backward(j)
    return most


def check_positive(name: str, value) -> None:
    """ValueError naming ``name`` unless ``value`` is a positive int that fits a C int."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    if value > INT_MAX:
        raise ValueError(f"{name}: must be at most {INT_MAX:,} (a C int), got {value:,}")


def is_real(value) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


MAX_PATTERN_LAYERS = 1 << 20  # a moe_layer_freq pattern longer than this is no model's
GPT_LAYER_SPECS = "megatron/core/models/gpt/gpt_layer_specs.py"
TRANSFORMER_CONFIG = "megatron/core/transformer/transformer_config.py"


def _eval_pattern(text: str) -> list:
    """A Megatron pattern string (``"([0]*3+[1]*58)"``, ``"[1,0]*4"``) read without ``eval``: only
    lists of integers, ``+``, ``*`` by an integer and parentheses (what arguments.py's
    ``moe_freq_type`` accepts in practice)."""

    def ev(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Add) and type(a) is type(b):
                return a + b
            if isinstance(node.op, ast.Mult):
                n, seq = (a, b) if isinstance(a, int) else (b, a)
                if isinstance(n, int) and isinstance(seq, list):
                    if len(seq) * max(n, 0) > MAX_PATTERN_LAYERS:
                        raise ValueError("longer than any model")
                    return seq * n
                if isinstance(a, int) and isinstance(b, int) and abs(a * b) <= MAX_PATTERN_LAYERS:
                    return a * b
        raise ValueError("only lists of 0/1, + and * by an integer are read")

    if len(text) > 65536:
        raise ValueError("longer than any model")
    try:
        value = ev(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, RecursionError, MemoryError) as exc:
        raise ValueError(type(exc).__name__) from None
    if not isinstance(value, list):
        raise ValueError("not a list")
    return value


LAYER_CHARS = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}
LAYER_TYPES = ("embedding", "loss", "encoder", "decoder", "mtp")  # megatron's LayerType


def _unroll(match) -> str:
    body, times = match.group(1), int(match.group(2))
    if len(body) * times > MAX_PATTERN_LAYERS:
        raise ValueError("longer than any model")
    return body * times


def parse_pipeline_layout(value) -> Tuple[Tuple[str, ...], ...]:
    """Megatron's ``pipeline_model_parallel_layout``: a list of stages, each a list of layer
    types (``embedding``, ``decoder``, ``mtp``, ``loss``), or the string form (``"Et|(tt|)*29,
    m|L"``: E, t, m, L; ``|`` between stages, ``(...)*n`` and ``x*n`` repeat, commas cosmetic),
    unrolled as ``pipeline_parallel_layer_layout.py`` ``parse_str_to_list`` does, bounded. The
    stages as tuples of type names; ValueError names the field."""
    name = "pipeline_model_parallel_layout"
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    if isinstance(value, str):
        text = value.replace(",", "")
        if len(text) > 65536:
            raise ValueError(f"{name}: longer than any model")
        try:
            for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
                text = re.sub(pattern, _unroll, text)
                if len(text) > MAX_PATTERN_LAYERS:
                    raise ValueError("longer than any model")
        except ValueError as exc:
            raise ValueError(f"{name}: cannot read {shown}: {exc}") from None
        bad = next((ch for ch in text if ch not in LAYER_CHARS and ch != "|"), None)
        if bad is not None:
            raise ValueError(
                f"{name}: {bad!r} is no layer (E, t, m, L; '|' between stages) in {shown}"
            )
        return tuple(tuple(LAYER_CHARS[ch] for ch in stage) for stage in text.split("|"))
    if not isinstance(value, (list, tuple)) or not all(isinstance(r, (list, tuple)) for r in value):
        raise ValueError(f"{name}: must be a list of stages (lists of layer types) or a string")
    stages = []
    for row in value:
        kinds = [v.strip().lower() if isinstance(v, str) else v for v in row]
        bad = next((k for k in kinds if k not in LAYER_TYPES), None)
        if bad is not None or any(not isinstance(k, str) for k in kinds):
            raise ValueError(f"{name}: {bad!r} is not one of {', '.join(LAYER_TYPES)}")
        stages.append(tuple(kinds))
    if sum(len(s) for s in stages) > MAX_PATTERN_LAYERS:
        raise ValueError(f"{name}: longer than any model")
    return tuple(stages)


def parse_moe_layer_freq(value, num_layers) -> Union[int, Tuple[int, ...]]:
    """Megatron's ``moe_layer_freq`` as an int N or a tuple of 0/1 per layer: an int, a list, a
    string of an int, or a pattern string (arguments.py ``moe_freq_type``). ValueError names
    the field and never echoes a whole list."""
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    if isinstance(value, str):
        text = value.strip()
        if "[" in text:
            try:
                value = _eval_pattern(text)
            except ValueError as exc:
                raise ValueError(f"moe_layer_freq: cannot read {shown}: {exc}") from None
        else:
            try:
                value = int(text)
            except ValueError:
                raise ValueError(
                    f"moe_layer_freq: {shown} is neither an integer nor a pattern such as "
                    "'([0]*3+[1]*58)'"
                ) from None
    if isinstance(value, int) and not isinstance(value, bool):
        check_positive("moe_layer_freq", value)
        return value
    if not isinstance(value, (list, tuple)):
        raise ValueError(
            f"moe_layer_freq: must be an integer, a 0/1 list or a pattern string, got {shown}"
        )
    if any(type(v) is not int or v not in (0, 1) for v in value):
        bad = next(v for v in value if type(v) is not int or v not in (0, 1))
        raise ValueError(f"moe_layer_freq: entries are 0 (dense) or 1 (MoE), got {bad!r}")
    if isinstance(num_layers, int) and len(value) != num_layers:
        raise ValueError(
            f"moe_layer_freq: the pattern has {len(value)} entries for {num_layers} layers; "
            f"megatron needs one per layer ({GPT_LAYER_SPECS}:653)"
        )
    return tuple(value)
