"""`moe_release.py upstream`: the series in upstream's conventions, applied with git am."""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_release import settings
from moe_release.commands.cli import main as cli_main
from moe_release.commands.upstream import (
    check_export,
    check_topic,
    export_subject,
    export_test_files,
    export_upstream,
    identity,
    is_placeholder_email,
    prerequisite_exports,
    prerequisites,
    topic_series,
    topic_test_files,
    upstream_message,
    upstream_test_files,
    without_shims,
)
from moe_release.common import REPO_ROOT, UserError
from moe_release.series.patches import check_trailers, parse_patch, upstream_subject
from moe_release.series.pins import load_pins
from moe_release.series.repo import read_series
from moe_release.series.targets import VARIANT_TARGETS, target_base, target_series
from moe_release.series.topics import load_topics

IDENT = ("Ada Lovelace", "ada.lovelace@users.noreply.github.com")
TOPICS = load_topics()
PR_TOPICS = TOPICS.memory
TOPIC_TESTS = TOPICS.tests


def _export_with_dependencies(out: Path, topic: str) -> list[Path]:
    """``topic``'s export for core_r0.19.0 as `git am` takes it: the PRs it builds on (written
    under ``out/prerequisites/``, in merge order), then its own."""
    own = export_upstream("core_r0.19.0", out, IDENT, topic)
    return [p for _, paths in prerequisite_exports(out) for p in paths] + own


def _git(cwd: Path, *args: str) -> None:
    env = dict(os.environ, GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
    subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True)


@pytest.fixture
def isolated_git(monkeypatch):
    """No global or system git config: only what a test sets in its repo counts."""
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")


@pytest.mark.parametrize(
    "email,message",
    [
        (None, "no git identity to sign off with"),
        (
            "maintainers@moe-release.invalid",
            r"is a placeholder \(a domain reserved by RFC 2606/6761\), which the DCO cannot accept",
        ),
        ("someone@host.invalid", "is a placeholder"),
        ("maintainers@users.noreply.a-seed-50509c1d.example", "is a placeholder"),
        ("ci@runner.test", "is a placeholder"),
        ("me@box.localhost", "is a placeholder"),
        ("you@example.com", "is a placeholder"),
        ("you@mail.Example.ORG", "is a placeholder"),
        ("you@example.net", "is a placeholder"),
        ("root@localhost", "is a placeholder"),
    ],
)
def test_identity_refuses_unset_or_placeholder(tmp_path, isolated_git, monkeypatch, email, message):
    for var in ("GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL", "GIT_AUTHOR_NAME", "EMAIL"):
        monkeypatch.delenv(var, raising=False)
    _git(tmp_path, "init", "-q")
    if email:
        _git(tmp_path, "config", "user.name", "Somebody")
        _git(tmp_path, "config", "user.email", email)
    with pytest.raises(UserError, match=message) as exc:
        identity(tmp_path)
    assert "git config user.name" in str(exc.value)  # names the fix


def test_identity_is_the_exporters(tmp_path, isolated_git, monkeypatch):
    for var in ("GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL"):
        monkeypatch.delenv(var, raising=False)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.name", IDENT[0])
    _git(tmp_path, "config", "user.email", IDENT[1])
    assert identity(tmp_path) == IDENT
    assert not is_placeholder_email("dev@example.community")  # only the reserved names


def test_identity_resolves_as_git_does(tmp_path, isolated_git, monkeypatch):
    """GIT_COMMITTER_NAME/GIT_COMMITTER_EMAIL before the config (git signs off as the
    committer), committer.* before user.*, and nothing guessed from the host."""
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.name", "Config Name")
    _git(tmp_path, "config", "user.email", "config@users.noreply.github.com")
    monkeypatch.setenv("GIT_COMMITTER_NAME", IDENT[0])
    monkeypatch.setenv("GIT_COMMITTER_EMAIL", IDENT[1])
    assert identity(tmp_path) == IDENT
    monkeypatch.setenv("GIT_COMMITTER_EMAIL", "ci@runner.test")
    with pytest.raises(UserError, match="ci@runner.test is a placeholder"):
        identity(tmp_path)
    monkeypatch.delenv("GIT_COMMITTER_NAME")
    monkeypatch.delenv("GIT_COMMITTER_EMAIL")
    _git(tmp_path, "config", "committer.email", "committer@users.noreply.github.com")
    assert identity(tmp_path) == ("Config Name", "committer@users.noreply.github.com")
    # Environment only, no config: what git would sign with.
    bare = tmp_path / "bare"
    bare.mkdir()
    _git(bare, "init", "-q")
    monkeypatch.setenv("GIT_COMMITTER_NAME", IDENT[0])
    monkeypatch.setenv("GIT_COMMITTER_EMAIL", IDENT[1])
    assert identity(bare) == IDENT


