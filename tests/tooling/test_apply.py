"""`moe_release.py apply`: the nearest series carried onto a Megatron-LM checkout at any commit,
on a synthetic Megatron-shaped git repository built here (main and dev lines, one pinned base
on each, a series for each), and once on the real mirror where it is at hand; and `sweep`,
apply --dry-run on every first-parent commit of main and dev, each row checked against apply."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import AUTHOR, REPO_ROOT, trailers

from moe_release import settings
from moe_release.commands import apply as apply_mod
from moe_release.commands import cli
from moe_release.commands.apply import (
    choose_series,
    open_checkout,
    resolution_path,
    run_apply,
)
from moe_release.commands.check import check_base
from moe_release.commands.sweep import BORROWED, CODES, SETTLED, summary_lines, sweep
from moe_release.common import UserError
from moe_release.series.applying import APPLIED, CONFLICT, LANDED, NOT_APPLICABLE, REPLAYED
from moe_release.series.checkout import (
    LABEL_SUBJECT,
    build_checkout_trees,
    verify_checkout_install,
)
from moe_release.series.git import format_patches, git, git_env
from moe_release.series.merge import Resolution, file_diff, has_markers, merge_file
from moe_release.series.pins import load_pins
from moe_release.series.source import CHECKOUT_ENV

TD = "megatron/core/transformer/moe/token_dispatcher.py"
FA = "megatron/core/transformer/moe/fused_a2a.py"
PS = "megatron/core/transformer/moe/paged_stash.py"
PI = "megatron/core/package_info.py"
TD_MOVED = "megatron/core/transformer/moe/dispatchers/token_dispatcher.py"
PACKAGE_INFO = "MAJOR = 0\nMINOR = 20\nPATCH = 0\nPRE_RELEASE = ''\n"
HELPERS = "".join(f"\n\ndef helper_{i}():\n    return {i}\n" for i in range(1, 13))
DISPATCHER = (
    '''"""Token dispatchers."""


class MoETokenDispatcher:
    """Base."""

    def __init__(self, config):
        self.config = config
        self.routing_map = None
        self.probs = None

    def dispatch(self, tokens, routing_map, probs):
        self.routing_map = routing_map
        self.probs = probs
        return tokens

    def combine(self, tokens):
        output = tokens * 1
        return output
'''
    + HELPERS
)
FUSED = '''"""Fused all-to-all."""

_buffer = None


def get_buffer(group):
    global _buffer
    if _buffer is None:
        _buffer = object()
    return _buffer
'''
FUSED_PER_GROUP = '''"""Fused all-to-all."""

_buffer = None
_buffers = {}


def get_buffer(group):
    global _buffer
    if group not in _buffers:
        _buffers[group] = object()
    _buffer = _buffers[group]
    return _buffer
'''
STASH = '"""Paged stash."""\n\nimport triton\n'
STASH_CPU = (
    '"""Paged stash."""\n\ntry:\n    import triton\nexcept ImportError:\n    triton = None\n'
)
# dev's code: further from main's than main's commits are from each other (5 helpers changed)
DEV_TD = DISPATCHER
for _i in range(3, 8):
    DEV_TD = DEV_TD.replace(f"return {_i}\n", f"return {_i}{_i}\n")
RELEASE = "        self.routing_map = None\n        self.probs = None\n"
CLONED = "= tokens.clone()  # the state is released below\n"
P_STASH = "cpu-import.patch"
P_RELEASE = "flex-dispatcher-state.patch"
P_BUFFER = "hybridep-buffer-per-group.patch"
# The synthetic patches' subjects and the primary patches whose names they carry.
NAMES = {
    "[MoE] Let the paged stash import without Triton": "cpu-import",
    "[MoE] Release dispatcher state after combine": "flex-dispatcher-state",
    "[MoE] Keep one buffer per process group": "hybridep-buffer-per-group",
}


def _git(repo: Path, *args: str, date: str = "2026-06-01T12:00:00+00:00") -> str:
    env = git_env(dict(AUTHOR, GIT_AUTHOR_DATE=date, GIT_COMMITTER_DATE=date))
    return git(repo, *args, env=env).decode().strip()


def _commit(repo: Path, date: str, msg: str, files: dict) -> str:
    for rel, text in files.items():
        path = repo / rel
        if text is None:
            path.unlink()
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    _git(repo, "add", "--all")
    _git(repo, "commit", "--quiet", "-m", msg, date=date)
    return _git(repo, "rev-parse", "HEAD")


def _series(work: Path, base: str, changes: list) -> list:
    """The series (file name, mbox) of ``changes`` (subject, files) made on ``base``, each patch
    named as the primary patch it stands for (:data:`NAMES`)."""
    _git(work, "checkout", "--quiet", "--detach", base)
    _git(work, "tag", "-f", "base", base)
    for subject, files in changes:
        msg = f"{subject}\n\nBody.\n\n{trailers(NAMES[subject])}"
        _commit(work, "2026-11-29T12:00:00+00:00", msg, files)
    out = format_patches(work)
    _git(work, "checkout", "--quiet", "main")
    return out


def _snapshot(repo: Path) -> tuple:
    """What a failed apply must leave as it was: refs, HEAD, index and work tree."""
    return (
        _git(repo, "for-each-ref", "--format=%(refname) %(objectname)"),
        _git(repo, "rev-parse", "HEAD"),
        _git(repo, "symbolic-ref", "-q", "HEAD"),
        _git(repo, "ls-files", "-s"),
        _git(repo, "status", "--porcelain"),
        {p: p.read_bytes() for p in repo.rglob("*.py")},
    )


@pytest.fixture
def mlm(tmp_path, repo, monkeypatch):
    """A Megatron-shaped repository (main: c0 .. c5, dev forked at c1) and the tooling's
    ``repo`` copy with main's and dev's pinned bases and series replaced by synthetic ones."""
    m = tmp_path / "Megatron-LM"
    m.mkdir()
    _git(m, "init", "--quiet", "--initial-branch=main")
    c = {}
    c[0] = _commit(m, "2026-01-10T12:00:00+00:00", "initial", {
        "megatron/core/__init__.py": "", "megatron/core/package_info.py": PACKAGE_INFO,
        TD: DISPATCHER, FA: FUSED})  # fmt: skip
    c[1] = _commit(m, "2026-03-02T12:00:00+00:00", "docs", {"README.md": "Megatron-LM\n"})
    c[2] = _commit(m, "2026-03-20T12:00:00+00:00", "combine clones (#2)",
                   {TD: DISPATCHER.replace("tokens * 1", "tokens.clone()")})  # fmt: skip
    c[3] = _commit(m, "2026-04-10T12:00:00+00:00", "paged stash (#3)", {PS: STASH})
    c[4] = _commit(m, "2026-05-01T12:00:00+00:00", "helper 12 (#4)", {TD: DISPATCHER.replace(
        "tokens * 1", "tokens.clone()").replace("return 12", "return 120")})  # fmt: skip
    td_b = DISPATCHER.replace("tokens * 1", "tokens.clone()").replace("return 12", "return 120")
    c["B"] = _commit(m, "2026-06-01T12:00:00+00:00", "helper 1 (#5)",
                     {TD: td_b.replace("return 1\n", "return 10\n")})  # fmt: skip
    c[5] = _commit(m, "2026-07-01T12:00:00+00:00", "buffer per group (#6)", {FA: FUSED_PER_GROUP})
    moved = _git(m, "show", f"{c[5]}:{TD}") + "\n"
    c[6] = _commit(m, "2026-07-10T12:00:00+00:00", "move the dispatchers (#7)",
                   {TD: None, TD_MOVED: moved})  # fmt: skip
    _git(m, "checkout", "--quiet", "-b", "dev", c[1])
    c["d0"] = _commit(m, "2026-03-05T12:00:00+00:00", "[dev] docs", {"README.md": "dev\n"})
    c["d1"] = _commit(m, "2026-03-10T12:00:00+00:00", "[dev] routing", {TD: DEV_TD})
    c["D"] = _commit(m, "2026-05-10T12:00:00+00:00", "[dev] more routing",
                     {TD: DEV_TD.replace("return 9\n", "return 99\n")})  # fmt: skip
    _git(m, "checkout", "--quiet", "-b", "feature", c[4])
    c["side"] = _commit(m, "2026-05-05T12:00:00+00:00", "wip", {"README.md": "wip\n"})
    _git(m, "checkout", "--quiet", "main")

    work = tmp_path / "work"
    _git(tmp_path, "clone", "--quiet", str(m), str(work))
    # The patch rewrites the line main changed at c2 (so that the merge at c1 and d0, before
    # c2, is a conflict a person resolves) and inserts the release below it.
    after_b = td_b.replace("return 1\n", "return 10\n").replace(
        "        return output\n", RELEASE + "        return output\n").replace(
        "= tokens.clone()\n", CLONED)  # fmt: skip
    main_series = _series(work, c["B"], [
        ("[MoE] Let the paged stash import without Triton", {PS: STASH_CPU}),
        ("[MoE] Release dispatcher state after combine", {TD: after_b}),
        ("[MoE] Keep one buffer per process group", {FA: FUSED_PER_GROUP})])  # fmt: skip
    assert [n for n, _ in main_series] == [P_STASH, P_RELEASE, P_BUFFER]
    dev_td = DEV_TD.replace("return 9\n", "return 99\n").replace(
        "        return output\n", RELEASE + "        return output\n")  # fmt: skip
    dev_series = _series(work, c["D"], [("[MoE] Release dispatcher state after combine",
                                         {TD: dev_td})])  # fmt: skip
    pins = (repo / "patches" / "pins.toml").read_text().split("\n[bases.\"main-")[0]
    for line, key, series in (("main", "B", main_series), ("dev", "D", dev_series)):
        tree = _git(m, "rev-parse", f"{c[key]}^{{tree}}")
        pins += (
            f'\n[bases."{line}-{c[key][:7]}"]\ncommit = "{c[key]}"\ntree = "{tree}"\n'
            f'version = "0.20.0"\nbranch = "{line}"\nseries = "patches/upstream/{line}"\n'
        )
        sdir = repo / "patches" / "upstream" / line
        for old in sdir.glob("*.patch"):
            old.unlink()
        (sdir / "series").write_text(f"# synthetic {line}\n" + "".join(f"{n}\n" for n, _ in series))
        for name, data in series:
            (sdir / name).write_bytes(data)
    (repo / "patches" / "pins.toml").write_text(pins)
    monkeypatch.setattr(apply_mod, "REPO_ROOT", repo)
    monkeypatch.delenv(CHECKOUT_ENV, raising=False)  # the real mirror is no --mirror here
    return m, c, repo


def _apply(m: Path, ref: str, repo: Path, **kw):
    return run_apply(m, ref, root=repo, **kw)


def _verdicts(result) -> dict:
    return {o.patch: o.verdict for o in result.outcomes}


def test_a_clean_apply_commits_each_patch_on_a_new_branch(mlm):
    """At a main commit older than main's base whose code around the hunks is the base's, every
    patch merges; each is its own commit with its message and trailers on a new branch; HEAD,
    the index and the work tree are untouched."""
    m, c, repo = mlm
    before = _snapshot(m)
    co, result, done = _apply(m, c[4], repo)
    assert result.ok and _verdicts(result) == {P_STASH: APPLIED, P_RELEASE: APPLIED,
                                               P_BUFFER: APPLIED}  # fmt: skip
    assert result.choice.base.name == f"main-{c['B'][:7]}"
    assert result.choice.why.startswith(f"REF is on main (main {c['B'][:12]} is 1 commit (31 "
                                        f"days) after it); main-{c['B'][:7]} (main ")  # fmt: skip
    assert "is the nearest: 2 lines differ from REF in the 3 files the series change" in (
        result.choice.why)  # fmt: skip
    branch = f"moe-release/{c[4][:12]}"
    assert done[0].startswith(f"branch {branch} at ")
    log = _git(m, "log", "--format=%s%n%b%x00", f"{c[4]}..{branch}").split("\0")
    subjects = [entry.strip().splitlines()[0] for entry in log if entry.strip()]
    assert subjects[0].startswith("moe-release: label the build megatron-core 0.20.0+moerelease.3.")
    assert subjects[1:] == ["[MoE] Keep one buffer per process group",
                        "[MoE] Release dispatcher state after combine",
                        "[MoE] Let the paged stash import without Triton"]  # fmt: skip
    assert all("Forwarded: no" in e and "Signed-off-by: Test" in e for e in log[1:] if e.strip())
    assert _git(m, "show", f"{branch}:{TD}") == (
        DISPATCHER.replace("tokens * 1", "tokens.clone()").replace("return 12", "return 120")
        .replace("        return output\n", RELEASE + "        return output\n")
        .replace("= tokens.clone()\n", CLONED).rstrip("\n")
    )  # fmt: skip
    after = _snapshot(m)
    assert after[1:] == before[1:]
    assert set(after[0].splitlines()) - set(before[0].splitlines()) == {
        f"refs/heads/{branch} {_git(m, 'rev-parse', branch)}"
    }


def test_a_stored_resolution_is_replayed(mlm):
    """At c1 the release patch conflicts (main changed the line above its hunk since); a
    person's resolution stored under the series' apply/<commit12>/ is replayed, and the patch
    whose file c1 lacks is not applicable, with the commit that added the file as evidence."""
    m, c, repo = mlm
    before_td = _git(m, "show", f"{c['B']}:{TD}").encode() + b"\n"
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
    co, result, done = _apply(m, c[1], repo)
    assert result.ok, _verdicts(result)
    assert _verdicts(result) == {P_STASH: NOT_APPLICABLE, P_RELEASE: REPLAYED, P_BUFFER: APPLIED}
    stash = next(o for o in result.outcomes if o.patch == P_STASH)
    assert f"{PS}: not at REF; added later by {c[3][:12]} 2026-04-10 paged stash (#3)" in stash.note
    branch = f"moe-release/{c[1][:12]}"
    assert _git(m, "show", f"{branch}:{TD}") + "\n" == resolved
    assert _git(m, "rev-list", "--count", f"{c[1]}..{branch}") == "3"  # and the label


def _store_c1_resolution(m: Path, c: dict, repo: Path) -> tuple[Path, str]:
    """A person's resolution of the release patch at c1 (where it conflicts), stored."""
    before_td = _git(m, "show", f"{c['B']}:{TD}").encode() + b"\n"
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
    assert _verdicts(after)[P_RELEASE] == REPLAYED


