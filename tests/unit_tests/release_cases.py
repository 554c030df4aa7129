# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The release tests carry the ``backport`` marker themselves.

A release test (one case per fix of the series) is what `scripts/run-tests` also runs against
every other pinned base (``-m backport``). A whole test carries ``@pytest.mark.backport``, a
whole module ``pytestmark = pytest.mark.backport``; where only some parametrizations of a test
are release cases, ``backport(params, *ids)`` marks those by id.
"""

import pytest


def backport(params, *ids):
    """``params`` (``pytest.param``s with ids) with the ``backport`` marker on those whose id is
    one of ``ids``. An id that names none of them fails the collection: a renamed case cannot
    silently drop out of the release tests."""
    unknown = set(ids) - {p.id for p in params}
    if unknown:
        raise ValueError(f"no parameter has the release case id(s) {sorted(unknown)}")
    return [
        pytest.param(*p.values, id=p.id, marks=[*p.marks, pytest.mark.backport])
        if p.id in ids
        else p
        for p in params
    ]
