# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Trees under test and the multi-rank job cache: a pytest plugin (``pytest_plugins`` in
tests/conftest.py), so that a test anywhere under tests/ (the release tests under unit_tests/,
the runtime's tests under tooling/) has the same fixtures and markers.

``MOE_RELEASE_TREE`` is the patched tree (base + series + overlay modules) and
``MOE_RELEASE_BASE_TREE`` the pristine base plus overlay modules; each holds ``megatron/core``.
The patched tree goes first on ``sys.path`` here and on ``PYTHONPATH`` of every spawned rank.
Tests of a flex backend or code a tree lacks, or of an unset environment variable, are
deselected here (not skipped: under CI a skip fails the run).
"""

import json
import os
import sys

import pytest

from moe_release import settings

os.environ.setdefault("NO_VCS_VERSION", "1")
# Every rank uses one thread; the pytest process itself only loads the emulation.
os.environ.setdefault("OMP_NUM_THREADS", "1")

PATCHED_TREE = settings.tree()
BASE_TREE = settings.base_tree()

if PATCHED_TREE:
    sys.path.insert(0, PATCHED_TREE)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long multi-rank variants, not run by default")
    config.addinivalue_line(
        "markers",
        "backport: a release test (one case per fix of the series), also run against every "
        "other pinned base (`scripts/run-tests`); marked on the test, the module "
        "(``pytestmark``) or the parameter (``release_cases.backport``)",
    )
    config.addinivalue_line(
        "markers",
        "flex_backend(name): needs a flex backend only some trees have (ncclep, deepepv2); "
        "deselected, not skipped, where the tree under test lacks it",
    )
    config.addinivalue_line(
        "markers",
        "tree_has(path, text): needs code only some trees have (``text`` in the tree's file at "
        "``path``); deselected, not skipped, where the tree under test lacks it",
    )
    config.addinivalue_line(
        "markers",
        "needs_env(name): reads what the environment variable ``name`` points at (a source "
        "checkout CI does not have); deselected, not skipped, where it is unset",
    )
    config.addinivalue_line(
        "markers",
        "guard: a release test that passes with and without the series (what the series must "
        "not change); every other release test must fail on the commit without the series "
        "(`run-tests --checkout` enforces it)",
    )


@pytest.fixture(autouse=True)
def _release_test_kind(request):
    """Write a guard's kind into the JUnit XML (``moe_release`` = ``guard``), where
    ``run-tests --checkout`` reads which release tests may pass without the series."""
    if request.node.get_closest_marker("guard"):
        request.node.user_properties.append(("moe_release", "guard"))


def _tree_has(path: str, text: str) -> bool:
    try:
        with open(os.path.join(PATCHED_TREE, path), encoding="utf-8") as f:
            return text in f.read()
    except (OSError, TypeError):
        return False


def _tree_backends() -> frozenset:
    from moe_release import backends

    return backends.available(PATCHED_TREE) if PATCHED_TREE else frozenset()


def pytest_collection_modifyitems(config, items):
    # Tests of a flex backend the tree lacks are deselected (not skipped: under CI a skip fails).
    backends = _tree_backends()
    lacking = [
        item
        for item in items
        if any(m.args[0] not in backends for m in item.iter_markers("flex_backend"))
        or any(not _tree_has(*m.args) for m in item.iter_markers("tree_has"))
        or any(not os.environ.get(m.args[0]) for m in item.iter_markers("needs_env"))
    ]
    if lacking:
        config.hook.pytest_deselected(items=lacking)
        items[:] = [item for item in items if item not in lacking]
    # A release test says so in the JUnit XML (``moe_release_test`` = ``backport``), where
    # ``moe_release.py matrix --record`` reads which tests of a run are release tests; set at
    # collection, so that a test skipped before its fixtures run says it too.
    for item in items:
        if item.get_closest_marker("backport"):
            item.user_properties.append(("moe_release_test", "backport"))


def _require(tree, name):
    if not tree or not os.path.isdir(os.path.join(tree, "megatron", "core")):
        pytest.skip(f"{name} is not set to a tree containing megatron/core")
    return tree


@pytest.fixture(scope="session")
def patched_tree():
    """Path of the patched megatron-core tree."""
    return _require(PATCHED_TREE, "MOE_RELEASE_TREE")


@pytest.fixture(scope="session")
def base_tree():
    """Path of the pristine base tree (overlay modules only, no series)."""
    return _require(BASE_TREE, "MOE_RELEASE_BASE_TREE")


@pytest.fixture(scope="session")
def dist_job():
    """Run a rank-side job once per distinct arguments for the session; returns the results.

    Usage: ``dist_job(target, world_size, tree, **kwargs)``. A failing job is cached too, so the
    tests that share it all report the same rank tracebacks without re-spawning.
    """
    from moe_release.runtime.ranks.launcher import run_distributed

    cache = {}

    def run(target, world_size, tree, timeout=300.0, torch_compile=False, **kwargs):
        # JSON with sorted keys: kwargs may hold (nested) dicts.
        key = (target, world_size, tree, torch_compile, json.dumps(kwargs, sort_keys=True))
        if key not in cache:
            try:
                cache[key] = (
                    "ok",
                    run_distributed(
                        target, world_size, tree, kwargs, timeout, torch_compile=torch_compile
                    ),
                )
            except Exception as exc:  # reported by every test sharing the job
                cache[key] = ("error", exc)
        status, value = cache[key]
        if status == "error":
            raise value
        return value

    return run