def test_one_record_serves_the_commits_after_it(mlm, capsys):
    """A resolution recorded at c1 is replayed at d0, which descends from c1 and conflicts the
    same way (one record per era, not per commit); at c2, where the merge is clean, it is not
    replayed; a record at d0 from apply's branch stores nothing; the label names the record
    and verify recomputes it."""
    m, c, repo = mlm
    path, resolved = _store_c1_resolution(m, c, repo)
    series = f"main-{c['B'][:7]}"
    _, plain, _ = _apply(m, c["d0"], repo, series_name=series, dry_run=True)
    path.rename(path.with_suffix(".off"))  # without the record: the same conflict as c1's
    _, without, _ = _apply(m, c["d0"], repo, series_name=series, dry_run=True)
    path.with_suffix(".off").rename(path)
    assert _verdicts(without)[P_RELEASE] == CONFLICT
    assert _verdicts(plain)[P_RELEASE] == REPLAYED
    co, result, _ = _apply(m, c["d0"], repo, series_name=series)
    release = next(o for o in result.outcomes if o.patch == P_RELEASE)
    assert release.verdict == REPLAYED
    assert release.note == f"recorded at {c[1][:12]} for the same conflict"
    branch = f"moe-release/{c['d0'][:12]}"
    assert _git(m, "show", f"{branch}:{TD}") + "\n" == resolved
    manifest = json.loads(_git(m, "show", f"{branch}:megatron/core/_moe_release_manifest.json"))
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
    _, clean, _ = _apply(m, c[2], repo, dry_run=True)
    assert _verdicts(clean)[P_RELEASE] == APPLIED


