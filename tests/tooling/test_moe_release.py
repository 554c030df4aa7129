"""Tests of scripts/moe_release.py against the real megatron-core 0.19.2 sdist."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import AUTHOR, REPO_ROOT, name_for, run_git, trailers

from moe_release.commands.check import check_base
from moe_release.commands.verify import verify_installed
from moe_release.common import UserError
from moe_release.series.git import create_edit_repo, export_series, format_patches
from moe_release.series.patches import (
    apply_file_patch,
    check_trailers,
    parse_patch,
    parse_series,
    series_header,
    stamp_package_info,
)
from moe_release.series.pins import Base, load_pins, parse_pins
from moe_release.series.sdist import fetch_sdist
from moe_release.series.source import read_base_files
from moe_release.series.trees import (
    MANIFEST_PATH,
    PACKAGE_INFO,
    build_tree,
    ensure_trees,
    load_tree,
    materialize,
)

SCRIPT = REPO_ROOT / "scripts" / "moe_release.py"
PRINT_VERSION = "import runpy, sys; print(runpy.run_path(sys.argv[1])['__version__'])"


def series_patches(root: Path) -> list[Path]:
    sdir = root / "patches"
    return [sdir / n for n in parse_series((sdir / "series").read_text())]


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name]


# ----------------------------------------------------------------------------- pure functions


def test_parse_series_order_comments_and_blanks():
    text = "# header\n\nfirst.patch\n  second.patch  # why\n\n# trailing\nthird.patch\n"
    assert parse_series(text) == ["first.patch", "second.patch", "third.patch"]
    assert series_header(text) == "# header\n\n"


@pytest.mark.parametrize(
    "text, message",
    [
        ("a.patch\na.patch\n", "listed twice"),
        ("0001-a.patch\n", "numeric prefix"),
        ("sub/a.patch\n", "plain file name"),
        ("a.patch -p1\n", "one patch file name"),
    ],
)
def test_parse_series_rejects(text, message):
    with pytest.raises(UserError, match=message):
        parse_series(text, "series")


def test_parse_pins_rejects_bad_entries():
    with pytest.raises(UserError, match="lacks sha256"):
        parse_pins('primary = "1"\n[bases."1"]\nsdist="x"\ntag="t"\nbranch="b"\nseries="p"\n')
    with pytest.raises(UserError, match="64 lowercase hex"):
        parse_pins(
            'primary = "1"\n[bases."1"]\nsdist="x"\nsha256="abc"\ntag="t"\nbranch="b"\nseries="p"\n'
        )
    with pytest.raises(UserError, match="primary base '2'"):
        parse_pins('primary = "2"\n')
    commit = 'commit="%s"\ntree="%s"\nversion="0.20.0"\nbranch="main"\nseries="p"\n'
    ok = parse_pins(
        'primary = "1"\n[bases."1"]\nsdist="x"\nsha256="%s"\ntag="t"\nbranch="b"\n'
        'series="p"\n[bases.m]\n' % ("0" * 64) + commit % ("a" * 40, "b" * 40)
    )
    assert ok.get("m").is_commit and ok.get("m").version == "0.20.0" and ok.get("m").ci
    with pytest.raises(UserError, match="base m: commit must be 40 lowercase hex"):
        parse_pins('primary = "m"\n[bases.m]\n' + commit % ("a" * 7, "b" * 40))
    with pytest.raises(UserError, match="base m lacks tree"):
        parse_pins(
            'primary = "m"\n[bases.m]\ncommit="%s"\nversion="1"\nbranch="b"\n'
            'series="p"\n' % ("a" * 40)
        )
    with pytest.raises(UserError, match="base m: unknown key"):
        parse_pins('primary = "m"\n[bases.m]\nsha256="x"\n' + commit % ("a" * 40, "b" * 40))


def test_pins_hold_primary_and_backport_bases(pins):
    assert pins.primary == "0.19.2"
    assert {v: (b.branch, b.identity[:8]) for v, b in pins.bases.items()} == {
        "0.19.2": ("core_r0.19.0", "de643eee"),
        "0.18.2": ("core_r0.18.0", "911216b7"),
        "0.18.0": ("core_r0.18.0", "8feff0cd"),
        "0.17.1": ("core_r0.17.0", "d4c86f3b"),
        "0.17.0": ("core_r0.17.0", "ff66c206"),
        "0.16.1": ("core_r0.16.0", "86522fea"),
        "main-d98e8a6": ("main", "3575bb50"),
        "dev-d48bd6b": ("dev", "24a79d30"),
    }
    main = pins.get("main-d98e8a6")
    assert main.is_commit and main.commit.startswith("d98e8a6") and main.version == "0.20.0"
    with pytest.raises(UserError, match="unknown base version '9.9'"):
        pins.get("9.9")


def test_apply_file_patch_names_patch_file_and_hunk(base_files):
    data = series_patches(REPO_ROOT)[0].read_bytes()
    patch = parse_patch(data, "p.patch")
    fp = next(f for f in patch.files if f.path.endswith("paged_stash.py"))
    old = base_files[fp.path]
    assert apply_file_patch(old, fp, "p.patch") != old
    broken = old.replace(b"import FullCudaGraphWrapper\n", b"import FullCudaGraphWrappers\n")
    with pytest.raises(UserError) as err:
        apply_file_patch(broken, fp, "p.patch")
    msg = str(err.value)
    assert "p.patch: hunk #1 (@@ -" in msg and "megatron/core/transformer/moe/paged_stash.py" in msg
    assert "does not apply: line" in msg and "FullCudaGraphWrappers" in msg
    with pytest.raises(UserError, match="which does not exist"):
        apply_file_patch(None, fp, "p.patch")


def test_stamp_overrides_vcs_suffix():
    text = "__version__ = '0.19.2'\n__version__ += '+abc1234'\n"
    scope: dict = {}
    exec(stamp_package_info(text, "0.19.2+moerelease.1.x"), scope)
    assert scope["__version__"] == "0.19.2+moerelease.1.x"


# ----------------------------------------------------------------------------- fetch


def test_fetch_rejects_tampered_cache(tmp_path, base, sdist):
    cache = tmp_path / "cache"
    cache.mkdir()
    data = bytearray(sdist.read_bytes())
    data[1000] ^= 0xFF
    (cache / base.sdist).write_bytes(bytes(data))
    with pytest.raises(UserError) as err:
        fetch_sdist(base, cache)
    msg = str(err.value)
    assert base.sdist in msg and f"expected {base.sha256}" in msg and "got " in msg
    assert "megatron-core 0.19.2" in msg


def test_fetch_wrong_pin_downloads_nothing_into_cache(tmp_path, base):
    """A pin whose sha256 does not match PyPI's file: clear error, and nothing is cached."""
    wrong = Base(**{**base.__dict__, "sha256": "0" * 64})
    cache = tmp_path / "cache"
    with pytest.raises(UserError) as err:
        fetch_sdist(wrong, cache)
    assert f"expected {'0' * 64}, got {base.sha256}" in str(err.value)
    assert list(cache.iterdir()) == []


