# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Where the memory report runs: device and kernel choice, refusals, and the CUDA timeline.

The GPU path itself needs a GPU (``scripts/device-check`` runs it there); these tests cover what
decides it and what converts its allocator trace, on the host.
"""

import json
import os
import subprocess
import sys

import pytest

from cpu_runtime.launcher import REPO_ROOT, rank_env, run_distributed
from report import cli, worker
from report.runtime import ReportError, Runtime


@pytest.mark.parametrize(
    "device, kernels, gpus, deep_ep, expected",
    [
        ("auto", "auto", 0, None, Runtime("cpu", "emulation", "gloo")),
        ("auto", "auto", 1, None, Runtime("cuda", "emulation", "gloo")),
        # One GPU for two ranks: NCCL refuses a shared GPU, so the emulation over gloo.
        ("auto", "auto", 1, "", Runtime("cuda", "emulation", "gloo")),
        ("auto", "auto", 2, "", Runtime("cuda", "deep_ep", "nccl")),
        # A deep_ep without HybridEP cannot run megatron's hybridep backend.
        ("auto", "auto", 2, "HybridEPBuffer", Runtime("cuda", "emulation", "gloo")),
        ("cpu", "auto", 2, "", Runtime("cpu", "emulation", "gloo")),
        ("cuda", "emulation", 2, "", Runtime("cuda", "emulation", "gloo")),
        ("cuda", "deep_ep", 8, "", Runtime("cuda", "deep_ep", "nccl")),
    ],
)
def test_resolve_runtime(device, kernels, gpus, deep_ep, expected):
    assert cli.resolve_runtime(device, kernels, 2, gpus, deep_ep) == expected


@pytest.mark.parametrize(
    "device, kernels, gpus, deep_ep, message",
    [
        ("cuda", "auto", 0, None, "--device cuda: no CUDA device is visible"),
        ("cpu", "deep_ep", 2, "", "--kernels deep_ep: the real kernels need CUDA"),
        ("cuda", "deep_ep", 2, None, "--kernels deep_ep: deep_ep is not importable"),
        ("cuda", "deep_ep", 2, "HybridEPBuffer", "lacks HybridEPBuffer"),
        ("cuda", "deep_ep", 1, "", "2 ranks need 2 GPUs for NCCL, 1 visible"),
        ("tpu", "auto", 0, None, "--device tpu: expected auto, cpu or cuda"),
    ],
)
def test_resolve_runtime_refusals_name_the_problem(device, kernels, gpus, deep_ep, message):
    with pytest.raises(ReportError, match=message.replace("(", r"\(")):
        cli.resolve_runtime(device, kernels, 2, gpus, deep_ep)


def test_report_refuses_cuda_here_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "probe_machine", lambda: (0, None))
    out = tmp_path / "report"
    assert cli.main(["--device", "cuda", "--out", str(out)]) == 2
    assert "memory_report: --device cuda: no CUDA device is visible" in capsys.readouterr().err
    assert not out.exists()


def test_golden_values_are_recorded_on_cpu_only(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "probe_machine", lambda: (1, None))
    golden = tmp_path / "golden.json"
    assert cli.main(["--record-golden", str(golden), "--out", str(tmp_path)]) == 2
    assert "--record-golden: golden values hold CPU-allocator figures" in capsys.readouterr().err
    assert not golden.exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dispatcher", "allgather", "--backend", "deepep"], "only the flex dispatcher has"),
        (["--dispatcher", "alltoall", "--record-golden", "g.json"], "are for flex/hybridep"),
    ],
)
def test_dispatcher_refusals_write_nothing(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.setattr(cli, "probe_machine", lambda: (0, None))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "report"
    assert cli.main([*args, "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "g.json").exists()


@pytest.mark.parametrize(
    "cfg, overrides, label",
    [
        ({"backend": "hybridep"}, {}, "flex/hybridep"),
        ({"backend": "deepep"}, {}, "flex/deepep"),
        (
            {"backend": "hybridep", "dispatcher": "allgather"},
            {"moe_token_dispatcher_type": "allgather"},
            "allgather",
        ),
        (
            {"backend": "hybridep", "dispatcher": "alltoall"},
            {"moe_token_dispatcher_type": "alltoall"},
            "alltoall",
        ),
    ],
)
def test_dispatcher_choice_reaches_the_config(cfg, overrides, label):
    assert worker._dispatcher_overrides(cfg) == overrides
    assert cli.dispatcher_label(cfg) == label


def test_cuda_trace_points_follow_allocated_bytes():
    """Allocations count when made, frees when completed; segment events change nothing."""
    trace = [
        {"action": "segment_alloc", "size": 2097152, "time_us": 5},
        {"action": "alloc", "size": 512, "time_us": 10},
        {"action": "alloc", "size": 1024, "time_us": 11},
        {"action": "free_requested", "size": 512, "time_us": 12},
        {"action": "free_completed", "size": 512, "time_us": 13},
        {"action": "segment_free", "size": 2097152, "time_us": 14},
    ]
    pts = worker.cuda_trace_points(trace, baseline=4096)
    assert pts == [(10_000, 4608), (11_000, 5632), (13_000, 5120)]
    # Older torch without time_us: event order stands in for time.
    untimed = [{k: v for k, v in e.items() if k != "time_us"} for e in trace]
    assert [t for t, _ in worker.cuda_trace_points(untimed, 0)] == [1000, 2000, 4000]


def test_downsample_keeps_each_buckets_maximum():
    pts = [(i * 1_000_000, b) for i, b in enumerate([1, 5, 2, 2, 9, 3, 4])]
    from cpu_runtime.cpu_memory import downsample

    tl = downsample(pts, t0=0, points=3)
    assert tl == {"t_ms": [0.0, 2.0, 4.0, 6.0], "bytes": [5, 2, 9, 4]}


def test_rank_env_hides_gpus_only_for_cpu_ranks(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cpu = rank_env("/tree", 0, 2, 1234)
    cuda = rank_env("/tree", 1, 2, 1234, device="cuda")
    assert cpu["CUDA_VISIBLE_DEVICES"] == ""
    assert "CUDA_VISIBLE_DEVICES" not in cuda and cuda["LOCAL_RANK"] == "1"
    assert cuda["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


@pytest.mark.parametrize(
    "device, backend, message",
    [("tpu", "gloo", "device must be one of"), ("cpu", "nccl", "nccl backend needs")],
)
def test_run_distributed_refuses_bad_placement(device, backend, message):
    with pytest.raises(ValueError, match=message):
        run_distributed("x:y", 2, "/tree", device=device, backend=backend)


DEVICE_CHECK = REPO_ROOT / "scripts" / "device-check"


def _device_check(tmp_path, env_file, *args):
    env = dict(
        os.environ, DEVICE_TREES_ENV=str(env_file), OUT=str(tmp_path / "out"), PYTHON=sys.executable
    )
    return subprocess.run(
        ["bash", str(DEVICE_CHECK), "run", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_device_check_refuses_without_prepared_trees(tmp_path):
    done = _device_check(tmp_path, tmp_path / "absent.env")
    assert done.returncode == 2
    assert "run 'scripts/device-check prepare' first" in done.stderr
    env_file = tmp_path / "trees.env"
    env_file.write_text(f"MOE_RELEASE_BASE_TREE={tmp_path}/nope\nMOE_RELEASE_TREE={tmp_path}\n")
    done = _device_check(tmp_path, env_file)
    assert done.returncode == 2 and f"tree {tmp_path}/nope is missing" in done.stderr


def test_device_check_runs_the_report_end_to_end(tmp_path, base_tree, patched_tree):
    """The script the GPU check runs, here on the host (--device cpu overrides its cuda):
    table, JSON, PNG and log come back under $OUT."""
    env_file = tmp_path / "trees.env"
    env_file.write_text(f"MOE_RELEASE_BASE_TREE={base_tree}\nMOE_RELEASE_TREE={patched_tree}\n")
    done = _device_check(tmp_path, env_file, "--device", "cpu", "--quick")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "out"
    names = {p.name for p in out.iterdir()}
    assert names == {
        "machine.txt", "report.log", "memory_report.json", "memory_report.png", "memory_report.txt"
    }  # fmt: skip
    text = (out / "memory_report.txt").read_text()
    assert "runs on: CPU, deep_ep emulation over gloo, counting CPU allocator" in text
    assert "losses bitwise equal: yes" in text
    report = json.loads((out / "memory_report.json").read_text())
    assert report["runtime"] == {"device": "cpu", "kernels": "emulation", "backend": "gloo"}
    assert all(sum(r["dispatcher_held_bytes"]) == 0 for r in report["patched"])
    assert all(sum(r["dispatcher_held_bytes"]) > 0 for r in report["base"])
    # The flex dispatcher's communication buffers: emulated bytes, and what the patched tree's
    # reset_fused_a2a_buffers() returns (the base has no release).
    assert "returned by reset_fused_a2a_buffers" in text
    for b, p in zip(report["base"], report["patched"]):
        assert b["comm_buffers"]["allocator_bytes_released"] is None
        assert p["comm_buffers"]["emulated_bytes"] > 0
        assert p["comm_buffers"]["allocator_bytes_released"] == p["comm_buffers"]["emulated_bytes"]
    # The warm-peak reduction is the base's dispatcher state alive at its peak, measured by
    # dropping it in the base where the release does (fails on an unpatched "patched" tree).
    for rank, e in enumerate(report["warm_peak_explained"]):
        assert e["after_forward"] >= e["after_backward"] > 0, e
        assert report["targets"][f"rank {rank} warm peak reduction"].endswith(": met"), e
    # The HybridEP accounting's prediction beside the measurement (buffer and one call).
    assert "HybridEP accounting" in text and "combine_output (max call)" in text
    # The 1F1B A2A-overlap section: megatron-core's overlap schedule, base vs patched.
    assert "1F1B A2A overlap (overlap_moe_expert_parallel_comm" in text
    assert "overlap on == overlap off (losses, all gradients, bitwise): yes" in text
    overlap = report["overlap"]
    assert overlap["bitwise_base_patched"]
    for b, p in zip(overlap["base"], overlap["patched"]):
        assert min(b["held_past_last_use"]) > 10_000 and b["chunk_state_bytes"] > 0
        # Allocator level, within the counter's noise (gloo frees buffers asynchronously).
        assert max(p["held_past_last_use"]) < 1024 and p["chunk_state_bytes"] == 0
        # The peak's range over repeated runs (not compared: at --quick size the release's
        # effect on the peak is within the runs' spread).
        assert len(b["peak_range"]) == len(p["peak_range"]) == 2
    assert all(len(overlap["timeline"][k]["bytes"]) > 10 for k in ("base", "patched"))


def test_bootstrap_interval_brackets_the_ratio_and_is_reproducible():
    base = [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.02, 0.98]
    patched = [x * 1.5 for x in base]
    lo, hi = cli.bootstrap_ratio_ci(base, patched)
    assert lo <= 1.5 <= hi and hi - lo < 0.5
    assert cli.bootstrap_ratio_ci(base, patched) == (lo, hi)
    # Identical samples: the interval is centred on 1.
    lo, hi = cli.bootstrap_ratio_ci(base, list(base))
    assert lo < 1.0 < hi


def test_release_timer_times_only_the_release_calls(patched_tree):
    import time

    import torch

    class Dispatcher:
        def __init__(self):
            self.released = 0

        def reset_transient_forward_state(self):
            time.sleep(0.01)
            self.released += 1

    class Layer(torch.nn.Module):
        def __init__(self, dispatcher):
            super().__init__()
            self.token_dispatcher = dispatcher

    layer = Layer(Dispatcher())
    timer = worker.ReleaseTimer(torch.nn.Sequential(layer))
    layer.token_dispatcher.reset_transient_forward_state()
    layer.token_dispatcher.reset_transient_forward_state()
    spent = timer.take()
    assert layer.token_dispatcher.released == 2 and timer.calls == 2
    assert 0.02 <= spent < 0.5
    assert timer.take() == 0.0
    # A tree without the release (the unpatched base) has nothing to time.
    bare = worker.ReleaseTimer(torch.nn.Sequential(Layer(object())))
    assert bare.take() is None