def test_record_stores_what_a_person_resolved(mlm, capsys):
    """`apply --record RESOLVED`: a person resolves at c1 with git (a commit per patch to
    apply, here the conflicting one resolved by hand and the clean one as it merges); per patch
    the difference from the 3-way merge is stored, only where there is one, and apply then
    replays it: the branch is RESOLVED's tree. The checkout is only read."""
    m, c, repo = mlm
    _git(m, "checkout", "--quiet", "-b", "resolved", c[1])
    resolved = DISPATCHER.replace("        return output\n", RELEASE + "        return output\n")
    _commit(m, "2026-12-01T12:00:00+00:00", "release, resolved", {TD: resolved})
    _commit(m, "2026-12-01T12:00:00+00:00", "buffers", {FA: FUSED_PER_GROUP})
    _git(m, "checkout", "--quiet", "main")
    before = _snapshot(m)
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
    assert _snapshot(m) == before
    _, result, _ = _apply(m, c[1], repo)
    assert _verdicts(result) == {P_STASH: NOT_APPLICABLE, P_RELEASE: REPLAYED, P_BUFFER: APPLIED}
    assert _git(m, "rev-parse", f"moe-release/{c[1][:12]}~1^{{tree}}") == _git(
        m, "rev-parse", "resolved^{tree}"
    )  # fmt: skip (~1: below the label commit)
    # Recorded again from the branch apply made: the same resolution, nothing written.
    _git(m, "branch", "again", f"moe-release/{c[1][:12]}")
    assert cli.main(["apply", str(m), "--ref", c[1], "--record", "again"]) == 0
    assert capsys.readouterr().out.endswith("\nunchanged\n")
    assert (sdir / stored[0]).read_bytes() == data
    # At c2, where the patch merges cleanly, a stale resolution is deleted by a record.
    _apply(m, c[2], repo)
    stale = sdir / "apply" / c[2][:12] / stored[0].name
    stale.parent.mkdir()
    stale.write_bytes(data)
    assert cli.main(["apply", str(m), "--ref", c[2], "--record", f"moe-release/{c[2][:12]}"]) == 0
    assert f"deleted: patches/upstream/main/apply/{c[2][:12]}/" in capsys.readouterr().out
    assert not stale.parent.exists()
    _git(m, "branch", "short", f"{c[1]}")
    assert cli.main(["apply", str(m), "--ref", c[1], "--record", "short"]) == 2
    assert "0 series commit(s) on REF, but " + P_RELEASE in capsys.readouterr().err


