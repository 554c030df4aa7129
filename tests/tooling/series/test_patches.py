"""Patch files and the series list (``moe_release.series.patches``): parsing, applying one
file's hunks, the package-info stamp; against the real megatron-core 0.19.2 sdist."""

import pytest

from moe_release.common import UserError
from moe_release.series.patches import (
    apply_file_patch,
    parse_patch,
    parse_series,
    series_header,
    stamp_package_info,
)
from tests.helpers import REPO_ROOT
from tests.helpers.series import series_patches


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
