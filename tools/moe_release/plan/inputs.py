# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The command's input: Megatron's argument names and a Megatron-Bridge style YAML to a
:class:`MoEMemoryConfig`, strictly: a key or flag within typo distance of a known one, a value
of the wrong kind, or a configuration megatron refuses is a ValueError naming it (and the
refusing source line); deprecated fields megatron still accepts are read, with a note."""

import argparse
import difflib
import math
import re
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from moe_release import settings
from moe_release.plan.pricing import planner

CHUNK_ENV = planner.CHUNK_ENV
DEEP_EP_COMMIT = planner.DEEP_EP_COMMIT
DEEP_EP_MAIN_COMMIT = planner.DEEP_EP_MAIN_COMMIT
INT_MAX = planner.INT_MAX
TRANSFORMER_CONFIG = planner.TRANSFORMER_CONFIG
MoEMemoryConfig = planner.MoEMemoryConfig
_positive = planner.check_positive
_real = planner.is_real


@dataclass(frozen=True)
class Arg:
    """One command-line argument: its flag (Megatron's name where Megatron has one) and help."""

    flag: str
    help: str
    metavar: str = "INT"


# MoEMemoryConfig field -> its argument; the help says what it is, its default and its unit.
ARGS = {
    "hidden_size": Arg("--hidden-size", "hidden size H, elements per token"),
    "num_moe_experts": Arg("--num-experts", "routed experts of an MoE layer"),
    "moe_router_topk": Arg("--moe-router-topk", "experts each token is routed to"),
    "num_layers": Arg("--num-layers", "transformer layers of the model, all pipeline stages"),
    "seq_length": Arg(
        "--seq-length", "tokens per sequence (no default: needed unless --tokens-per-rank)"
    ),
    "micro_batch_size": Arg("--micro-batch-size", "sequences per micro-batch (default 1)"),
    "tensor_model_parallel_size": Arg("--tensor-model-parallel-size", "TP, ranks (default 1)"),
    "context_parallel_size": Arg("--context-parallel-size", "CP, ranks (default 1)"),
    "pipeline_model_parallel_size": Arg(
        "--pipeline-model-parallel-size",
        "PP, ranks (default 1); without a layout, PP x VPP must divide --num-layers",
    ),
    "virtual_pipeline_model_parallel_size": Arg(
        "--num-virtual-stages-per-pipeline-rank",
        "VPP, virtual stages per pipeline rank (default: none; with a layout, from it)",
    ),
    "num_layers_in_first_pipeline_stage": Arg(
        "--decoder-first-pipeline-num-layers",
        "layers of the first pipeline stage (default: an even split)",
    ),
    "num_layers_in_last_pipeline_stage": Arg(
        "--decoder-last-pipeline-num-layers",
        "layers of the last pipeline stage (default: an even split)",
    ),
    "pipeline_model_parallel_layout": Arg(
        "--pipeline-model-parallel-layout",
        "megatron's layout string, e.g. 'Et*4|(tttt|)*14,tmL' (E embedding, t decoder, m MTP, "
        "L loss; '|' between stages; default: layers split evenly over PP x VPP)",
        "LAYOUT",
    ),
    "expert_model_parallel_size": Arg("--expert-model-parallel-size", "EP, ranks (default 1)"),
    "expert_tensor_parallel_size": Arg(
        "--expert-tensor-parallel-size", "ETP, ranks (default: TP); the flex group is ETP x EP"
    ),
    "moe_layer_freq": Arg(
        "--moe-layer-freq",
        "which layers are MoE: N (every Nth layer from layer 0), or a pattern of one 0/1 per "
        "layer such as '([0]*3+[1]*58)' (default 1: every layer)",
        "N|PATTERN",
    ),
    "moe_token_dispatcher_type": Arg(
        "--moe-token-dispatcher-type", "allgather, alltoall or flex (default allgather)", "TYPE"
    ),
    "moe_flex_dispatcher_backend": Arg(
        "--moe-flex-dispatcher-backend",
        f"flex backend: {', '.join(planner.FLEX_BACKENDS[:-1])} or {planner.FLEX_BACKENDS[-1]}"
        " (default deepep)",
        "BACKEND",
    ),
    "moe_flex_dispatcher_num_sms": Arg(
        "--moe-flex-dispatcher-num-sms",
        "SMs of the flex kernels (default: DeepEP 20, even; HybridEP 8 per direction across "
        "nodes, where its queue pairs scale with it)",
    ),
    "moe_hybridep_num_sms_preprocessing": Arg(
        "--moe-hybridep-num-sms-preprocessing", "HybridEP preprocessing blocks (default 108)"
    ),
    "moe_router_dtype": Arg(
        "--moe-router-dtype", "router probabilities: fp32 or fp64 (default: the model's)", "DTYPE"
    ),
    "moe_expert_rank_capacity_factor": Arg(
        "--moe-expert-rank-capacity-factor",
        "NCCL EP receive capacity, a multiple of tokens x top-k (default: none, eager sizing)",
        "FACTOR",
    ),
    "recompute_granularity": Arg(
        "--recompute-granularity", "selective or full (default: no recompute)", "GRANULARITY"
    ),
    "recompute_modules": Arg(
        "--recompute-modules",
        "modules selective recompute reruns; 'moe' reruns the MoE layer (default core_attn)",
        "MODULE",
    ),
    "tokens_per_rank": Arg(
        "--tokens-per-rank",
        "T, tokens an MoE layer's dispatcher gets per call on a rank "
        "(default: seq x micro-batch / (TP x CP), sequence parallel)",
    ),
    "ranks_per_node": Arg(
        "--ranks-per-node",
        "ranks of one NVLink domain (default 8: an HGX node; GB200: 72; HybridEP: "
        "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN when set)",
    ),
    "routed_rows_factor": Arg(
        "--routed-rows-factor",
        "rows a rank's experts receive, as a multiple of balanced routing T x top-k "
        "(default 1.0; above 0, at most EP)",
        "FACTOR",
    ),
    "deep_ep": Arg(
        "--deep-ep",
        f"deep_ep source priced: hybrid-ep (branch head {DEEP_EP_COMMIT[:7]}: HybridEP and "
        f"DeepEP; default) or main (DeepEP 2.1.0, {DEEP_EP_MAIN_COMMIT[:7]}: DeepEP only, its "
        "own configs, EP 48 and 96 too)",
        "SOURCE",
    ),
}
REQUIRED = ("hidden_size", "num_moe_experts", "moe_router_topk", "num_layers")
# Command-line flag (Megatron's argument names) -> MoEMemoryConfig field.
FLAGS = {arg.flag: name for name, arg in ARGS.items()}
FIELD_FLAGS = {field_name: flag for flag, field_name in FLAGS.items()}
# The flags build_parser adds beside ARGS, named as megatron names them.
FIELD_FLAGS.update({name: "--" + name.replace("_", "-") for name in (
    "num_layers_per_virtual_pipeline_stage", "sequence_parallel", "moe_ncclep_zero_copy",
    "moe_permute_fusion_into_hybridep", "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split", "moe_permute_fusion",
)})  # fmt: skip
INT_FIELDS = {
    "hidden_size", "num_moe_experts", "moe_router_topk", "num_layers", "seq_length",
    "micro_batch_size", "tensor_model_parallel_size", "context_parallel_size",
    "pipeline_model_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
    "moe_flex_dispatcher_num_sms", "moe_hybridep_num_sms_preprocessing",
    "tokens_per_rank", "ranks_per_node", "virtual_pipeline_model_parallel_size",
    "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
}  # fmt: skip
FLOAT_FIELDS = ("routed_rows_factor", "moe_expert_rank_capacity_factor")
BOOL_KEYS = (
    "bf16", "fp16", "moe_ncclep_zero_copy", "moe_enable_deepep", "moe_layer_recompute",
    "moe_permute_fusion_into_hybridep", "moe_permute_fusion",
    "sequence_parallel", "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)  # fmt: skip
# Megatron's argument names for TransformerConfig fields (arguments.py).
YAML_ALIASES = {
    "num_experts": "num_moe_experts",
    "num_virtual_stages_per_pipeline_rank": "virtual_pipeline_model_parallel_size",
    "decoder_first_pipeline_num_layers": "num_layers_in_first_pipeline_stage",
    "decoder_last_pipeline_num_layers": "num_layers_in_last_pipeline_stage",
}
# Deprecated TransformerConfig fields megatron-core 0.19 still accepts and routes to
# moe_flex_dispatcher_num_sms unless that is set (transformer_config.py:1616-1635).
DEPRECATED_SMS = ("moe_deepep_num_sms", "moe_hybridep_num_sms")
# Megatron's own names (TransformerConfig, ModelParallelConfig, megatron/training/config and
# arguments.py in megatron-core 0.19.2) that are not the planner's but lie within the typo
# distance of one of its names: never taken for a typo. A test re-derives it from the tree.
MEGATRON_NEIGHBOURS = frozenset({
    "eval_micro_batch_size", "ffn_hidden_size", "inference_moe_token_dispatcher_type",
    "main_params_dtype", "model_parallel_size", "moe_expert_capacity_factor",
    "moe_router_fusion", "moe_router_group_topk", "mtp_num_layers",
    "rl_inference_expert_model_parallel_size",
    "rl_inference_pipeline_model_parallel_size", "rl_inference_tensor_model_parallel_size",
})  # fmt: skip
# Megatron fields the terms depend on that the planner does not model: set, they are noted.
NOT_MODELLED = {
    "moe_expert_capacity_factor": "capacity-factor routing (the plan is dropless)",
    "moe_pad_expert_input_to_capacity": "capacity-factor routing (the plan is dropless)",
    "mtp_num_layers": "multi-token-prediction layers (their MoE layers are not counted)",
    "moe_router_padding_for_fp8": "rows padded per expert for FP8 (routed rows are unpadded)",
    "moe_router_padding_for_quantization": "rows padded per expert (routed rows are unpadded)",
}
TYPO_CUTOFF = 0.8  # difflib ratio: expert_model_paralel_size is 0.98 from its field


def _known_keys() -> List[str]:
    return sorted(set(ARGS) | set(YAML_ALIASES) | set(BOOL_KEYS) | set(DEPRECATED_SMS)
                  | {"params_dtype", "num_layers_per_virtual_pipeline_stage"})  # fmt: skip


def closest(name: str, known: Sequence[str]) -> Optional[str]:
    """The known name ``name`` is most likely a typo of (difflib), or None."""
    match = difflib.get_close_matches(name, list(known), n=1, cutoff=TYPO_CUTOFF)
    return match[0] if match else None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit status 2
        raise SystemExit(_fail(message))


def _fail(message: str) -> int:
    print(f"moe_memory_planner: {message}", file=sys.stderr)
    return 2


def _note(message: str) -> None:
    print(f"moe_memory_planner: note: {message}", file=sys.stderr)


def read_config_file(path: str, notes: Optional[List[str]] = None) -> Dict[str, object]:
    """The planner's fields of a Megatron-Bridge style YAML (``model:`` and ``train:`` sections,
    or top-level keys, in TransformerConfig's names). A key that is no name the planner or
    Megatron knows but lies within typo distance of one of the planner's is a ValueError naming
    the closest; other keys are not the planner's. The deprecated SM-count fields and
    ``moe_enable_deepep`` are kept under their names (:func:`apply_deprecated` routes them);
    fields the planner does not model are appended to ``notes``."""
    try:
        import yaml
    except ImportError:
        raise ValueError("--config-file: reading YAML needs PyYAML (pip install pyyaml)") from None
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        lines = str(exc).splitlines() or [type(exc).__name__]
        raise ValueError(f"--config-file: {path}: {lines[0]}") from None
    except RecursionError:
        raise ValueError(f"--config-file: {path}: nested too deeply") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config-file: {path}: not a mapping")
    known = _known_keys()
    values: Dict[str, object] = {}
    for where, section in (("top level", data), ("train:", data.get("train")),
                           ("model:", data.get("model"))):  # fmt: skip
        if not isinstance(section, dict):
            continue
        for key, value in section.items():
            if key == "params_dtype" and isinstance(value, dict):  # Bridge: {_target_: torch.x}
                value = str(value.get("_target_"))
            if not isinstance(key, str) or isinstance(value, dict):
                if section is data and isinstance(key, str) and key not in ("model", "train"):
                    near = closest(key, ["model", "train"])
                    if near:
                        raise ValueError(
                            f"--config-file: {path}: unknown section {key!r}; the closest known "
                            f"is {near!r}"
                        )
                continue
            if key in NOT_MODELLED and value not in (None, False, 0) and notes is not None:
                notes.append(f"{key} is set; not modelled: {NOT_MODELLED[key]}")
            if key in known:
                values[YAML_ALIASES.get(key, key)] = value
            elif key not in MEGATRON_NEIGHBOURS and closest(key, known):
                raise ValueError(
                    f"--config-file: {path}: unknown key {key!r} ({where}); the closest known "
                    f"name is {closest(key, known)!r}"
                )
    if "params_dtype" in values:  # torch.bfloat16 or torch.float16: 16-bit activations
        dtype = str(values.pop("params_dtype"))
        if "bf16" not in values and "fp16" not in values:
            values["bf16"] = "float16" in dtype
    return values


def apply_deprecated(values: Dict[str, object], notes: List[str]) -> None:
    """Megatron's handling of the deprecated fields it still accepts, in place: the SM-count
    knobs route to ``moe_flex_dispatcher_num_sms`` unless it is set (``transformer_config.py``
    1616-1635; two that differ are an error), ``moe_layer_recompute`` is selective recompute
    of ``moe`` (1835-1846), ``moe_enable_deepep`` selects the deepep backend of the flex
    dispatcher (1589-1598)."""
    sms = {}
    for name in DEPRECATED_SMS:
        value = values.pop(name, None)
        if value is not None:
            _positive(name, value)
            sms[name] = value
    if sms:
        notes.append(f"{', '.join(sms)} is deprecated; megatron routes it to "
                     f"moe_flex_dispatcher_num_sms ({TRANSFORMER_CONFIG}:1616-1635)")  # fmt: skip
        if values.get("moe_flex_dispatcher_num_sms") is None:
            if len(set(sms.values())) > 1:
                raise ValueError(
                    f"{'/'.join(sms)}: conflicting deprecated SM counts "
                    f"{', '.join(f'{k}={v}' for k, v in sms.items())}; megatron refuses them "
                    f"({TRANSFORMER_CONFIG}:1630-1634)"
                )
            values["moe_flex_dispatcher_num_sms"] = next(iter(sms.values()))
    if values.pop("moe_layer_recompute", False) is True:
        if values.get("recompute_granularity") == "full":
            raise ValueError(
                "moe_layer_recompute: conflicts with recompute_granularity full; megatron "
                f"refuses it ({TRANSFORMER_CONFIG}:1840-1843)"
            )
        values["recompute_granularity"] = "selective"
        modules = values.get("recompute_modules") or ["core_attn"]
        if isinstance(modules, (list, tuple)) and "moe" not in modules:
            values["recompute_modules"] = list(modules) + ["moe"]
        notes.append(
            "moe_layer_recompute is deprecated; megatron reads it as recompute_granularity "
            f"selective with moe among recompute_modules ({TRANSFORMER_CONFIG}:1835-1846)"
        )
    enable = values.pop("moe_enable_deepep", False)
    if not isinstance(enable, bool):
        raise ValueError(f"moe_enable_deepep: must be true or false, got {enable!r}")
    if enable:
        if values.get("moe_token_dispatcher_type") != "flex":
            raise ValueError(
                "moe_enable_deepep: needs moe_token_dispatcher_type flex; megatron refuses it "
                f"({TRANSFORMER_CONFIG}:1590-1591)"
            )
        if values.get("moe_flex_dispatcher_backend") == "hybridep":
            raise ValueError(
                "moe_enable_deepep: conflicts with moe_flex_dispatcher_backend hybridep; megatron "
                f"refuses it ({TRANSFORMER_CONFIG}:1592-1593)"
            )
        values["moe_flex_dispatcher_backend"] = "deepep"
        notes.append(
            "moe_enable_deepep is deprecated; megatron reads it as moe_flex_dispatcher_backend "
            f"deepep ({TRANSFORMER_CONFIG}:1589-1598)"
        )


ARGUMENTS = "megatron/training/arguments.py"
LAYERS_PER_VIRTUAL_STAGE = "num_layers_per_virtual_pipeline_stage"


def _vpp_from_layers_per_stage(values: Dict[str, object]) -> None:
    """Megatron's ``--num-layers-per-virtual-pipeline-stage``: VPP = num_layers / PP / it,
    exclusive of the other VPP arguments and of uneven stages (``arguments.py:894-944``)."""
    n = values.pop(LAYERS_PER_VIRTUAL_STAGE, None)
    if n is None:
        return
    _positive(LAYERS_PER_VIRTUAL_STAGE, n)
    if any(values.get(k) is not None for k in (
        "virtual_pipeline_model_parallel_size", "pipeline_model_parallel_layout",
    )):  # fmt: skip
        raise ValueError(
            f"{LAYERS_PER_VIRTUAL_STAGE}: no more than one of it, the virtual stages per rank "
            f"and the layout ({ARGUMENTS}:894-905)"
        )
    if any(values.get(k) is not None for k in (
        "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
    )):  # fmt: skip
        raise ValueError(
            f"{LAYERS_PER_VIRTUAL_STAGE}: not with uneven first/last stages ({ARGUMENTS}:921-922)"
        )
    layers, pp = values.get("num_layers"), values.get("pipeline_model_parallel_size") or 1
    if not isinstance(layers, int) or not isinstance(pp, int) or pp <= 0:
        return  # the config's own checks name what is wrong
    if layers % pp or (layers // pp) % n:
        raise ValueError(
            f"{LAYERS_PER_VIRTUAL_STAGE}: {n} does not divide the {layers} layers' share of "
            f"each of the {pp} pipeline stages ({ARGUMENTS}:933-938)"
        )
    vpp = layers // pp // n
    values["virtual_pipeline_model_parallel_size"] = vpp if vpp > 1 else None


RANKS_ENV = "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"


def _ranks_per_node_from_env(values: Dict[str, object], notes: List[str]) -> None:
    """HybridEP takes its NVLink domain from ``NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN`` when
    set, over what it detects (``deep_ep/hybrid_ep_buffer.py:63-72``, ``int()``), and asserts
    it divides the group (``:74-76``): so does the plan of a hybridep configuration, with a
    note where it overrides ``--ranks-per-node``."""
    raw = settings.deep_ep_variable(RANKS_ENV)
    if raw is None or values.get("moe_flex_dispatcher_backend") != "hybridep":
        return
    try:
        ranks = int(raw)
    except ValueError:
        raise ValueError(
            f"{RANKS_ENV}={raw[:40]!r}: deep_ep reads it with int(), which refuses it "
            "(deep_ep/hybrid_ep_buffer.py:63-65)"
        ) from None
    ep = values.get("expert_model_parallel_size") or 1
    etp = values.get("expert_tensor_parallel_size") or values.get("tensor_model_parallel_size") or 1
    if not 0 < ranks <= INT_MAX or (ep * etp) % ranks:
        raise ValueError(
            f"{RANKS_ENV}={raw[:40]!r}: HybridEP needs it to divide the group of ETP x EP = "
            f"{ep * etp} ranks (deep_ep/hybrid_ep_buffer.py:74-76)"
        )
    given = values.get("ranks_per_node")
    if given is not None and given != ranks:
        notes.append(f"{RANKS_ENV}={ranks} overrides --ranks-per-node {given}, as in deep_ep")
    values["ranks_per_node"] = ranks


def _check_types(values: Dict[str, object]) -> None:
    """Each value of the type its field takes: a ValueError naming the field otherwise."""
    for name, value in values.items():
        if name in INT_FIELDS and value is not None:
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name}: must be an integer, got {value!r}")
        elif name in FLOAT_FIELDS and value is not None:
            if isinstance(value, str):
                try:
                    number = float(value)
                except ValueError:
                    raise ValueError(f"{name}: must be a number, got {value!r}") from None
                if not math.isfinite(number):
                    raise ValueError(f"{name}: must be a finite number, got {value!r}")
                values[name] = number
            elif not _real(value):
                raise ValueError(f"{name}: must be a finite number, got {value!r}")
        elif name in ("moe_token_dispatcher_type", "moe_flex_dispatcher_backend", "deep_ep",
                      "moe_router_dtype", "recompute_granularity"):  # fmt: skip
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name}: must be a name, got {value!r}")
        elif name in BOOL_KEYS and not isinstance(value, bool):
            raise ValueError(f"{name}: must be true or false, got {value!r}")


# --device-memory's units, any case: binary (KiB ... TiB) and decimal (KB ... TB).
SIZE_UNITS = {"": 1, "b": 1}
SIZE_UNITS.update({f"{p}ib": 1024 ** (i + 1) for i, p in enumerate("kmgt")})
SIZE_UNITS.update({f"{p}b": 1000 ** (i + 1) for i, p in enumerate("kmgt")})
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes of ``text``: an integer of bytes, or a number with a unit (``80GiB``, ``141GB``,
    ``79.6GiB``), rounded down to a byte; argparse's error (one line) unless positive."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else None
    if unit not in SIZE_UNITS or ("." in match.group(1) and SIZE_UNITS[unit] == 1):
        raise argparse.ArgumentTypeError(
            f"must be bytes or a size such as 80GiB or 141GB, got {text[:40]!r}"
        )
    number = float(match.group(1)) if "." in match.group(1) else int(match.group(1))
    nbytes = int(number * SIZE_UNITS[unit])
    if nbytes <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text[:40]!r}")
    return nbytes