@pytest.mark.parametrize(
    "subject,expected",
    [
        ("[MoE] Release flex dispatcher state after combine",
         "fix(moe): release flex dispatcher state after combine"),
        ("[MoE] A2A overlap: drop a node's tensors",
         "fix(moe): A2A overlap: drop a node's tensors"),
        ("[MoE] Re-create the HybridEP buffer", "fix(moe): re-create the HybridEP buffer"),
        ("cp: `fix(moe): release x` into `core_r0.18.0`",
         "cp: `fix(moe): release x` into `core_r0.18.0`"),
    ],
)  # fmt: skip
def test_conventional_subject(subject, expected):
    assert upstream_subject(subject) == expected


def test_topics_split_the_series(base):
    """One PR per code-owner area and topic, in series order; memory is the four together; the
    overlay's own teardown patch is in no PR."""
    series = read_series(base)
    cpu, memory = topic_series(series, "cpu-import"), topic_series(series, "memory")
    assert [parse_patch(d, n).subject for n, d in cpu] == [
        f"[MoE] L{TOPICS.get('cpu-import', 'subject')}"
    ]
    teardown = topic_series(series, "teardown")
    assert [n for n, _ in teardown] == ["destroy-comm-buffers.patch"]
    assert len(memory) == len(series) - 2 and cpu[0] not in memory and teardown[0] not in memory
    prs = {t: topic_series(series, t) for t in PR_TOPICS}
    assert [len(prs[t]) for t in PR_TOPICS] == [3, 3, 1, 2]
    assert [item for t in PR_TOPICS for item in prs[t]] == memory
    subjects = [parse_patch(d, n).subject for n, d in prs["dispatcher-state"]]
    assert all("dispatcher state after combine" in s for s in subjects), subjects
    assert all("A2A overlap" in parse_patch(d, n).subject for n, d in prs["a2a-overlap"])
    with pytest.raises(UserError, match="unknown topic 'docs'"):
        topic_series(series, "docs")
    with pytest.raises(UserError, match=r"stray.patch: belongs to no upstream topic \(add it to "):
        stray = series[1][1].replace(b"Patch-Name: flex-dispatcher-state", b"Patch-Name: stray")
        topic_series([("stray.patch", stray)], "memory")


def test_export_leaves_out_the_overlay_evidence(tmp_path, base):
    """A message paragraph starting "moe-release: " cites this repository's commands, which an
    upstream reader cannot run: the export leaves it out, and keeps the rest."""
    name, data = read_series(base)[1]
    patch = parse_patch(data, name)
    assert "\nmoe-release: " in patch.message
    text = upstream_message(patch, *IDENT)
    assert "moe-release" not in text and "scripts/" not in text
    assert text.startswith(patch.message.split("\n\n", 1)[0])
    assert "Not covered here:" in text


def test_dev_export_titles_carry_the_dev_prefix(tmp_path):
    """On dev the PR's title starts with [Dev]; its commits' subjects do not, as git am would
    strip it from them."""
    paths = export_upstream("dev", tmp_path / "out", IDENT, "dispatcher-state")
    subjects = [p.read_text().split("Subject: ", 1)[1].split("\n", 1)[0] for p in paths]
    assert all("] fix(moe): " in s or "] test(moe): " in s for s in subjects), subjects
    pr = (tmp_path / "out" / "PR.md").read_text()
    assert pr.startswith("Title: [Dev] fix(moe): release the MoE dispatchers'"), pr[:80]
    main = export_upstream("main", tmp_path / "main", IDENT, "dispatcher-state")
    assert "[Dev]" not in "".join(p.read_text() for p in main)
    assert "[Dev]" not in (tmp_path / "main" / "PR.md").read_text()


@pytest.mark.parametrize(
    "subject,target,expected",
    [
        ("[MoE] A2A overlap: drop a node's tensors", "main",
         "fix(moe): drop a node's tensors in the A2A overlap"),
        ("cp: `fix(moe): A2A overlap: drop x` into `core_r0.18.0`", "core_r0.18.0",
         "cp: `fix(moe): drop x in the A2A overlap` into `core_r0.18.0`"),
        ("[MoE] Let the MoE dispatcher path import and build without CUDA", "dev",
         "fix(moe): let megatron.core.pipeline_parallel import where Triton is absent"),
        ("cp: `fix(moe): let the MoE dispatcher path import and build without CUDA` into "
         "`core_r0.16.0`", "core_r0.16.0",
         "fix(moe): let the MoE router run where Transformer Engine is absent"),
        ("[MoE] Keep one HybridEP buffer per process group", "dev",
         "fix(moe): keep one HybridEP buffer per process group"),
    ],
)  # fmt: skip
def test_export_subjects_have_one_colon_and_upstream_names(subject, target, expected):
    assert export_subject(subject, target) == expected


def test_exported_subjects_have_one_colon_after_the_type(tmp_path):
    for target in ("main", "dev", "core_r0.19.0", "core_r0.18.0", "core_r0.16.0"):
        for path in export_upstream(target, tmp_path / target, IDENT):
            subject = path.read_text().split("Subject: ", 1)[1].split("\n", 1)[0]
            title = subject.split("] ", 1)[1]
            inner = title.split("`")[1] if title.startswith("cp: `") else title
            assert inner.count(": ") == 1, (target, subject)


