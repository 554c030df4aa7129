# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The patch-series tooling behind ``scripts/moe_release.py``, one module per concern.

Pure functions over bytes and their I/O are kept apart:

* ``backends`` - the flex dispatcher's backends: one registry, and which a tree has
* ``settings`` - every environment variable the tooling reads, one accessor each
* ``pins`` - ``patches/pins.toml``
* ``patches`` - series files and mboxes: parse, apply with zero fuzz, trailers, label (pure)
* ``merge`` - the 3-way merge engine and its resolutions, shared by ``port`` and ``apply``
* ``hunkstate`` - where a series' hunks stand in a set of files (applied, pending, conflict)
* ``repo`` - the series and overlay modules as read from this repository
* ``sdist`` - download, verify and read the pinned sdist
* ``source`` - a base's files: the sdist, or a Megatron-LM commit from a clone or ``git archive``
  (verified by commit id and tree hash)
* ``trees`` - build, stamp and write materialized trees
* ``git`` - the ``edit``/``export`` round trip
* ``check`` - ``check`` and ``verify``
* ``port`` - the 3-way port of the primary series onto the other series
* ``landed`` - which patches a checkout already holds
* ``matrix`` - the compatibility matrix from the pins and the recorded test runs
* ``drift`` - the release code compared across series: one implementation on every branch
* ``cli`` - the verbs

The verbs (``apply``, ``port``, ``upstream``, ``check``, ``landed``, ``matrix``) live
in :mod:`.verbs` and never import each other; only ``cli`` imports them
(tests/tooling/test_import_layers.py).
"""