def build_parser() -> argparse.ArgumentParser:
    """The command's parser: Megatron's argument names, each with what it is, its default and
    its unit; the required ones in their own group."""
    p = _Parser(
        prog="moe_memory_planner",
        allow_abbrev=False,
        description="Every MoE memory term of a configuration on one rank (communication "
        "buffers, dispatcher state held between calls), base (unpatched megatron-core) vs "
        "patched, before anything is allocated. Sizes in bytes. HybridEP reads "
        + ", ".join(CHUNK_ENV.values())
        + " (tokens per chunk, default 64) from the environment, as deep_ep does.",
        epilog="Bad input: one line on stderr naming it, exit status 2.",
    )
    req = p.add_argument_group("required (here or in --config-file)")
    opt = p.add_argument_group("model and parallelism (Megatron's names)")
    for name, arg in ARGS.items():
        group = req if name in REQUIRED else opt
        help_text = arg.help + (" [required]" if name in REQUIRED else "")
        if name == "recompute_modules":
            group.add_argument(arg.flag, nargs="*", dest=name, default=None, help=help_text,
                               metavar=arg.metavar)  # fmt: skip
        else:
            kind = int if name in INT_FIELDS else str
            group.add_argument(arg.flag, dest=name, type=kind, default=None, help=help_text,
                               metavar=arg.metavar)  # fmt: skip
    opt.add_argument("--bf16", action="store_true", default=None,
                     help="16-bit activations, 2 bytes each (default: fp32, 4 bytes, unless "
                     "the YAML's bf16, fp16 or params_dtype says otherwise)")  # fmt: skip
    opt.add_argument("--fp16", action="store_true", default=None,
                     help="16-bit activations, as --bf16 (default off)")  # fmt: skip
    opt.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, metavar="INT",
                     dest=LAYERS_PER_VIRTUAL_STAGE, default=None,
                     help="layers per virtual pipeline stage: VPP = layers / PP / this "
                     "(default: none)")  # fmt: skip
    for flag, name in (("--account-for-embedding-in-pipeline-split", "embedding"),
                       ("--account-for-loss-in-pipeline-split", "loss")):  # fmt: skip
        help_text = f"the {name} counts as a layer of the pipeline split (default off)"
        opt.add_argument(flag, action="store_true", default=None, help=help_text)
    opt.add_argument("--sequence-parallel", action="store_true", default=None,
                     help="sequence parallelism: tokens split over TP too (default: assumed on, "
                     "with a note when TP > 1; the YAML's sequence_parallel: false turns it "
                     "off)")  # fmt: skip
    opt.add_argument("--moe-permute-fusion-into-hybridep", action="store_true", default=None,
                     help="HybridEP's fused permute-dispatch: one chunk size for all three "
                     "variables (default off)")  # fmt: skip
    opt.add_argument("--moe-permute-fusion", action="store_true", default=None,
                     help="Transformer Engine's fused permute: the dispatchers keep its "
                     "row_id_map [rows, 2 x experts + 1] int32 (default off)")  # fmt: skip
    opt.add_argument("--moe-ncclep-zero-copy", dest="moe_ncclep_zero_copy", action="store_true",
                     default=None, help="NCCL EP's zero-copy buffers (default off)")  # fmt: skip
    out = p.add_argument_group("input and output")
    out.add_argument("--config-file", metavar="YAML",
                     help="a Megatron-Bridge style YAML: model:, train: or top-level keys in "
                     "TransformerConfig's names; flags override it (default: none)")  # fmt: skip
    out.add_argument("--held-rows", type=int, metavar="ROWS",
                     help="rows per rank of a HybridEP buffer already held, to price a call's "
                     "growth against (default: none held)")  # fmt: skip
    out.add_argument("--device-memory", type=parse_size, metavar="SIZE",
                     help="the GPU's memory, which the last line's bytes back for rollout are a "
                     "share of: bytes, or with a unit such as 80GiB or 141GB (default 80GiB: no "
                     "config field names the GPU)")  # fmt: skip
    out.add_argument("--json", action="store_true", help="print one JSON object (default: a table)")
    return p


