"""`moe_release.py port`: the primary series carried onto every backport and upstream variant
series by a 3-way merge, replaying the resolutions stored per target."""

import shutil
import subprocess
import sys
from pathlib import Path

from moe_release import settings
from moe_release.commands.check import check_base
from moe_release.commands.port import (
    RESOLUTIONS,
    all_target_names,
    get_target,
    port_all,
    report_lines,
    target_name,
)
from moe_release.series.git import create_edit_repo, export_series
from moe_release.series.patches import parse_patch, parse_series
from moe_release.series.pins import load_pins
from moe_release.series.source import CHECKOUT_ENV
from tests.helpers import REPO_ROOT
from tests.helpers.series import AUTHOR, name_for, run_git, trailers

# A Megatron-LM repository holding the commit bases, where settings name one (none in CI).
MIRROR = Path(settings.megatron_lm() or "/nonexistent")
COMMIT_TARGETS = [target_name(b) for b in load_pins().bases.values() if b.is_commit]
BACKPORTS = [n for n in all_target_names() if n not in COMMIT_TARGETS]
# The upstream variants are Megatron-LM commits: ported where a Megatron-LM repository holding
# them is at hand (the read-only mirror here; CI has the backports, which need only the sdists).
TARGETS = all_target_names() if MIRROR.is_dir() else BACKPORTS
ALL_GATHER = "allgather-dispatcher-state.patch"
OLD_LINE = b"# token_combine read local_probs last; backward keeps its own references."
NEW_LINE = b"# token_combine read local_probs last; the backward keeps its own references."


def _mirror():
    return MIRROR if MIRROR.is_dir() else None


def _snapshot(root: Path) -> dict:
    return {p: p.read_bytes() for p in sorted((root / "patches").rglob("*")) if p.is_file()}


def _sdir(root: Path, target: str) -> Path:
    return get_target(target, _mirror(), root).sdir


def _counterpart(root: Path, target: str, primary: str) -> Path:
    sdir = _sdir(root, target)
    for name in parse_series((sdir / "series").read_text()):
        patch = parse_patch((sdir / name).read_bytes(), name)
        if f"{patch.trailers['Patch-Name'][0]}.patch" == primary:
            return sdir / name
    raise AssertionError(f"{target} carries nothing from {primary}")


def _without_index_lines(data: bytes) -> bytes:
    return b"".join(line for line in data.splitlines(True) if not line.startswith(b"index "))


def _edit_primary(tmp_path, repo, base, base_files, change, subject=None):
    """Change the primary series as a maintainer does: edit, commit (a fixup of the all-gather
    patch, or a new patch with ``subject``), rebase, export."""
    edit = tmp_path / "edit"
    sdir = repo / "patches"
    patches = [(n, (sdir / n).read_bytes()) for n in parse_series((sdir / "series").read_text())]
    create_edit_repo(edit, base, base_files, patches)
    path = edit / "megatron/core/transformer/moe/token_dispatcher.py"
    path.write_bytes(change(path.read_bytes()))
    if subject:
        run_git(
            edit,
            "commit",
            "-q",
            "-am",
            f"{subject}\n\nBody.\n\n{trailers(name_for(subject))}",
            **AUTHOR,
        )
    else:
        commits = run_git(edit, "rev-list", "--reverse", "base..HEAD").split()
        target = commits[[n for n, _ in patches].index(ALL_GATHER)]
        run_git(edit, "commit", "-q", "-a", "--fixup", target, **AUTHOR)
        run_git(edit, "rebase", "-q", "-i", "--autosquash", "base", GIT_SEQUENCE_EDITOR="true")
    export_series(edit, root=repo)


def test_port_leaves_every_series_byte_identical(repo):
    """With no change to the primary series, porting regenerates every backport and variant
    patch byte for byte from the primary patches and the stored resolutions."""
    before = _snapshot(repo)
    results = port_all(TARGETS, _mirror(), root=repo)
    for result, written in results:
        assert result.ok, "\n".join(report_lines(result))
        assert written == ([], []), (result.target.name, written)
    assert _snapshot(repo) == before
    verdicts = {r.target.name: {s.patch: s.verdict for s in r.steps} for r, _ in results}
    assert verdicts["core_r0.16.0"]["overlap-layer-state.patch"] == ("not carried")
    assert all(v == "applied" for v in (verdicts["core_r0.18.0"][ALL_GATHER],))


def test_record_derives_the_stored_resolutions_from_the_current_series(repo):
    """`port --record` stores, per target and patch, the difference between the mechanical
    3-way merge and the series as it is: what is committed under resolutions/."""
    for target in TARGETS:
        shutil.rmtree(_sdir(repo, target) / RESOLUTIONS)
    for result, written in port_all(TARGETS, _mirror(), record=True, root=repo):
        assert result.ok and not written[1]
        assert all(name.startswith(f"{RESOLUTIONS}/") for name in written[0])
    for target in TARGETS:
        ours = _sdir(repo, target) / RESOLUTIONS
        theirs = _sdir(REPO_ROOT, target) / RESOLUTIONS
        assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
        for path in ours.iterdir():
            assert path.read_bytes() == (theirs / path.name).read_bytes(), path


