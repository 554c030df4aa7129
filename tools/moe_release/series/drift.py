# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The release code, compared across series: one implementation on every branch.

The *release code* is what the primary series adds to megatron-core: every function, method and
class attribute present in the patched primary tree and absent from its base. Each other series
(backports, the main/dev variants) must end with the same definitions, compared as code (the
AST with docstrings, so comments may differ where a branch lacks what they mention), or name
the ones it does not carry in :data:`NOT_CARRIED` with the reason. On dev, which already has
part of the API (#5869), the definitions the series modifies count as well: after the series
they must equal the primary's.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterable, Mapping, Optional

from moe_release.series.patches import apply_file_patch, parse_patch

Files = Mapping[str, Optional[bytes]]

# (series directory, "path::qualname") -> why that series does not end with that definition, or
# ends with a different one. Every entry is a reason a reviewer can check on that branch.
_DEV_V2 = "dev also has DeepEP v2's buffers (a third _BufferTable), which these hold and release"
_BUFFERS = "megatron/core/transformer/moe/fused_a2a.py::"
_DISPATCHER = "megatron/core/transformer/moe/token_dispatcher.py::"
_NO_NCCL_EP = "this branch has no NCCL EP (moe_flex_dispatcher_backend: 'deepep', 'hybridep')"
_NCCL_EP_RELEASE = (
    "_note_nccl_ep_capture",
    "is_nccl_ep_bootstrapped",
    "_NCCLEPContext.identity",
    "_NCCLEPContext.group",
    "_destroy_needs_group",
    "_agree",
    "_graph_use",
    "reset_fused_a2a_buffers",
)
NOT_CARRIED: dict[tuple[str, str], str] = {
    ("patches/upstream/dev", _BUFFERS + "reset_fused_a2a_buffers"): _DEV_V2,
    ("patches/upstream/dev", _BUFFERS + "_destroy_needs_group"): (
        "dev's DeepEP v2 buffer on the group's own NCCL communicator (EP_REUSE_NCCL_COMM=1) "
        "needs that group to destroy, as NCCL EP's context does"
    ),
    ("patches/upstream/dev", _DISPATCHER + "nccl_ep_release_context"): (
        "dev's NCCL EP manager has no zero-copy buffers: its release only finalizes the context"
    ),
    ("patches/upstream/main", _BUFFERS + "is_nccl_ep_bootstrapped"): (
        "main has its own (TE's is_ep_bootstrapped where TE has it), which the series extends "
        "by the EP group"
    ),
    ("patches/upstream/main", _DISPATCHER + "nccl_ep_release_context"): (
        "main has its own (paged stash's rerun calls it), which the series calls"
    ),
    (
        "patches/upstream/main",
        _DISPATCHER + "MoEAlltoAllTokenDispatcher.reset_transient_forward_state",
    ): (
        "main's batch_invariant_mode keeps batch_invariant_inverse_permutation_mapping from "
        "dispatch_preprocess to combine_postprocess; the release drops it too"
    ),
}
# The release branches before 0.19 carry none of NCCL EP's release (reset_fused_a2a_buffers,
# _agree and _graph_use there are the primary's without their NCCL EP part).
for _series in (
    "patches/backports/core_r0.18.0",
    "patches/backports/core_r0.18.0@0.18.0",
    "patches/backports/core_r0.17.0",
    "patches/backports/core_r0.17.0@0.17.0",
    "patches/backports/core_r0.16.0",
):
    for _name in _NCCL_EP_RELEASE:
        NOT_CARRIED[(_series, _BUFFERS + _name)] = _NO_NCCL_EP
    NOT_CARRIED[(_series, _DISPATCHER + "nccl_ep_release_context")] = _NO_NCCL_EP


def definitions(source: bytes, path: str) -> dict[str, str]:
    """``qualname -> ast.dump`` of the module's top-level functions and classes' methods and
    attributes (one level of nesting: megatron's layout)."""
    tree = ast.parse(source, filename=path)
    out: dict[str, str] = {}

    def add(name: str, node: ast.AST) -> None:
        out[name] = ast.dump(node, include_attributes=False)

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            add(node.name, node)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    add(f"{node.name}.{item.name}", item)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    for target in targets:
                        if isinstance(target, ast.Name):
                            add(f"{node.name}.{target.id}", item)
    return out


def apply_series(files: Files, series: Iterable[tuple[str, bytes]]) -> dict[str, Optional[bytes]]:
    """The files a series touches, after it (``files`` holds the base's)."""
    out: dict[str, Optional[bytes]] = {}
    for name, data in series:
        for fp in parse_patch(data, name).files:
            old = out[fp.path] if fp.path in out else files.get(fp.path)
            out[fp.path] = apply_file_patch(old, fp, name)
    return out


def python_defs(files: Files) -> dict[str, str]:
    """``path::qualname -> dump`` over the Python files in ``files``."""
    out: dict[str, str] = {}
    for path, data in files.items():
        if data is None or not path.endswith(".py"):
            continue
        for name, dump in definitions(data, path).items():
            out[f"{path}::{name}"] = dump
    return out


def release_code(base: Files, patched: Files) -> dict[str, str]:
    """The definitions the primary series adds: in ``patched``, not in ``base``."""
    before = python_defs({p: base.get(p) for p in patched})
    after = python_defs(patched)
    return {k: v for k, v in after.items() if k not in before}


def drift(
    release: Mapping[str, str], target_base: Files, target_patched: Files, sdir: str
) -> list[str]:
    """One line per release definition the target series does not end with as the primary
    does (absent, or different), unless :data:`NOT_CARRIED` names it for ``sdir``."""
    paths = {key.split("::", 1)[0] for key in release} | set(target_patched)
    files = {p: target_patched.get(p, target_base.get(p)) for p in paths}
    have = python_defs(files)
    by_name: dict[str, list[str]] = {}
    for key, dump in have.items():  # a module that moved on this branch (dev's
        by_name.setdefault(key.split("::", 1)[1], []).append(dump)  # fine_grained_callables)
    problems = []
    for key, dump in sorted(release.items()):
        if (sdir, key) in NOT_CARRIED:
            continue
        found = [have[key]] if key in have else by_name.get(key.split("::", 1)[1], [])
        if not found:
            problems.append(f"{sdir}: {key} is missing (the primary series adds it)")
        elif dump not in found:
            problems.append(f"{sdir}: {key} differs from the primary series' code")
    return problems


def compare_all(
    checkout: Optional[Path] = None, root: Optional[Path] = None
) -> tuple[list[str], list[str]]:
    """Compare every series that can be read here with the primary series: (names of the bases
    compared, problems). Commit bases need a Megatron-LM checkout (``checkout`` or
    ``$MOE_RELEASE_MEGATRON_LM``); without one they are not compared."""
    from moe_release.common import REPO_ROOT
    from moe_release.series.pins import load_pins
    from moe_release.series.repo import read_series
    from moe_release.series.source import available, read_base_files

    root = root or REPO_ROOT
    pins = load_pins(root / "patches" / "pins.toml")
    primary = pins.get(None)
    files = read_base_files(primary)
    release = release_code(files, apply_series(files, read_series(primary, root)))
    compared, problems = [], []
    for base in pins.bases.values():
        if base is primary or not (base.series_dir(root) / "series").exists():
            continue
        if base.is_commit and checkout is None and not available(base):
            continue
        theirs = read_base_files(base, checkout)
        patched = apply_series(theirs, read_series(base, root))
        problems += drift(release, theirs, patched, base.series)
        compared.append(base.name)
    return compared, problems
