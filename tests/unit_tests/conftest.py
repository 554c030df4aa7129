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


# The release tests that run against every pinned base (`scripts/run-tests` runs them with
# `-m backport` on each backport series' trees): one case per fix of the series, node-id
# prefixes. A prefix that matches nothing fails the collection, so a rename cannot silently
# drop a backport's coverage.
BACKPORT_CASES = (
    "transformer/moe/test_cpu_guards.py::",
    "transformer/moe/test_dispatcher_state_release.py::test_nothing_of_the_forward_outlives_"
    "backward[flex-hybridep-ep2-",
    "transformer/moe/test_dispatcher_state_release.py::test_nothing_of_the_forward_outlives_"
    "backward[flex-deepep-ep2-",
    "transformer/moe/test_dispatcher_state_release.py::test_nothing_of_the_forward_outlives_"
    "backward[alltoall-dropless-ep2-",
    "transformer/moe/test_dispatcher_state_release.py::test_nothing_of_the_forward_outlives_"
    "backward[allgather-ep2-",
    "transformer/moe/test_dispatcher_state_release.py::test_bitwise_equal_to_base[flex-hybridep-"
    "ep2-",
    # The flex backends only some bases have (NCCL EP from 0.19, DeepEP v2 on dev): required
    # where the tree has the backend (_backend_of).
    "transformer/moe/test_dispatcher_state_release.py::test_nothing_of_the_forward_outlives_"
    "backward[flex-ncclep-ep2-",
    "transformer/moe/test_dispatcher_state_release.py::test_bitwise_equal_to_base[flex-ncclep-ep2-",
    "transformer/moe/test_dispatcher_state_release.py::test_nothing_of_the_forward_outlives_"
    "backward[flex-deepepv2-ep2-",
    "transformer/moe/test_dispatcher_state_release.py::test_bitwise_equal_to_base[flex-deepepv2-"
    "ep2-",
    "transformer/moe/test_deepep_v2_buffer.py::test_a_replaced_buffer_serves_its_pending_",
    "transformer/moe/test_nccl_ep_buffers.py::test_release_frees_the_context_and_the_next_step_"
    "recreates_it[normal]",
    "transformer/moe/test_nccl_ep_buffers.py::test_a_second_ep_group_is_refused_not_silently_",
    "transformer/moe/test_dispatcher_state_release.py::test_series_adds_no_host_sync[flex-"
    "hybridep-ep2-",
    "transformer/moe/test_dispatcher_state_release.py::test_cudagraph_attrs_survive_release["
    "alltoall-dropless-ep2]",
    "transformer/moe/test_comm_buffers.py::test_destroy_model_parallel_releases_the_buffer[",
    "transformer/moe/test_comm_buffers.py::test_growth_never_holds_two_buffers[",
    "transformer/moe/test_comm_buffers.py::test_hybridep_buffer_rebinds_after_reinitialization"
    "[new-ep2]",
    "transformer/moe/test_comm_buffers.py::test_two_models_on_different_groups_keep_their_own_",
    "transformer/moe/test_comm_buffers.py::test_release_refuses_while_a_captured_graph_holds_the_"
    "buffer[hybridep]",
    "transformer/moe/test_comm_buffers.py::test_release_waits_for_every_peer_before_freeing["
    "hybridep]",
    "transformer/moe/test_comm_buffers.py::test_deep_ep_buffer_is_destroyed_explicitly",
    "transformer/moe/test_comm_buffers.py::test_a_rank_exiting_after_a_caught_exception_waits_",
    "transformer/moe/test_downstream_calls.py::test_art_hybridep_capacity_calls",
    "transformer/moe/test_downstream_calls.py::test_fixture_save_and_restore[",
    "a2a_overlap/test_a2a_overlap_schedule.py::test_finished_layer_holds_nothing[hybridep-",
    "a2a_overlap/test_a2a_overlap_schedule.py::test_chunk_state_released_after_backward[hybridep-",
    "a2a_overlap/test_a2a_overlap_schedule.py::test_overlap_with_full_recompute[hybridep]",
    "a2a_overlap/test_stream_care.py::",
)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long multi-rank variants, not run by default")
    config.addinivalue_line(
        "markers", "backport: release tests that also run against every backport series"
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


def _backend_of(prefix: str):
    """The flex backend a release-test prefix names in its parameters, if it names one."""
    params = prefix.partition("[")[2]
    for backend in ("deepepv2", "ncclep"):
        if backend in params:
            return backend
    return None


def _tree_backends() -> frozenset:
    from patchtool.trees import flex_backends

    return flex_backends(PATCHED_TREE) if PATCHED_TREE else frozenset()


def _backport_prefix(item) -> str:
    nodeid = item.nodeid
    cut = nodeid.find("unit_tests/")
    return nodeid[cut + len("unit_tests/") :] if cut >= 0 else nodeid


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
    # Release-test prefixes only deselected tests match are not expected on this tree.
    not_here = {
        p for item in lacking for p in BACKPORT_CASES if _backport_prefix(item).startswith(p)
    }
    if lacking:
        config.hook.pytest_deselected(items=lacking)
        items[:] = [item for item in items if item not in lacking]
    matched = set()
    for item in items:
        rel = _backport_prefix(item)
        for prefix in BACKPORT_CASES:
            if rel.startswith(prefix):
                item.add_marker(pytest.mark.backport)
                matched.add(prefix)
    not_here -= matched
    # A release test says so in the JUnit XML (``moe_release_test`` = ``backport``), where
    # ``moe_release.py matrix --record`` reads which tests of a run are release tests; set at
    # collection, so that a test skipped before its fixtures run says it too.
    for item in items:
        if item.get_closest_marker("backport"):
            item.user_properties.append(("moe_release_test", "backport"))
    marker = config.getoption("-m") or ""
    if "backport" in marker and not config.getoption("collectonly"):
        # A listed file that is gone, or a collected file none of whose tests match its entry.
        here = os.path.dirname(os.path.abspath(__file__))
        files = {_backport_prefix(item).split("::", 1)[0] for item in items}
        missing = [
            p
            for p in BACKPORT_CASES
            if p not in matched
            and p not in not_here
            and (_backend_of(p) is None or _backend_of(p) in backends)
            and (
                p.split("::", 1)[0] in files
                or not os.path.exists(os.path.join(here, p.split("::")[0]))
            )
        ]
        if missing:
            raise pytest.UsageError(f"BACKPORT_CASES entries match no test: {missing}")


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