# ----------------------------------------------------------------------------- materialize


def test_materialize_writes_complete_stamped_tree(tmp_path, repo, base_files):
    dest = tmp_path / "tree"
    tree = materialize(dest, root=repo)
    assert tree.version.startswith("0.19.2+moerelease.") and tree.version.count("+") == 1
    # Every upstream file is there, patched files differ, the overlay is added.
    for rel in base_files:
        assert (dest / rel).is_file(), rel
    assert set(tree.touched) >= {
        "megatron/core/transformer/moe/paged_stash.py",
        "megatron/core/transformer/moe/token_dispatcher.py",
    }
    for rel in tree.touched:
        assert (dest / rel).read_bytes() != base_files[rel]
    for rel in tree.overlay:
        assert (dest / rel).read_bytes() == (repo / rel).read_bytes()
    assert not (dest / "PKG-INFO").exists()
    manifest = json.loads((dest / MANIFEST_PATH).read_text())
    assert manifest["version"] == tree.version and manifest["base"]["sha256"] == tree.base.sha256
    assert leftovers(tmp_path) == []


def test_materialized_version_inside_a_git_checkout(tmp_path, repo):
    """package_info appends a VCS hash in a git checkout; the label must still appear once."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(
        ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t",
         "commit", "-q", "--allow-empty", "-m", "x"],
        check=True,
    )  # fmt: skip
    tree = materialize(tmp_path / "tree", root=repo)
    env = {k: v for k, v in os.environ.items() if k != "NO_VCS_VERSION"}
    out = subprocess.run(
        [sys.executable, "-c", PRINT_VERSION, str(tmp_path / "tree" / PACKAGE_INFO)],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == tree.version


def test_materialize_refuses_non_empty_target(tmp_path, repo):
    dest = tmp_path / "tree"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="target exists and is not empty"):
        materialize(dest, root=repo)
    assert [p.name for p in dest.iterdir()] == ["keep.txt"]


def test_materialize_through_a_patch_applies_the_series_up_to_it(tmp_path, repo):
    tree = materialize(tmp_path / "tree", root=repo, through="allgather-dispatcher-state")
    names = [p.name for p in series_patches(repo)]
    assert tree.patches == names[:4]
    # A name matching no patch, or several, names the series' patches and writes nothing.
    for through, what in (("no-such-patch", "no patch"), ("dispatcher-state", "3 patches")):
        dest = tmp_path / through
        with pytest.raises(UserError, match=f"--through {through}: {what} of the series of"):
            materialize(dest, root=repo, through=through)
        assert not dest.exists()


def test_materialize_into_empty_dir(tmp_path, repo):
    dest = tmp_path / "tree"
    dest.mkdir()
    materialize(dest, root=repo)
    assert (dest / PACKAGE_INFO).exists()


def test_patch_that_does_not_apply_leaves_nothing(tmp_path, repo):
    patch = series_patches(repo)[0]
    data = patch.read_bytes()
    # Change one context line of the paged_stash.py hunk: the patch no longer matches the base.
    data = data.replace(
        b" from megatron.core.full_cuda_graph import FullCudaGraphWrapper\n",
        b" from megatron.core.full_cuda_graph import FullCudaGraphWrappers\n",
    )
    patch.write_bytes(data)
    dest = tmp_path / "tree"
    with pytest.raises(UserError) as err:
        materialize(dest, root=repo)
    msg = str(err.value)
    assert msg.startswith(f"{patch.name}: hunk #1 (@@ ")
    assert "of megatron/core/transformer/moe/paged_stash.py does not apply" in msg
    assert not dest.exists() and leftovers(tmp_path) == []


def test_series_entry_without_file(tmp_path, repo):
    with open(repo / "patches" / "series", "a") as f:
        f.write("missing-topic.patch\n")
    with pytest.raises(UserError, match="lists missing-topic.patch, which does not exist"):
        materialize(tmp_path / "tree", root=repo)
    assert not (tmp_path / "tree").exists()


def test_patch_file_not_in_series(tmp_path, repo):
    shutil.copy(series_patches(repo)[0], repo / "patches" / "stray-topic.patch")
    with pytest.raises(UserError, match="stray-topic.patch: patch file is not listed"):
        materialize(tmp_path / "tree", root=repo)


def test_overlay_collision_and_init_rejected(tmp_path, repo):
    moe = repo / "megatron/core/transformer/moe"
    moe.mkdir(parents=True, exist_ok=True)
    (moe / "router.py").write_text("# ours\n")
    with pytest.raises(UserError, match="overlay file .*router.py collides with upstream"):
        materialize(tmp_path / "tree", root=repo)
    (moe / "router.py").unlink()
    (moe / "__init__.py").write_text("")
    with pytest.raises(UserError, match="must not contain __init__.py"):
        materialize(tmp_path / "tree", root=repo)
    assert leftovers(tmp_path) == []


def test_overlay_subpackage_keeps_its_init(tmp_path, repo):
    """A new subpackage of ours (the planner) has an ``__init__.py``; it reaches the tree."""
    pkg = repo / "megatron/core/transformer/moe/our_subpackage"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 1\n")
    (pkg / "part.py").write_text("PART = 2\n")
    tree = materialize(tmp_path / "tree", root=repo)
    for name in ("__init__.py", "part.py"):
        rel = f"megatron/core/transformer/moe/our_subpackage/{name}"
        assert rel in tree.overlay
        assert (tmp_path / "tree" / rel).read_text() == (pkg / name).read_text()


def test_each_prefix_must_compile(base, base_files, repo):
    bad = _commit_patch(
        repo, base, base_files, "megatron/core/transformer/moe/router.py",
        lambda s: s.replace("def gating(self, input: torch.Tensor):", "def gating(self, input:"),
        "[MoE] Break the router",
    )  # fmt: skip
    patches = [(p.name, p.read_bytes()) for p in series_patches(repo)] + [bad]
    with pytest.raises(UserError, match="router.py does not compile after this patch"):
        build_tree(base, base_files, patches, [], compile_check=True)


# ----------------------------------------------------------------------------- edit / export


def _edit_repo(tmp_path, repo, base, base_files) -> Path:
    edit = tmp_path / "edit"
    patches = [(p.name, p.read_bytes()) for p in series_patches(repo)]
    create_edit_repo(edit, base, base_files, patches)
    return edit


def _commit_patch(repo, base, base_files, rel, change, subject, tail=None):
    """A one-commit patch on top of the series, as format-patch writes it."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        edit = Path(tmp) / "edit"
        patches = [(p.name, p.read_bytes()) for p in series_patches(repo)]
        create_edit_repo(edit, base, base_files, patches)
        path = edit / rel
        path.write_text(change(path.read_text()))
        run_git(
            edit,
            "commit",
            "-q",
            "-am",
            f"{subject}\n\nBody.\n\n{tail or trailers(name_for(subject))}",
            **AUTHOR,
        )
        return format_patches(edit)[-1]


