"""`moe_release.py apply`: the nearest series carried onto a Megatron-LM checkout at any commit,
on a synthetic Megatron-shaped git repository (tests/helpers/megatron_repo.py: main and dev
lines, one pinned base on each, a series for each), and once on the real mirror where it is at
hand (`sweep`, apply on every commit: test_sweep.py)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moe_release import settings
from moe_release.commands import cli
from moe_release.commands.apply import (
    choose_series,
    open_checkout,
    resolution_path,
    run_apply,
)
from moe_release.commands.check import check_base
from moe_release.commands.sweep import sweep
from moe_release.common import UserError
from moe_release.series.applying import APPLIED, CONFLICT, LANDED, NOT_APPLICABLE, REPLAYED
from moe_release.series.checkout import (
    LABEL_SUBJECT,
    build_checkout_trees,
    verify_checkout_install,
)
from moe_release.series.merge import Resolution, file_diff, has_markers, merge_file
from moe_release.series.pins import load_pins
from moe_release.series.source import CHECKOUT_ENV
from tests.helpers import REPO_ROOT
from tests.helpers.megatron_repo import (
    CLONED,
    DISPATCHER,
    FA,
    FUSED_PER_GROUP,
    P_BUFFER,
    P_RELEASE,
    P_STASH,
    PI,
    PS,
    RELEASE,
    STASH,
    TD,
    TD_MOVED,
    apply_at,
    commit_files,
    git_in,
    repo_state,
    sweep_codes,
    verdicts,
)


def test_a_clean_apply_commits_each_patch_on_a_new_branch(mlm):
    """At a main commit older than main's base whose code around the hunks is the base's, every
    patch merges; each is its own commit with its message and trailers on a new branch; HEAD,
    the index and the work tree are untouched."""
    m, c, repo = mlm
    before = repo_state(m)
    co, result, done = apply_at(m, c[4], repo)
    assert result.ok and verdicts(result) == {P_STASH: APPLIED, P_RELEASE: APPLIED,
                                               P_BUFFER: APPLIED}  # fmt: skip
    assert result.choice.base.name == f"main-{c['B'][:7]}"
    assert result.choice.why.startswith(f"REF is on main (main {c['B'][:12]} is 1 commit (31 "
                                        f"days) after it); main-{c['B'][:7]} (main ")  # fmt: skip
    assert "is the nearest: 2 lines differ from REF in the 3 files the series change" in (
        result.choice.why)  # fmt: skip
    branch = f"moe-release/{c[4][:12]}"
    assert done[0].startswith(f"branch {branch} at ")
    log = git_in(m, "log", "--format=%s%n%b%x00", f"{c[4]}..{branch}").split("\0")
    subjects = [entry.strip().splitlines()[0] for entry in log if entry.strip()]
    assert subjects[0].startswith("moe-release: label the build megatron-core 0.20.0+moerelease.3.")
    assert subjects[1:] == ["[MoE] Keep one buffer per process group",
                        "[MoE] Release dispatcher state after combine",
                        "[MoE] Let the paged stash import without Triton"]  # fmt: skip
    assert all("Forwarded: no" in e and "Signed-off-by: Test" in e for e in log[1:] if e.strip())
    assert git_in(m, "show", f"{branch}:{TD}") == (
        DISPATCHER.replace("tokens * 1", "tokens.clone()").replace("return 12", "return 120")
        .replace("        return output\n", RELEASE + "        return output\n")
        .replace("= tokens.clone()\n", CLONED).rstrip("\n")
    )  # fmt: skip
    after = repo_state(m)
    assert after[1:] == before[1:]
    assert set(after[0].splitlines()) - set(before[0].splitlines()) == {
        f"refs/heads/{branch} {git_in(m, 'rev-parse', branch)}"
    }


def test_a_stored_resolution_is_replayed(mlm):
    """At c1 the release patch conflicts (main changed the line above its hunk since); a
    person's resolution stored under the series' apply/<commit12>/ is replayed, and the patch
    whose file c1 lacks is not applicable, with the commit that added the file as evidence."""
    m, c, repo = mlm
    before_td = git_in(m, "show", f"{c['B']}:{TD}").encode() + b"\n"
    theirs = before_td.replace(
        b"        return output\n", RELEASE.encode() + b"        return output\n"
    ).replace(b"= tokens.clone()\n", CLONED.encode())
    ours = DISPATCHER.encode()
    merged, n = merge_file(ours, before_td, theirs)
    assert n == 1
    resolved = DISPATCHER.replace("        return output\n", RELEASE + "        return output\n")
    co = open_checkout(m)
    path = resolution_path(choose_series(co, c[1], repo), c[1], P_RELEASE)
    path.parent.mkdir(parents=True)
    path.write_bytes(Resolution(file_diff(TD, merged, resolved.encode()), []).to_bytes(
        P_RELEASE, c[1][:12]))  # fmt: skip
    assert has_markers(merged) and b"<<<<<<< target" in path.read_bytes()
    co, result, done = apply_at(m, c[1], repo)
    assert result.ok, verdicts(result)
    assert verdicts(result) == {P_STASH: NOT_APPLICABLE, P_RELEASE: REPLAYED, P_BUFFER: APPLIED}
    stash = next(o for o in result.outcomes if o.patch == P_STASH)
    assert f"{PS}: not at REF; added later by {c[3][:12]} 2026-04-10 paged stash (#3)" in stash.note
    branch = f"moe-release/{c[1][:12]}"
    assert git_in(m, "show", f"{branch}:{TD}") + "\n" == resolved
    assert git_in(m, "rev-list", "--count", f"{c[1]}..{branch}") == "3"  # and the label


def _store_c1_resolution(m: Path, c: dict, repo: Path) -> tuple[Path, str]:
    """A person's resolution of the release patch at c1 (where it conflicts), stored."""
    before_td = git_in(m, "show", f"{c['B']}:{TD}").encode() + b"\n"
    theirs = before_td.replace(
        b"        return output\n", RELEASE.encode() + b"        return output\n"
    ).replace(b"= tokens.clone()\n", CLONED.encode())
    merged, n = merge_file(DISPATCHER.encode(), before_td, theirs)
    assert n == 1
    resolved = DISPATCHER.replace("        return output\n", RELEASE + "        return output\n")
    path = resolution_path(choose_series(open_checkout(m), c[1], repo), c[1], P_RELEASE)
    path.parent.mkdir(parents=True)
    path.write_bytes(Resolution(file_diff(TD, merged, resolved.encode()), []).to_bytes(
        P_RELEASE, c[1][:12]))  # fmt: skip
    return path, resolved