@pytest.mark.parametrize("topic", [*PR_TOPICS, "memory", "cpu-import"])
def test_each_pr_gets_a_description_in_upstreams_template(tmp_path, base, topic):
    """PR.md beside a PR's patches: upstream's pull_request_template.md sections, every commit's
    subject, the tests it adds and how to run them, what it does not cover."""
    export_upstream("core_r0.19.0", tmp_path / "out", IDENT, topic)
    pr = tmp_path / "out" / "PR.md"
    if topic == "memory":
        assert not pr.exists()
        return
    text = pr.read_text()
    for heading in ("# What does this PR do?", "## Issue tracking", "### Pre-checks", "## Tests"):
        assert heading in text, heading
    for name, data in topic_series(read_series(base), topic):
        assert export_subject(parse_patch(data, name).subject, "core_r0.19.0") in text
    # The tests this branch's PR adds (a file about one module only where the series changes it).
    series = topic_series(read_series(base), topic)
    tests = [p.rsplit("/", 1)[-1] for p in export_test_files(topic, series)]
    assert tests and set(tests) <= set(TOPIC_TESTS[topic])
    assert ("- [x] I have added relevant unit tests" in text) == bool(tests)
    assert all(t in text for t in tests) and "## Not covered" in text
    assert "moe-release" not in text and "scripts/" not in text
    # One item per commit that says what it does not cover, under the commit's subject.
    items = text.split("## Not covered", 1)[1].strip().splitlines()
    assert items and all(i.startswith("- *fix(moe): ") for i in items), items
    assert "Not covered:" not in text.split("## Not covered", 1)[1]


def test_core_r0_16_cpu_import_pr_is_the_router_change(tmp_path):
    """core_r0.16.0 has no paged stash: its CPU-import PR is the router's Transformer Engine
    fallback, with that change's own test and message, and says so."""
    paths = export_upstream("core_r0.16.0", tmp_path / "out", IDENT, "cpu-import")
    text = (tmp_path / "out" / "PR.md").read_text()
    assert "te_general_gemm" in text and "paged stash" not in text
    assert "test_router_gating_without_te.py" in text and "test_paged_stash_import" not in text
    tests_patch = paths[-1].read_text()
    assert "test(moe): test that the MoE router gates without Transformer Engine" in tests_patch
    assert "moe-release" not in tests_patch


def _hunks(diff: bytes) -> list:
    """A diff without its index lines and hunk positions."""
    return [
        b"@@" if line.startswith(b"@@ ") else line
        for line in diff.splitlines()
        if not line.startswith(b"index ")
    ]


@pytest.mark.parametrize("topic", ["memory", *PR_TOPICS, "cpu-import"])
def test_export_strips_overlay_trailers_and_signs_off(tmp_path, base, topic):
    series = topic_series(read_series(base), topic)
    paths = export_upstream("core_r0.19.0", tmp_path / "out", IDENT, topic)
    # A topic with upstream-layout tests ends with the patch adding them.
    total = len(series) + 1
    assert [p.name[:5] for p in paths] == [f"{n:04d}-" for n in range(1, total + 1)]
    for path, (name, data) in zip(paths, series):
        text = path.read_text()
        assert f"Subject: [PATCH {paths.index(path) + 1}/{total}] fix(moe): " in text
        assert "From: Ada Lovelace <ada.lovelace@users.noreply.github.com>" in text
        message = text.split("\n---\n", 1)[0]
        assert "Forwarded:" not in message and "Origin:" not in message
        assert "moe-release.invalid" not in message
        assert message.rstrip().endswith(
            "Signed-off-by: Ada Lovelace <ada.lovelace@users.noreply.github.com>"
        )
        # The diff is the series' own; a topic without the patches before it is diffed against
        # the base alone, so only its index lines and hunk positions may differ.
        exported = text.encode()[text.encode().index(b"\ndiff --git ") + 1 :]
        assert _hunks(exported) == _hunks(data[data.index(b"\ndiff --git ") + 1 :])
        assert upstream_message(parse_patch(data, name), *IDENT) in text


def test_memory_export_adds_the_upstream_layout_tests(tmp_path, base):
    """The last memory patch adds its three PRs' files under patches/upstream/tests as new
    files, byte for byte but for the release-branch shims main does not need (TEST_SHIMS), with
    the exporter's sign-off; the cpu-import PR adds its own."""
    paths = export_upstream("main", tmp_path / "out", IDENT)
    text = paths[-1].read_text()
    total = len(paths)
    assert f"Subject: [PATCH {total}/{total}] test(moe): " in text
    message = text.split("\n---\n", 1)[0]
    assert message.rstrip().endswith(
        "Signed-off-by: Ada Lovelace <ada.lovelace@users.noreply.github.com>"
    )
    files = without_shims(upstream_test_files(), "main")
    assert "tests/unit_tests/transformer/moe/test_token_dispatcher_state_release.py" in files
    applied = tmp_path / "applied"
    applied.mkdir()
    subprocess.run(["git", "apply", str(paths[-1])], cwd=applied, check=True)
    got = {p.relative_to(applied).as_posix(): p.read_bytes() for p in applied.rglob("*.py")}
    cpu_tests = TOPIC_TESTS["cpu-import"] + TOPIC_TESTS["teardown"]
    memory = {p: d for p, d in files.items() if not p.endswith(cpu_tests)}
    assert got == memory
    cpu = export_upstream("main", tmp_path / "cpu", IDENT, "cpu-import")
    assert (
        "test(moe)" in cpu[-1].read_text() and "test_paged_stash_import.py" in cpu[-1].read_text()
    )
    assert "test_token_dispatcher_state_release.py" not in cpu[-1].read_text()