def test_edit_then_export_is_a_byte_for_byte_noop(tmp_path, repo, base, base_files):
    edit = _edit_repo(tmp_path, repo, base, base_files)
    assert run_git(edit, "describe", "--tags", "--abbrev=0").strip() == "base"
    files = sorted((repo / "patches").rglob("*"))
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in files if p.is_file()}
    _, written, deleted = export_series(edit, root=repo)
    assert (written, deleted) == ([], [])
    after = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in files if p.is_file()}
    assert after == before


def test_edit_base_commit_is_reproducible(tmp_path, base, base_files):
    a, b = tmp_path / "a", tmp_path / "b"
    create_edit_repo(a, base, base_files, [])
    create_edit_repo(b, base, base_files, [])
    assert run_git(a, "rev-parse", "base") == run_git(b, "rev-parse", "base")


def test_fixup_add_and_drop_commits_round_trip(tmp_path, repo, base, base_files):
    edit = _edit_repo(tmp_path, repo, base, base_files)
    names_before = [p.name for p in series_patches(repo)]
    first = series_patches(repo)[0]
    old_first = first.read_bytes()
    # A fixup of the existing patch: its file changes, the series does not.
    router = edit / "megatron/core/transformer/moe/router.py"
    router.write_text(router.read_text().replace("Logits tensor.", "Router logits."))
    first_commit = run_git(edit, "rev-list", "--reverse", "base..HEAD").split()[0]
    run_git(edit, "commit", "-q", "-a", "--fixup", first_commit, **AUTHOR)
    run_git(edit, "rebase", "-q", "-i", "--autosquash", "base", GIT_SEQUENCE_EDITOR="true")
    _, written, deleted = export_series(edit, root=repo)
    assert (written, deleted) == ([first.name], [])
    assert first.read_bytes() != old_first and b"torch.Tensor: Router logits." in first.read_bytes()
    # A new topic: new file, appended to the series.
    exp = edit / "megatron/core/transformer/moe/experts.py"
    exp.write_text(exp.read_text() + "\n# extra\n")
    run_git(
        edit,
        "commit",
        "-q",
        "-am",
        f"[MoE] Add a note\n\nBody.\n\n{trailers('add-a-note')}",
        **AUTHOR,
    )
    _, written, _ = export_series(edit, root=repo)
    assert written == ["add-a-note.patch"]
    names = parse_series((repo / "patches" / "series").read_text())
    assert names == names_before + ["add-a-note.patch"]
    assert (repo / "patches" / "series").read_text().startswith("# Patch series over")
    # Dropping it deletes the stale file and its series line.
    run_git(edit, "reset", "-q", "--hard", "HEAD~1")
    _, written, deleted = export_series(edit, root=repo)
    assert (written, deleted) == ([], ["add-a-note.patch"])
    assert not (repo / "patches" / "add-a-note.patch").exists()
    assert check_base(base, repo) == []


