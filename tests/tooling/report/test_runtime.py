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

from moe_release.report import cli, config, render, stats, worker
from moe_release.report.runtime import ReportError, Runtime
from moe_release.runtime.ranks.launcher import rank_env, run_distributed
from tests.helpers import REPO_ROOT


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
        # Asked for on one GPU: the ranks share it, the process group over gloo (the lent
        # device has one GPU; scripts/device-kernels.sh).
        ("cuda", "deep_ep", 1, "", Runtime("cuda", "deep_ep", "gloo")),
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
    assert config.dispatcher_label(cfg) == label


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
    from moe_release.runtime.measure.cpu_memory import downsample

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


PEAK_JITTER_BYTES = 2048


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
    # Each figure is the base's peak minus another run's peak: with --quick, dropping after the
    # forward and after the backward lower the peak almost alike, and host allocations move a
    # run's peak by up to a few hundred bytes (after_backward came 820 B above after_forward in
    # one of two runs of 2026-12-06), so the order holds within PEAK_JITTER_BYTES.
    for rank, e in enumerate(report["warm_peak_explained"]):
        assert e["after_forward"] + PEAK_JITTER_BYTES >= e["after_backward"] > 0, e
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
    # Timing with the placement rules on and off, the runtime's bookkeeping their difference.
    t = report["timing"]
    assert "  rules off: the release itself" in text and "bookkeeping (on - off)" in text
    assert t["bookkeeping"]["release_seconds_median"] == (
        t["release_seconds_median"] - t["rules_off"]["release_seconds_median"]
    )
    assert "values with the placement rules off equal those with them on" in text


def test_bootstrap_interval_brackets_the_ratio_and_is_reproducible():
    base = [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.02, 0.98]
    patched = [x * 1.5 for x in base]
    lo, hi = stats.bootstrap_ratio_ci(base, patched)
    assert lo <= 1.5 <= hi and hi - lo < 0.5
    assert stats.bootstrap_ratio_ci(base, patched) == (lo, hi)
    # Identical samples: the interval is centred on 1.
    lo, hi = stats.bootstrap_ratio_ci(base, list(base))
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


def _fake_rank(tree: str, placement, rank: int, steps: int):
    """A rank's timing result: step times that depend on the tree and the placement rules, and
    release times in the patched tree only (made-up figures: the structure is what is tested)."""
    slower = ((1.5 if placement else 1.2) if tree == "patched" else 1.0) * (2 if placement else 1)
    release = 0.01 * (3.0 if placement else 1.0) if tree == "patched" else None
    return {
        "rank": rank,
        "losses": [1.0 + s for s in range(steps)],
        "step_times": [(s + 1 + rank) * slower for s in range(steps)],
        "step_cpu_times": [(s + 1) * slower / 2 for s in range(steps)],
        "release_times": [release] * steps,
    }


def test_timing_runs_each_tree_with_the_rules_on_and_off(monkeypatch):
    """On the CPU runtime every round runs both trees with the placement rules and without;
    the report prints both settings, and the bookkeeping rows are on - off."""
    calls = []

    def fake_run(tree, target, cfg, runtime=cli.CPU, timeout=900, placement=None):
        calls.append((tree, placement))
        return [_fake_rank(tree, placement, rank, cfg["steps"]) for rank in range(2)]

    monkeypatch.setattr(stats, "run", fake_run)
    monkeypatch.setattr(stats, "log", lambda msg: None)
    t = stats.timing("base", "patched", dict(cli.QUICK), rounds=2)
    on = [("base", True), ("patched", True), ("base", False), ("patched", False)]
    assert calls == on + on[::-1]
    off, book = t["rules_off"], t["bookkeeping"]
    assert book["ratio"] == t["ratio"] - off["ratio"] and book["ratio"] != 0
    for key in ("release_seconds_median", "release_fraction_median"):
        assert t[key] is not None and off[key] is not None
        assert book[key] == t[key] - off[key] and book[key] > 0
    assert t["rules_off_losses_equal"]
    samples = 2 * (config.TIMING_STEPS - 1)
    assert len(t["samples"]["base"]) == len(off["samples"]["patched"]) == samples
    text = "\n".join(render.timing_lines(t))
    for row in ("  placement rules on", "  placement rules off", "  rules off: the release itself"):
        assert row in text
    assert text.count("  the rules' bookkeeping (on - off)") == 2
    assert f"{book['release_seconds_median'] * 1e6:,.0f} us" in text
    assert "values with the placement rules off equal those with them on" in text
    # The targets judge the release's own figures: those with the rules off.
    report = {"base": [], "patched": [], "timing": t}
    targets = render.targets(report)
    assert targets["step time ratio patched/base (placement rules off)"].startswith(
        f"{off['ratio']:.3f}"
    )
    frac = 100 * off["release_fraction_median"]
    assert targets["time inside the release calls (placement rules off)"].startswith(f"{frac:.3f}%")