@pytest.mark.parametrize(
    "target,message",
    [
        ("core_r0.9.0", "unknown target 'core_r0.9.0'"),
        ("release", "unknown target 'release'"),
    ],
)
def test_export_refuses_unknown_targets(target, message):
    with pytest.raises(UserError, match=message):
        target_series(target)


def test_backport_target_without_a_series_is_refused(tmp_path):
    """A release branch whose pinned base has no backport series yet is named as such."""
    shutil.copytree(REPO_ROOT / "patches", tmp_path / "patches")
    shutil.rmtree(tmp_path / "patches" / "backports", ignore_errors=True)
    with pytest.raises(UserError, match=r"core_r0.18.0: no backport series yet"):
        target_series("core_r0.18.0", root=tmp_path)


def test_target_series():
    """core_r0.19.0 takes the primary series; main and dev their variants, which carry every
    topic of the primary series (the same subjects), with the overlay's trailers."""
    primary = [parse_patch(d, n).subject for n, d in target_series("core_r0.19.0")]
    assert primary == [parse_patch(d, n).subject for n, d in read_series(load_pins().get(None))]
    for target in VARIANT_TARGETS:
        series = target_series(target)
        assert sorted(parse_patch(d, n).subject for n, d in series) == sorted(primary), target
        for name, data in series:
            assert not check_trailers(parse_patch(data, name)), (target, name)
    # The variants differ from the primary series where the target's code moved.
    ours = dict(read_series(load_pins().get(None)))
    for target in VARIANT_TARGETS:
        changed = [n for n, d in target_series(target) if _diff(d) != _diff(ours[n])]
        assert changed, f"the {target} variant is the primary series"


def _diff(data: bytes) -> bytes:
    """The hunks of a patch without its index lines (blob ids differ between bases)."""
    diff = data[data.index(b"\ndiff --git ") :]
    return b"\n".join(line for line in diff.split(b"\n") if not line.startswith(b"index "))


def test_export_refuses_a_nonempty_target(tmp_path, base):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    with pytest.raises(UserError, match="not empty"):
        export_upstream("core_r0.19.0", tmp_path / "out", IDENT)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep"]


def _checkout(tmp_path: Path, base, base_files, edit=None) -> Path:
    """A git checkout holding the files the series touches, as in the pinned base."""
    root = tmp_path / "mlm"
    paths = {fp.path for n, d in read_series(base) for fp in parse_patch(d, n).files}
    for rel in paths:
        if rel in base_files:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(base_files[rel])
    if edit:
        edit(root)
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "-c", "user.name=x", "-c", "user.email=x@example.com", "commit", "-qm", "base")
    return root


@pytest.mark.parametrize("topic", ["memory", *PR_TOPICS, "cpu-import"])
def test_check_applies_with_git_am_and_byte_compiles(tmp_path, base, base_files, topic):
    paths = export_upstream("core_r0.19.0", tmp_path / "out", IDENT, topic)
    deps = prerequisite_exports(tmp_path / "out")
    lines = check_export(paths, _checkout(tmp_path, base, base_files), None, IDENT, deps)
    assert len(lines) == len(deps) + 2
    assert lines[-2].endswith(f"{len(paths)} patches applied with git am " + (
        "on top" if deps else "to HEAD" + lines[-2].rsplit("HEAD", 1)[1]))  # fmt: skip
    assert "all Python ones byte-compile" in lines[-1]


def test_check_names_the_patch_that_does_not_apply(tmp_path, base, base_files):
    def reword(root):
        f = root / "megatron/core/transformer/moe/fused_a2a.py"
        f.write_text(f.read_text().replace("    Reset the HybridEP buffer\n", "    Reworded.\n"))

    paths = export_upstream("core_r0.19.0", tmp_path / "out", IDENT)
    checkout = _checkout(tmp_path, base, base_files, reword)
    first = next(p for p in paths if "-    Reset the HybridEP buffer\n" in p.read_text())
    with pytest.raises(UserError, match=rf"^{first.name} does not apply to HEAD"):
        check_export(paths, checkout, None, IDENT)
    # The checkout itself is untouched: git am ran on a scratch clone.
    status = subprocess.run(["git", "status", "--porcelain"], cwd=checkout, capture_output=True)
    assert status.stdout == b""