def test_export_refuses_commit_without_trailers(tmp_path, repo, base, base_files):
    edit = _edit_repo(tmp_path, repo, base, base_files)
    exp = edit / "megatron/core/transformer/moe/experts.py"
    exp.write_text(exp.read_text() + "\n# extra\n")
    run_git(edit, "commit", "-q", "-am", "[MoE] No trailers\n\nBody.\n", **AUTHOR)
    before = sorted(p.name for p in (repo / "patches").iterdir())
    with pytest.raises(
        UserError, match=r"commit '\[MoE\] No trailers' lacks a Patch-Name: trailer"
    ):
        export_series(edit, root=repo)
    assert sorted(p.name for p in (repo / "patches").iterdir()) == before


def test_export_refuses_dirty_tree_and_foreign_repo(tmp_path, repo, base, base_files):
    edit = _edit_repo(tmp_path, repo, base, base_files)
    (edit / "megatron/core/transformer/moe/experts.py").write_text("dirty\n")
    with pytest.raises(UserError, match="uncommitted changes"):
        export_series(edit, root=repo)
    other = tmp_path / "other"
    subprocess.run(["git", "init", "-q", str(other)], check=True)
    with pytest.raises(UserError, match="not an edit repo"):
        export_series(other, root=repo)


def test_edit_names_the_patch_that_does_not_apply(tmp_path, repo, base, base_files):
    patch = series_patches(repo)[0]
    patch.write_bytes(
        patch.read_bytes().replace(
            b"import FullCudaGraphWrapper\n", b"import FullCudaGraphWrappers\n"
        )
    )
    patches = [(p.name, p.read_bytes()) for p in series_patches(repo)]
    with pytest.raises(UserError, match=f"{patch.name}: does not apply to megatron-core 0.19.2"):
        create_edit_repo(tmp_path / "edit", base, base_files, patches)
    assert not (tmp_path / "edit").exists() and leftovers(tmp_path) == []


