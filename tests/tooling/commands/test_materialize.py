"""`moe_release.py materialize`: a complete stamped tree from the real megatron-core 0.19.2
sdist, the series and the overlay modules, or nothing where something fails."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from moe_release.common import UserError
from moe_release.series.trees import MANIFEST_PATH, PACKAGE_INFO, build_tree, materialize
from tests.helpers.series import PRINT_VERSION, commit_patch, leftovers, series_patches


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
    bad = commit_patch(
        repo, base, base_files, "megatron/core/transformer/moe/router.py",
        lambda s: s.replace("def gating(self, input: torch.Tensor):", "def gating(self, input:"),
        "[MoE] Break the router",
    )  # fmt: skip
    patches = [(p.name, p.read_bytes()) for p in series_patches(repo)] + [bad]
    with pytest.raises(UserError, match="router.py does not compile after this patch"):
        build_tree(base, base_files, patches, [], compile_check=True)
