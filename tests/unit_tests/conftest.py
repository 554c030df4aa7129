# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Trees under test and the multi-rank job cache.

``MOE_RELEASE_TREE`` is the patched tree (base + series + overlay modules) and
``MOE_RELEASE_BASE_TREE`` the pristine base plus overlay modules; each holds ``megatron/core``.
The patched tree goes first on ``sys.path`` here and on ``PYTHONPATH`` of every spawned rank.
"""

import json
import os
import sys

import pytest

os.environ.setdefault("NO_VCS_VERSION", "1")
# Every rank uses one thread; the pytest process itself only loads the emulation.
os.environ.setdefault("OMP_NUM_THREADS", "1")

PATCHED_TREE = os.environ.get("MOE_RELEASE_TREE")
BASE_TREE = os.environ.get("MOE_RELEASE_BASE_TREE")

if PATCHED_TREE:
    sys.path.insert(0, PATCHED_TREE)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long multi-rank variants, not run by default")


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
    from cpu_runtime.launcher import run_distributed

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