def test_resolve_leaves_each_conflict_in_a_work_tree_for_a_person(mlm, tmp_path, capsys):
    """`apply --resolve DIR` at c1: a work tree on moe-release/<c1>-resolve stops at the release
    patch's conflict with the 3-way merge (markers) in DIR and its message ready; once the
    person commits the resolution, the same command commits the rest; --record then stores it
    and apply replays it. The checkout's HEAD, index and work tree stay as they were."""
    m, c, repo = mlm
    before = _snapshot(m)
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
    assert _git(m, "rev-list", "--count", f"{c[1]}..{branch}") == "0"  # the stash: n/a at c1
    # Run again before resolving: refused, nothing changed.
    assert cli.main(["apply", str(m), "--ref", c[1], "--resolve", str(wt)]) == 2
    assert "uncommitted changes" in capsys.readouterr().err
    resolved = DISPATCHER.replace("        return output\n", RELEASE + "        return output\n")
    (wt / TD).write_text(resolved)
    _git(wt, "commit", "--quiet", "-a", "-F", str(msg))
    assert cli.main(["apply", str(m), "--ref", c[1], "--resolve", str(wt)]) == 0
    out = capsys.readouterr().out
    assert f"committed {P_BUFFER}" in out and f"--record {branch}" in out
    # The finished branch is labelled as apply labels its own: pip install builds the series.
    assert "labelled: pip install of the branch builds megatron-core 0.20.0+moerelease.2." in out
    subjects = _git(m, "log", "--format=%s", f"{c[1]}..{branch}").splitlines()
    assert subjects[0].startswith(LABEL_SUBJECT + "0.20.0+moerelease.2.")
    assert subjects[1:] == ["[MoE] Keep one buffer per process group",
                            "[MoE] Release dispatcher state after combine"]  # fmt: skip
    assert "_moe_release_manifest.json" in _git(m, "show", "--name-only", "--format=", branch)
    assert cli.main(["apply", str(m), "--ref", c[1], "--resolve", str(wt)]) == 0  # once only
    assert "labelled" not in capsys.readouterr().out
    assert _git(m, "rev-list", "--count", f"{c[1]}..{branch}") == "3"
    assert cli.main(["apply", str(m), "--ref", c[1], "--record", branch]) == 0
    capsys.readouterr()
    _, result, _ = _apply(m, c[1], repo)
    assert _verdicts(result)[P_RELEASE] == REPLAYED
    assert _git(m, "rev-parse", f"moe-release/{c[1][:12]}~1^{{tree}}") == _git(
        m, "rev-parse", f"{branch}~1^{{tree}}")  # fmt: skip
    after = _snapshot(m)
    assert after[1:4] == before[1:4]  # HEAD, its ref, the index
    assert after[5] == before[5]  # the checkout's files (the work tree DIR is elsewhere)


