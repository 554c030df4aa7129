"""A Megatron-LM checkout carrying the series (issue 32 items 2 and 4), on the synthetic
Megatron-shaped repository of tests/helpers/megatron_repo.py: the trees `run-tests --checkout`
tests, the matrix row it records, and the label commit that makes `pip install` of the checkout
a drop-in `verify` recognises."""

import json
import os
import subprocess
import sys
import zipfile
from functools import partial
from pathlib import Path

import pytest

from moe_release.commands import cli
from moe_release.commands.apply import open_checkout
from moe_release.commands.matrix import (
    compare_lines,
    record_run,
    retention_passed_unpatched,
    table,
)
from moe_release.commands.verify import find_installed_core
from moe_release.common import UserError
from moe_release.series.checkout import (
    LABEL_SUBJECT,
    ORIGIN,
    build_checkout_trees,
    is_checkout_manifest,
    unpatched_commit,
    verify_checkout_install,
)
from moe_release.series.repo import overlay_files
from moe_release.series.trees import MANIFEST_PATH
from tests.helpers.megatron_repo import FA, PS, TD, apply_at, commit_files, git_in

PLANNER = "megatron/core/transformer/moe/moe_memory_planner/__init__.py"
# Megatron-LM's packaging, as its pyproject.toml has it (the version read from package_info.py,
# package data from MANIFEST.in), without the C++ helper.
PYPROJECT = """[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[tool.setuptools]
include-package-data = true

[tool.setuptools.packages.find]
include = ["megatron.core", "megatron.core.*"]

[tool.setuptools.dynamic]
version = { attr = "megatron.core.package_info.__version__" }

[project]
name = "megatron-core"
dynamic = ["version"]
requires-python = ">=3.10"
"""


def test_the_trees_of_an_applied_branch(mlm):
    """The patched tree is the branch's megatron-core as committed (the work tree does not
    matter), the unpatched one the commit below its series and label commits; both carry the
    new modules; a commit without series commits needs --base-ref."""
    m, c, repo = mlm
    apply_at(m, c[4], repo)
    branch = f"moe-release/{c[4][:12]}"
    (m / TD).write_text("a change in the work tree\n")
    trees = build_checkout_trees(open_checkout(m), branch, None, root=repo,
                                 line_of=lambda commit: "main")  # fmt: skip
    head = git_in(m, "rev-parse", branch)
    assert (trees.name, trees.commit, trees.base_commit) == (f"checkout-{head[:12]}", head, c[4])
    assert trees.patched == repo / ".build" / "trees" / trees.name / "patched"
    assert trees.source == f"Megatron-LM `main` `{c[4][:12]}` (0.20.0) + 3 series commits"
    for rel in (TD, FA, PS):
        assert (trees.base / rel).read_text() == git_in(m, "show", f"{c[4]}:{rel}") + "\n"
        assert (trees.patched / rel).read_text() == git_in(m, "show", f"{branch}:{rel}") + "\n"
        assert (trees.patched / rel).read_text() != (trees.base / rel).read_text()
    for tree in (trees.patched, trees.base):
        assert (tree / PLANNER).read_bytes() == dict(overlay_files(repo))[PLANNER]
    assert "+moerelease.3." in (trees.patched / "megatron/core/package_info.py").read_text()
    assert (trees.patched / MANIFEST_PATH).exists() and not (trees.base / MANIFEST_PATH).exists()
    with pytest.raises(UserError, match="carries no series commit.*--base-ref REF0"):
        build_checkout_trees(open_checkout(m), c[5], None, root=repo)
    named = build_checkout_trees(open_checkout(m), c[5], c[4], root=repo)
    assert named.base_commit == c[4] and named.source.endswith(f", patched: `{c[5][:12]}`")


def test_the_unpatched_commit_is_below_the_series_and_the_label():
    subjects = {"Release dispatcher state after combine"}
    log = [
        ("L", LABEL_SUBJECT + "0.20.0+moerelease.1.x"),
        ("P", "Release dispatcher state after combine"),
        ("B", "upstream"),
        ("A", "older"),
    ]
    assert unpatched_commit(log, subjects) == ("B", 1, [])
    assert unpatched_commit(
        [("P", "[MoE] Release dispatcher state after combine")] + log[2:], subjects
    ) == ("B", 1, [])  # git am's subject keeps or drops the tag
    with pytest.raises(UserError, match="carries no series commit"):
        unpatched_commit(log[2:], subjects)


