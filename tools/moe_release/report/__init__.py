# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The side-by-side memory report (``scripts/memory_report.py`` runs :func:`.cli.main`).

* ``cli`` - the command: configurations, the base and patched runs, the table, JSON, plot and
  golden values
* ``worker`` - the rank side (``moe_release.report.worker:<function>`` targets of
  ``moe_release.runtime.ranks.launcher``):
  a small but real megatron-core MoE training run, measured at the allocator
* ``runtime`` - where it runs: tensor device, dispatch kernels, process-group backend
* ``overlap_section`` - the 1F1B A2A-overlap section
* ``buffer_section`` - the communication-buffer and HybridEP-accounting rows

Imported with ``tools/`` on ``sys.path``; importing the package imports none of its modules, so
a rank loading ``moe_release.report.worker`` does not load the command's side.
"""