def test_timing_on_a_gpu_has_no_rules_to_take_out(monkeypatch):
    calls = []

    def fake_run(tree, target, cfg, runtime=cli.CPU, timeout=900, placement=None):
        calls.append((tree, placement))
        return [_fake_rank(tree, placement, rank, cfg["steps"]) for rank in range(2)]

    monkeypatch.setattr(stats, "run", fake_run)
    monkeypatch.setattr(stats, "log", lambda msg: None)
    t = stats.timing("base", "patched", dict(cli.QUICK), 1, Runtime("cuda", "emulation", "gloo"))
    assert calls == [("base", None), ("patched", None)]
    assert "rules_off" not in t and "bookkeeping" not in t
    text = "\n".join(render.timing_lines(t))
    assert "placement rules" not in text and "inside the release calls (patched)" in text
    targets = render.targets({"base": [], "patched": [], "timing": t})
    assert "step time ratio patched/base" in targets


@pytest.mark.slow
def test_timing_rows_come_from_runs_with_the_rules_on_and_off(base_tree, patched_tree):
    """A real (tiny) timing round: both settings measured the release calls, the bookkeeping
    rows are on - off, and the rules change no value."""
    cfg = dict(cli.QUICK, layers=1, tokens=256)
    t = stats.timing(base_tree, patched_tree, cfg, rounds=1)
    off = t["rules_off"]
    assert t["release_seconds_median"] > 0 and off["release_seconds_median"] > 0
    assert t["bookkeeping"]["release_seconds_median"] == (
        t["release_seconds_median"] - off["release_seconds_median"]
    )
    assert t["bookkeeping"]["ratio"] == t["ratio"] - off["ratio"]
    assert t["rules_off_losses_equal"]
    text = "\n".join(render.timing_lines(t))
    assert "  rules off: the release itself" in text and "bookkeeping (on - off)" in text


def _rank_profile(rows_per_step, steps=3):
    """A rank of a profiled run: the same cProfile rows each warm step."""
    return {
        "profile": [rows_per_step] * (steps - 1),
        "step_times": [0.5] * steps,
        "step_cpu_times": [0.4] * steps,
        "page_faults": [100] * steps,
    }


def test_step_profile_names_the_calls_the_patched_tree_adds():
    """Calls are matched by file and function name (a moved function adds nothing), the time
    inside a function counts each call once even when a same-named method calls it, and the
    patched tree's own code is entered where the base's code calls it."""
    from moe_release.report import step_profile

    shared = {
        "megatron/m.py:10(forward)": (4, 0.010, 0.050, {}),
        "torch/distributed/c10d.py:5(all_to_all_single)": (2, 0.020, 0.020, {}),
    }
    base = dict(shared, **{"megatron/m.py:30(helper)": (4, 0.001, 0.001, {})})
    patched = dict(
        shared,
        **{
            "megatron/m.py:33(helper)": (4, 0.001, 0.001, {}),  # moved by the patch: same calls
            "megatron/m.py:50(release)": (2, 0.001, 0.003, {"megatron/m.py:10(forward)": 0.003}),
            # The manager's release, called by the dispatcher's release: not counted twice.
            "megatron/m.py:90(release)": (2, 0.001, 0.002, {"megatron/m.py:50(release)": 0.002}),
            "megatron/m.py:95(drop)": (6, 0.001, 0.001, {"megatron/m.py:90(release)": 0.001}),
        },
    )
    runs = {"base": [[_rank_profile(base)] * 2], "patched": [[_rank_profile(patched)] * 2]}
    result = step_profile.summarize(runs)
    added = {a["function"]: a for a in result["calls_added"]}
    assert set(added) == {"megatron/m.py(release)", "megatron/m.py(drop)"}
    assert added["megatron/m.py(release)"]["calls"] == 4
    assert added["megatron/m.py(release)"]["seconds"] == pytest.approx(0.003)
    assert result["patched_only_entries"] == ["megatron/m.py(release)"]
    assert result["patched_only_seconds"] == pytest.approx(0.003)
    assert result["base"]["rank_steps"] == result["patched"]["rank_steps"] == 4
    kinds = result["patched"]["kinds"]
    assert kinds["collectives (incl. waiting for the other rank)"][1] == pytest.approx(0.020)
    assert kinds["megatron-core Python"][1] == pytest.approx(0.014)
    text = "\n".join(step_profile.lines(result))
    assert "megatron/m.py(release)" in text and "time inside the code only the patched" in text
    assert result["patched"]["page_faults"] == (100, 100, 100) and "minor page faults" in text