def test_no_series_adds_a_config_field():
    """Upstream's tests/unit_tests/models/test_hybrid_moe_model.py compares TransformerConfig
    with GOLDEN_CONFIG (ALLOW_ADDED_FIELDS empty): no series for any target may add a field."""
    series = [("core_r0.19.0", target_series("core_r0.19.0"))]
    series += [(t, target_series(t)) for t in VARIANT_TARGETS]
    for version, base in load_pins().bases.items():
        if (base.series_dir() / "series").exists():
            series.append((version, read_series(base)))
    assert len(series) >= 4
    configs = ("transformer/transformer_config.py", "model_parallel_config.py")
    for target, patches in series:
        for name, data in patches:
            for fp in parse_patch(data, name).files:
                assert not fp.path.endswith(configs), f"{target}: {name} changes {fp.path}"


@pytest.mark.parametrize("target", ["core_r0.17.0", "core_r0.16.0"])
def test_no_test_for_a_fix_the_branch_does_not_get(tmp_path, target):
    """A PR adds only tests of what it changes: the paged-stash import test does not go to
    release branches without the paged stash (0.17.1's series has no CPU-import patch, 0.16.1's
    fixes another import and adds that fix's test), and a topic without patches gets no
    tests-only PR."""
    paths = export_upstream(target, tmp_path / "out", IDENT, "cpu-import")
    text = "".join(p.read_text() for p in paths)
    assert "test_paged_stash_import.py" not in text
    tests_patches = [p for p in paths if "test(moe)" in p.read_text().split("\n---\n", 1)[0]]
    if target == "core_r0.16.0":
        assert len(tests_patches) == 1
        assert "test_router_gating_without_te.py" in tests_patches[0].read_text()
    else:
        assert tests_patches == [] and "test_router_gating_without_te.py" not in text


@pytest.mark.parametrize("topic", [*PR_TOPICS, "cpu-import"])
def test_a_topic_alone_indexes_blobs_a_checkout_has(tmp_path, base, base_files, topic):
    """Exported alone, a topic's diffs are made against the base without the series' other
    patches (but with the PRs it builds on, which merge first): applied with ``git am`` in merge
    order, every ``index`` line's pre-image is a blob the checkout has by then, which
    ``git am -3`` needs to fall back to a 3-way merge."""
    checkout = _checkout(tmp_path, base, base_files)
    for path in _export_with_dependencies(tmp_path / "out", topic):
        for line in path.read_text().splitlines():
            if line.startswith("index ") and not line.startswith("index 0000000000"):
                pre = line.split()[1].split("..")[0]
                has = subprocess.run(["git", "cat-file", "-e", pre], cwd=checkout)
                assert has.returncode == 0, f"{path}: {line} names a blob of the stacked series"
        _git(checkout, "-c", "user.name=x", "-c", "user.email=x@localhost", "am", "-q", str(path))


def test_a_pr_built_on_another_says_so_and_applies_after_it(tmp_path, base, base_files):
    """The comm-buffers PR builds on the dispatcher-state and HybridEP-per-group PRs: its
    description names both, in merge order, its export writes theirs under prerequisites/, and
    it applies after them, not alone."""
    own = export_upstream("core_r0.19.0", tmp_path / "out", IDENT, "comm-buffers")
    text = (tmp_path / "out" / "PR.md").read_text()
    first = text.index('Builds on "fix(moe): release the MoE dispatchers\' per-forward state')
    second = text.index(
        "Builds on \"fix(moe): keep one HybridEP buffer per process group's ranks\""
    )
    assert first < second and text.count("which must merge first") == 2, text
    deps = prerequisite_exports(tmp_path / "out")
    assert [t for t, _ in deps] == ["dispatcher-state", "hybridep-groups"]
    with pytest.raises(UserError, match="does not apply"):
        check_export(own, _checkout(tmp_path, base, base_files), None, IDENT)
    lines = check_export(own, _checkout(tmp_path / "2", base, base_files), None, IDENT, deps)
    assert lines[0] == (
        f"prerequisite 1/2 dispatcher-state: {len(deps[0][1])} patches applied with git am to "
        f"HEAD ({lines[0].rsplit('(', 1)[1]}"
    )
    assert lines[1] == f"prerequisite 2/2 hybridep-groups: {len(deps[1][1])} patches applied " \
        "with git am on top"  # fmt: skip
    assert lines[2] == f"the PR: {len(own)} patches applied with git am on top"


def test_a_topic_alone_falls_back_to_a_3way_merge(tmp_path, base, base_files):
    """On a checkout with a local change in a hunk's context, plain ``git am`` of the
    hybridep-groups topic stops and ``git am -3`` merges it: token_dispatcher.py is a file the
    series' earlier topics change too, so an index line naming the stacked series' blob would
    leave git nothing to merge from."""

    def local_change(root):
        f = root / "megatron/core/transformer/moe/token_dispatcher.py"
        block = (
            "            fused=self.config.moe_permute_fusion_into_hybridep,\n"
            "        )\n"
            "        if (\n"
            "            self._padded_num_tokens is not None\n"
        )
        assert f.read_text().count(block) == 1
        f.write_text(f.read_text().replace(block, block[:-1] + "  # a local change\n"))

    paths = export_upstream("core_r0.19.0", tmp_path / "out", IDENT, "hybridep-groups")
    checkout = _checkout(tmp_path, base, base_files)  # the base, committed ...
    local_change(checkout)  # ... then the user's own commit on top
    _git(checkout, "-c", "user.name=x", "-c", "user.email=x@localhost", "commit", "-qam", "mine")
    files = [str(tmp_path / "out" / p) for p in paths]
    am = ["git", "-c", "user.name=x", "-c", "user.email=x@localhost", "am", "-q"]
    plain = subprocess.run([*am, *files], cwd=checkout, capture_output=True)
    assert plain.returncode != 0, "the local change did not touch a hunk's context"
    subprocess.run(["git", "am", "--abort"], cwd=checkout, check=True)
    merged = subprocess.run([*am, "-3", *files], cwd=checkout, capture_output=True)
    assert merged.returncode == 0, merged.stderr.decode()


