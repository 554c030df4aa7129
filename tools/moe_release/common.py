# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""What every part of the tooling shares: the repository root, user errors, progress."""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


class UserError(Exception):
    """A problem with the user's input: reported as one line, no traceback."""


def log(msg: str) -> None:
    """Progress on stderr."""
    print(f"moe-release: {msg}", file=sys.stderr, flush=True)
