"""The upstream CPU harness (scripts/upstream_cpu) and the upstream-layout tests it runs.

What CI can run: the PyPI sdist our trees come from has no ``tests/``, and CI cannot reach a
Megatron-LM checkout. So the CI case builds a scratch checkout around the materialized patched
tree (its ``megatron/``), our upstream-layout test files from ``patches/upstream/tests`` and a
stand-in for upstream's ``tests/unit_tests/test_utilities.py`` (``upstream_standin/``: only
``Utils``, with upstream's behaviour), and runs a few of those tests through ``run.py`` on 8
gloo ranks, as upstream's CI runs them on 8 GPUs. That covers the harness (launch, CUDA to host,
NCCL to gloo, counting over ranks) and our tests' logic against the series; a small
upstream-style file (``upstream_standin/standin_placement_wiring.py``) checks that the plugin
runs tests under the CPU runtime's placement rules (and without them, ``--no-placement``), and
what ``--te-local-spec``/``--fp32-gemm`` give a test. It does not cover
upstream's own test files or their ``Utils``. Running upstream's own MoE tests needs a
Megatron-LM checkout: the ``slow`` case does it when the read-only mirror exists (never on CI),
on a snapshot of core_r0.19.0 with and without the series.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from upstream_cpu import run as harness

REPO_ROOT = Path(__file__).resolve().parents[2]
RUN = REPO_ROOT / "scripts" / "upstream_cpu" / "run.py"
UPSTREAM_TESTS = REPO_ROOT / "patches" / "upstream" / "tests"
STANDIN = Path(__file__).resolve().parent / "upstream_standin" / "standin_test_utilities.py"
WIRING = Path(__file__).resolve().parent / "upstream_standin" / "standin_placement_wiring.py"
MIRROR = Path("/work/.mirror/NVIDIA+Megatron-LM/repo")
MOE = "tests/unit_tests/transformer/moe"
STATE_RELEASE = f"{MOE}/test_token_dispatcher_state_release.py"
COMM_BUFFERS = f"{MOE}/test_fused_a2a_release_comm_buffers.py"


def _tree(name: str) -> Path:
    tree = os.environ.get(name)
    if not tree or not (Path(tree) / "megatron" / "core").is_dir():
        pytest.skip(f"{name} is not set to a materialized tree (scripts/run-tests sets it)")
    return Path(tree)


def _write_jsonl(path: Path, records: list) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _phases(nodeid: str, call: str, detail: str = "") -> list:
    phases = [dict(nodeid=nodeid, when="setup", outcome="passed", detail="")]
    if call == "skipped":
        return [dict(nodeid=nodeid, when="setup", outcome="skipped", detail=detail)]
    phases.append(dict(nodeid=nodeid, when="call", outcome=call, detail=detail))
    return phases + [dict(nodeid=nodeid, when="teardown", outcome="passed", detail="")]


def test_aggregate_over_ranks(tmp_path):
    """Failed on any rank is failed (with that rank's first error line), skipped is rank 0's
    skip, a test some rank did not finish is incomplete."""
    ok, bad, skip, cut = "f.py::ok", "f.py::bad", "f.py::skip", "g.py::cut"
    error = "def test():\n>   assert x\nE   AssertionError: held ['a']\nE   + where x = 1\n"
    _write_jsonl(
        tmp_path / "rank0.jsonl",
        _phases(ok, "passed")
        + _phases(bad, "passed")
        + _phases(skip, "skipped", "Skipped: no TE")
        + _phases(cut, "passed"),
    )
    _write_jsonl(
        tmp_path / "rank1.jsonl",
        _phases(ok, "passed")
        + _phases(bad, "failed", error)
        + _phases(skip, "skipped", "Skipped: no TE")
        + _phases(cut, "passed")[:1],
    )
    tests = harness.aggregate(tmp_path, nproc=2)
    assert tests[ok] == dict(outcome="passed", reason="")
    assert tests[bad] == dict(outcome="failed", reason="rank 1: call: AssertionError: held ['a']")
    assert tests[skip] == dict(outcome="skipped", reason="Skipped: no TE")
    assert tests[cut]["outcome"] == "incomplete"
    summary = harness.summarize(tests)
    assert summary["files"] == {
        "f.py": dict(passed=1, failed=1, skipped=1),
        "g.py": dict(incomplete=1),
    }


def test_refuses_a_tree_without_upstream_tests(tmp_path, capsys):
    """A tree without tests/unit_tests/test_utilities.py (e.g. a bare sdist) is a usage error."""
    assert harness.main([str(tmp_path)]) == 2
    assert "has no tests/unit_tests/test_utilities.py" in capsys.readouterr().err


def standin_checkout(root: Path, tree: Path) -> Path:
    """A Megatron-LM-shaped checkout: the tree's megatron/, our upstream-layout tests and the
    stand-in Utils."""
    root.mkdir()
    (root / "megatron").symlink_to(tree / "megatron", target_is_directory=True)
    shutil.copytree(UPSTREAM_TESTS, root / "tests")
    for pkg in ("tests", "tests/unit_tests", "tests/unit_tests/transformer", MOE):
        (root / pkg / "__init__.py").touch()
    shutil.copy(STANDIN, root / "tests" / "unit_tests" / "test_utilities.py")
    return root


def run_harness(
    checkout: Path,
    out: Path,
    *pytest_args: str,
    timeout: int = 600,
    options=("--deep-ep-emulation",),
) -> dict:
    """``run.py CHECKOUT --json OUT OPTIONS PYTEST_ARGS`` (8 ranks unless OPTIONS say
    ``--nproc``; the deep_ep emulation by default); its JSON."""
    cmd = [sys.executable, str(RUN), str(checkout), "--timeout", str(timeout - 60)]
    cmd += [*options, "--json", str(out), *pytest_args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert out.exists(), f"no result (exit {done.returncode}):\n{done.stdout[-3000:]}"
    return json.loads(out.read_text())


WIRING_TEST = "tests/unit_tests/test_placement_wiring.py"


def test_plugin_runs_tests_under_the_placement_rules(tmp_path):
    """The plugin installs the CPU runtime's placement rules: an upstream-style test calling
    record_stream on a pinned host tensor (as HybridEP's blocking dispatch returns
    tokens_per_expert) fails with torch's own error, one on a device tensor passes, mixing
    device and host fails, and a checkpoint's recompute still reaches the device; with
    --no-placement (the plain CUDA-to-host mapping) the host takes all of it. --te-local-spec
    builds an MLA layer on the local spec, on the device; --fp32-gemm rounds bf16 GEMMs once.
    A module that fails to collect is one failed entry for its file, and the other files still
    run. One rank each (the tests need no collectives)."""
    checkout = standin_checkout(tmp_path / "checkout", _tree("MOE_RELEASE_TREE"))
    shutil.copy(WIRING, checkout / WIRING_TEST)
    broken = "tests/unit_tests/test_broken.py"
    (checkout / broken).write_text("import torch\n\nFREE = torch.cuda.mem_get_info()\n")
    runs = {}
    for name, options in {
        "placement": ("--nproc", "1", "--te-local-spec", "--fp32-gemm"),
        "no-placement": ("--nproc", "1", "--no-placement"),
    }.items():
        result = run_harness(
            checkout, tmp_path / f"{name}.json", WIRING_TEST, broken, timeout=300, options=options
        )
        assert result["placement"] == (name == "placement"), result
        assert result["files"][broken] == {"failed": 1}, result
        assert result["tests"][broken]["reason"].startswith("rank 0: collect: "), result
        runs[name] = {n.split("::")[-1]: t for n, t in result["tests"].items() if "::" in n}
    rules, plain = runs["placement"], runs["no-placement"]
    outcomes = {name: t["outcome"] for name, t in rules.items()}
    assert outcomes == {
        "test_the_device_is_an_h100": "passed",
        "test_cuda_tensors_are_device_tensors": "passed",
        "test_record_stream_on_a_device_tensor": "passed",
        "test_record_stream_on_a_pinned_host_tensor": "failed",
        "test_device_and_host_tensors_do_not_mix": "failed",
        "test_a_read_on_another_stream_waits_for_the_write": "failed",
        "test_a_checkpoint_recompute_moves_to_the_device": "passed",
        "test_bf16_gemm_rounds_once": "passed",
        "test_mla_layer_on_the_te_spec": "passed",
    }, rules
    record_stream = rules["test_record_stream_on_a_pinned_host_tensor"]["reason"]
    assert "Could not run 'aten::record_stream' with arguments from the 'CPU' backend" in (
        record_stream
    ), record_stream
    mixing = rules["test_device_and_host_tensors_do_not_mix"]["reason"]
    assert "Expected all tensors to be on the same device" in mixing, mixing
    race = rules["test_a_read_on_another_stream_waits_for_the_write"]["reason"]
    assert "StreamOrderError" in race, race
    for name in (
        "test_record_stream_on_a_device_tensor",
        "test_record_stream_on_a_pinned_host_tensor",
        "test_device_and_host_tensors_do_not_mix",
        "test_a_read_on_another_stream_waits_for_the_write",
        "test_a_checkpoint_recompute_moves_to_the_device",
        "test_the_device_is_an_h100",
    ):
        assert plain[name]["outcome"] == "passed", (name, plain[name])
    assert plain["test_cuda_tensors_are_device_tensors"]["outcome"] == "failed", plain
    assert plain["test_mla_layer_on_the_te_spec"]["outcome"] == "skipped", plain


@pytest.mark.slow
def test_no_stream_order_keeps_the_other_placement_rules(tmp_path):
    """--no-stream-order: the race passes, record_stream on a pinned host tensor and mixing
    device with host still fail."""
    checkout = standin_checkout(tmp_path / "checkout", _tree("MOE_RELEASE_TREE"))
    shutil.copy(WIRING, checkout / WIRING_TEST)
    result = run_harness(
        checkout,
        tmp_path / "out.json",
        WIRING_TEST,
        "-k",
        "stream or mix",
        timeout=300,
        options=("--nproc", "1", "--no-stream-order"),
    )
    outcomes = {n.split("::")[-1]: t["outcome"] for n, t in result["tests"].items()}
    assert outcomes == {
        "test_record_stream_on_a_device_tensor": "passed",
        "test_record_stream_on_a_pinned_host_tensor": "failed",
        "test_device_and_host_tensors_do_not_mix": "failed",
        "test_a_read_on_another_stream_waits_for_the_write": "passed",
    }, result["tests"]


def test_upstream_layout_tests_pass_with_the_series(tmp_path):
    """On the patched tree: all-gather and all-to-all at TP2xEP4 with recompute, and
    reset_fused_a2a_buffers() before any dispatch, pass on all 8 ranks."""
    checkout = standin_checkout(tmp_path / "checkout", _tree("MOE_RELEASE_TREE"))
    selection = "test_state_released_after_backward and not Flex and True-2-4 or idempotent"
    result = run_harness(
        checkout, tmp_path / "out.json", STATE_RELEASE, COMM_BUFFERS, "-k", selection
    )
    outcomes = {n.split("::")[-1]: t["outcome"] for n, t in result["tests"].items()}
    assert outcomes == {
        "test_state_released_after_backward[True-2-4-allgather]": "passed",
        "test_state_released_after_backward[True-2-4-alltoall]": "passed",
        "test_reset_fused_a2a_buffers_is_idempotent_without_buffers": "passed",
    }, result["tests"]
    assert result["returncode"] == 0


@pytest.mark.slow
def test_upstream_layout_tests_fail_without_the_series(tmp_path):
    """On the base tree the release tests fail (the flex ones on the deep_ep emulation), and
    the output-equality tests pass on both trees."""
    selection = "(allgather or hybridep or idempotent or release_and_recreate) and not False-"
    results = {}
    for env in ("MOE_RELEASE_TREE", "MOE_RELEASE_BASE_TREE"):
        checkout = standin_checkout(tmp_path / env, _tree(env))
        out = tmp_path / f"{env}.json"
        result = run_harness(checkout, out, STATE_RELEASE, COMM_BUFFERS, "-k", selection)
        results[env] = {n.split("::", 1)[1]: t["outcome"] for n, t in result["tests"].items()}
    patched, base = results["MOE_RELEASE_TREE"], results["MOE_RELEASE_BASE_TREE"]
    assert patched.keys() == base.keys() and len(patched) >= 6, results
    assert set(patched.values()) == {"passed"}, patched
    for name, outcome in base.items():
        expected = "passed" if "keeps_outputs" in name else "failed"
        assert outcome == expected, (name, base)


@pytest.mark.slow
def test_upstream_moe_tests_on_a_snapshot_with_and_without_the_series(tmp_path):
    """Upstream's own all-to-all dispatcher tests on core_r0.19.0 (the read-only mirror's
    snapshot; absent on CI): the same outcomes with the series git-am'd as without it."""
    if not (MIRROR / "HEAD").exists():
        pytest.skip(f"no Megatron-LM mirror at {MIRROR}")
    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    archive = subprocess.run(
        ["git", f"--git-dir={MIRROR}", "archive", "core_r0.19.0"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(checkout)], input=archive.stdout, check=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-C", str(checkout)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "core_r0.19.0"], check=True)
    base = run_harness(checkout, tmp_path / "base.json", f"{MOE}/test_a2a_token_dispatcher.py")

    export = tmp_path / "export"
    env = dict(os.environ, GIT_CONFIG_GLOBAL=str(tmp_path / "gitconfig"))
    subprocess.run(["git", "config", "--global", "user.name", "Test"], env=env, check=True)
    subprocess.run(
        ["git", "config", "--global", "user.email", "test@example.com"], env=env, check=True
    )
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "moe_release.py"), "upstream"]
        + ["core_r0.19.0", str(export), "--topic", "memory"],
        env=dict(env, GIT_CONFIG_NOSYSTEM="1"),
        cwd=tmp_path,
        check=True,
        capture_output=True,
    )
    subprocess.run([*git, "am", "-q", *sorted(map(str, export.glob("*.patch")))], check=True)
    series = run_harness(checkout, tmp_path / "series.json", f"{MOE}/test_a2a_token_dispatcher.py")
    assert base["files"] == series["files"], (base["files"], series["files"])
    assert base["files"][f"{MOE}/test_a2a_token_dispatcher.py"].get("passed", 0) >= 10
    assert not base["files"][f"{MOE}/test_a2a_token_dispatcher.py"].get("failed")