def config_from_args(
    argv: Optional[Sequence[str]] = None, notes: Optional[List[str]] = None
) -> tuple:
    """(MoEMemoryConfig, --json, --held-rows, --device-memory) from the command line (the
    device memory in bytes, None if not given); ValueError names the bad argument. Notes
    (deprecated fields read, fields set but not modelled) are appended to ``notes``, or printed
    on stderr if it is None."""
    p = build_parser()
    args, extra = p.parse_known_args(argv)
    if extra:
        flag = next((e.split("=")[0] for e in extra if e.startswith("-")), None)
        near = closest(flag, [a.option_strings[0] for a in p._actions]) if flag else None
        hint = f"; the closest known flag is {near}" if near else ""
        p.error(f"unrecognized arguments: {' '.join(extra)[:80]}{hint}")
    if args.held_rows is not None and not 0 < args.held_rows <= INT_MAX:
        raise ValueError(
            f"--held-rows: must be a positive integer up to {INT_MAX:,}, got {args.held_rows}"
        )
    printed = notes is None
    notes = [] if notes is None else notes
    values = read_config_file(args.config_file, notes) if args.config_file else {}
    values.update({n: getattr(args, n) for n in ARGS if getattr(args, n) is not None})
    if args.moe_ncclep_zero_copy:
        values["moe_ncclep_zero_copy"] = True
    for name in (
        "sequence_parallel",
        "account_for_embedding_in_pipeline_split",
        "account_for_loss_in_pipeline_split",
        "moe_permute_fusion_into_hybridep",
        "moe_permute_fusion",
    ):
        if getattr(args, name):
            values[name] = True
    if getattr(args, LAYERS_PER_VIRTUAL_STAGE) is not None:
        values[LAYERS_PER_VIRTUAL_STAGE] = getattr(args, LAYERS_PER_VIRTUAL_STAGE)
    _check_types(values)
    tp = values.get("tensor_model_parallel_size")
    if "sequence_parallel" not in values and isinstance(tp, int) and tp > 1:
        if "tokens_per_rank" not in values:
            notes.append(
                "sequence_parallel not given: assumed on, T = seq x micro-batch / (TP x CP) "
                "(megatron's default is off, and warns with EP and TP: model_parallel_config.py"
                ":560-565)"
            )
    apply_deprecated(values, notes)
    _vpp_from_layers_per_stage(values)
    _ranks_per_node_from_env(values, notes)
    if args.bf16 or args.fp16:
        values["bf16"] = True
    elif args.config_file is None or "bf16" not in values:
        values["bf16"] = bool(values.get("fp16", False) or values.get("bf16", False))
    values.pop("fp16", None)
    for name in REQUIRED:
        if name not in values:
            raise ValueError(f"{FIELD_FLAGS[name]}: required")
    if "recompute_modules" in values and isinstance(values["recompute_modules"], list):
        values["recompute_modules"] = tuple(values["recompute_modules"])
    try:
        cfg = MoEMemoryConfig(**values)
    except ValueError as exc:
        field_name, _, rest = str(exc).partition(": ")
        raise ValueError(f"{FIELD_FLAGS.get(field_name, field_name)}: {rest}") from None
    if args.held_rows is not None and (
        cfg.moe_token_dispatcher_type != "flex" or cfg.moe_flex_dispatcher_backend != "hybridep"
    ):
        notes.append("--held-rows prices a HybridEP buffer's growth; not read for this backend")
    for note in notes if printed else ():
        _note(note)
    return cfg, args.json, args.held_rows, args.device_memory