# ----------------------------------------------------------------------------- check


def test_check_passes_on_this_repository(base):
    assert check_base(base, REPO_ROOT) == []


def test_check_reports_missing_trailer_and_non_round_trip(repo, base):
    patch = series_patches(repo)[0]
    original = patch.read_bytes()
    patch.write_bytes(original.replace(b"Forwarded: no\n", b""))
    assert check_base(base, repo) == [f"{patch.name}: lacks trailer(s) Forwarded/Applied-Upstream"]
    # Still applies, but is not what format-patch writes: the round trip catches it.
    patch.write_bytes(original.replace(b"Subject: ", b"Subject: [PATCH] ", 1))
    problems = check_base(base, repo)
    assert any("round-trip" in p or "import+export changes" in p for p in problems), problems


def test_check_refuses_a_patch_that_adds_a_leftover_file(repo, base):
    """A `.orig` left by `patch` and committed with the fix would vendor a copy of upstream."""
    patch = series_patches(repo)[0]
    leftover = (
        b"diff --git a/megatron/core/transformer/moe/router.py.orig "
        b"b/megatron/core/transformer/moe/router.py.orig\n"
        b"new file mode 100644\n--- /dev/null\n"
        b"+++ b/megatron/core/transformer/moe/router.py.orig\n@@ -0,0 +1 @@\n+x = 1\n"
    )
    patch.write_bytes(patch.read_bytes() + leftover)
    assert check_base(base, repo) == [
        f"{patch.name}: adds megatron/core/transformer/moe/router.py.orig, a leftover of "
        "patch/merge (remove it)"
    ]


