"""Shared by every test directory.

The tooling (the ``moe_release`` package: the series, the CPU runtime, the planner's command, the
report) lives under tools/, put first on ``sys.path`` here; tests import it, never the reverse.

The fixtures and markers of the trees under test (``patched_tree``, ``dist_job``,
``flex_backend``, ...) are the plugin :mod:`tests.helpers.trees`, loaded for every test here;
what tests share that is not a fixture is in :mod:`tests.helpers`, imported as a module.

Under CI (``CI`` set, as the CI runner does) a skipped test fails the run: a skip there means
the setup a test needs (the materialized trees, a venv) is missing, and a green run that
executed none of the release tests would hide that.
"""

import os
import sys

import pytest

from tests.helpers import TOOLS

if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

pytest_plugins = ("tests.helpers.trees",)

_SKIPPED: list = []


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _SKIPPED.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _SKIPPED and _in_ci() and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    if _SKIPPED and _in_ci():
        terminalreporter.write_line(
            f"CI: {len(_SKIPPED)} test(s) skipped, which fails the run (first: {_SKIPPED[0]})",
            red=True,
        )