def _topics_file(root: Path, text: str) -> Path:
    (root / "patches").mkdir(parents=True, exist_ok=True)
    (root / "patches" / "topics.toml").write_text(text)
    return root


def test_every_patch_of_every_target_has_a_topic(base):
    """patches/topics.toml names every patch of patches/series (and nothing else), and every
    series an upstream target exports (a backport by its Patch-Name:) splits into its topics;
    each topic has a PR description and its test files exist."""
    primary = [n for n, _ in read_series(base)]
    assert sorted(TOPICS.of_patch) == sorted(primary)
    for target in ("main", "dev", "core_r0.19.0", "core_r0.18.0", "core_r0.17.0", "core_r0.16.0"):
        whole = target_series(target)
        parts = [n for t in TOPICS.names for n, _ in topic_series(whole, t)]
        assert sorted(parts) == sorted(n for n, _ in whole), target
    for topic in TOPICS.forwarded:
        assert TOPICS.get(topic, "summary") and TOPICS.get(topic, "related"), topic
        assert topic == "cpu-import" or TOPICS.get(topic, "backends"), topic
        assert topic_test_files(topic), topic
    # The overlay's own topic says why no PR carries it, and has its tests all the same.
    overlay = [t for t in TOPICS.names if t not in TOPICS.forwarded]
    assert overlay == ["teardown"] and TOPICS.get("teardown", "not-forwarded")
    assert topic_test_files("teardown")


def test_prerequisites_are_declared_in_merge_order():
    """comm-buffers needs dispatcher-state (without it the flex manager's dispatched probs keep
    the HybridEP buffer alive through their grad_fn, and the release frees nothing) and
    hybridep-groups (its diffs change that PR's code); the other PRs stand alone. On every
    target, in merge order."""
    assert TOPICS.names[: len(PR_TOPICS)] == PR_TOPICS
    expected = {"comm-buffers": ["dispatcher-state", "hybridep-groups"]}
    for target in ("main", "dev", "core_r0.19.0", "core_r0.16.0"):
        for topic in TOPICS.choices():
            assert prerequisites(target, topic) == expected.get(topic, []), (target, topic)


def test_prerequisites_are_transitive_and_in_merge_order(tmp_path):
    """A topic's prerequisites are those of its prerequisites too, listed in merge order (the
    order of the [topic.*] tables), whatever order a table names them in."""
    root = _topics_file(tmp_path, """
[topic.a]
[topic.b]
prerequisites = ["a"]
[topic.c]
[topic.d]
prerequisites = ["c", "b"]
[topic.cpu-import]
""")  # fmt: skip
    topics = load_topics(root)
    assert topics.closure("d") == ("a", "b", "c")
    assert topics.closure("b") == ("a",) and topics.closure("a") == ()
    assert topics.memory == ("a", "b", "c", "d")


@pytest.mark.parametrize(
    "text,message",
    [
        ("[topic.a]\nprerequisites = [\"b\"]\n[topic.b]\n[topic.cpu-import]\n",
         r"topic.a.prerequisites: 'b' is not a topic declared before it \(topics are listed in "
         "merge order\\)"),
        ("[topic.a]\nprerequisites = [\"a\"]\n[topic.cpu-import]\n", "'a' is not a topic"),
        ("[patch.x]\ntopic = \"nope\"\n[topic.cpu-import]\n",
         "patch.x: topic 'nope' is not a declared topic"),
        ("[patch.x]\ntopc = \"a\"\n[topic.cpu-import]\n", "patch.x: unknown key 'topc'"),
        ("[topic.cpu-import]\n[patch.x]\ntopic = \"cpu-import\"\n[[patch.x.not-carried]]\n"
         "series = []\n", r"patch.x.not-carried\[0\]: wants exactly series, definitions, why"),
        ("[topic.memory]\n[topic.cpu-import]\n", "topic.memory: not a topic table"),
        ("[topic.a]\nprerequisite = []\n[topic.cpu-import]\n", "unknown key 'prerequisite'"),
        ("[topic.a]\ntests = \"t.py\"\n[topic.cpu-import]\n", "topic.a.tests: must be a list"),
        ("[topic.a]\n", r"no \[topic.cpu-import\]"),
        ("[topic.a\n", "not valid TOML"),
        ("", r"wants \[topic.<name>\], \[test-file.<name>\], \[patch.<name>\] and "),
    ],
)  # fmt: skip
def test_a_bad_topics_file_is_one_line_naming_the_problem(tmp_path, text, message):
    with pytest.raises(UserError, match=message) as exc:
        load_topics(_topics_file(tmp_path, text))
    assert str(exc.value).startswith("patches/topics.toml: ") and "\n" not in str(exc.value)