def test_every_patch_in_series_has_trailers():
    for path in series_patches(REPO_ROOT):
        patch = parse_patch(path.read_bytes(), path.name)
        assert check_trailers(patch) == [], path.name
        assert patch.trailers["Signed-off-by"], path.name


# ----------------------------------------------------------------------------- verify


def test_verify_detects_replaced_files(tmp_path, repo):
    site = tmp_path / "site"
    tree = materialize(site, root=repo)
    core = site / "megatron" / "core"
    assert verify_installed(core, tree.version, tree) == []
    assert verify_installed(core, "0.19.2", tree) == [
        f"installed distribution is megatron-core 0.19.2, expected {tree.version}"
    ]
    dispatcher = core / "transformer/moe/token_dispatcher.py"
    dispatcher.write_text(dispatcher.read_text() + "# changed\n")
    assert verify_installed(core, tree.version, tree) == [
        "megatron/core/transformer/moe/token_dispatcher.py: differs from the series"
    ]


def test_verify_says_what_the_install_releases(tmp_path, repo):
    """verify's last line: what the installed megatron-core releases, of the backends and paths
    it has (probes.releases_line), and what it leaves unreleased: none for the series; the
    base's fused_a2a.py put back leaves every communication buffer unreleased."""
    from moe_release.series.probes import installed_releases

    site = tmp_path / "site"
    materialize(site, root=repo)
    core = site / "megatron" / "core"
    line = installed_releases(core)
    assert line.startswith("releases the flex dispatcher's state") and "NCCL EP's context" in line
    assert line.endswith("leaves unreleased: none")
    fused = "megatron/core/transformer/moe/fused_a2a.py"
    (site / fused).write_bytes(read_base_files(load_pins().get(None))[fused])
    left = installed_releases(core).split("leaves unreleased: ")[1].split("; ")
    assert [item.split(":")[0] for item in left] == [
        "HybridEP's buffers", "DeepEP's buffers", "NCCL EP's context"
    ]  # fmt: skip


def test_verify_reads_the_base_from_the_installed_manifest(tmp_path, repo):
    """After `MOE_RELEASE_BASE=0.17.0 pip install .`, a plain verify checks the install against
    0.17.0's series, read from the manifest the wheel carries (not the primary's)."""
    from moe_release.commands.verify import _installed_pin

    site = tmp_path / "site"
    tree = materialize(site, "0.17.0", root=repo)
    manifest = json.loads((site / MANIFEST_PATH).read_text())
    assert _installed_pin(manifest) == "0.17.0"
    assert verify_installed(site / "megatron" / "core", tree.version, tree) == []
    assert _installed_pin(None) is None and _installed_pin({"base": {"sha256": "0" * 64}}) is None


# ----------------------------------------------------------------------------- CLI


# A sign-off identity git reads before any config, so that `upstream` gets past it on any
# machine (its own refusals are tested in test_upstream.py).
IDENTITY_ENV = dict(
    GIT_COMMITTER_NAME="Test Exporter", GIT_COMMITTER_EMAIL="exporter@users.noreply.github.com"
)


def cli(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=dict(os.environ, **IDENTITY_ENV),
    )


@pytest.mark.parametrize(
    "verb",
    ["fetch", "materialize", "edit", "export", "check", "verify", "trees", "label", "landed",
     "upstream", "port", "apply", "sweep", "matrix"],
)  # fmt: skip
def test_every_verb_has_help(verb):
    result = cli(verb, "--help")
    assert result.returncode == 0 and "usage: moe_release.py " + verb in result.stdout


def test_user_error_is_one_line_without_traceback(tmp_path):
    (tmp_path / "x").write_text("x")
    result = cli("materialize", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"moe_release.py materialize: error: {tmp_path}: target exists and is not empty"
    ]
    result = cli("materialize", "--base", "0.1.0", str(tmp_path / "new"))
    assert result.returncode == 2 and "unknown base version '0.1.0'" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_check_and_label():
    result = cli("check")
    assert result.returncode == 0, result.stdout + result.stderr
    # Every pinned base: its series checks OK (or, for a backport not written yet, says so; a
    # commit base without a Megatron-LM checkout configured is skipped, saying so).
    for version, pinned in load_pins().bases.items():
        skipped = pinned.is_commit and f"{version}: skipped (" in result.stdout
        assert (
            skipped
            or f"{version}: OK" in result.stdout
            or f"{version}: no series yet" in (result.stdout)
        )
    assert "0.19.2: OK" in result.stdout
    label = cli("label").stdout.strip()
    assert label == load_tree().version


