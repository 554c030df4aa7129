# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""What a merged series must leave in REF's files, read from the files, for a clean merge that
is still wrong.

A 3-way merge is clean when the series' changes and REF's do not overlap; it cannot see that
REF moved the code a patch guards, or dropped a line the series' base had and the series
therefore does not add. Four such merges were found by running the release tests on commits
nobody recorded (``run-tests --checkout``):

- main 55638bc4 with the 0.18.0 series: upstream moved the Triton kernels to
  ``moe/ops/paged_stash.py``, both sides deleted ``import triton`` from ``moe/paged_stash.py``,
  and the merge kept the series' guard around an import that is no longer there, leaving the
  new, unguarded one;
- main 4beb8caa with the 0.16.1 series: main dropped ``node.layer_state.dispatched_probs =
  None`` (#3164) after core_r0.16.0 left it, so the series, whose base has the line, does not
  carry the patch that adds it;
- dev f47ad914 with the 0.17.0 series: dev still binds ``te_general_gemm`` only where
  Transformer Engine imports, which the 0.17.0 base (and so its series) no longer does;
- main c8239f9a with the 0.18.0 series: main has DeepEP v2 (``ElasticBuffer``), which no
  release branch series knows, so a regrown buffer was dropped while a backward still needed it
  and destroyed from its finalizer.

Each probe states one topic's promise about the files as a reader would check it, and says in
one line what is wrong. They read the text (``ast``), never import it, and pass on every
stored series' own result (``tests/tooling/series/test_probes.py``).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Callable, Optional

from moe_release.series.merge import Files
from moe_release.series.topics import load_topics

PAGED_STASH = "megatron/core/transformer/moe/paged_stash.py"
OPS_PAGED_STASH = "megatron/core/transformer/moe/ops/paged_stash.py"
OPS_INIT = "megatron/core/transformer/moe/ops/__init__.py"
MOE_UTILS = "megatron/core/transformer/moe/moe_utils.py"
CALLABLES = "megatron/core/models/gpt/fine_grained_callables.py"
FUSED_A2A = "megatron/core/transformer/moe/fused_a2a.py"
# The per-layer tensors the A2A-overlap release drops once used (the release tests report
# them held as layer_state.<name>).
LAYER_STATE_RELEASED = ("dispatched_probs", "tokens_per_expert")


@dataclasses.dataclass(frozen=True)
class Probe:
    """One promise of a topic about the merged files."""

    topic: str
    name: str
    paths: tuple[str, ...]  # the files it reads (absent ones are None)
    check: Callable[[Files], Optional[str]]  # what is wrong, in a line; None when it holds
    # A release probe: what it releases, in words, and whether the files have that backend or
    # path at all (None: a probe of something else, e.g. a CPU import).
    releases: str = ""
    present: Optional[Callable[[Files], bool]] = None

    @property
    def id(self) -> str:
        """``topic/name``, as patches/topics.toml's ``probes`` name it."""
        return f"{self.topic}/{self.name}"

    @property
    def patch(self) -> str:
        """The patch (its file, ``<name>.patch``) that keeps the promise: the one whose
        ``[patch.<name>]`` in patches/topics.toml lists this probe."""
        return load_topics().probes[self.id]


def _tree(files: Files, path: str) -> Optional[ast.Module]:
    data = files.get(path)
    if data is None:
        return None
    try:
        return ast.parse(data.decode("utf-8", errors="replace"), filename=path)
    except SyntaxError:
        return None  # a conflicted or broken file: the merge already says so


def _unguarded_imports(module: ast.Module) -> list[tuple[int, str]]:
    """The modules a file imports at import time outside a ``try`` (line, dotted name)."""
    out = []
    for stmt in module.body:
        if isinstance(stmt, ast.Import):
            out.extend((stmt.lineno, a.name) for a in stmt.names)
        elif isinstance(stmt, ast.ImportFrom) and stmt.level == 0 and stmt.module:
            out.append((stmt.lineno, stmt.module))
    return out


def _is_triton(name: str) -> bool:
    return name == "triton" or name.startswith("triton.")


def _module_path(name: str) -> str:
    return name.replace(".", "/") + ".py"


def triton_guard(files: Files) -> Optional[str]:
    """cpu-import: the paged stash (imported by the pipeline schedules) imports without Triton,
    directly or through a module of its own it imports."""
    module = _tree(files, PAGED_STASH)
    if module is None:
        return None
    for line, name in _unguarded_imports(module):
        if _is_triton(name):
            return f"{PAGED_STASH}:{line} imports {name} outside a try"
        for path in (OPS_INIT, _module_path(name)) if name.startswith(
            "megatron.core.transformer.moe.ops"
        ) else ():  # fmt: skip
            inner = _tree(files, path)
            hit = next((n for _, n in _unguarded_imports(inner) if _is_triton(n)), None) if (
                inner is not None) else None  # fmt: skip
            if hit:
                return (f"{PAGED_STASH}:{line} imports {name} outside a try, and {path} "
                        f"imports {hit}")  # fmt: skip
    return None


def te_general_gemm_bound(files: Files) -> Optional[str]:
    """cpu-import: ``te_general_gemm`` is bound whether or not Transformer Engine imports."""
    data = files.get(MOE_UTILS)
    if data is None:
        return None
    text = data.decode("utf-8", errors="replace")
    head, sep, rest = text.partition("\ndef ")
    if sep and head.count("te_general_gemm") == 1 and "te_general_gemm" in rest:
        return f"{MOE_UTILS} binds te_general_gemm only where Transformer Engine imports"
    return None


def layer_state_released(files: Files) -> Optional[str]:
    """a2a-overlap: each per-layer tensor the MoE forward stores on ``node.layer_state`` is
    dropped again (set to None) once used."""
    module = _tree(files, CALLABLES)
    if module is None:
        return None
    stored: dict[str, int] = {}
    dropped: set[str] = set()
    for node in ast.walk(module):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            if (isinstance(target, ast.Attribute) and target.attr in LAYER_STATE_RELEASED
                    and isinstance(target.value, ast.Attribute)
                    and target.value.attr == "layer_state"):  # fmt: skip
                if isinstance(node.value, ast.Constant) and node.value.value is None:
                    dropped.add(target.attr)
                else:
                    stored.setdefault(target.attr, node.lineno)
    held = sorted(set(stored) - dropped)
    if held:
        where = ", ".join(f"{name} (line {stored[name]})" for name in held)
        return f"{CALLABLES} stores layer_state.{where} and never drops it"
    return None


def elastic_buffer_kept(files: Files) -> Optional[str]:
    """comm-buffers: where fused_a2a builds DeepEP v2's ``ElasticBuffer``, it builds it with
    ``explicitly_destroy=True`` (no destroy from a finalizer), and never rebinds
    ``_elastic_buffer`` to a new one without keeping the buffer it replaces (which a pending
    backward may still use) first."""
    module = _tree(files, FUSED_A2A)
    if module is None:
        return None
    for node in sorted(
        (n for n in ast.walk(module) if isinstance(n, ast.Call)),
        key=lambda n: (n.lineno, n.col_offset),
    ):
        if not (isinstance(node.func, ast.Name) and node.func.id == "ElasticBuffer"):
            continue
        explicit = any(
            k.arg == "explicitly_destroy"
            and isinstance(k.value, ast.Constant)
            and k.value.value is True
            for k in node.keywords
        )
        if not explicit:
            return (f"{FUSED_A2A}:{node.lineno} builds ElasticBuffer without "
                    "explicitly_destroy=True (destroyed from a finalizer)")  # fmt: skip
    for fn in (n for n in ast.walk(module) if isinstance(n, ast.FunctionDef)):
        kept = False  # the buffer being replaced was passed on (kept) before the rebinding
        for node in sorted(
            (n for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.Call))),
            key=lambda n: (n.lineno, n.col_offset),
        ):
            if isinstance(node, ast.Call) and any(
                isinstance(a, ast.Name) and a.id == "_elastic_buffer" for a in node.args
            ):
                kept = True
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name)
                and node.value.func.id == "ElasticBuffer"
                and any(isinstance(t, ast.Name) and t.id == "_elastic_buffer" for t in node.targets)
                and not kept
            ):
                return (f"{FUSED_A2A}:{node.lineno} rebinds _elastic_buffer and drops the buffer "
                        "it replaces, which a pending backward may still use")  # fmt: skip
    return None