def test_a_new_subject_changes_one_line(mlm, monkeypatch):
    """A patch is named by its Patch-Name: trailer, never by its subject: rewording the subject
    of the release patch, which has a recorded resolution, changes that one line of the
    repository; check passes and apply replays the record, with the same verdicts."""
    m, c, repo = mlm
    _store_c1_resolution(m, c, repo)
    _, before, _ = run_apply(m, c[1], dry_run=True, root=repo)
    files = {p: p.read_bytes() for p in repo.rglob("*") if p.is_file()}
    path = repo / "patches" / "upstream" / "main" / P_RELEASE
    old = b"Subject: [MoE] Release dispatcher state after combine\n"
    new = b"Subject: [MoE] Drop the routing state once combine is done\n"
    assert old in files[path]
    path.write_bytes(files[path].replace(old, new, 1))
    changed = [p for p in repo.rglob("*") if p.is_file() and p.read_bytes() != files.get(p)]
    assert changed == [path]
    lines = set(files[path].splitlines()) ^ set(path.read_bytes().splitlines())
    assert lines == {old.rstrip(), new.rstrip()}
    monkeypatch.setenv(CHECKOUT_ENV, str(m))
    pins = load_pins(repo / "patches" / "pins.toml")
    assert check_base(pins.get(f"main-{c['B'][:7]}"), repo) == []
    _, after, _ = run_apply(m, c[1], dry_run=True, root=repo)
    assert [(o.patch, o.verdict, o.note) for o in after.outcomes] == [
        (o.patch, o.verdict, o.note) for o in before.outcomes
    ]
    assert verdicts(after)[P_RELEASE] == REPLAYED


