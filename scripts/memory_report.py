#!/usr/bin/env python3
# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Side-by-side memory report: unpatched megatron-core against the moe-release series.

The entry point; the report is the ``report`` package next to this file (``report.cli``).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