def test_one_line_change_reaches_every_series(tmp_path, repo, base, base_files, monkeypatch):
    """A one-line change to one primary patch (a comment in a hunk) reaches every series with
    one port, nothing else changes, and every base's series still checks."""
    assert OLD_LINE in (repo / "patches" / ALL_GATHER).read_bytes()
    _edit_primary(tmp_path, repo, base, base_files, lambda s: s.replace(OLD_LINE, NEW_LINE))
    before = _snapshot(repo)
    results = port_all(TARGETS, _mirror(), root=repo)
    for result, written in results:
        assert result.ok, "\n".join(report_lines(result))
        path = _counterpart(repo, result.target.name, ALL_GATHER)
        assert path.name in written[0] and not written[1], (result.target.name, written)
        data = path.read_bytes()
        assert NEW_LINE in data and OLD_LINE not in data
    after = _snapshot(repo)
    changed = {p for p in after if after[p] != before.get(p)}
    assert {_counterpart(repo, t, ALL_GATHER) for t in TARGETS} <= changed
    # Beyond the changed line, only the blob ids of later patches to the same file move.
    for path in changed:
        old, new = (_without_index_lines(x[path]) for x in (before, after))
        assert old.replace(OLD_LINE, NEW_LINE) == new, path
    if MIRROR.is_dir():
        monkeypatch.setenv(CHECKOUT_ENV, str(MIRROR))
    for version, pinned in load_pins(repo / "patches" / "pins.toml").bases.items():
        if pinned.is_commit and not MIRROR.is_dir():
            continue
        assert check_base(pinned, repo) == [], version


def test_a_new_primary_patch_gets_the_backport_conventions(tmp_path, repo, base, base_files):
    """A primary patch a backport series does not carry yet is ported as a new backport
    patch: ``cp: `fix(moe): …` into `<branch>```, named as its primary patch, and checks."""
    old = b"        self._maybe_reset_transient_forward_state()\n        return output\n"
    _edit_primary(
        tmp_path, repo, base, base_files,
        lambda s: s.replace(old, b"        # Released here, after combine.\n" + old, 1),
        subject="[MoE] Say where the all-gather state is released",
    )  # fmt: skip
    ((result, written),) = port_all(["core_r0.18.0"], root=repo)
    assert result.ok, "\n".join(report_lines(result))
    assert result.steps[-1].verdict == "applied"
    name = "say-where-the-all-gather-state-is-released.patch"
    assert written == ([name, "series"], [])
    patch = parse_patch((_sdir(repo, "core_r0.18.0") / name).read_bytes(), name)
    assert patch.subject == (
        "cp: `fix(moe): say where the all-gather state is released` into `core_r0.18.0`"
    )
    assert patch.trailers["Patch-Name"] == ["say-where-the-all-gather-state-is-released"]
    assert check_base(load_pins(repo / "patches" / "pins.toml").get("0.18.2"), repo) == []


def test_a_conflict_without_a_resolution_is_reported_and_nothing_written(repo):
    """Without its stored resolution, a patch whose merge conflicts is reported with the file,
    the primary hunk and both sides, and the target is left as it was."""
    sdir = _sdir(repo, "core_r0.18.0")
    (sdir / RESOLUTIONS / "flex-dispatcher-state.diff").unlink()
    before = _snapshot(repo)
    ((result, written),) = port_all(["core_r0.18.0"], root=repo)
    assert not result.ok and written is None
    step = result.steps[-1]
    assert step.patch == "flex-dispatcher-state.patch"
    assert step.verdict == "conflict" and step.conflicts
    lines = "\n".join(report_lines(result))
    assert "megatron/core/transformer/moe/token_dispatcher.py:" in lines and "@@ -" in lines
    assert "        target:" in lines and "        primary:" in lines
    assert _snapshot(repo) == before


def test_port_cli_dry_run_reports_each_patch():
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "moe_release.py"), "port", "--dry-run",
         "--target", "0.18.2", "--patch", ALL_GATHER],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("core_r0.18.0 (megatron-core 0.18.2) -> patches/backports/core_r0.18.0:")
    assert f"  applied                          {ALL_GATHER}" in out
    assert "kept as it is" in out and "(dry run: nothing written)" in out


def test_a_stale_resolution_is_refused_naming_it(repo):
    """A resolution left behind for a patch the primary series no longer has (renamed or
    dropped) is an error naming its file, and nothing is written."""
    stale = _sdir(repo, "core_r0.18.0") / RESOLUTIONS / "renamed-long-ago.diff"
    stale.write_bytes(b"# stale\n")
    before = _snapshot(repo)
    try:
        port_all(["core_r0.18.0"], _mirror(), root=repo)
    except Exception as exc:  # UserError: one line for the CLI
        assert "renamed-long-ago.diff" in str(exc) and "no patch of patches/series" in str(exc)
    else:
        raise AssertionError("a stale resolution was accepted")
    assert _snapshot(repo) == before
