"""`moe_release.py edit`: the series as commits in an edit repo on the base, reproducibly; a
patch that does not apply is named."""

import pytest

from moe_release.common import UserError
from moe_release.series.git import create_edit_repo
from tests.helpers.series import leftovers, run_git, series_patches


def test_edit_base_commit_is_reproducible(tmp_path, base, base_files):
    a, b = tmp_path / "a", tmp_path / "b"
    create_edit_repo(a, base, base_files, [])
    create_edit_repo(b, base, base_files, [])
    assert run_git(a, "rev-parse", "base") == run_git(b, "rev-parse", "base")


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
