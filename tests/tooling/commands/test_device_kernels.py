"""`scripts/device-check kernels prepare` (issue 55's CPU side): the folder a lent GPU needs to
build deep_ep and run the release with the real kernels: the deep_ep source at the pin or the
nearest commit the repository has, both trees, and run.sh, which reads only the folder and the
repository's tracked files; refused whole (nothing written) over the device tool's size limit.
The run itself needs the GPU; these tests check what travels there."""

import re
import subprocess
from pathlib import Path

import pytest

from moe_release.commands import device_kernels as dk
from tests.helpers import REPO_ROOT


def _git(repo: Path, *args: str) -> str:
    env = dict(GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t", GIT_CONFIG_GLOBAL="/dev/null")  # fmt: skip
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                          env=env, check=True)  # fmt: skip
    return done.stdout.strip()


@pytest.fixture
def deep_ep(tmp_path):
    """A deep_ep-shaped repository: two commits, (older, newer)."""
    repo = tmp_path / "DeepEP"
    (repo / "csrc").mkdir(parents=True)
    _git(repo, "init", "--quiet")
    (repo / "setup.py").write_text("print('setup')\n")
    (repo / "csrc" / "deep_ep.cpp").write_text("// v1\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "--quiet", "-m", "one")
    older = _git(repo, "rev-parse", "HEAD")
    (repo / "csrc" / "deep_ep.cpp").write_text("// v2\n")
    _git(repo, "commit", "--quiet", "-am", "two")
    return repo, older, _git(repo, "rev-parse", "HEAD")


@pytest.fixture
def trees(tmp_path):
    out = []
    for name in ("base-0.19.2+x", "0.19.2+y"):
        core = tmp_path / "trees" / name / "megatron" / "core"
        core.mkdir(parents=True)
        (core / "package_info.py").write_text("MAJOR = 0\n")
        out.append(core.parent.parent)
    return out


def test_the_pin_where_the_repository_has_it_else_the_nearest(deep_ep):
    repo, older, newer = deep_ep
    assert dk.choose_commit(repo, older, newer) == (older, f"the pin megatron-core 0.19.2 names "
                                                           f"({older[:7]})")  # fmt: skip
    commit, why = dk.choose_commit(repo, "de0dd11" + "0" * 33, newer)
    assert commit == newer and "the pin de0dd11 is not in" in why
    with pytest.raises(dk.PrepareError, match="has neither the pin"):
        dk.choose_commit(repo, "1" * 40, "2" * 40)


def test_prepare_writes_what_travels_and_run_sh_reads_only_that(tmp_path, deep_ep, trees):
    repo, older, newer = deep_ep
    dest = tmp_path / "out" / "device-kernels"
    lines = dk.prepare(dest, repo, *trees, pin="3" * 40, nearest=older)
    assert (dest / "deep_ep" / "csrc" / "deep_ep.cpp").read_text() == "// v1\n"  # the commit
    assert (dest / "trees" / "base" / "megatron/core/package_info.py").is_file()
    assert (dest / "trees" / "patched" / "megatron/core/package_info.py").is_file()
    assert (dest / "run.sh").read_bytes() == (REPO_ROOT / dk.SCRIPT).read_bytes()
    assert f"deep_ep {older}" in (dest / "SOURCE.txt").read_text()
    assert lines[-2:] == [f'carry: ["{dest}"]', f"command: bash {dest}/run.sh"]
    assert re.match(rf"{re.escape(str(dest))}: [\d,]+ B; with the tracked files [\d,]+ B", lines[1])
    # run.sh: every path of its folder it names is there; every repository path it names is
    # tracked (it travels); nothing else.
    script = (dest / "run.sh").read_text()
    for rel in set(re.findall(r'\$K/([\w./-]+)', script)) - {"out"}:
        assert (dest / rel).exists(), rel
    tracked = set(subprocess.run(["git", "-C", str(REPO_ROOT), "ls-files"], capture_output=True,
                                 text=True).stdout.split())  # fmt: skip
    for rel in re.findall(r"\b(scripts/[\w.-]+)", script):
        assert rel in tracked, rel
    assert not re.search(r"(^|\s)/(work|tmp|home)/", script)  # no machine path of this host
    assert subprocess.run(["bash", "-n", str(dest / "run.sh")]).returncode == 0
    # Again: the folder is replaced whole.
    dk.prepare(dest, repo, *trees, pin=newer, nearest=older)
    assert (dest / "deep_ep" / "csrc" / "deep_ep.cpp").read_text() == "// v2\n"


def test_prepare_refuses_over_the_limit_and_leaves_nothing(tmp_path, deep_ep, trees, monkeypatch):
    repo, older, _ = deep_ep
    dest = tmp_path / "out" / "device-kernels"
    monkeypatch.setattr(dk, "CARRY_LIMIT", 1000)
    with pytest.raises(dk.PrepareError, match="over the device tool's 1,000 B"):
        dk.prepare(dest, repo, *trees, nearest=older)
    assert not dest.exists() and list(dest.parent.iterdir()) == []
    with pytest.raises(dk.PrepareError, match="not a git repository"):
        dk.prepare(dest, tmp_path / "nothing", *trees)
    with pytest.raises(dk.PrepareError, match="not a materialized megatron-core tree"):
        dk.prepare(dest, repo, tmp_path, trees[1], nearest=older)


@pytest.mark.needs_env("DEEP_EP_SRC")
def test_the_real_folder_fits_what_the_device_tool_carries(tmp_path):
    """With the real deep_ep repository and the primary base's trees: within 64 MiB with the
    tracked files (25.3 MB measured 2026-12-06, 94a9f8f: the pin de0dd11 is not mirrored)."""
    import os

    from moe_release.series.trees import ensure_trees

    dest = tmp_path / "device-kernels"
    lines = dk.prepare(dest, Path(os.environ["DEEP_EP_SRC"]), *ensure_trees())
    assert dk.size(dest) + dk.tracked_size() < dk.CARRY_LIMIT, lines
    assert (dest / "deep_ep" / "setup.py").is_file()
    assert (dest / "deep_ep" / "csrc" / "hybrid_ep" / "hybrid_ep.cu").is_file()


def test_without_a_deep_ep_repository_it_says_how_to_name_one(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("DEEP_EP_SRC", raising=False)
    assert dk.main(["prepare", "--out", str(tmp_path / "k")]) == 2
    assert "--deep-ep PATH or DEEP_EP_SRC=PATH" in capsys.readouterr().err
    assert not (tmp_path / "k").exists()
