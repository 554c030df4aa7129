# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""moe-release's tooling: the patch series, the CPU runtime, the planner's command, the report.

One package of layered rooms, lowest first; a room imports its own modules and lower rooms only
(``tests/tooling/test_import_layers.py`` keeps it so):

* :mod:`moe_release.common` - the repository root (``REPO_ROOT``, defined here only), user
  errors, progress;
* :mod:`moe_release.settings`, :mod:`moe_release.backends` - the environment variables the
  tooling reads, and the flex dispatcher's backends, each written once;
* :mod:`moe_release.series` - pins, patches, sdists, trees, the merge engine; its verbs
  (:mod:`moe_release.series.verbs`) never import each other; :mod:`moe_release.series.cli` is
  ``python scripts/moe_release.py``;
* :mod:`moe_release.runtime` - megatron-core's real MoE code on CPU ranks;
* :mod:`moe_release.plan` - the planner's command, the only route to the planner;
* :mod:`moe_release.report` - the side-by-side memory report;
* :mod:`moe_release.upstream_tests` - upstream's own unit tests on the CPU runtime;
* :mod:`moe_release.commands` - the fault matrix and the production-shape terms.

The entry scripts under ``scripts/`` and the test configuration put ``tools/`` on the module
search path; ``pip install -e tools`` installs the package with its commands instead.
"""
