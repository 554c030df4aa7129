# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""`landed`: which patches of a series a newer checkout already contains.

The test is hunkstate.py's, which ``port`` and ``apply`` share: each hunk is looked for
anywhere in its file, its new side present meaning "applied", its old side "pending", neither
"conflict"; a patch whose hunks are all applied has landed.
"""

from __future__ import annotations

from pathlib import Path

from moe_release.common import UserError
from moe_release.series.hunkstate import PatchState, dir_series_states
from moe_release.series.patches import Patch


def landed_states(checkout: Path, patches: list[Patch]) -> list[PatchState]:
    """The state of every patch in ``checkout`` (a Megatron-LM checkout or a megatron-core
    tree: any directory holding ``megatron/core``).

    The series is read as a whole: landed patches are peeled off from the end first (a later
    patch may rewrite lines an earlier one added), then the rest are judged in order, each
    applied in memory once it is found to apply, so that later patches see it."""
    if not checkout.exists():
        raise UserError(f"{checkout}: checkout does not exist")
    if not checkout.is_dir():
        raise UserError(f"{checkout}: checkout is not a directory")
    if not (checkout / "megatron" / "core").is_dir():
        raise UserError(f"{checkout}: not a checkout (no megatron/core in it)")
    return dir_series_states(checkout, patches)
