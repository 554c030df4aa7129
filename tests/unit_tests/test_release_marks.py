# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The release tests (``-m backport``) carry their marker themselves (release_cases.py): on the
tree under test there are some, and every module that marks release tests and has tests on
this tree has release tests here (none lost its marks to a renamed parameter)."""

import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO_ROOT

HERE = Path(__file__).resolve().parent
MARKS = re.compile(r"mark\.backport\b|\bbackport\(")


def _collect(marker: str, paths: list) -> set:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
         "-m", marker, *paths],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode in (0, 5), done.stdout[-3000:] + done.stderr[-3000:]
    return {line.split("::", 1)[0] for line in done.stdout.splitlines() if "::" in line}


def test_every_module_that_marks_release_tests_has_some_here(patched_tree):
    marking = sorted(
        str(p.relative_to(REPO_ROOT))
        for p in HERE.rglob("test_*.py")
        if p.name != Path(__file__).name and MARKS.search(p.read_text())
    )
    released = _collect("backport", marking)
    assert released, "no release test on this tree"
    here = released | _collect("not backport", marking)
    assert [m for m in marking if m in here and m not in released] == []