@pytest.mark.parametrize("target", ["main", "dev", "core_r0.19.0", "core_r0.18.0"])
def test_pr_md_lists_every_prerequisite_in_merge_order(tmp_path, target):
    """PR.md says "Builds on ..., which must merge first" for each PR its topic builds on,
    directly or not, in merge order; prerequisites/ holds their exports in the same order."""
    for topic in PR_TOPICS:
        out = tmp_path / f"{target}-{topic}"
        export_upstream(target, out, IDENT, topic)
        said = re.findall(r"Builds on \"[^\"]+\" \(`upstream --topic ([a-z-]+)`\), which must "
                          r"merge first\.", (out / "PR.md").read_text())  # fmt: skip
        assert said == prerequisites(target, topic), (target, topic)
        assert [t for t, _ in prerequisite_exports(out)] == said


def _cli(capsys, *argv: str) -> tuple[int, str]:
    code = cli_main(["upstream", *argv])
    out, err = capsys.readouterr()
    return code, out + err


def _shell(cwd: Path, command: str) -> subprocess.CompletedProcess:
    """``command`` as a user types it (a ``git am ...`` line the export printed), in ``cwd``."""
    env = dict(os.environ, GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1",
               GIT_AUTHOR_NAME=IDENT[0], GIT_AUTHOR_EMAIL=IDENT[1],
               GIT_COMMITTER_NAME=IDENT[0], GIT_COMMITTER_EMAIL=IDENT[1])  # fmt: skip
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True)


def _am_line(output: str, target: str) -> str:
    lines = [ln for ln in output.splitlines() if ln.startswith(f"to apply to {target}")]
    assert len(lines) == 1, output
    return lines[0].split(": ", 1)[1]


def test_the_export_says_what_to_apply_first_and_check_applies_it(
    tmp_path, base, base_files, capsys, monkeypatch
):
    """The comm-buffers export writes the PRs it builds on under OUTDIR/prerequisites/ and
    prints, in merge order, which they are and the one `git am` line that applies everything;
    that line works on a checkout of the base, where the PR's own patches alone do not, and
    `--check` applies the prerequisites, then the PR, reporting each."""
    monkeypatch.setenv("GIT_COMMITTER_NAME", IDENT[0])
    monkeypatch.setenv("GIT_COMMITTER_EMAIL", IDENT[1])
    out, checkout = tmp_path / "pr", _checkout(tmp_path, base, base_files)
    code, text = _cli(capsys, "core_r0.19.0", str(out), "--topic", "comm-buffers",
                      "--check", str(checkout), "--ref", "HEAD")  # fmt: skip
    assert code == 0, text
    deps = prerequisite_exports(out)
    assert [t for t, _ in deps] == ["dispatcher-state", "hybridep-groups"]
    lines = text.splitlines()
    assert lines[1].startswith("the comm-buffers PR builds on 2 PRs, which must merge first;")
    assert lines[2] == f"  1. dispatcher-state: {len(deps[0][1])} patches in {deps[0][1][0].parent}"
    assert lines[3] == f"  2. hybridep-groups: {len(deps[1][1])} patches in {deps[1][1][0].parent}"
    assert _am_line(text, "core_r0.19.0") == (
        f"git am -3 {out}/prerequisites/1-dispatcher-state/*.patch "
        f"{out}/prerequisites/2-hybridep-groups/*.patch {out}/*.patch"
    )
    assert "check: prerequisite 1/2 dispatcher-state: " in text
    assert "check: prerequisite 2/2 hybridep-groups: " in text
    assert "check: the PR: 3 patches applied with git am on top" in text
    alone = _shell(checkout, f"git am {out}/*.patch")
    assert alone.returncode != 0, "the PR's own patches applied without its prerequisites"
    _shell(checkout, "git am --abort")
    done = _shell(checkout, _am_line(text, "core_r0.19.0"))
    assert done.returncode == 0, done.stderr.decode()
    # A bad argument writes nothing: the topic is checked before the export.
    code, text = _cli(capsys, "core_r0.19.0", str(tmp_path / "bad"), "--topic", "comm")
    assert code == 2 and "unknown topic 'comm'" in text and len(text.splitlines()) == 1
    assert not (tmp_path / "bad").exists()


def _mirror_clone(tmp_path: Path, commit: str) -> Path:
    """A work tree of $MOE_RELEASE_MEGATRON_LM's ``commit``, as a new user's clone."""
    work = tmp_path / "Megatron-LM"
    _git(tmp_path, "clone", "-q", "--shared", "--no-checkout",
         settings.megatron_lm(), str(work))  # fmt: skip
    _git(work, "checkout", "-q", "--detach", commit)
    return work