def test_record_keeps_a_fix_in_a_file_no_patch_touches(mlm, capsys):
    """A person's commit may fix, with a patch, a file no patch of the series touches (the fix
    the series lacks at REF): --record stores it and apply replays it."""
    m, c, repo = mlm
    _apply(m, c[2], repo, branch="plain", label=False)
    _git(m, "checkout", "--quiet", "-b", "fixed", f"{c[2]}")
    for sha in _git(m, "rev-list", "--reverse", f"{c[2]}..plain").split():
        _git(m, "cherry-pick", "--quiet", sha)
        if _git(m, "log", "-1", "--format=%s").endswith("after combine"):
            (m / "megatron/core/__init__.py").write_text("FIXED = True\n")
            _git(m, "commit", "--quiet", "-a", "--amend", "--no-edit")
    _git(m, "checkout", "--quiet", "main")
    assert cli.main(["apply", str(m), "--ref", c[2], "--record", "fixed"]) == 0
    assert "flex-dispatcher-state.diff" in capsys.readouterr().out
    _, result, _ = _apply(m, c[2], repo)
    assert _verdicts(result)[P_RELEASE] == REPLAYED
    assert _git(m, "show", f"moe-release/{c[2][:12]}:megatron/core/__init__.py") == "FIXED = True"


