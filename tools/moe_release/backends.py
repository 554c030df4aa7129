# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The flex dispatcher's backends, in one registry: what each is called, what stands in for
its kernels on CPU ranks, what the memory planner calls it, and which trees have it.

A new backend is one more :class:`Backend` in :data:`REGISTRY` (and its emulation under
``runtime/kernels/``, its terms in the planner); the main report's ``--backend``, its colocated
section, the fault matrix and the tests read their backends from here.
``tests/tooling/test_backends.py`` keeps the list written out nowhere else under ``tools/``.

The planner (``megatron/core/transformer/moe/moe_memory_planner/``) ships in the wheel and
imports no tooling: it keeps its own ``FLEX_BACKENDS``, and each entry here names the planner's
spelling (the test checks the two agree).

Standard library only; the lowest layer of the tooling (every package may import it).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Backend:
    """One flex dispatcher backend."""

    name: str  # this repo's spelling: tests' parametrize ids, the report's rows, --backend
    megatron: str  # TransformerConfig.moe_flex_dispatcher_backend's value for it
    label: str  # how prose names it
    aliases: tuple[str, ...]  # other spellings of it in the repository (modules, fields, docs)
    emulation: str  # the module of runtime/kernels/ that stands in for its kernels
    planner: Optional[str]  # the planner's moe_flex_dispatcher_backend for it; None: not priced
    since: Optional[str]  # the first pinned base that has it; None: every pinned base
    accounted: bool = False  # the main report prices its buffer beside the measured one
    bf16_payloads: bool = False  # its kernels take bf16 payloads only
    hidden_multiple: int = 1  # its kernels take a hidden size that is a multiple of this
    # fused_a2a's module global naming its buffer, which code outside megatron-core reads and
    # test fixtures save, clear and restore (None: it has none)
    module_global: Optional[str] = None


# In report order: the colocated section's rows, the fault matrix's columns, test ids.
REGISTRY: tuple[Backend, ...] = (
    Backend(
        name="hybridep",
        megatron="hybridep",
        label="HybridEP",
        aliases=("hybrid_ep", "hybrid-ep"),
        emulation="moe_release.runtime.kernels.hybridep_emulation",
        planner="hybridep",
        since=None,
        accounted=True,
        module_global="_hybrid_ep_buffer",
    ),
    Backend(
        name="deepep",
        megatron="deepep",
        label="DeepEP",
        aliases=("deep_ep",),
        emulation="moe_release.runtime.kernels.deepep_emulation",
        planner="deepep",
        since=None,
        accounted=True,
        module_global="_buffer",
    ),
    Backend(
        name="deepepv2",
        megatron="deepepv2",
        label="DeepEP v2",
        aliases=("deepep_v2", "deep_ep_v2"),
        emulation="moe_release.runtime.kernels.deepepv2_emulation",
        planner="deepepv2",
        since="dev",
        bf16_payloads=True,
        hidden_multiple=256,  # its combine kernel's static assert (deepepv2_emulation)
        module_global="_elastic_buffer",
    ),
    Backend(
        name="ncclep",
        megatron="ncclep",
        label="NCCL EP",
        aliases=("nccl_ep", "te_ep"),
        emulation="moe_release.runtime.kernels.ncclep_emulation",
        planner="ncclep",
        since="0.19",
        bf16_payloads=True,
    ),
)

NAMES: tuple[str, ...] = tuple(b.name for b in REGISTRY)
# The backends only some pinned bases have: their tests carry the ``flex_backend`` marker.
ONLY_SOME_TREES: tuple[str, ...] = tuple(b.name for b in REGISTRY if b.since is not None)
# The backends whose buffer the main report prices beside what it measured (the planner's
# HybridEP and DeepEP buffer tables); the report runs every backend a tree has.
ACCOUNTED: tuple[str, ...] = tuple(b.name for b in REGISTRY if b.accounted)
# The backends whose kernels take bf16 payloads only.
BF16_PAYLOADS: tuple[str, ...] = tuple(b.name for b in REGISTRY if b.bf16_payloads)

_BY_SPELLING = {s: b for b in REGISTRY for s in (b.name, *b.aliases)}


def get(spelling: str) -> Backend:
    """The backend a name or alias spells; KeyError naming the known names otherwise."""
    try:
        return _BY_SPELLING[spelling]
    except KeyError:
        raise KeyError(f"{spelling!r}: not a flex backend (one of {', '.join(NAMES)})") from None


def megatron_values(tree: Path | str) -> frozenset[str]:
    """The values of a megatron-core tree's ``TransformerConfig.moe_flex_dispatcher_backend``
    annotation (a ``Literal``), read from the source. Empty where the tree has no such field or
    cannot be read."""
    path = Path(tree) / "megatron" / "core" / "transformer" / "transformer_config.py"
    try:
        module = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return frozenset()
    for node in ast.walk(module):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "moe_flex_dispatcher_backend"
        ):
            return frozenset(
                c.value
                for c in ast.walk(node.annotation)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            )
    return frozenset()


def available(tree: Path | str) -> frozenset[str]:
    """The flex backends a megatron-core tree offers, by name (0.16-0.18: deepep, hybridep;
    0.19: + ncclep; dev: + deepepv2): the registry's backends whose megatron value the tree's
    config accepts. Empty where the tree has no such field or cannot be read."""
    values = megatron_values(tree)
    return frozenset(b.name for b in REGISTRY if b.megatron in values)