# ----------------------------------------------------------------------------- the releases
#
# What the series releases, per backend and path a tree has: each is present where the tree
# has the code (the dispatcher class, the schedule node, the backend's buffer) and released
# where the method or function the series adds for it is there. A tree that has a backend and
# not its release fails the probe, and apply then borrows the release from another series.

TOKEN_DISPATCHER = "megatron/core/transformer/moe/token_dispatcher.py"
COMMON_UTILS = "megatron/core/models/common/utils.py"
CHUNK_PLAN = "megatron/core/models/common/model_chunk_schedule_plan.py"
DISPATCHER_CALL = "_maybe_reset_transient_forward_state"
RELEASE_FN = "reset_fused_a2a_buffers"
NCCL_EP_RELEASE = "nccl_ep_release_context"


def _classes(files: Files, path: str) -> dict[str, ast.ClassDef]:
    module = _tree(files, path)
    if module is None:
        return {}
    return {n.name: n for n in ast.walk(module) if isinstance(n, ast.ClassDef)}


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def _functions(module: Optional[ast.Module]) -> dict[str, ast.FunctionDef]:
    """Every function the module defines (at any level: a try or an ``if`` included)."""
    if module is None:
        return {}
    return {n.name: n for n in ast.walk(module) if isinstance(n, ast.FunctionDef)}


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def _dispatcher(cls_name: str) -> tuple[Callable[[Files], bool], Callable[[Files], Optional[str]]]:
    """A dispatcher class's state: present where TOKEN_DISPATCHER defines the class, released
    where one of its methods calls the reset once combine is done (DISPATCHER_CALL; a reset
    nothing calls after combine, as dev's for the overlap schedule only, releases nothing)."""

    def present(files: Files) -> bool:
        return cls_name in _classes(files, TOKEN_DISPATCHER)

    def check(files: Files) -> Optional[str]:
        cls = _classes(files, TOKEN_DISPATCHER).get(cls_name)
        if cls is None or any(DISPATCHER_CALL in _names(m) for m in _methods(cls).values()):
            return None
        return (f"{TOKEN_DISPATCHER}:{cls.lineno} {cls_name} never calls "
                f"{DISPATCHER_CALL}() after combine")  # fmt: skip

    return present, check


