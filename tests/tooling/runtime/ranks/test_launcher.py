# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The rank launcher's fork server (runtime.ranks.zygote): a forked rank is what a spawned one is.

Each job's ranks start from the zygote's state, never from an earlier job's; they see the same
modules, deep_ep and rules as a fresh interpreter; a failing or hung rank is reported and
killed as a spawned one is, and no rank outlives its call.
"""

import os

import pytest

from moe_release.runtime.ranks import launcher
from moe_release.runtime.ranks.launcher import DistributedTestError, run_distributed

THIS = "tests.tooling.runtime.ranks.test_launcher"
_STATE = {}


def rank_state(mark: str) -> dict:
    """What a rank sees at its start, then leave a mark for a next job to find."""
    import sys

    import torch
    import torch.distributed as dist

    from moe_release.runtime.cuda import placement

    seen = dict(_STATE)
    _STATE["mark"] = mark
    return {
        "rank": dist.get_rank(),
        "pid": os.getpid(),
        "earlier_mark": seen.get("mark"),
        "deep_ep_emulated": sys.modules["deep_ep"].utils.IS_CPU_EMULATION,
        "placement": placement.active(),
        "cuda_tensor": torch.ones(1, device="cuda").is_cuda if placement.active() else None,
        "threads": torch.get_num_threads(),
        "env_rank": os.environ["RANK"],
    }


def rank_hang(pid_dir: str) -> None:
    import time

    import torch.distributed as dist

    open(os.path.join(pid_dir, f"{dist.get_rank()}.pid"), "w").write(str(os.getpid()))
    time.sleep(300)


def _state(tree, mark, monkeypatch, fork):
    monkeypatch.setenv("MOE_RELEASE_FORK", "1" if fork else "0")
    return run_distributed(f"{THIS}:rank_state", 2, tree, {"mark": mark}, timeout=120)


def test_forked_ranks_start_fresh_and_match_spawned_ones(patched_tree, monkeypatch):
    spawned = _state(patched_tree, "spawned", monkeypatch, fork=False)
    first = _state(patched_tree, "first", monkeypatch, fork=True)
    second = _state(patched_tree, "second", monkeypatch, fork=True)
    for results in (spawned, first, second):
        assert [r["rank"] for r in results] == [0, 1]
        assert [r["env_rank"] for r in results] == ["0", "1"]
        assert all(r["earlier_mark"] is None for r in results), results
    drop = ("pid",)
    view = [{k: v for k, v in r.items() if k not in drop} for r in spawned]
    assert [{k: v for k, v in r.items() if k not in drop} for r in second] == view
    assert view[0]["placement"] and view[0]["cuda_tensor"] and view[0]["deep_ep_emulated"]
    assert {r["pid"] for r in first}.isdisjoint(r["pid"] for r in second)


def test_a_hung_forked_rank_is_killed(patched_tree, monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_RELEASE_FORK", "1")
    with pytest.raises(DistributedTestError, match="timed out after 5s") as err:
        run_distributed(f"{THIS}:rank_hang", 2, patched_tree, {"pid_dir": str(tmp_path)}, timeout=5)
    assert "exit code -9" in str(err.value)
    # Each rank printed its stacks when it timed out (the launcher's signal), where it hung.
    assert str(err.value).count(" in rank_hang\n") == 2, str(err.value)
    for rank in (0, 1):
        assert not launcher._pid_alive(int((tmp_path / f"{rank}.pid").read_text()))
    # The zygote that served this job (most recently used: last) survives its ranks' kill. An
    # earlier test's zygote may have gone meanwhile; the launcher replaces a dead one on use.
    zygotes = list(launcher._ZYGOTES.values())
    assert zygotes and zygotes[-1].proc.poll() is None
    # The killed ranks are gone (reaped by their zygote), the zygote serves the next job.
    assert [r["rank"] for r in _state(patched_tree, "after", monkeypatch, fork=True)] == [0, 1]


def test_a_taken_rendezvous_port_is_retried_on_another(patched_tree, monkeypatch):
    """free_port() can hand out a port another process binds before rank 0's store does
    (EADDRINUSE at init_process_group): the job runs again on another port, not fails."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    real, ports = launcher.free_port, []

    def racy_free_port():
        ports.append(taken.getsockname()[1] if not ports else real())
        return ports[-1]

    monkeypatch.setattr(launcher, "free_port", racy_free_port)
    try:
        results = run_distributed(f"{THIS}:rank_state", 2, patched_tree, {"mark": "x"}, timeout=120)
    finally:
        taken.close()
    assert [r["rank"] for r in results] == [0, 1]
    assert len(ports) == 2 and ports[0] != ports[1], ports


def test_placement_argument_overrides_the_environment(patched_tree, monkeypatch):
    """``placement=False`` runs a job's ranks without the placement rules while
    ``MOE_RELEASE_PLACEMENT`` leaves them on (the memory report's timing runs both)."""
    monkeypatch.delenv("MOE_RELEASE_PLACEMENT", raising=False)
    off = run_distributed(f"{THIS}:rank_state", 2, patched_tree, {"mark": "off"}, placement=False)
    assert [r["placement"] for r in off] == [False, False]
    assert [r["cuda_tensor"] for r in off] == [None, None]
