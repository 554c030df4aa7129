"""`moe_release.py check` (and `label`): the series round-trips, carries its trailers and adds
no leftover file, on every pinned base."""

from moe_release.commands.check import check_base
from moe_release.series.patches import check_trailers, parse_patch
from moe_release.series.pins import load_pins
from moe_release.series.trees import load_tree
from tests.helpers import REPO_ROOT
from tests.helpers.series import cli, series_patches


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