def test_one_record_serves_the_commits_after_it(mlm, capsys):
    """A resolution recorded at c1 is replayed at d0, which descends from c1 and conflicts the
    same way (one record per era, not per commit); at c2, where the merge is clean, it is not
    replayed; a record at d0 from apply's branch stores nothing; the label names the record
    and verify recomputes it."""
    m, c, repo = mlm
    path, resolved = _store_c1_resolution(m, c, repo)
    series = f"main-{c['B'][:7]}"
    _, plain, _ = apply_at(m, c["d0"], repo, series_name=series, dry_run=True)
    path.rename(path.with_suffix(".off"))  # without the record: the same conflict as c1's
    _, without, _ = apply_at(m, c["d0"], repo, series_name=series, dry_run=True)
    path.with_suffix(".off").rename(path)
    assert verdicts(without)[P_RELEASE] == CONFLICT
    assert verdicts(plain)[P_RELEASE] == REPLAYED
    co, result, _ = apply_at(m, c["d0"], repo, series_name=series)
    release = next(o for o in result.outcomes if o.patch == P_RELEASE)
    assert release.verdict == REPLAYED
    assert release.note == f"recorded at {c[1][:12]} for the same conflict"
    branch = f"moe-release/{c['d0'][:12]}"
    assert git_in(m, "show", f"{branch}:{TD}") + "\n" == resolved
    manifest = json.loads(git_in(m, "show", f"{branch}:megatron/core/_moe_release_manifest.json"))
    assert manifest["base"]["resolutions"] == [f"{c[1][:12]}/{path.name}"]
    installed = m.parent / "installed"
    installed.mkdir()
    archive = subprocess.run(["git", "-C", str(m), "archive", branch, "megatron"],
                             capture_output=True, check=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(installed)], input=archive, check=True)
    core = installed / "megatron" / "core"
    assert verify_checkout_install(core, manifest["version"], manifest, root=repo) == []
    path.write_bytes(path.read_bytes().replace(b"self.probs = None", b"self.probs = 0"))
    assert any(
        p.startswith("built from another series")
        for p in verify_checkout_install(core, manifest["version"], manifest, root=repo)
    )
    path.write_bytes(path.read_bytes().replace(b"self.probs = 0", b"self.probs = None"))
    # Recorded at d0 from apply's branch: the era's record gives the same, nothing is stored.
    assert cli.main(["apply", str(m), "--ref", c["d0"], "--series", series,
                     "--record", branch]) == 0  # fmt: skip
    assert capsys.readouterr().out.endswith("\nunchanged\n")
    assert not (path.parent.parent / c["d0"][:12]).exists()
    # c2 descends from c1 too, but merges cleanly: the record is not replayed there.
    _, clean, _ = apply_at(m, c[2], repo, dry_run=True)
    assert verdicts(clean)[P_RELEASE] == APPLIED


def test_record_stores_what_a_person_resolved(mlm, capsys):
    """`apply --record RESOLVED`: a person resolves at c1 with git (a commit per patch to
    apply, here the conflicting one resolved by hand and the clean one as it merges); per patch
    the difference from the 3-way merge is stored, only where there is one, and apply then
    replays it: the branch is RESOLVED's tree. The checkout is only read."""
    m, c, repo = mlm
    git_in(m, "checkout", "--quiet", "-b", "resolved", c[1])
    resolved = DISPATCHER.replace("        return output\n", RELEASE + "        return output\n")
    commit_files(m, "2026-12-01T12:00:00+00:00", "release, resolved", {TD: resolved})
    commit_files(m, "2026-12-01T12:00:00+00:00", "buffers", {FA: FUSED_PER_GROUP})
    git_in(m, "checkout", "--quiet", "main")
    before = repo_state(m)
    sdir = repo / "patches" / "upstream" / "main"
    kept = set((sdir / "apply").rglob("*"))  # resolutions the repository stores for real pins
    assert cli.main(["apply", str(m), "--ref", c[1], "--record", "resolved"]) == 0
    out = capsys.readouterr().out
    stored = sorted(
        p.relative_to(sdir) for p in (sdir / "apply").rglob("*") if p.is_file() and p not in kept
    )
    assert stored == [Path(f"apply/{c[1][:12]}/flex-dispatcher-state.diff")]
    assert f"written: patches/upstream/main/{stored[0]}" in out
    data = (sdir / stored[0]).read_bytes()
    assert data.startswith(b"# Resolution of " + P_RELEASE.encode() + b" at " + c[1].encode())
    assert b"-<<<<<<< target\n" in data and b"-        output " + CLONED.encode() in data
    assert repo_state(m) == before
    _, result, _ = apply_at(m, c[1], repo)
    assert verdicts(result) == {P_STASH: NOT_APPLICABLE, P_RELEASE: REPLAYED, P_BUFFER: APPLIED}
    assert git_in(m, "rev-parse", f"moe-release/{c[1][:12]}~1^{{tree}}") == git_in(
        m, "rev-parse", "resolved^{tree}"
    )  # fmt: skip (~1: below the label commit)
    # Recorded again from the branch apply made: the same resolution, nothing written.
    git_in(m, "branch", "again", f"moe-release/{c[1][:12]}")
    assert cli.main(["apply", str(m), "--ref", c[1], "--record", "again"]) == 0
    assert capsys.readouterr().out.endswith("\nunchanged\n")
    assert (sdir / stored[0]).read_bytes() == data
    # At c2, where the patch merges cleanly, a stale resolution is deleted by a record.
    apply_at(m, c[2], repo)
    stale = sdir / "apply" / c[2][:12] / stored[0].name
    stale.parent.mkdir()
    stale.write_bytes(data)
    assert cli.main(["apply", str(m), "--ref", c[2], "--record", f"moe-release/{c[2][:12]}"]) == 0
    assert f"deleted: patches/upstream/main/apply/{c[2][:12]}/" in capsys.readouterr().out
    assert not stale.parent.exists()
    git_in(m, "branch", "short", f"{c[1]}")
    assert cli.main(["apply", str(m), "--ref", c[1], "--record", "short"]) == 2
    assert "0 series commit(s) on REF, but " + P_RELEASE in capsys.readouterr().err