def test_a_conflict_is_reported_and_nothing_changes(mlm, capsys, monkeypatch):
    """Without a stored resolution the same merge is a conflict: file, line, the patch's hunk,
    both sides and where the resolution would go; exit 1, refs, HEAD, index and work tree as
    before, and the patches after it are still merged and reported."""
    m, c, repo = mlm
    before = _snapshot(m)
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
    assert _snapshot(m) == before


def test_a_patch_already_upstream_is_landed(mlm):
    """At c5, a main commit after main's base in which upstream took the per-group buffer
    change, that patch is landed (not committed again) and the others apply."""
    m, c, repo = mlm
    co, result, _ = _apply(m, c[5], repo)
    assert _verdicts(result) == {P_STASH: APPLIED, P_RELEASE: APPLIED, P_BUFFER: LANDED}
    assert "is 1 commit (30 days) before it" in result.choice.why
    assert _git(m, "rev-list", "--count", f"{c[5]}..moe-release/{c[5][:12]}") == "3"


def test_a_file_moved_since_the_base_is_merged_where_REF_has_it(mlm):
    """At c6, which moved token_dispatcher.py after main's base, the release patch is merged
    into the file at its new path (git's rename detection between the base and REF)."""
    m, c, repo = mlm
    _, result, _ = _apply(m, c[6], repo)
    assert _verdicts(result) == {P_STASH: APPLIED, P_RELEASE: APPLIED, P_BUFFER: LANDED}
    release = next(o for o in result.outcomes if o.patch == P_RELEASE)
    assert release.note == f"{TD} merged as {TD_MOVED}"
    branch = f"moe-release/{c[6][:12]}"
    assert RELEASE in _git(m, "show", f"{branch}:{TD_MOVED}") + "\n"
    assert _git(m, "diff", "--name-only", c[6], f"{branch}~1").split() == sorted([PS, TD_MOVED])


def test_a_stale_clone_finds_the_bases_in_the_mirror(mlm, tmp_path):
    """A clone that has not fetched main's and dev's bases (here: the feature branch only)
    is told so; with --mirror the ancestry and the base's files come from the mirror too, and
    the branch made in the clone is the one a full clone gets."""
    m, c, repo = mlm
    stale = tmp_path / "stale"
    _git(tmp_path, "clone", "--quiet", "--single-branch", "--branch", "feature",
         f"file://{m}", str(stale))  # fmt: skip
    with pytest.raises(UserError, match="holds none of the stored bases"):
        run_apply(stale, c[4], root=repo, dry_run=True)
    before = _snapshot(stale)
    _, result, _ = run_apply(stale, c[4], root=repo, mirror=m)
    assert result.ok and result.choice.base.name == f"main-{c['B'][:7]}"
    assert not {f"main-{c['B'][:7]}", f"dev-{c['D'][:7]}"} & set(result.choice.missing)
    after = _snapshot(stale)
    assert after[1:] == before[1:]
    _apply(m, c[4], repo)
    branch = f"moe-release/{c[4][:12]}"
    assert _git(stale, "rev-parse", branch) == _git(m, "rev-parse", branch)


def test_a_dev_commit_takes_the_dev_series(mlm):
    """A commit on dev's first-parent history takes dev's series; main's c1, on dev's history
    only from before dev left main, stays main's."""
    m, c, repo = mlm
    co, result, _ = _apply(m, c["d1"], repo, dry_run=True)
    assert result.choice.base.name == f"dev-{c['D'][:7]}" and result.ok
    assert _verdicts(result) == {P_RELEASE: APPLIED}
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
    _, result, _ = _apply(m, c["d0"], repo, dry_run=True, series_name=f"dev-{c['D'][:7]}")
    assert result.ok and _verdicts(result) == {P_RELEASE: APPLIED}
    assert "is as --series says: 12 lines differ" in result.choice.why
    with pytest.raises(UserError, match="--series 0.18.2: not a stored base this checkout holds"):
        choose_series(co, c["d0"], repo, "0.18.2")


