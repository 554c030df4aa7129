"""scripts/moe_release.py as a whole: every verb has help, and a user's error is one line,
exit status 2, no traceback, nothing written."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT
from tests.helpers.series import cli


@pytest.mark.parametrize(
    "verb",
    ["fetch", "materialize", "edit", "export", "check", "verify", "trees", "label", "landed",
     "upstream", "port", "apply", "sweep", "matrix"],
)  # fmt: skip
def test_every_verb_has_help(verb):
    result = cli(verb, "--help")
    assert result.returncode == 0 and "usage: moe_release.py " + verb in result.stdout


def test_a_tool_says_its_command_and_its_script_says_its_own_name():
    """A tool with its own parser, run as ``moe_release.py report``, names that command in its
    usage line; run as its script (the alias), it prints what the script always printed."""
    result = cli("report", "--help")
    assert result.returncode == 0
    assert result.stdout.startswith("usage: moe_release.py report [-h]"), result.stdout
    script = REPO_ROOT / "scripts" / "memory_report.py"
    result = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, check=True
    )
    assert result.stdout.startswith("usage: memory_report.py [-h]"), result.stdout


def test_user_error_is_one_line_without_traceback(tmp_path):
    (tmp_path / "x").write_text("x")
    result = cli("materialize", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"moe_release.py materialize: error: {tmp_path}: target exists and is not empty"
    ]
    result = cli("materialize", "--base", "0.1.0", str(tmp_path / "new"))
    assert result.returncode == 2 and "unknown base version '0.1.0'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.fixture
def read_only_dir(tmp_path) -> Path:
    """A directory nothing can be created in: a 0555 directory, or for root (whom permissions
    do not stop) sysfs, where creating a directory fails for everyone."""
    if os.geteuid() == 0:
        yield Path("/sys")
        return
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    yield ro
    ro.chmod(0o755)


# (argv, what the message names); {t} is the test's scratch directory holding `file` (a plain
# file), `empty` (an empty directory) and `fake-python` (an executable that is no Python), {ro}
# a read-only directory.
NO_PARENT = "the target's parent directory does not exist"
UNKNOWN_BASE = "unknown base version '9.9'"
BAD_INPUTS = [
    (["materialize", "{t}/missing/out"], "{t}/missing: " + NO_PARENT),
    (["materialize", "{t}/file"], "{t}/file: target exists and is not a directory"),
    (["materialize", "{t}/file/out"], "{t}/file: the target's parent is not a directory"),
    (["materialize", "{ro}/out"], "{ro}/out"),
    (["materialize", "--base", "9.9", "{t}/out"], UNKNOWN_BASE),
    (["edit", "{t}/missing/out"], "{t}/missing: " + NO_PARENT),
    (["edit", "{t}/file"], "{t}/file: target exists and is not a directory"),
    (["edit", "{ro}/out"], "{ro}/out"),
    (["edit", "--base", "9.9", "{t}/out"], UNKNOWN_BASE),
    (["export", "{t}/missing"], "{t}/missing: does not exist"),
    (["export", "{t}/file"], "{t}/file: is not a directory"),
    (["export", "{t}/empty"], "{t}/empty: not an edit repo"),
    (["check", "--base", "9.9"], UNKNOWN_BASE),
    (["verify", "--python", "/nonexistent/python"],
      "/nonexistent/python: interpreter does not exist"),
    (["verify", "--python", "{t}/missing/python"],
      "{t}/missing/python: interpreter does not exist"),
    (["verify", "--python", "{t}/empty"], "{t}/empty: is a directory, not an interpreter"),
    (["verify", "--python", "{t}/file"], "{t}/file: is not executable"),
    (["verify", "--python", "{t}/fake-python"], "{t}/fake-python: does not answer as a Python"),
    (["verify", "--python", "no-such-python-3.99"],
      "no-such-python-3.99: no such interpreter on PATH"),
    (["verify", "--base", "9.9"], UNKNOWN_BASE),
    (["trees", "--base", "9.9"], UNKNOWN_BASE),
    (["label", "--base", "9.9"], UNKNOWN_BASE),
    (["fetch", "--base", "9.9"], UNKNOWN_BASE),
    (["landed", "{t}/missing"], "{t}/missing: checkout does not exist"),
    (["landed", "{t}/file"], "{t}/file: checkout is not a directory"),
    (["landed", "{t}/empty"], "{t}/empty: not a checkout (no megatron/core in it)"),
    (["landed", "--base", "9.9", "{t}/empty"], UNKNOWN_BASE),
    (["landed", "--target", "nope", "{t}/empty"], "unknown target 'nope'"),
    (["upstream", "main", "/missing/parent/out"], "/missing/parent: " + NO_PARENT),
    (["upstream", "main", "{t}/missing/out"], "{t}/missing: " + NO_PARENT),
    (["upstream", "main", "{t}/file"], "{t}/file: target exists and is not a directory"),
    (["upstream", "main", "{t}/file/out"], "{t}/file: the target's parent is not a directory"),
    (["upstream", "main", "{ro}/out"], "{ro}/out"),
    (["upstream", "main", "{t}/out", "--check", "{t}/missing"],
      "{t}/missing: checkout does not exist"),
    (["upstream", "nope", "{t}/out"], "unknown target 'nope'"),
    (["port"], "name the targets: --target TARGET (repeatable) or --all"),
    (["port", "--target", "nope"], "unknown port target 'nope'"),
    (["port", "--target", "main", "--mirror", "{t}/missing"],
      "base main-d98e8a6: {t}/missing: Megatron-LM source does not exist"),
    (["port", "--target", "main", "--mirror", "{t}/file"],
      "base main-d98e8a6: {t}/file: not a tar archive"),
    (["port", "--target", "main", "--mirror", "{t}/empty"],
      "base main-d98e8a6: {t}/empty is not the pinned Megatron-LM commit: expected commit "
      "d98e8a64ddf34856e74b24714e3bedb2f5a39553 (tree 3575bb50bf77ba700a7413c96c5cf1e6521e023f), "
      "found tree 4b825dc642cb6eb9a060e54bf8d69288fbee4904"),
    (["materialize", "--base", "main-d98e8a6", "--checkout", "{t}/missing", "{t}/out"],
      "base main-d98e8a6: {t}/missing: Megatron-LM source does not exist"),
    (["trees", "--base", "dev-d48bd6b", "--checkout", "{t}/empty"],
      "found tree 4b825dc642cb6eb9a060e54bf8d69288fbee4904"),
    (["port", "--target", "0.18.2", "--patch", "nope.patch"],
      "--patch nope.patch: not in patches/series"),
]  # fmt: skip


def _snapshot(*dirs: Path) -> set:
    return {str(p) for d in dirs if d.is_dir() for p in d.rglob("*")}


@pytest.mark.parametrize("argv, names", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, read_only_dir, argv, names):
    """Every verb, as a new user would call it wrong: one line naming the path or argument on
    stderr, exit status 2, no traceback, and nothing created (not the target, not a parent,
    not a temp dir beside it)."""
    t = tmp_path / "t"
    t.mkdir()
    (t / "file").write_text("a file\n")
    (t / "empty").mkdir()
    fake = t / "fake-python"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    subst = {"{t}": str(t), "{ro}": str(read_only_dir)}

    def fill(s: str) -> str:
        for k, v in subst.items():
            s = s.replace(k, v)
        return s

    before = _snapshot(t, read_only_dir) if read_only_dir != Path("/sys") else _snapshot(t)
    result = cli(*map(fill, argv))
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    lines = [line for line in lines if not line.startswith("moe-release: ")]  # progress lines
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"moe_release.py {argv[0]}: error: "), lines[0]
    assert fill(names) in lines[0]
    assert "Traceback" not in result.stderr
    after = _snapshot(t, read_only_dir) if read_only_dir != Path("/sys") else _snapshot(t)
    assert after == before
    assert not Path("/missing").exists() and not (read_only_dir / "out").exists()