def test_resolve_leaves_each_conflict_in_a_work_tree_for_a_person(mlm, tmp_path, capsys):
    """`apply --resolve DIR` at c1: a work tree on moe-release/<c1>-resolve stops at the release
    patch's conflict with the 3-way merge (markers) in DIR and its message ready; once the
    person commits the resolution, the same command commits the rest; --record then stores it
    and apply replays it. The checkout's HEAD, index and work tree stay as they were."""
    m, c, repo = mlm
    before = repo_state(m)
    wt = tmp_path / "resolve"
    branch = f"moe-release/{c[1][:12]}-resolve"
    assert cli.main(["apply", str(m), "--ref", c[1], "--resolve", str(wt)]) == 1
    out = capsys.readouterr().out
    assert f"work tree {wt} on new branch {branch} at {c[1][:12]}" in out
    assert f"CONFLICT in {P_RELEASE}:" in out and f"  {TD}:" in out
    text = (wt / TD).read_text()
    assert "        self.probs = None\n" in text
    # diff3 markers: REF's side, the series' base, the series' side, each named.
    assert f"<<<<<<< REF {c[1][:12]}\n        output = tokens * 1\n" in text
    assert (
        f"||||||| the series' base (main-{c['B'][:7]})\n        output = tokens.clone()\n" in text
    )
    assert (
        f"=======\n        output {CLONED}" in text and f">>>>>>> the series ({P_RELEASE})" in text
    )
    msg = Path(re.search(r"commit -a -F (\S+)`", out).group(1))
    assert msg.read_text().startswith("[MoE] Release dispatcher state after combine\n\nBody.")
    assert git_in(m, "rev-list", "--count", f"{c[1]}..{branch}") == "0"  # the stash: n/a at c1
    # Run again before resolving: refused, nothing changed.
    assert cli.main(["apply", str(m), "--ref", c[1], "--resolve", str(wt)]) == 2
    assert "uncommitted changes" in capsys.readouterr().err
    resolved = DISPATCHER.replace("        return output\n", RELEASE + "        return output\n")
    (wt / TD).write_text(resolved)
    git_in(wt, "commit", "--quiet", "-a", "-F", str(msg))
    assert cli.main(["apply", str(m), "--ref", c[1], "--resolve", str(wt)]) == 0
    out = capsys.readouterr().out
    assert f"committed {P_BUFFER}" in out and f"--record {branch}" in out
    # The finished branch is labelled as apply labels its own: pip install builds the series.
    assert "labelled: pip install of the branch builds megatron-core 0.20.0+moerelease.2." in out
    subjects = git_in(m, "log", "--format=%s", f"{c[1]}..{branch}").splitlines()
    assert subjects[0].startswith(LABEL_SUBJECT + "0.20.0+moerelease.2.")
    assert subjects[1:] == ["[MoE] Keep one buffer per process group",
                            "[MoE] Release dispatcher state after combine"]  # fmt: skip
    assert "_moe_release_manifest.json" in git_in(m, "show", "--name-only", "--format=", branch)
    assert cli.main(["apply", str(m), "--ref", c[1], "--resolve", str(wt)]) == 0  # once only
    assert "labelled" not in capsys.readouterr().out
    assert git_in(m, "rev-list", "--count", f"{c[1]}..{branch}") == "3"
    assert cli.main(["apply", str(m), "--ref", c[1], "--record", branch]) == 0
    capsys.readouterr()
    _, result, _ = apply_at(m, c[1], repo)
    assert verdicts(result)[P_RELEASE] == REPLAYED
    assert git_in(m, "rev-parse", f"moe-release/{c[1][:12]}~1^{{tree}}") == git_in(
        m, "rev-parse", f"{branch}~1^{{tree}}")  # fmt: skip
    after = repo_state(m)
    assert after[1:4] == before[1:4]  # HEAD, its ref, the index
    assert after[5] == before[5]  # the checkout's files (the work tree DIR is elsewhere)