def test_out_files_git_am_3_in_a_full_clone(mlm, tmp_path):
    """--out writes format-patch --full-index files whose index lines name REF's blobs (so
    git am -3 can fall back), and git am -3 in a full clone at REF gives the branch's tree."""
    m, c, repo = mlm
    out = tmp_path / "out"
    before = _snapshot(m)
    co, result, done = _apply(m, c[2], repo, out_dir=out)
    assert result.ok and _snapshot(m) == before
    files = sorted(out.iterdir())
    assert [f.name[:5] for f in files] == ["0001-", "0002-", "0003-"]  # 0003: the label
    pre = [re.findall(r"diff --git a/(\S+) .*\nindex ([0-9a-f]{40})\.\.", f.read_text())
           for f in files]  # fmt: skip
    assert [[p for p, _ in each] for each in pre] == [[TD], [FA], [PI]]
    for path, blob in (pair for each in pre for pair in each):
        assert blob == _git(m, "rev-parse", f"{c[2]}:{path}")
    clone = tmp_path / "clone"
    _git(tmp_path, "clone", "--quiet", str(m), str(clone))
    _git(clone, "checkout", "--quiet", "--detach", c[2])
    _git(clone, "am", "-3", "--quiet", *map(str, files))
    with pytest.raises(UserError, match="already has the series: its history has "):
        run_apply(clone, root=repo, dry_run=True)  # git am dropped the [MoE] prefix
    _, again, _ = _apply(m, c[2], repo)
    assert _git(clone, "rev-parse", "HEAD^{tree}") == _git(
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
        _apply(m, c[4], repo)
        _git(m, "checkout", "--quiet", f"moe-release/{c[4][:12]}")
        want = "HEAD already has the series: its history has "
    elif case == "branch-exists":
        _git(m, "branch", "mine", c[4])
        args, want = args + ["--ref", c[4], "--branch", "mine"], "branch mine exists"
    before = _snapshot(m) if case != "not-git" else None
    capsys.readouterr()
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moe_release.py apply: error: "), err
    assert want in err, err
    if before is not None:
        assert _snapshot(m) == before


def test_a_user_finds_the_way(mlm, tmp_path, capsys):
    """A dirty work tree does not block --dry-run (nothing is written); a git repository that
    is not Megatron-LM is told so, not to fetch; a typo of a verb or a flag is answered with
    the closest known one."""
    m, c, repo = mlm
    (m / FA).write_text("changed\n")
    _, result, done = _apply(m, c[4], repo, dry_run=True)
    assert result.ok and done == ["(dry run: nothing written)"]
    other = tmp_path / "other"
    other.mkdir()
    _git(other, "init", "--quiet")
    _commit(other, "2026-06-01T12:00:00+00:00", "x", {"megatron/core/__init__.py": ""})
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


# ----------------------------------------------------------------------------- sweep


def _codes(result) -> str:
    return "".join(BORROWED if o.borrowed and o.verdict != CONFLICT else
                   SETTLED if o.verdict == APPLIED and o.settled else CODES[o.verdict]
                   for o in result.outcomes)  # fmt: skip


def test_sweep_agrees_with_apply_on_every_commit(mlm):
    """Each first-parent commit of main and dev since February: the series and the verdicts
    the sweep reports are apply --dry-run's at that commit; c1 and dev's d0 conflict (main
    changed the line above the release hunk since), grouped under that hunk."""
    m, c, repo = mlm
    rows, facts = sweep(open_checkout(m), root=repo)
    main = [c[k] for k in (1, 2, 3, 4, "B", 5, 6)]
    assert [r.commit for r in rows if r.line == "main"] == main
    assert [r.commit for r in rows if r.line == "dev"] == [c[1], c["d0"], c["d1"], c["D"]]
    for r in rows:
        _, result, _ = run_apply(m, r.commit, dry_run=True, root=repo)
        assert (r.series, r.codes) == (result.choice.base.name, _codes(result)), r
    bad = {r.commit: r for r in rows if not r.whole}
    assert set(bad) == {c[1], c["d0"]}
    assert bad[c[1]].conflict.startswith(f"{P_RELEASE}: {TD} (@@ ")
    text = "\n".join(summary_lines(rows, facts))
    assert "main: 7 commits (2026-03-02 .. 2026-07-10): 6 (85.7%) take the whole series" in text
    assert f"1 x {P_RELEASE}: {TD}" in text
    assert facts["merges"] <= len(rows)


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
    assert {r.commit: r.codes for r in rows}[c[1]] == _codes(result)
    # A record whose conflict is not this merge's is never replayed: broken, c1 conflicts.
    at_d0.write_bytes(at_d0.read_bytes().replace(b"-=======", b"-======="[:-1]))
    _, result, _ = run_apply(m, c[1], dry_run=True, root=repo)
    assert {o.patch: o.verdict for o in result.outcomes}[P_RELEASE] == CONFLICT


def test_sweep_command(mlm, capsys, tmp_path, monkeypatch):
    """The command: a row per commit, the summary, --write's page; exit 1 while a commit
    conflicts; bad input is one line and exit 2, nothing written."""
    m, c, repo = mlm
    monkeypatch.setattr("moe_release.commands.sweep.REPO_ROOT", repo)
    page = tmp_path / "sweep.md"
    assert cli.main(["sweep", str(m), "--write", str(page)]) == 1
    out = capsys.readouterr().out
    assert f"main 2026-03-02 {c[1][:12]} main-{c['B'][:7]}" in out
    assert "main: 7 commits" in out and "dev: 4 commits" in out
    assert page.read_text().startswith("# `apply` on every first-parent commit of main and dev")
    assert f"| 2026-03-02 | `{c[1][:12]}` |" in page.read_text()
    for argv, message in (
        (["sweep", str(tmp_path / "nothing")], "not a git checkout"),
        (["sweep", str(m), "--since", "March"], "--since March: not a date"),
        (["sweep", str(m), "--every", "0"], "--every 0: must be 1 or more"),
    ):
        out_page = tmp_path / "not-written.md"
        assert cli.main([*argv, "--write", str(out_page)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("moe_release.py sweep: error:") and message in err, err
        assert len(err.splitlines()) == 1 and not out_page.exists()


@pytest.mark.needs_env(CHECKOUT_ENV)
def test_on_the_mirror_the_sweep_is_applys_verdict():
    """On the real mirror, main 2026-07-22 .. 07-24 (81770cb015ea, where the release patch's
    new method sits beside 0.19.2 code the commit lacks: settled), NeMo-RL's pin 14346b65
    (the import block of fused_a2a.py) and 2d7060f44fc9 (NCCL EP landed; the nearest series,
    0.18.0, conflicts and 0.19.2's is taken): every commit whole, each row apply's own
    verdict."""
    mirror = Path(settings.megatron_lm())
    co = open_checkout(mirror)
    rows, _ = sweep(co, ("main",), "2026-07-22", "2026-07-24")
    rows += [r for r in sweep(co, ("main",), "2026-08-12", "2026-08-12")[0]
             if r.commit.startswith("14346b65")]  # fmt: skip
    # Where the nearest series conflicts: a farther one, whole (NCCL EP's window on main).
    rows += [r for r in sweep(co, ("main",), "2026-07-08", "2026-07-08")[0]
             if r.commit.startswith("2d7060f44fc9")]  # fmt: skip
    assert any(r.commit.startswith("81770cb015ea") and SETTLED in r.codes for r in rows)
    assert any(r.commit.startswith("14346b65") for r in rows)
    assert [r.series for r in rows if r.farther] == ["0.19.2"]
    for r in rows:
        _, result, _ = run_apply(mirror, r.commit, dry_run=True)
        assert (r.series, r.codes) == (result.choice.base.name, _codes(result)), r
        assert r.whole, r


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
    c7 = _commit(m, "2026-07-20T12:00:00+00:00", "stash kernels in ops (#8)",
                 {PS: STASH + tail, ops: "import triton\n\nK = 1\n"})  # fmt: skip
    before = _snapshot(m)
    assert cli.main(["apply", str(m), "--ref", c7]) == 1
    out = capsys.readouterr().out
    assert f"{P_STASH} (merged cleanly, but {PS}:13 imports megatron.core.transformer.moe.ops." \
           f"paged_stash outside a try, and {ops} imports triton)" in out  # fmt: skip
    assert "no stored series has a patch that merges right here" in out
    assert _snapshot(m) == before
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
    _git(wt, "commit", "--quiet", "-a", "-m", "guard the ops import")
    fix = _git(wt, "rev-parse", "HEAD")
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
    _, result, _ = _apply(m, c7, repo)
    assert result.ok and _verdicts(result)[P_STASH] == REPLAYED
    assert _git(m, "rev-parse", f"moe-release/{c7[:12]}~1^{{tree}}") == _git(
        m, "rev-parse", f"{branch}~1^{{tree}}")  # fmt: skip
    plain = build_checkout_trees(open_checkout(m), f"moe-release/{c7[:12]}", None, root=repo)
    assert (plain.base_commit, plain.series_commits) == (c7, 2)