def _detaching_nodes(files: Files) -> list[tuple[str, ast.ClassDef]]:
    """The schedule-node classes that store ``self.before_detached`` outside ``__init__`` and
    ``__del__`` (the node of the A2A overlap that keeps what ``detach`` saved), with their
    file."""
    out = []
    for path in (CALLABLES, COMMON_UTILS):
        for cls in _classes(files, path).values():
            for name, fn in _methods(cls).items():
                if name in ("__init__", "__del__", "_release_state"):
                    continue
                if any(
                    isinstance(t, ast.Attribute) and t.attr == "before_detached"
                    for n in ast.walk(fn)
                    if isinstance(n, ast.Assign)
                    for t in n.targets
                ):
                    out.append((path, cls))
                    break
    return out


def schedule_node_released(files: Files) -> Optional[str]:
    """a2a-overlap: a schedule node that keeps ``before_detached`` drops it in
    ``_release_state`` (once its backward has run)."""
    for path, cls in _detaching_nodes(files):
        release = _methods(cls).get("_release_state")
        if release is None or "before_detached" not in _names(release):
            return f"{path}:{cls.lineno} {cls.name} keeps before_detached after its backward"
    return None


def _chunk_plan_present(files: Files) -> bool:
    return "TransformerModelChunkSchedulePlan" in _classes(files, CHUNK_PLAN)