def test_record_keeps_a_fix_in_a_file_no_patch_touches(mlm, capsys):
    """A person's commit may fix, with a patch, a file no patch of the series touches (the fix
    the series lacks at REF): --record stores it and apply replays it."""
    m, c, repo = mlm
    apply_at(m, c[2], repo, branch="plain", label=False)
    git_in(m, "checkout", "--quiet", "-b", "fixed", f"{c[2]}")
    for sha in git_in(m, "rev-list", "--reverse", f"{c[2]}..plain").split():
        git_in(m, "cherry-pick", "--quiet", sha)
        if git_in(m, "log", "-1", "--format=%s").endswith("after combine"):
            (m / "megatron/core/__init__.py").write_text("FIXED = True\n")
            git_in(m, "commit", "--quiet", "-a", "--amend", "--no-edit")
    git_in(m, "checkout", "--quiet", "main")
    assert cli.main(["apply", str(m), "--ref", c[2], "--record", "fixed"]) == 0
    assert "flex-dispatcher-state.diff" in capsys.readouterr().out
    _, result, _ = apply_at(m, c[2], repo)
    assert verdicts(result)[P_RELEASE] == REPLAYED
    assert git_in(m, "show", f"moe-release/{c[2][:12]}:megatron/core/__init__.py") == "FIXED = True"


def test_a_conflict_is_reported_and_nothing_changes(mlm, capsys, monkeypatch):
    """Without a stored resolution the same merge is a conflict: file, line, the patch's hunk,
    both sides and where the resolution would go; exit 1, refs, HEAD, index and work tree as
    before, and the patches after it are still merged and reported."""
    m, c, repo = mlm
    before = repo_state(m)
    assert cli.main(["apply", str(m), "--ref", c[1]]) == 1
    out = capsys.readouterr().out
    assert f"  {CONFLICT:30} {P_RELEASE}" in out
    assert re.search(rf"      {TD}:\d+ \(@@ -\d+,\d+ \+\d+,\d+ @@", out)
    assert "        REF:\n          |         output = tokens * 1\n" in out
    assert "        series:\n          |         output " + CLONED in out
    assert (f"needs a stored resolution: patches/upstream/main/apply/{c[1][:12]}/"
            "flex-dispatcher-state.diff") in out  # fmt: skip
    assert f"  {APPLIED:30} {P_BUFFER}" in out
    assert "CONFLICT: nothing written" in out
    assert repo_state(m) == before


def test_a_patch_already_upstream_is_landed(mlm):
    """At c5, a main commit after main's base in which upstream took the per-group buffer
    change, that patch is landed (not committed again) and the others apply."""
    m, c, repo = mlm
    co, result, _ = apply_at(m, c[5], repo)
    assert verdicts(result) == {P_STASH: APPLIED, P_RELEASE: APPLIED, P_BUFFER: LANDED}
    assert "is 1 commit (30 days) before it" in result.choice.why
    assert git_in(m, "rev-list", "--count", f"{c[5]}..moe-release/{c[5][:12]}") == "3"


def test_a_file_moved_since_the_base_is_merged_where_REF_has_it(mlm):
    """At c6, which moved token_dispatcher.py after main's base, the release patch is merged
    into the file at its new path (git's rename detection between the base and REF)."""
    m, c, repo = mlm
    _, result, _ = apply_at(m, c[6], repo)
    assert verdicts(result) == {P_STASH: APPLIED, P_RELEASE: APPLIED, P_BUFFER: LANDED}
    release = next(o for o in result.outcomes if o.patch == P_RELEASE)
    assert release.note == f"{TD} merged as {TD_MOVED}"
    branch = f"moe-release/{c[6][:12]}"
    assert RELEASE in git_in(m, "show", f"{branch}:{TD_MOVED}") + "\n"
    assert git_in(m, "diff", "--name-only", c[6], f"{branch}~1").split() == sorted([PS, TD_MOVED])


def test_a_stale_clone_finds_the_bases_in_the_mirror(mlm, tmp_path):
    """A clone that has not fetched main's and dev's bases (here: the feature branch only)
    is told so; with --mirror the ancestry and the base's files come from the mirror too, and
    the branch made in the clone is the one a full clone gets."""
    m, c, repo = mlm
    stale = tmp_path / "stale"
    git_in(tmp_path, "clone", "--quiet", "--single-branch", "--branch", "feature",
         f"file://{m}", str(stale))  # fmt: skip
    with pytest.raises(UserError, match="holds none of the stored bases"):
        run_apply(stale, c[4], root=repo, dry_run=True)
    before = repo_state(stale)
    _, result, _ = run_apply(stale, c[4], root=repo, mirror=m)
    assert result.ok and result.choice.base.name == f"main-{c['B'][:7]}"
    assert not {f"main-{c['B'][:7]}", f"dev-{c['D'][:7]}"} & set(result.choice.missing)
    after = repo_state(stale)
    assert after[1:] == before[1:]
    apply_at(m, c[4], repo)
    branch = f"moe-release/{c[4][:12]}"
    assert git_in(stale, "rev-parse", branch) == git_in(m, "rev-parse", branch)


