"""`moe_release.py export`: an edit repo back to the series, byte for byte where nothing
changed; commits without trailers, a dirty tree and a foreign repo refused."""

import subprocess

import pytest

from moe_release.commands.check import check_base
from moe_release.common import UserError
from moe_release.series.git import export_series
from moe_release.series.patches import parse_series
from tests.helpers.series import AUTHOR, edit_repo, run_git, series_patches, trailers


def test_edit_then_export_is_a_byte_for_byte_noop(tmp_path, repo, base, base_files):
    edit = edit_repo(tmp_path, repo, base, base_files)
    assert run_git(edit, "describe", "--tags", "--abbrev=0").strip() == "base"
    files = sorted((repo / "patches").rglob("*"))
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in files if p.is_file()}
    _, written, deleted = export_series(edit, root=repo)
    assert (written, deleted) == ([], [])
    after = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in files if p.is_file()}
    assert after == before


def test_fixup_add_and_drop_commits_round_trip(tmp_path, repo, base, base_files):
    edit = edit_repo(tmp_path, repo, base, base_files)
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
    edit = edit_repo(tmp_path, repo, base, base_files)
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
    edit = edit_repo(tmp_path, repo, base, base_files)
    (edit / "megatron/core/transformer/moe/experts.py").write_text("dirty\n")
    with pytest.raises(UserError, match="uncommitted changes"):
        export_series(edit, root=repo)
    other = tmp_path / "other"
    subprocess.run(["git", "init", "-q", str(other)], check=True)
    with pytest.raises(UserError, match="not an edit repo"):
        export_series(other, root=repo)
