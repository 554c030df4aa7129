# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The patch-series tooling behind ``scripts/moe_release.py``, one module per concern.

Pure functions over bytes and their I/O are kept apart:

* ``common`` - repository root, ``UserError``, progress on stderr
* ``pins`` - ``patches/pins.toml``
* ``patches`` - series files and mboxes: parse, apply with zero fuzz, trailers, label (pure)
* ``repo`` - the series and overlay modules as read from this repository
* ``sdist`` - download, verify and read the pinned sdist
* ``trees`` - build, stamp and write materialized trees
* ``git`` - the ``edit``/``export`` round trip
* ``check`` - ``check`` and ``verify``
* ``cli`` - the verbs
"""