def test_a_dev_commit_takes_the_dev_series(mlm):
    """A commit on dev's first-parent history takes dev's series; main's c1, on dev's history
    only from before dev left main, stays main's."""
    m, c, repo = mlm
    co, result, _ = apply_at(m, c["d1"], repo, dry_run=True)
    assert result.choice.base.name == f"dev-{c['D'][:7]}" and result.ok
    assert verdicts(result) == {P_RELEASE: APPLIED}
    assert choose_series(open_checkout(m), c[1], repo).base.branch == "main"


def test_the_nearest_series_is_the_one_whose_code_is_nearest(mlm):
    """d0, on dev two commits before dev's base, still has main's code in the files the series
    change (dev changed them later): main's series is the nearest, as the report says;
    --series takes dev's, which merges there too."""
    m, c, repo = mlm
    co = open_checkout(m)
    choice = choose_series(co, c["d0"], repo)
    assert choice.line == "dev" and choice.base.name == f"main-{c['B'][:7]}"
    assert choice.why.startswith(f"REF is on dev (dev {c['D'][:12]} is 2 commits (66 days) after")
    assert choice.candidates == [f"dev-{c['D'][:7]} (12 lines, 2 commits)"]
    _, result, _ = apply_at(m, c["d0"], repo, dry_run=True, series_name=f"dev-{c['D'][:7]}")
    assert result.ok and verdicts(result) == {P_RELEASE: APPLIED}
    assert "is as --series says: 12 lines differ" in result.choice.why
    with pytest.raises(UserError, match="--series 0.18.2: not a stored base this checkout holds"):
        choose_series(co, c["d0"], repo, "0.18.2")


def test_out_files_git_am_3_in_a_full_clone(mlm, tmp_path):
    """--out writes format-patch --full-index files whose index lines name REF's blobs (so
    git am -3 can fall back), and git am -3 in a full clone at REF gives the branch's tree."""
    m, c, repo = mlm
    out = tmp_path / "out"
    before = repo_state(m)
    co, result, done = apply_at(m, c[2], repo, out_dir=out)
    assert result.ok and repo_state(m) == before
    files = sorted(out.iterdir())
    assert [f.name[:5] for f in files] == ["0001-", "0002-", "0003-"]  # 0003: the label
    pre = [re.findall(r"diff --git a/(\S+) .*\nindex ([0-9a-f]{40})\.\.", f.read_text())
           for f in files]  # fmt: skip
    assert [[p for p, _ in each] for each in pre] == [[TD], [FA], [PI]]
    for path, blob in (pair for each in pre for pair in each):
        assert blob == git_in(m, "rev-parse", f"{c[2]}:{path}")
    clone = tmp_path / "clone"
    git_in(tmp_path, "clone", "--quiet", str(m), str(clone))
    git_in(clone, "checkout", "--quiet", "--detach", c[2])
    git_in(clone, "am", "-3", "--quiet", *map(str, files))
    with pytest.raises(UserError, match="already has the series: its history has "):
        run_apply(clone, root=repo, dry_run=True)  # git am dropped the [MoE] prefix
    _, again, _ = apply_at(m, c[2], repo)
    assert git_in(clone, "rev-parse", "HEAD^{tree}") == git_in(
        m, "rev-parse", f"moe-release/{c[2][:12]}^{{tree}}")  # fmt: skip


@pytest.mark.parametrize("case", ["not-git", "dirty", "unknown-ref", "no-line", "too-old",
                                  "has-series", "branch-exists"])  # fmt: skip
def test_bad_input_is_one_line_exit_2_nothing_changed(mlm, tmp_path, capsys, case):
    m, c, repo = mlm
    args, want = ["apply", str(m)], ""
    if case == "not-git":
        (tmp_path / "plain").mkdir()
        args, want = ["apply", str(tmp_path / "plain")], "not a git checkout"
    elif case == "dirty":
        (m / FA).write_text("changed\n")
        want = "work tree not clean (1 changed file(s), first: " + FA
    elif case == "unknown-ref":
        args, want = args + ["--ref", "no-such-ref"], "unknown ref 'no-such-ref'"
    elif case == "no-line":
        args, want = args + ["--ref", c["side"]], "is on no known line"
    elif case == "too-old":
        args, want = args + ["--ref", c[0]], "is older than every series"
    elif case == "has-series":
        apply_at(m, c[4], repo)
        git_in(m, "checkout", "--quiet", f"moe-release/{c[4][:12]}")
        want = "HEAD already has the series: its history has "
    elif case == "branch-exists":
        git_in(m, "branch", "mine", c[4])
        args, want = args + ["--ref", c[4], "--branch", "mine"], "branch mine exists"
    before = repo_state(m) if case != "not-git" else None
    capsys.readouterr()
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moe_release.py apply: error: "), err
    assert want in err, err
    if before is not None:
        assert repo_state(m) == before


