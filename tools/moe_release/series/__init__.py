# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The patch-series engine behind the series' commands (:mod:`moe_release.commands`), one module
per concern.

Pure functions over bytes and their I/O are kept apart:

* ``pins`` - ``patches/pins.toml``
* ``patches`` - series files and mboxes: parse, apply with zero fuzz, trailers, label (pure)
* ``merge`` - the 3-way merge engine and its resolutions, shared by ``port`` and ``apply``
* ``hunkstate`` - where a series' hunks stand in a set of files (applied, pending, conflict)
* ``repo`` - the series and overlay modules as read from this repository
* ``sdist`` - download, verify and read the pinned sdist
* ``source`` - a base's files: the sdist, or a Megatron-LM commit from a clone or ``git archive``
  (verified by commit id and tree hash); the verbs' ``--base``/``--checkout``; the bases
  ``trees --list`` names
* ``trees`` - build, stamp and write materialized trees
* ``git`` - the ``edit``/``export`` round trip
* ``targets`` - the upstream refs the series is exported for, and which series each takes
* ``probes`` - what a merged series must leave in a ref's files; what an install releases
* ``drift`` - the release code compared across series: one implementation on every branch

The verbs (``check``, ``port``, ``apply``, ``upstream``, ...) are modules of
:mod:`moe_release.commands`, one per verb, which never import each other: what two of them
share lives here (tests/tooling/test_import_layers.py).
"""