@pytest.mark.needs_env("MOE_RELEASE_MEGATRON_LM")
def test_the_readmes_upstream_example_works_as_written(tmp_path):
    """README.md's "Patches for upstream" command, run as written (its OUTDIR in a scratch
    directory, no Megatron-LM checkout configured, as a new user runs it), prints a `git am`
    line that applies to main at the variant's commit, where the PR's patches alone do not."""
    readme = (REPO_ROOT / "README.md").read_text()
    bullet = readme.split("**Patches for upstream", 1)[1].split("\n- ", 1)[0]
    command = " ".join(re.search(r"`(python scripts/moe_release\.py upstream[^`]+)`", bullet)
                       .group(1).split())  # fmt: skip
    assert command == "python scripts/moe_release.py upstream main /tmp/pr --topic comm-buffers"
    out = tmp_path / "pr"
    argv = shlex.split(command.replace("/tmp/pr", str(out)))
    env = {k: v for k, v in os.environ.items() if k != "MOE_RELEASE_MEGATRON_LM"}
    env.update(GIT_COMMITTER_NAME=IDENT[0], GIT_COMMITTER_EMAIL=IDENT[1])
    done = subprocess.run([sys.executable, *argv[1:]], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    work = _mirror_clone(tmp_path, target_base("main").commit)
    alone = _shell(work, f"git am {out}/*.patch")
    assert alone.returncode != 0, "comm-buffers applied to main without its prerequisites"
    _shell(work, "git am --abort")
    applied = _shell(work, _am_line(done.stdout, "main"))
    assert applied.returncode == 0, applied.stderr.decode()
    log = subprocess.run(["git", "log", "--format=%s", f"{target_base('main').commit}..HEAD"],
                         cwd=work, capture_output=True, text=True).stdout  # fmt: skip
    assert log.count("\n") == 3 + sum(len(p) for _, p in prerequisite_exports(out))


@pytest.mark.needs_env("MOE_RELEASE_MEGATRON_LM")
@pytest.mark.parametrize("target", VARIANT_TARGETS)
def test_check_on_the_mirror_applies_the_prerequisites_then_the_pr(
    tmp_path, capsys, monkeypatch, target
):
    """`upstream TARGET OUTDIR --topic comm-buffers --check MIRROR --ref <variant commit>`:
    dispatcher-state, then hybridep-groups, then the PR, each applied with git am."""
    monkeypatch.setenv("GIT_COMMITTER_NAME", IDENT[0])
    monkeypatch.setenv("GIT_COMMITTER_EMAIL", IDENT[1])
    commit, mirror = target_base(target).commit, settings.megatron_lm()
    code, text = _cli(capsys, target, str(tmp_path / "pr"), "--topic", "comm-buffers",
                      "--check", mirror, "--ref", commit)  # fmt: skip
    assert code == 0, text
    checks = [ln for ln in text.splitlines() if ln.startswith("check: ")]
    assert checks[0].startswith("check: prerequisite 1/2 dispatcher-state: ")
    assert checks[0].endswith(f"patches applied with git am to {commit} ({commit[:12]})")
    assert checks[1].startswith("check: prerequisite 2/2 hybridep-groups: ")
    assert checks[2] == "check: the PR: 3 patches applied with git am on top"
    assert "note: " not in text  # the mirror is the base: diffs made against it


TEARDOWN = "destroy-comm-buffers.patch"


def test_the_overlays_own_topic_is_no_upstream_pr(tmp_path):
    """The teardown patch (Forwarded: not-needed, #7029 owns the teardown) is in no PR: the
    verb refuses its topic, naming why, and writes nothing."""
    with pytest.raises(UserError, match="overlay's own, no upstream PR: NVIDIA/Megatron-LM#7029"):
        check_topic("teardown", exported=True)
    parser_out = tmp_path / "pr"
    assert cli_main(["upstream", "main", str(parser_out), "--topic", "teardown"]) == 2
    assert not parser_out.exists()


def test_the_teardown_patch_stands_aside_where_7029_landed(base, base_files):
    """Merged onto a tree whose parallel_state.py already has #7029's stages (TeardownStage),
    the teardown patch is left out (not applicable, saying why) and every other patch merges as
    it does without them."""
    from moe_release.series.applying import NOT_APPLICABLE, Records, merge_series
    from moe_release.series.merge import series_states

    states = series_states(base_files, read_series(base))
    path = "megatron/core/parallel_state.py"
    staged = dict(base_files)
    staged[path] = base_files[path] + b"\n\nclass TeardownStage:\n    pass\n"
    at_ref = {p: staged.get(p) for _, before, _ in states for p in before}
    steps = merge_series(states, at_ref, Records())
    verdicts = {s.outcome.patch: (s.outcome.verdict, s.outcome.note) for s in steps}
    assert verdicts[TEARDOWN] == (
        NOT_APPLICABLE,
        f"stands aside: {path} has 'class TeardownStage'",
    ), verdicts[TEARDOWN]
    assert all(v == "applied" for n, (v, _) in verdicts.items() if n != TEARDOWN), verdicts
    plain = merge_series(states, {p: base_files.get(p) for p in at_ref}, Records())
    assert all(s.outcome.verdict == "applied" for s in plain), plain
