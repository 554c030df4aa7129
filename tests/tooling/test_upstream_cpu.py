"""The upstream CPU harness (scripts/upstream_cpu) and the upstream-layout tests it runs.

What CI can run: the PyPI sdist our trees come from has no ``tests/``, and CI cannot reach a
Megatron-LM checkout. So the CI case builds a scratch checkout around the materialized patched
tree (its ``megatron/``), our upstream-layout test files from ``patches/upstream/tests`` and a
stand-in for upstream's ``tests/unit_tests/test_utilities.py`` (``upstream_standin/``: only
``Utils``, with upstream's behaviour), and runs a few of those tests through ``run.py`` on 8
gloo ranks, as upstream's CI runs them on 8 GPUs. That covers the harness (launch, CUDA to host,
NCCL to gloo, counting over ranks) and our tests' logic against the series; it does not cover
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


def run_harness(checkout: Path, out: Path, *pytest_args: str, timeout: int = 600) -> dict:
    """``run.py CHECKOUT --json OUT PYTEST_ARGS`` (8 ranks, deep_ep emulation); its JSON."""
    cmd = [sys.executable, str(RUN), str(checkout), "--timeout", str(timeout - 60)]
    cmd += ["--deep-ep-emulation", "--json", str(out), *pytest_args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert out.exists(), f"no result (exit {done.returncode}):\n{done.stdout[-3000:]}"
    return json.loads(out.read_text())


def test_upstream_layout_tests_pass_with_the_series(tmp_path):
    """On the patched tree: all-gather and all-to-all at TP2xEP4 with recompute, and
    release_comm_buffers() before any dispatch, pass on all 8 ranks."""
    checkout = standin_checkout(tmp_path / "checkout", _tree("MOE_RELEASE_TREE"))
    selection = "test_state_released_after_backward and not Flex and True-2-4 or idempotent"
    result = run_harness(
        checkout, tmp_path / "out.json", STATE_RELEASE, COMM_BUFFERS, "-k", selection
    )
    outcomes = {n.split("::")[-1]: t["outcome"] for n, t in result["tests"].items()}
    assert outcomes == {
        "test_state_released_after_backward[True-2-4-allgather]": "passed",
        "test_state_released_after_backward[True-2-4-alltoall]": "passed",
        "test_release_comm_buffers_is_idempotent_without_buffers": "passed",
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