def test_the_series_commits_are_found_by_their_trailer_not_by_counting():
    """A person's fix on top of the series (and below the label, as `apply --resolve` makes
    it) is neither the unpatched commit nor a series commit: it is reported as theirs. A
    series commit whose subject no stored patch has (an edited subject) is found by its
    ``Origin:`` trailer."""
    log = [
        ("L", LABEL_SUBJECT + "0.20.0+moerelease.2.x", ""),
        ("F", "guard the import the probe named", ""),
        ("Q", "[MoE] A reworded subject", ORIGIN),
        ("P", "[MoE] Release dispatcher state after combine", ORIGIN),
        ("B", "upstream", ""),
        ("A", "older", ""),
    ]
    assert unpatched_commit(log, set()) == ("B", 2, [("F", "guard the import the probe named")])
    fix_between = [log[0], log[2], log[1], *log[3:]]
    assert unpatched_commit(fix_between, set())[:2] == ("B", 2)


def _junit(path: Path, cases: dict) -> None:
    body = "".join(
        f'<testcase classname="tests.unit_tests.transformer.moe.test_dispatcher_state_release" '
        f'name="{name}" time="1">{inner}</testcase>'
        for name, inner in cases.items()
    )
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite>{body}</testsuite></testsuites>')


def test_a_checkout_run_is_a_matrix_row_with_the_unpatched_outcomes(
    tmp_path, repo, capsys, monkeypatch
):
    """run-tests --checkout records checkout-<commit12> with its source and, per release test,
    its outcome without the series: the row says how many failed there, the words name a guard
    that passed there, and a retention test that passes there is named and fails the run."""
    retention = "test_nothing_of_the_forward_outlives_backward[flex-hybridep-ep2-x]"
    equal = "test_bitwise_equal_to_base[flex-hybridep-ep2-x]"
    gone = "test_nothing_of_the_forward_outlives_backward[alltoall-dropless-ep2-x]"
    # What tests/helpers/trees.py writes for a release test (marked `backport`), a guard.
    marked = '<property name="moe_release_test" value="backport"/>'
    release = f"<properties>{marked}</properties>"
    guard = f'<properties><property name="moe_release" value="guard"/>{marked}</properties>'
    _junit(tmp_path / "p.xml", {retention: release, equal: guard, gone: release})
    _junit(tmp_path / "u.xml", {retention: release + '<failure message="held"/>', equal: guard})
    tree = tmp_path / "tree"
    (tree / "megatron/core/transformer").mkdir(parents=True)
    (tree / "megatron/core/transformer/transformer_config.py").write_text(
        "class TransformerConfig:\n    moe_flex_dispatcher_backend: Literal['deepep', "
        "'hybridep', 'ncclep'] = 'deepep'\n"
    )
    source = "Megatron-LM `main` `313f6e95db41` (0.20.0) + 11 series commits"
    path = record_run("checkout-4ad697b581ec", tmp_path / "p.xml", 99, 0, root=repo,
                      checkout=(source, tree, tmp_path / "u.xml"))  # fmt: skip
    record = json.loads(path.read_text())
    (row,) = [line for line in table(root=repo).splitlines() if "`checkout-4ad697b581ec`" in line]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == source and cells[2] == "✓ 2/2" and cells[5] == "—"  # ncclep: none ran
    assert cells[10].endswith(", 99 s; unpatched: 1/3 failed")
    words = compare_lines(record)
    assert words[1:3] == ["  patched: 3 of 3 release tests passed",
                          "  unpatched: 1 of them failed, 1 passed as they should (guards, "
                          "n/a), 0 retention test(s) passed, 1 not collected (the tree lacks "
                          "what they test)"]  # fmt: skip
    assert words[3].startswith("    passed unpatched (guard): ") and words[3].endswith(equal)
    assert retention_passed_unpatched(record) == []
    # A retention test that passes without the series shows no fix: named, and exit status 1.
    _junit(tmp_path / "u.xml", {retention: release, equal: guard})
    monkeypatch.setattr("moe_release.commands.matrix.record_run", partial(record_run, root=repo))
    assert cli.main(["matrix", "--record", "checkout-4ad697b581ec", "--junit",
                     str(tmp_path / "p.xml"), "--unpatched-junit", str(tmp_path / "u.xml"),
                     "--source", source, "--tree", str(tree), "--seconds", "1", "--status",
                     "0"]) == 1  # fmt: skip
    out = capsys.readouterr().out
    (line,) = [w for w in out.splitlines() if "RETENTION TEST PASSED UNPATCHED" in w]
    assert line.startswith("    RETENTION TEST PASSED UNPATCHED (it shows no fix): ")
    assert line.endswith(retention)
    with pytest.raises(UserError, match="a checkout's run is named checkout-"):
        record_run("mine", tmp_path / "p.xml", 1, 0, root=repo,
                   checkout=(source, tree, tmp_path / "u.xml"))  # fmt: skip


