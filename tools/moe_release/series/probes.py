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
stored series' own result (``tests/tooling/test_probes.py``).
"""

from __future__ import annotations

import ast
import dataclasses
from typing import Callable, Optional

from moe_release.series.merge import Files

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
    patch: str  # the primary series' patch (patches/series) that keeps the promise
    paths: tuple[str, ...]  # the files it reads (absent ones are None)
    check: Callable[[Files], Optional[str]]  # what is wrong, in a line; None when it holds


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


CPU_IMPORT_PATCH = "MoE-Let-the-MoE-dispatcher-path-import-and-build-wit.patch"
LAYER_STATE_PATCH = "MoE-A2A-overlap-release-the-layer-state-s-probs-and-.patch"


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


DEEPEP_V2_PATCH = "MoE-Free-the-HybridEP-and-DeepEP-buffers-only-by-an-.patch"
PROBES = (
    Probe(
        "cpu-import",
        "triton",
        CPU_IMPORT_PATCH,
        (PAGED_STASH, OPS_PAGED_STASH, OPS_INIT),
        triton_guard,
    ),  # fmt: skip
    Probe("cpu-import", "te_general_gemm", CPU_IMPORT_PATCH, (MOE_UTILS,), te_general_gemm_bound),
    Probe("a2a-overlap", "layer-state", LAYER_STATE_PATCH, (CALLABLES,), layer_state_released),
    Probe("comm-buffers", "deepep-v2", DEEPEP_V2_PATCH, (FUSED_A2A,), elastic_buffer_kept),
)
PATHS = tuple(sorted({p for probe in PROBES for p in probe.paths}))


def failures(files: Files) -> list[tuple[Probe, str]]:
    """Each probe that fails on ``files`` (by path; absent files are None or missing), with
    what is wrong."""
    out = []
    for probe in PROBES:
        msg = probe.check(files)
        if msg is not None:
            out.append((probe, msg))
    return out
