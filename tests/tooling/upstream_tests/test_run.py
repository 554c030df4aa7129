"""The upstream CPU harness (moe_release.upstream_tests) and the upstream-layout tests it runs.

What CI can run: the PyPI sdist our trees come from has no ``tests/``, and CI cannot reach a
Megatron-LM checkout. So :mod:`moe_release.upstream_tests.per_patch` builds scratch checkouts around
trees of the sdist with a prefix of the series applied (their ``megatron/``), our upstream-layout
test files from ``patches/upstream/tests`` and :mod:`moe_release.upstream_tests.standin_utils`
(upstream's ``Utils``, only what those tests use, with upstream's behaviour), and runs each patch's
tests (``[patch.<name>.tests]`` in ``patches/topics.toml``) through ``run.py`` on 8 gloo ranks, as
upstream's CI runs them on 8 GPUs, on the tree without the patch (they must fail, for the manifest's
reason) and with it (they must pass). The default run does that for one patch; the ``slow`` cases
for every patch, and for every test on the unpatched base against the whole series. A small
upstream-style file (``upstream_standin/standin_placement_wiring.py``) checks that the plugin runs
tests under the CPU runtime's placement rules (and without them, ``--no-placement``), and what
``--te-local-spec``/``--fp32-gemm`` give a test. Upstream's own test files and ``Utils`` need a
Megatron-LM checkout: the ``slow`` snapshot case runs them when the read-only mirror exists (never
on CI), on core_r0.19.0 with and without the series.
"""

import ast
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_release import settings
from moe_release.common import UserError
from moe_release.series.pins import load_pins
from moe_release.series.repo import read_series
from moe_release.upstream_tests import per_patch
from moe_release.upstream_tests import run as harness
from tests.helpers import REPO_ROOT

RUN = REPO_ROOT / "scripts" / "upstream_cpu" / "run.py"
UPSTREAM_TESTS = REPO_ROOT / "patches" / "upstream" / "tests"
WIRING = Path(__file__).resolve().parent / "upstream_standin" / "standin_placement_wiring.py"
MOE = "tests/unit_tests/transformer/moe"


def _tree(name: str) -> Path:
    tree = {"MOE_RELEASE_TREE": settings.tree, "MOE_RELEASE_BASE_TREE": settings.base_tree}[name]()
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


GROUPS_SCRIPT = """
import gc, sys
import torch.distributed as dist
from moe_release.runtime.measure import faults
from moe_release.upstream_tests import plugin

dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
bound, other = plugin.new_group(ranks=[0]), plugin.new_group(ranks=[0])


class Buffer:
    pass


buffer = Buffer()
buffer.group = bound
faults.register_buffer(buffer)


def live(group):
    try:
        dist.get_process_group_ranks(group)
        return True
    except (KeyError, RuntimeError, ValueError):
        return False


print(plugin.destroy_groups(), live(bound), live(other))
del buffer
gc.collect()
print(plugin.destroy_groups(), live(bound))
dist.destroy_process_group()
"""


