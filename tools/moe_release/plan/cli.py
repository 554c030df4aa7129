# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The MoE memory planner's command: a configuration from Megatron's flags or a
Megatron-Bridge YAML, its terms base beside patched as a table or ``--json``; bad input is one
line on stderr naming it, exit status 2."""

import json
import sys
from typing import List, Optional, Sequence

from moe_release.plan.compare import format_plan, plan
from moe_release.plan.inputs import FIELD_FLAGS, _fail, _note, config_from_args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The planner command: the table, or ``--json``; exit 2 on bad input (one line)."""
    notes: List[str] = []
    try:
        cfg, as_json, held_rows, device_memory = config_from_args(argv, notes)
        result = plan(cfg, held_rows, device_memory)
    except ValueError as exc:
        field_name, sep, rest = str(exc).partition(": ")
        return _fail(
            f"{FIELD_FLAGS[field_name]}: {rest}" if field_name in FIELD_FLAGS else str(exc)
        )
    except SystemExit as exc:
        return int(exc.code or 0)
    for note in notes:
        _note(note)
    for warning in result["warnings"]:
        print(f"moe_memory_planner: warning: {warning}", file=sys.stderr)
    print(json.dumps(result, indent=1) if as_json else format_plan(result))
    return 0
