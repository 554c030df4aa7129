# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""moe-release's tooling: the patch series, the CPU runtime, the planner's command, the report.

One package of layered rooms, lowest first; a room imports its own modules and lower rooms only
(``tests/tooling/test_import_layers.py`` keeps it so):

* :mod:`moe_release.common` - the repository root (``REPO_ROOT``, defined here only), user
  errors, progress;
* :mod:`moe_release.settings`, :mod:`moe_release.backends` - the environment variables the
  tooling reads, and the flex dispatcher's backends, each written once;
* :mod:`moe_release.series` - pins, patches, sdists, trees, the merge engine;
* :mod:`moe_release.runtime` - megatron-core's real MoE code on CPU ranks;
* :mod:`moe_release.plan` - the planner's command, the only route to the planner;
* :mod:`moe_release.report` - the side-by-side memory report;
* :mod:`moe_release.upstream_tests` - upstream's own unit tests on the CPU runtime;
* :mod:`moe_release.commands` - every command, one module each (the series' verbs, the
  planner's, the report's, the fault matrix, ...), registered once in
  :mod:`moe_release.commands.registry` and run by :func:`moe_release.commands.cli.main`
  (``moe-release``, ``python scripts/moe_release.py``); no command imports another.

The entry scripts under ``scripts/`` and the test configuration put ``tools/`` on the module
search path; ``pip install -e tools`` installs the package with its commands instead.
"""