def chunk_state_released(files: Files) -> Optional[str]:
    """a2a-overlap: the chunk plan's release_state() clears the chunk state's tensors."""
    cls = _classes(files, CHUNK_PLAN).get("TransformerModelChunkSchedulePlan")
    if cls is None or "_CHUNK_STATE_TENSORS" in _names(cls):
        return None
    return (f"{CHUNK_PLAN}:{cls.lineno} TransformerModelChunkSchedulePlan keeps the chunk "
            "state's tensors after its backward")  # fmt: skip


def _mentions(path: str, *names: str) -> Callable[[Files], bool]:
    def present(files: Files) -> bool:
        module = _tree(files, path)
        return module is not None and bool(_names(module) & set(names))

    return present


def _explicit_release(files: Files) -> Optional[ast.FunctionDef]:
    """fused_a2a's reset_fused_a2a_buffers where it takes ``collective`` (the explicit, agreed
    release the series adds); None otherwise."""
    fn = _functions(_tree(files, FUSED_A2A)).get(RELEASE_FN)
    if fn is None:
        return None
    args = [a.arg for a in (*fn.args.args, *fn.args.kwonlyargs)]
    return fn if "collective" in args else None


def _buffers_released(what: str) -> Callable[[Files], Optional[str]]:
    def check(files: Files) -> Optional[str]:
        if _explicit_release(files) is not None:
            return None
        return f"{FUSED_A2A} has {what} and no {RELEASE_FN}(collective=True, group=...)"

    return check


def _nccl_ep_present(files: Files) -> bool:
    return "ensure_nccl_ep_bootstrapped" in _functions(_tree(files, FUSED_A2A))


def nccl_ep_released(files: Files) -> Optional[str]:
    """comm-buffers: where NCCL EP is bootstrapped, the explicit release finalizes its context
    (nccl_ep_release_context, defined beside the manager or in fused_a2a)."""
    if not _nccl_ep_present(files):
        return None
    release = _explicit_release(files)
    defined = NCCL_EP_RELEASE in _functions(_tree(files, FUSED_A2A)) | _functions(
        _tree(files, TOKEN_DISPATCHER)
    )
    if release is not None and defined and NCCL_EP_RELEASE in _names(release):
        return None
    return f"{FUSED_A2A} bootstraps NCCL EP and the release never runs {NCCL_EP_RELEASE}()"


_FLEX = _dispatcher("MoEFlexTokenDispatcher")
_ALLTOALL = _dispatcher("MoEAlltoAllTokenDispatcher")
_ALLGATHER = _dispatcher("MoEAllGatherTokenDispatcher")
_HYBRIDEP = _mentions(FUSED_A2A, "HybridEPBuffer")
_DEEPEP = _mentions(FUSED_A2A, "Buffer")
_DEEPEP_V2 = _mentions(FUSED_A2A, "ElasticBuffer")


def _deep_ep_v2_released(files: Files) -> Optional[str]:
    return _buffers_released("DeepEP v2's ElasticBuffer")(files) or elastic_buffer_kept(files)


def _layer_state_present(files: Files) -> bool:
    module = _tree(files, CALLABLES)
    return module is not None and "layer_state" in _names(module)


