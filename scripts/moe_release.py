#!/usr/bin/env python3
"""moe-release: maintain the MoE dispatcher patch series over a pinned megatron-core sdist.

The entry point of the tooling (``python scripts/moe_release.py VERB``, see ``--help``); the
logic lives in the ``patchtool`` package beside this file, one module per concern.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from patchtool.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
