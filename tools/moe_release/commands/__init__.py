# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""moe-release's commands, above every room: one module per command (its parser's arguments
and its run), each registered once in :mod:`.registry`; :mod:`.cli` is the entry point. No
command imports another (tests/tooling/test_import_layers.py)."""