PROBES = (
    Probe(
        "cpu-import",
        "triton",
        (PAGED_STASH, OPS_PAGED_STASH, OPS_INIT),
        triton_guard,
    ),  # fmt: skip
    Probe("cpu-import", "te_general_gemm", (MOE_UTILS,), te_general_gemm_bound),
    Probe(
        "dispatcher-state",
        "flex",
        (TOKEN_DISPATCHER,),
        _FLEX[1],
        "the flex dispatcher's state",
        _FLEX[0],
    ),
    Probe(
        "dispatcher-state",
        "alltoall",
        (TOKEN_DISPATCHER,),
        _ALLTOALL[1],
        "the all-to-all dispatcher's state",
        _ALLTOALL[0],
    ),
    Probe(
        "dispatcher-state",
        "allgather",
        (TOKEN_DISPATCHER,),
        _ALLGATHER[1],
        "the all-gather dispatcher's state",
        _ALLGATHER[0],
    ),
    Probe(
        "a2a-overlap",
        "schedule-node",
        (CALLABLES, COMMON_UTILS),
        schedule_node_released,
        "the A2A overlap's schedule nodes",
        lambda f: bool(_detaching_nodes(f)),
    ),
    Probe(
        "a2a-overlap",
        "layer-state",
        (CALLABLES,),
        layer_state_released,
        "the A2A overlap's layer state",
        _layer_state_present,
    ),
    Probe(
        "a2a-overlap",
        "chunk-state",
        (CHUNK_PLAN,),
        chunk_state_released,
        "the A2A overlap's chunk state",
        _chunk_plan_present,
    ),
    Probe(
        "comm-buffers",
        "hybridep",
        (FUSED_A2A,),
        _buffers_released("HybridEP's buffer"),
        "HybridEP's buffers",
        _HYBRIDEP,
    ),
    Probe(
        "comm-buffers",
        "deepep",
        (FUSED_A2A,),
        _buffers_released("DeepEP's Buffer"),
        "DeepEP's buffers",
        _DEEPEP,
    ),
    Probe(
        "comm-buffers",
        "deepep-v2",
        (FUSED_A2A,),
        _deep_ep_v2_released,
        "DeepEP v2's buffers",
        _DEEPEP_V2,
    ),
    Probe(
        "comm-buffers",
        "nccl-ep",
        (FUSED_A2A, TOKEN_DISPATCHER),
        nccl_ep_released,
        "NCCL EP's context",
        _nccl_ep_present,
    ),
)
PATHS = tuple(sorted({p for probe in PROBES for p in probe.paths}))


def failures(files: Files) -> list[tuple[Probe, str]]:
    """Each probe that fails on ``files`` (by path; absent files are None or missing), with
    what is wrong."""
    out = []
    for probe in PROBES:
        if probe.present is not None and not probe.present(files):
            continue
        msg = probe.check(files)
        if msg is not None:
            out.append((probe, msg))
    return out


def releases(files: Files) -> tuple[list[str], list[str]]:
    """What the files release and what they leave unreleased, of the backends and paths they
    have: (released, ["<what>: <what is wrong>"]), each in the probes' order."""
    done, left = [], []
    for probe in PROBES:
        if probe.present is None or not probe.present(files):
            continue
        msg = probe.check(files)
        if msg is None:
            done.append(probe.releases)
        else:
            left.append(f"{probe.releases}: {msg}")
    return done, left


def releases_line(files: Files) -> str:
    """One line: what a tree releases and which of its backends and paths it leaves
    unreleased ("none" when it releases every one)."""
    done, left = releases(files)
    if not done and not left:
        return "has none of the backends and paths the series releases"
    return (f"releases {', '.join(done) or 'nothing'}; leaves unreleased: "
            f"{'; '.join(left) or 'none'}")  # fmt: skip


def installed_releases(core_dir: Path) -> str:
    """What an installed megatron-core releases, of the backends and paths it has, and what it
    leaves unreleased (:func:`releases_line` on its files)."""
    top = core_dir.parent.parent
    files = {}
    for path in PATHS:
        try:
            files[path] = (top / path).read_bytes()
        except OSError:
            files[path] = None
    return releases_line(files)