def _pip(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, cwd="/")  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs to run in a venv")
def test_pip_install_of_the_branch_is_the_labelled_drop_in(
    mlm,
    tmp_path,
    monkeypatch,
    capsys,
):
    """apply's last commit labels the build: pip install of the branch (Megatron-LM's
    packaging: the version from package_info.py, a VCS suffix computed there overridden)
    installs <version>+moerelease.3.HASH with the manifest, and verify recognises it; a file
    changed after the install, or a series changed since, is a mismatch."""
    m, c, repo = mlm
    _, result, done = apply_at(m, c[4], repo)
    version = result.version
    assert version.startswith("0.20.0+moerelease.3.") and version in done[-1]
    clone = tmp_path / "clone"
    git_in(tmp_path, "clone", "--quiet", "--branch", f"moe-release/{c[4][:12]}", str(m), str(clone))
    assert git_in(clone, "log", "-1", "--format=%s") == LABEL_SUBJECT + version
    assert f"include {MANIFEST_PATH}" in (clone / "MANIFEST.in").read_text()
    (clone / "pyproject.toml").write_text(PYPROJECT)  # a Megatron-LM checkout has it
    env = dict(os.environ, NO_VCS_VERSION="0")  # package_info.py's git suffix, as users build
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(tmp_path / "dist"), str(clone)],
        capture_output=True, text=True, env=env, cwd="/",
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("megatron_core-*.whl")
    assert wheel.name.startswith(f"megatron_core-{version}-")
    with zipfile.ZipFile(wheel) as zf:
        assert MANIFEST_PATH in zf.namelist() and PLANNER in zf.namelist()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    _pip("--python", python, "install", "--no-deps", str(wheel))
    core, dist_version = find_installed_core(python)
    assert dist_version == version
    manifest = json.loads((core / "_moe_release_manifest.json").read_text())
    assert is_checkout_manifest(manifest) and manifest["base"]["commit"] == c[4]
    assert set(manifest["files"]) >= {TD, FA, PS, PLANNER, "megatron/core/package_info.py"}
    assert verify_checkout_install(core, dist_version, manifest, root=repo) == []
    # The verb: told a checkout's build by its installed manifest (this repo: the synthetic one).
    monkeypatch.setattr(
        "moe_release.commands.verify.verify_checkout_install",
        partial(verify_checkout_install, root=repo),
    )
    assert cli.main(["verify", "--python", python]) == 0
    assert capsys.readouterr().out.startswith(
        f"OK: megatron-core {version} at {core} matches the series of {manifest['base']['pin']} "
        f"applied on Megatron-LM {c[4][:12]} ("
    )
    probe = "import megatron.core.package_info as p; print(p.__version__)"
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, cwd="/")
    assert out.stdout.strip() == version
    # A file replaced after the install, a series changed since: both named.
    (core / "transformer/moe/fused_a2a.py").write_text("# replaced\n")
    sdir = repo / "patches" / "upstream" / "main"
    name = sorted(sdir.glob("*.patch"))[0]
    name.write_bytes(name.read_bytes().replace(b"Body.", b"Body, edited."))
    problems = verify_checkout_install(core, dist_version, manifest, root=repo)
    assert f"{FA}: differs from the series" in problems
    assert any(p.startswith("built from another series than this repository's: label "
                            "moerelease.3.") for p in problems)  # fmt: skip
    assert cli.main(["verify", "--python", python]) == 1
    assert capsys.readouterr().out.startswith(f"MISMATCH: megatron-core at {core} does not match")


def test_no_label_leaves_the_checkouts_packaging_as_it_was(mlm):
    """--no-label: the series' commits only; a commit whose package_info.py spells no version
    cannot carry the label, which the error says, and --no-label applies there."""
    m, c, repo = mlm
    _, result, _ = apply_at(m, c[4], repo, label=False)
    branch = f"moe-release/{c[4][:12]}"
    assert result.version is None
    assert git_in(m, "diff", "--name-only", c[4], branch).split() == sorted([TD, FA, PS])
    c7 = commit_files(m, "2026-07-20T12:00:00+00:00", "version from elsewhere (#8)",
                 {"megatron/core/package_info.py": "__version__ = get_version()\n"})  # fmt: skip
    with pytest.raises(UserError, match=r"spells no MAJOR/MINOR/PATCH/PRE_RELEASE \(--no-label "):
        apply_at(m, c7, repo)
    assert apply_at(m, c7, repo, label=False)[1].ok
