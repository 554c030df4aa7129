# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The report's configurations (main, quick, golden, the sweep) and the trees it compares."""

import json
import re
from pathlib import Path
from typing import Any, Dict, Tuple

from moe_release import settings
from moe_release.report.runtime import (
    ReportError,
)
from moe_release.series.trees import ensure_trees

MAIN = dict(
    layers=4, tokens=2048, seq=256, hidden=64, ffn=128, heads=4, experts=8, topk=2, vocab=1024,
    backend="hybridep", seed=1234, steps=5,
)  # fmt: skip
QUICK = dict(MAIN, layers=2, tokens=512, seq=128, steps=3)
SWEEP_LAYERS = (2, 4, 8)
SWEEP_TOKENS = (1024, 4096, 16384)
GOLDEN_CONFIG = dict(MAIN, layers=3, tokens=512, seq=128, steps=4)
TIMING_STEPS = 10


def trees() -> Tuple[str, str]:
    """(base tree, patched tree): from the environment, or materialized under .build/trees."""
    base = settings.base_tree()
    patched = settings.tree()
    if base and patched:
        return base, patched
    base_path, patched_path = ensure_trees()
    return str(base_path), str(patched_path)


def base_label(tree: str) -> str:
    """The report's name for its base tree: the version, unpatched; or, for a tree of part of
    the series (``moe_release.py materialize --through``), its label and patch count."""
    manifest = Path(tree) / "megatron" / "core" / "_moe_release_manifest.json"
    series = json.loads(manifest.read_text()).get("series", []) if manifest.exists() else []
    version = tree_version(tree)
    if not series:
        return version.split("+")[0] + " (unpatched)"
    return f"{version} (the series' first {len(series)} patches)"


def tree_version(tree: str) -> str:
    """The version a materialized tree was stamped with (its package_info's last assignment)."""
    text = (Path(tree) / "megatron" / "core" / "package_info.py").read_text()
    found = re.findall(r"^__version__ = '([^']+)'$", text, flags=re.M)
    if not found:
        raise ReportError(f"{tree}: package_info.py carries no stamped __version__")
    return found[-1]


DISPATCHERS = ("flex", "alltoall", "allgather")


def dispatcher_label(cfg: Dict[str, Any]) -> str:
    """Which token dispatcher the configuration runs (the flex one with its backend)."""
    dispatcher = cfg.get("dispatcher", "flex")
    return f"flex/{cfg['backend']}" if dispatcher == "flex" else dispatcher