def test_a_user_finds_the_way(mlm, tmp_path, capsys):
    """A dirty work tree does not block --dry-run (nothing is written); a git repository that
    is not Megatron-LM is told so, not to fetch; a typo of a verb or a flag is answered with
    the closest known one."""
    m, c, repo = mlm
    (m / FA).write_text("changed\n")
    _, result, done = apply_at(m, c[4], repo, dry_run=True)
    assert result.ok and done == ["(dry run: nothing written)"]
    other = tmp_path / "other"
    other.mkdir()
    git_in(other, "init", "--quiet")
    commit_files(other, "2026-06-01T12:00:00+00:00", "x", {"megatron/core/__init__.py": ""})
    assert cli.main(["apply", str(other), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "is not a Megatron-LM commit (no megatron/core/package_info.py)" in err, err
    assert "fetch" not in err
    for argv, hint in ((["aply", str(m)], "did you mean apply?"),
                       (["apply", str(m), "--dryrun"], "did you mean --dry-run?")):  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 2 and hint in capsys.readouterr().err


def test_apply_help():
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "moe_release.py"), "apply", "--help"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0 and "--dry-run" in done.stdout and "--out DIR" in done.stdout


@pytest.mark.needs_env(CHECKOUT_ENV)
def test_on_the_mirror_each_pinned_commit_takes_its_own_series():
    """On the real mirror, each pinned commit is its own series' base: every patch applies."""
    mirror = Path(settings.megatron_lm())
    co = open_checkout(mirror)
    for ref, series in (("d98e8a6", "patches/upstream/main"), ("d48bd6b", "patches/upstream/dev")):
        try:
            _, result, _ = run_apply(mirror, ref, dry_run=True)
        except UserError as exc:
            pytest.fail(str(exc))
        assert result.choice.base.series == series and result.ok
        assert {o.verdict for o in result.outcomes} == {APPLIED}, co.describe(ref)


@pytest.mark.needs_env(CHECKOUT_ENV)
def test_on_the_mirror_a_new_subject_keeps_the_recorded_resolution(repo):
    """On the real mirror and a copy of this repository: rewording the subject of
    core_r0.17.0's flex-dispatcher-state (recorded at 83e7466c60e2) changes one line; check
    passes on 0.17.1 and apply at that commit still replays the record."""
    mirror = Path(settings.megatron_lm())
    _, before, _ = run_apply(mirror, "83e7466c60e2", dry_run=True, root=repo)
    path = repo / "patches" / "backports" / "core_r0.17.0" / "flex-dispatcher-state.patch"
    data = path.read_bytes()
    old = b"Subject: cp: `fix(moe): release flex dispatcher state after combine` into\n"
    new = b"Subject: cp: `fix(moe): drop the flex dispatcher's routing state` into\n"
    assert old in data
    path.write_bytes(data.replace(old, new, 1))
    assert set(data.splitlines()) ^ set(path.read_bytes().splitlines()) == {
        old.rstrip(),
        new.rstrip(),
    }
    assert check_base(load_pins(repo / "patches" / "pins.toml").get("0.17.1"), repo) == []
    _, after, _ = run_apply(mirror, "83e7466c60e2", dry_run=True, root=repo)
    assert [(o.patch, o.verdict, o.note) for o in after.outcomes] == [
        (o.patch, o.verdict, o.note) for o in before.outcomes
    ]
    assert verdicts(after)["flex-dispatcher-state.patch"] == REPLAYED


def test_a_record_serves_every_commit_with_the_same_conflict(mlm):
    """A resolution recorded at dev's d0 (the same conflict as main's c1, which d0 descends
    from) is replayed at c1 too, before the commit it was recorded at: records are keyed by
    the conflict, the commit is their provenance."""
    m, c, repo = mlm
    path, resolved = _store_c1_resolution(m, c, repo)
    at_d0 = path.parent.parent / c["d0"][:12] / path.name
    at_d0.parent.mkdir()
    path.rename(at_d0)
    path.parent.rmdir()
    _, result, _ = run_apply(m, c[1], dry_run=True, root=repo)
    release = next(o for o in result.outcomes if o.patch == P_RELEASE)
    assert (release.verdict, release.note) == (REPLAYED, f"recorded at {c['d0'][:12]} for the "
                                               "same conflict")  # fmt: skip
    rows, _ = sweep(open_checkout(m), root=repo)
    assert {r.commit: r.codes for r in rows}[c[1]] == sweep_codes(result)
    # A record whose conflict is not this merge's is never replayed: broken, c1 conflicts.
    at_d0.write_bytes(at_d0.read_bytes().replace(b"-=======", b"-======="[:-1]))
    _, result, _ = run_apply(m, c[1], dry_run=True, root=repo)
    assert {o.patch: o.verdict for o in result.outcomes}[P_RELEASE] == CONFLICT


def test_a_clean_merge_that_fails_a_probe_stops_and_resolve_says_what_to_fix(mlm, tmp_path, capsys):
    """At c7 main imports Triton through a new ops module, at the end of the paged stash, far
    from the `import triton` the series guards: the merge is clean but the stash still needs
    Triton (series.probes). No other series has a stash patch, so apply stops with the probe's
    line and writes nothing; --resolve commits every patch and then names what is left to fix,
    and once the person has fixed it, says to --record the branch."""
    m, c, repo = mlm
    ops = "megatron/core/transformer/moe/ops/paged_stash.py"
    tail = (
        "\n\nX = 1\nY = 2\nZ = 3\n\nfrom megatron.core.transformer.moe.ops.paged_stash import K\n"
    )
    c7 = commit_files(m, "2026-07-20T12:00:00+00:00", "stash kernels in ops (#8)",
                 {PS: STASH + tail, ops: "import triton\n\nK = 1\n"})  # fmt: skip
    before = repo_state(m)
    assert cli.main(["apply", str(m), "--ref", c7]) == 1
    out = capsys.readouterr().out
    assert f"{P_STASH} (merged cleanly, but {PS}:13 imports megatron.core.transformer.moe.ops." \
           f"paged_stash outside a try, and {ops} imports triton)" in out  # fmt: skip
    assert "no stored series has a patch that merges right here" in out
    assert repo_state(m) == before
    wt = tmp_path / "resolve"
    assert cli.main(["apply", str(m), "--ref", c7, "--resolve", str(wt)]) == 1
    out = capsys.readouterr().out
    assert f"committed {P_STASH}" in out
    assert f"the result merges, but {PS}:13 imports" in out and "(cpu-import/triton)" in out
    assert f"fix that in {wt} and commit it" in out
    fixed = (wt / PS).read_text().replace(
        "from megatron.core.transformer.moe.ops.paged_stash import K\n",
        "try:\n    from megatron.core.transformer.moe.ops.paged_stash import K\n"
        "except ImportError:\n    K = None\n")  # fmt: skip
    (wt / PS).write_text(fixed)
    git_in(wt, "commit", "--quiet", "-a", "-m", "guard the ops import")
    fix = git_in(wt, "rev-parse", "HEAD")
    assert cli.main(["apply", str(m), "--ref", c7, "--resolve", str(wt)]) == 0
    branch = f"moe-release/{c7[:12]}-resolve"
    assert f"--record {branch}" in capsys.readouterr().out
    # The tests of the branch: the series commits are found by their trailer; the person's
    # fix is neither the unpatched commit nor a patch. The README's branch name, before apply
    # made it, points at the one --resolve made; no --ref (HEAD: main) says so.
    trees = build_checkout_trees(open_checkout(m), branch, None, root=repo)
    assert (trees.base_commit, trees.series_commits) == (c7, 2)
    assert trees.source.endswith("+ 2 series commits + 1 of yours")
    with pytest.raises(UserError, match=f"unknown ref 'moe-release/{c7[:12]}'.*{branch}"):
        build_checkout_trees(open_checkout(m), f"moe-release/{c7[:12]}", None, root=repo)
    with pytest.raises(UserError, match=f"HEAD \\(no --ref given\\).*--ref.*{branch}"):
        build_checkout_trees(open_checkout(m), None, None, root=repo)
    # --record keeps the fix: folded into the resolution of the patch whose file it changes.
    assert cli.main(["apply", str(m), "--ref", c7, "--record", branch]) == 0
    out = capsys.readouterr().out
    assert (f'folded: {fix[:12]} ("guard the ops import") into the resolution of {P_STASH}, '
            "which changes its files") in out  # fmt: skip
    _, result, _ = apply_at(m, c7, repo)
    assert result.ok and verdicts(result)[P_STASH] == REPLAYED
    assert git_in(m, "rev-parse", f"moe-release/{c7[:12]}~1^{{tree}}") == git_in(
        m, "rev-parse", f"{branch}~1^{{tree}}")  # fmt: skip
    plain = build_checkout_trees(open_checkout(m), f"moe-release/{c7[:12]}", None, root=repo)
    assert (plain.base_commit, plain.series_commits) == (c7, 2)