def test_trees_are_made_once_per_label_and_stale_ones_removed(repo):
    stale = repo / ".build" / "trees" / "0.19.2+moerelease.0.stale"
    stale.mkdir(parents=True)
    other_base = repo / ".build" / "trees" / "0.18.2+moerelease.3.other"
    other_base.mkdir(parents=True)
    base, patched = ensure_trees(root=repo)
    assert not stale.exists()
    # Another base's trees are not this base's stale ones.
    assert other_base.exists()
    assert base.name == "base-" + load_tree(series=False, root=repo).version
    assert patched.name == load_tree(root=repo).version
    assert (patched / MANIFEST_PATH).exists() and (base / MANIFEST_PATH).exists()
    info = patched / PACKAGE_INFO
    before = info.stat().st_mtime_ns
    assert ensure_trees(root=repo) == (base, patched)
    assert info.stat().st_mtime_ns == before
    # The base tree carries the new modules but none of the series.
    dispatcher = "megatron/core/transformer/moe/token_dispatcher.py"
    assert (base / dispatcher).read_bytes() != (patched / dispatcher).read_bytes()


# ----------------------------------------------------------------------------- bad inputs


@pytest.fixture
def read_only_dir(tmp_path) -> Path:
    """A directory nothing can be created in: a 0555 directory, or for root (whom permissions
    do not stop) sysfs, where creating a directory fails for everyone."""
    if os.geteuid() == 0:
        yield Path("/sys")
        return
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    yield ro
    ro.chmod(0o755)


