"""A synthetic Megatron-shaped git repository (main and dev lines, one pinned base on each,
a series for each) and git in it, for the tests of `apply`, `sweep` and a checkout carrying the
series; the ``mlm`` fixture (tests/tooling/conftest.py) builds it."""

from pathlib import Path

from moe_release.commands.apply import run_apply
from moe_release.commands.sweep import BORROWED, CODES, SETTLED
from moe_release.series.applying import APPLIED, CONFLICT
from moe_release.series.git import format_patches, git, git_env
from tests.helpers.series import AUTHOR, trailers

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


def git_in(repo: Path, *args: str, date: str = "2026-06-01T12:00:00+00:00") -> str:
    env = git_env(dict(AUTHOR, GIT_AUTHOR_DATE=date, GIT_COMMITTER_DATE=date))
    return git(repo, *args, env=env).decode().strip()


def commit_files(repo: Path, date: str, msg: str, files: dict) -> str:
    for rel, text in files.items():
        path = repo / rel
        if text is None:
            path.unlink()
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    git_in(repo, "add", "--all")
    git_in(repo, "commit", "--quiet", "-m", msg, date=date)
    return git_in(repo, "rev-parse", "HEAD")


def series_of(work: Path, base: str, changes: list) -> list:
    """The series (file name, mbox) of ``changes`` (subject, files) made on ``base``, each patch
    named as the primary patch it stands for (:data:`NAMES`)."""
    git_in(work, "checkout", "--quiet", "--detach", base)
    git_in(work, "tag", "-f", "base", base)
    for subject, files in changes:
        msg = f"{subject}\n\nBody.\n\n{trailers(NAMES[subject])}"
        commit_files(work, "2026-11-29T12:00:00+00:00", msg, files)
    out = format_patches(work)
    git_in(work, "checkout", "--quiet", "main")
    return out


def repo_state(repo: Path) -> tuple:
    """What a failed apply must leave as it was: refs, HEAD, index and work tree."""
    return (
        git_in(repo, "for-each-ref", "--format=%(refname) %(objectname)"),
        git_in(repo, "rev-parse", "HEAD"),
        git_in(repo, "symbolic-ref", "-q", "HEAD"),
        git_in(repo, "ls-files", "-s"),
        git_in(repo, "status", "--porcelain"),
        {p: p.read_bytes() for p in repo.rglob("*.py")},
    )


def megatron_lm(tmp_path: Path, repo: Path) -> tuple[Path, dict]:
    """A Megatron-shaped repository (main: c0 .. c5, dev forked at c1) and the tooling's
    ``repo`` copy with main's and dev's pinned bases and series replaced by synthetic ones."""
    m = tmp_path / "Megatron-LM"
    m.mkdir()
    git_in(m, "init", "--quiet", "--initial-branch=main")
    c = {}
    c[0] = commit_files(m, "2026-01-10T12:00:00+00:00", "initial", {
        "megatron/core/__init__.py": "", "megatron/core/package_info.py": PACKAGE_INFO,
        TD: DISPATCHER, FA: FUSED})  # fmt: skip
    c[1] = commit_files(m, "2026-03-02T12:00:00+00:00", "docs", {"README.md": "Megatron-LM\n"})
    c[2] = commit_files(m, "2026-03-20T12:00:00+00:00", "combine clones (#2)",
                   {TD: DISPATCHER.replace("tokens * 1", "tokens.clone()")})  # fmt: skip
    c[3] = commit_files(m, "2026-04-10T12:00:00+00:00", "paged stash (#3)", {PS: STASH})
    c[4] = commit_files(m, "2026-05-01T12:00:00+00:00", "helper 12 (#4)", {TD: DISPATCHER.replace(
        "tokens * 1", "tokens.clone()").replace("return 12", "return 120")})  # fmt: skip
    td_b = DISPATCHER.replace("tokens * 1", "tokens.clone()").replace("return 12", "return 120")
    c["B"] = commit_files(m, "2026-06-01T12:00:00+00:00", "helper 1 (#5)",
                     {TD: td_b.replace("return 1\n", "return 10\n")})  # fmt: skip
    c[5] = commit_files(
        m, "2026-07-01T12:00:00+00:00", "buffer per group (#6)", {FA: FUSED_PER_GROUP}
    )
    moved = git_in(m, "show", f"{c[5]}:{TD}") + "\n"
    c[6] = commit_files(m, "2026-07-10T12:00:00+00:00", "move the dispatchers (#7)",
                   {TD: None, TD_MOVED: moved})  # fmt: skip
    git_in(m, "checkout", "--quiet", "-b", "dev", c[1])
    c["d0"] = commit_files(m, "2026-03-05T12:00:00+00:00", "[dev] docs", {"README.md": "dev\n"})
    c["d1"] = commit_files(m, "2026-03-10T12:00:00+00:00", "[dev] routing", {TD: DEV_TD})
    c["D"] = commit_files(m, "2026-05-10T12:00:00+00:00", "[dev] more routing",
                     {TD: DEV_TD.replace("return 9\n", "return 99\n")})  # fmt: skip
    git_in(m, "checkout", "--quiet", "-b", "feature", c[4])
    c["side"] = commit_files(m, "2026-05-05T12:00:00+00:00", "wip", {"README.md": "wip\n"})
    git_in(m, "checkout", "--quiet", "main")

    work = tmp_path / "work"
    git_in(tmp_path, "clone", "--quiet", str(m), str(work))
    # The patch rewrites the line main changed at c2 (so that the merge at c1 and d0, before
    # c2, is a conflict a person resolves) and inserts the release below it.
    after_b = td_b.replace("return 1\n", "return 10\n").replace(
        "        return output\n", RELEASE + "        return output\n").replace(
        "= tokens.clone()\n", CLONED)  # fmt: skip
    main_series = series_of(work, c["B"], [
        ("[MoE] Let the paged stash import without Triton", {PS: STASH_CPU}),
        ("[MoE] Release dispatcher state after combine", {TD: after_b}),
        ("[MoE] Keep one buffer per process group", {FA: FUSED_PER_GROUP})])  # fmt: skip
    assert [n for n, _ in main_series] == [P_STASH, P_RELEASE, P_BUFFER]
    dev_td = DEV_TD.replace("return 9\n", "return 99\n").replace(
        "        return output\n", RELEASE + "        return output\n")  # fmt: skip
    dev_series = series_of(work, c["D"], [("[MoE] Release dispatcher state after combine",
                                         {TD: dev_td})])  # fmt: skip
    pins = (repo / "patches" / "pins.toml").read_text().split("\n[bases.\"main-")[0]
    for line, key, series in (("main", "B", main_series), ("dev", "D", dev_series)):
        tree = git_in(m, "rev-parse", f"{c[key]}^{{tree}}")
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
    return m, c


def apply_at(m: Path, ref: str, repo: Path, **kw):
    return run_apply(m, ref, root=repo, **kw)


def verdicts(result) -> dict:
    return {o.patch: o.verdict for o in result.outcomes}


def sweep_codes(result) -> str:
    """The codes of a sweep row for apply's ``result``: what the row must say."""
    return "".join(BORROWED if o.borrowed and o.verdict != CONFLICT else
                   SETTLED if o.verdict == APPLIED and o.settled else CODES[o.verdict]
                   for o in result.outcomes)  # fmt: skip
