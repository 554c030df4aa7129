# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The verbs of ``scripts/moe_release.py`` over the series engine; no verb imports another."""