def test_destroy_groups_keeps_a_group_a_buffer_is_bound_to(tmp_path):
    """destroy_model_parallel() forgets its groups on a GPU; the harness destroys them (threads),
    but not one an emulated communication buffer is still bound to, which fused_a2a reuses on a
    re-initialization while it lives. Once the buffer is gone the group is destroyed too."""
    env = dict(
        os.environ, PYTHONPATH=f"{_tree('MOE_RELEASE_TREE')}{os.pathsep}{REPO_ROOT / 'tools'}"
    )
    done = subprocess.run(
        [sys.executable, "-c", GROUPS_SCRIPT, f"file://{tmp_path / 'store'}"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["1 True False", "1 False"], done.stdout


def standin_checkout(root: Path, tree: Path) -> Path:
    """A Megatron-LM-shaped checkout around a materialized tree (per_patch's)."""
    return per_patch.standin_checkout(root, tree / "megatron")


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


def _manifest_targets(nodeid: str) -> tuple:
    """(file, class or None, function) a node id names."""
    file, *names = nodeid.split("::")
    func = names[-1].split("[", 1)[0]
    return file, (names[0] if len(names) == 2 else None), func


def _defined(path: Path) -> set:
    """``Class.function`` and ``function`` names a test file defines."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names |= {f"{node.name}.{f.name}" for f in node.body if isinstance(f, ast.FunctionDef)}
    return names


def test_manifest_covers_every_patch_of_every_series():
    """Every patch of every series (a backport by its Patch-Name:) has a manifest entry with a
    test that fails without it; every node id names a test its file defines, and every
    upstream-layout test file is named by some entry."""
    manifest = per_patch.load_manifest()
    pins = load_pins()
    for version in pins.bases:
        base = pins.get(version)
        if not (base.series_dir(REPO_ROOT) / "series").exists():
            continue
        for name, data in read_series(base):
            primary = per_patch.primary_name(name, data)
            assert primary in manifest, f"{version}: {name} ({primary}) has no tests"
    used = set()
    for entry in manifest.values():
        overrides = [t for b in entry.branches.values() for k in ("fails_without", "guards",
                     "skips") for t in b.get(k, [])]  # fmt: skip
        for nodeid in entry.fails_without + entry.guards + overrides:
            file, cls, func = _manifest_targets(nodeid)
            used.add(file)
            want = f"{cls}.{func}" if cls else func
            assert want in _defined(UPSTREAM_TESTS.parent / file), f"{nodeid}: not defined"
    files = {
        p.relative_to(UPSTREAM_TESTS.parent).as_posix() for p in UPSTREAM_TESTS.rglob("test_*.py")
    }
    assert files == used, f"in no [patch.<name>.tests] of topics.toml: {sorted(files - used)}"


def test_manifest_errors_name_the_entry(tmp_path):
    """A manifest entry without a fails_without test, with an unknown key or naming a missing
    file is refused, naming the entry."""
    cases = {
        "no test": ('[patch.A.tests]\nguards = []\n', "[patch.A.tests]: no fails_without"),
        "unknown key": ('[patch.A.tests]\nfail = ["x"]\n', "unknown key 'fail'"),
        "missing file": (
            '[patch.A.tests]\nfails_without = ["tests/nope.py::test_x"]\n',
            "tests/nope.py::test_x: no such file",
        ),
    }
    for text, message in cases.values():
        path = tmp_path / "m.toml"
        path.write_text(text)
        with pytest.raises(UserError, match=re.escape(message)):
            per_patch.load_manifest(path)


def test_plan_and_evaluate():
    """Patch k runs on prefix k-1 (must fail, with the reason) and on prefix k (must pass, with
    its guards): one launch per prefix, shared by neighbouring patches; --ends runs everything
    on prefix 0 and the whole series. A test that passes without its patch, or fails for
    another reason, or did not run, is a failed check."""
    e = {
        2: per_patch.PatchTests("b.patch", ["t::b"], ["held"], ["t::gb"], []),
        3: per_patch.PatchTests("c.patch", ["t::c"], ["other", "held"], [], ["--fp32-gemm"], 1),
    }
    launches = per_patch.plan(e, ends=False, n=3)
    # A launch has as many ranks as the most any of its tests needs (8 unless an entry says).
    assert [(x.prefix, x.tests, x.options, x.nproc) for x in launches] == [
        (1, ["t::b"], [], 8),
        (2, ["t::b", "t::gb", "t::c"], ["--fp32-gemm"], 8),
        (3, ["t::c"], ["--fp32-gemm"], 1),
    ]
    ends = per_patch.plan(e, ends=True, n=3)
    assert [(x.prefix, x.tests) for x in ends] == [
        (0, ["t::b", "t::c"]),
        (3, ["t::b", "t::gb", "t::c"]),
    ]
    failed = dict(outcome="failed", reason="rank 0: call: AssertionError: held ['x']")
    passed = dict(outcome="passed", reason="")
    good = {
        1: {"t::b": failed},
        2: {"t::b": passed, "t::gb": passed, "t::c": failed},
        3: {"t::c": passed},
    }
    checks = per_patch.evaluate(per_patch.expectations(e, False, 3), good)
    assert [c["ok"] for c in checks] == [True] * 5, checks
    other_reason = {**good, 1: {"t::b": dict(outcome="failed", reason="ImportError: x")}}
    passes_without = {**good, 1: {"t::b": passed}}
    not_run = {**good, 3: {}}
    for outcomes in (other_reason, passes_without, not_run):
        checks = per_patch.evaluate(per_patch.expectations(e, False, 3), outcomes)
        assert sum(not c["ok"] for c in checks) == 1, checks
    # base_reason counts only on the unpatched base (--ends): there a test may first fail at
    # what an earlier patch adds.
    e[3].base_reason = ["no attribute 'reset'"]
    missing = dict(outcome="failed", reason="rank 0: call: AttributeError: no attribute 'reset'")
    on_base = {0: {"t::b": failed, "t::c": missing}, 3: {"t::b": passed, "t::gb": passed}}
    on_base[3]["t::c"] = passed
    assert all(c["ok"] for c in per_patch.evaluate(per_patch.expectations(e, True, 3), on_base))
    prefix = {**good, 2: {**good[2], "t::c": missing}}
    checks = per_patch.evaluate(per_patch.expectations(e, False, 3), prefix)
    assert [c["test"] for c in checks if not c["ok"]] == ["t::c"], checks


def test_branch_overrides(tmp_path):
    """``branch.<B>`` changes an entry on release branch B: its tests and reasons replace the
    entry's, ``skips`` must skip (with ``skip_reason``) on both trees and leave the entry's
    lists; ``[patch-tests.branch.<B>]`` base_reason joins every entry's on B. Bad keys are
    refused, naming the entry."""
    path = tmp_path / "m.toml"
    path.write_text(
        '[patch.A.tests]\nfile = "tests/unit_tests/transformer/moe/'
        'test_paged_stash_import.py"\nreason = "held"\n'
        'fails_without = ["test_schedules_import_without_triton_and_paged_stash_names_it"]\n'
        'branch."r16".fails_without = ["tests/unit_tests/transformer/moe/'
        'test_router_gating_without_te.py::test_router_gating_runs_without_transformer_engine"]\n'
        'branch."r16".reason = "te_general_gemm"\n'
        'branch."r17".skips = ["test_schedules_import_without_triton_and_paged_stash_names_it"]\n'
        'branch."r17".skip_reason = "no stash"\n'
        '[patch-tests.branch."r16"]\nbase_reason = "undefined"\n'
    )
    entry = per_patch.load_manifest(path)["A.patch"]
    assert entry.on("main") == dataclasses.replace(entry, branches={})
    r16 = entry.on("r16")
    assert r16.reason == ["te_general_gemm"] and r16.base_reason == ["undefined"]
    assert r16.fails_without[0].endswith("::test_router_gating_runs_without_transformer_engine")
    r17 = entry.on("r17")
    assert r17.fails_without == [] and len(r17.skips) == 1
    wanted = per_patch.expectations({1: r17}, False, 1)
    assert [(x["prefix"], x["want"], x["reason"]) for x in wanted] == [
        (0, "skipped", ["no stash"]),
        (1, "skipped", ["no stash"]),
    ]
    skipped = dict(outcome="skipped", reason="this branch has no stash")
    test = r17.skips[0]
    assert all(
        c["ok"] for c in per_patch.evaluate(wanted, {0: {test: skipped}, 1: {test: skipped}})
    )
    ran = per_patch.evaluate(wanted, {0: {test: skipped}, 1: {test: dict(outcome="passed")}})
    assert [c["ok"] for c in ran] == [True, False]
    bad = {
        'branch."r17".skip = ["x"]\n': "branch.r17: unknown key 'skip'",
        'branch."r17".skips = ["test_schedules_import_without_triton_and_paged_stash_names_it"]\n':
            "branch.r17: skips needs a skip_reason",
        '[patch-tests.branch."r16"]\nreason = "x"\n': (
            "[patch-tests.branch.'r16']: only base_reason may be set there"
        ),
    }  # fmt: skip
    head = (
        '[patch.A.tests]\nfile = "tests/unit_tests/transformer/moe/'
        'test_paged_stash_import.py"\nreason = "held"\n'
        'fails_without = ["test_schedules_import_without_triton_and_paged_stash_names_it"]\n'
    )
    for text, message in bad.items():
        path.write_text(head + text)
        with pytest.raises(UserError, match=re.escape(message)):
            per_patch.load_manifest(path)


@pytest.mark.parametrize(
    "args,prefixes,reason",
    [
        # Two one-rank launches (the entry's nproc): importing the schedules halts at Triton.
        pytest.param(
            ["--patch", "cpu-import", "--timeout", "300"],
            (0, 1),
            "import of triton halted",
            id="cpu-import",
        ),
        # Two 8-rank launches: the series up to the all-to-all patch still holds the tensors.
        pytest.param(
            ["--patch", "allgather", "--first", "--timeout", "540"],
            (3, 4),
            "still holds the forward's tensors",
            id="all-gather",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_one_patch_fails_without_and_passes_with(tmp_path, args, prefixes, reason):
    """A patch's (first) test, through per_patch on the real trees: it fails on the series
    prefix without the patch, for the manifest's reason, and passes once the patch is
    applied."""
    out = tmp_path / "out.json"
    rc = per_patch.main([*args, "--json", str(out)])
    checks = json.loads(out.read_text())["checks"]
    assert rc == 0, checks
    # The patch's first test without it and with it, then its guards (passed, with it).
    want = [(prefixes[0], "failed"), (prefixes[1], "passed")]
    got = [(c["prefix"], c["outcome"]) for c in checks]
    assert got[:2] == want and set(got[2:]) <= {(prefixes[1], "passed")}, checks
    assert reason in checks[0]["got_reason"], checks


@pytest.mark.slow
def test_every_patch_fails_without_and_passes_with(tmp_path):
    """Every patch of the series: its tests fail on the prefix without it and pass with it
    (one 8-rank launch per prefix tree, 11 in all)."""
    out = tmp_path / "out.json"
    rc = per_patch.main(["--timeout", "1500", "--json", str(out)])
    checks = json.loads(out.read_text())["checks"]
    assert rc == 0, [c for c in checks if not c["ok"]]
    assert {c["patch"] for c in checks} == {n for n, _ in read_series(load_pins().get(None))}


@pytest.mark.slow
def test_every_test_fails_on_the_base_and_passes_on_the_series(tmp_path):
    """--ends: every patch's fails_without tests fail on the unpatched base, and all its tests
    pass on the whole series."""
    out = tmp_path / "out.json"
    rc = per_patch.main(["--ends", "--timeout", "1500", "--json", str(out)])
    checks = json.loads(out.read_text())["checks"]
    assert rc == 0, [c for c in checks if not c["ok"]]


@pytest.mark.slow
@pytest.mark.needs_env("MOE_RELEASE_MEGATRON_LM")
def test_upstream_moe_tests_on_a_snapshot_with_and_without_the_series(tmp_path):
    """Upstream's own all-to-all dispatcher tests on core_r0.19.0 (a Megatron-LM repository's
    snapshot, ``MOE_RELEASE_MEGATRON_LM``; absent on CI): the same outcomes with the series
    git-am'd as without it."""
    mirror = Path(settings.megatron_lm())
    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(mirror), "archive", "core_r0.19.0"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(checkout)], input=archive.stdout, check=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-C", str(checkout)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "core_r0.19.0"], check=True)
    base = run_harness(checkout, tmp_path / "base.json", f"{MOE}/test_a2a_token_dispatcher.py")

    export = tmp_path / "export"
    # The exporter's identity as git reads it first (whatever this clone's config says).
    env = dict(
        os.environ, GIT_COMMITTER_NAME="Test", GIT_COMMITTER_EMAIL="test@users.noreply.github.com"
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