# (argv, what the message names); {t} is the test's scratch directory holding `file` (a plain
# file), `empty` (an empty directory) and `fake-python` (an executable that is no Python), {ro}
# a read-only directory.
NO_PARENT = "the target's parent directory does not exist"
UNKNOWN_BASE = "unknown base version '9.9'"
BAD_INPUTS = [
    (["materialize", "{t}/missing/out"], "{t}/missing: " + NO_PARENT),
    (["materialize", "{t}/file"], "{t}/file: target exists and is not a directory"),
    (["materialize", "{t}/file/out"], "{t}/file: the target's parent is not a directory"),
    (["materialize", "{ro}/out"], "{ro}/out"),
    (["materialize", "--base", "9.9", "{t}/out"], UNKNOWN_BASE),
    (["edit", "{t}/missing/out"], "{t}/missing: " + NO_PARENT),
    (["edit", "{t}/file"], "{t}/file: target exists and is not a directory"),
    (["edit", "{ro}/out"], "{ro}/out"),
    (["edit", "--base", "9.9", "{t}/out"], UNKNOWN_BASE),
    (["export", "{t}/missing"], "{t}/missing: does not exist"),
    (["export", "{t}/file"], "{t}/file: is not a directory"),
    (["export", "{t}/empty"], "{t}/empty: not an edit repo"),
    (["check", "--base", "9.9"], UNKNOWN_BASE),
    (["verify", "--python", "/nonexistent/python"],
      "/nonexistent/python: interpreter does not exist"),
    (["verify", "--python", "{t}/missing/python"],
      "{t}/missing/python: interpreter does not exist"),
    (["verify", "--python", "{t}/empty"], "{t}/empty: is a directory, not an interpreter"),
    (["verify", "--python", "{t}/file"], "{t}/file: is not executable"),
    (["verify", "--python", "{t}/fake-python"], "{t}/fake-python: does not answer as a Python"),
    (["verify", "--python", "no-such-python-3.99"],
      "no-such-python-3.99: no such interpreter on PATH"),
    (["verify", "--base", "9.9"], UNKNOWN_BASE),
    (["trees", "--base", "9.9"], UNKNOWN_BASE),
    (["label", "--base", "9.9"], UNKNOWN_BASE),
    (["fetch", "--base", "9.9"], UNKNOWN_BASE),
    (["landed", "{t}/missing"], "{t}/missing: checkout does not exist"),
    (["landed", "{t}/file"], "{t}/file: checkout is not a directory"),
    (["landed", "{t}/empty"], "{t}/empty: not a checkout (no megatron/core in it)"),
    (["landed", "--base", "9.9", "{t}/empty"], UNKNOWN_BASE),
    (["landed", "--target", "nope", "{t}/empty"], "unknown target 'nope'"),
    (["upstream", "main", "/missing/parent/out"], "/missing/parent: " + NO_PARENT),
    (["upstream", "main", "{t}/missing/out"], "{t}/missing: " + NO_PARENT),
    (["upstream", "main", "{t}/file"], "{t}/file: target exists and is not a directory"),
    (["upstream", "main", "{t}/file/out"], "{t}/file: the target's parent is not a directory"),
    (["upstream", "main", "{ro}/out"], "{ro}/out"),
    (["upstream", "main", "{t}/out", "--check", "{t}/missing"],
      "{t}/missing: checkout does not exist"),
    (["upstream", "nope", "{t}/out"], "unknown target 'nope'"),
    (["port"], "name the targets: --target TARGET (repeatable) or --all"),
    (["port", "--target", "nope"], "unknown port target 'nope'"),
    (["port", "--target", "main", "--mirror", "{t}/missing"],
      "base main-d98e8a6: {t}/missing: Megatron-LM source does not exist"),
    (["port", "--target", "main", "--mirror", "{t}/file"],
      "base main-d98e8a6: {t}/file: not a tar archive"),
    (["port", "--target", "main", "--mirror", "{t}/empty"],
      "base main-d98e8a6: {t}/empty is not the pinned Megatron-LM commit: expected commit "
      "d98e8a64ddf34856e74b24714e3bedb2f5a39553 (tree 3575bb50bf77ba700a7413c96c5cf1e6521e023f), "
      "found tree 4b825dc642cb6eb9a060e54bf8d69288fbee4904"),
    (["materialize", "--base", "main-d98e8a6", "--checkout", "{t}/missing", "{t}/out"],
      "base main-d98e8a6: {t}/missing: Megatron-LM source does not exist"),
    (["trees", "--base", "dev-d48bd6b", "--checkout", "{t}/empty"],
      "found tree 4b825dc642cb6eb9a060e54bf8d69288fbee4904"),
    (["port", "--target", "0.18.2", "--patch", "nope.patch"],
      "--patch nope.patch: not in patches/series"),
]  # fmt: skip


def _snapshot(*dirs: Path) -> set:
    return {str(p) for d in dirs if d.is_dir() for p in d.rglob("*")}


@pytest.mark.parametrize("argv, names", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, read_only_dir, argv, names):
    """Every verb, as a new user would call it wrong: one line naming the path or argument on
    stderr, exit status 2, no traceback, and nothing created (not the target, not a parent,
    not a temp dir beside it)."""
    t = tmp_path / "t"
    t.mkdir()
    (t / "file").write_text("a file\n")
    (t / "empty").mkdir()
    fake = t / "fake-python"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    subst = {"{t}": str(t), "{ro}": str(read_only_dir)}

    def fill(s: str) -> str:
        for k, v in subst.items():
            s = s.replace(k, v)
        return s

    before = _snapshot(t, read_only_dir) if read_only_dir != Path("/sys") else _snapshot(t)
    result = cli(*map(fill, argv))
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    lines = [line for line in lines if not line.startswith("moe-release: ")]  # progress lines
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"moe_release.py {argv[0]}: error: "), lines[0]
    assert fill(names) in lines[0]
    assert "Traceback" not in result.stderr
    after = _snapshot(t, read_only_dir) if read_only_dir != Path("/sys") else _snapshot(t)
    assert after == before
    assert not Path("/missing").exists() and not (read_only_dir / "out").exists()
