# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The compatibility matrix: per pinned base (release or Megatron-LM commit), per dispatcher,
which release tests ran and passed at the last recorded run.

``scripts/run-tests`` records each base's run (pytest's JUnit XML) with ``matrix --record``
into ``.build/test-runs/<base>.json`` (not committed); ``matrix`` prints the table from
patches/pins.toml and those records, and ``matrix --update FILE`` rewrites the table between
the ``<!-- moe-release matrix -->`` markers in FILE (docs/compatibility.md). A record whose
series label is not the base's current one is shown as stale: the series changed since it ran.

The release tests are the tests marked ``backport`` (on the tests themselves, under
tests/unit_tests); a run's JUnit XML names them (the ``moe_release_test`` property the unit
tests' conftest writes for each). Each is put in a column by its node id: the A2A-overlap
tests by their directory, the others by the dispatcher named in their parameters (flex on
HybridEP, DeepEP, DeepEP v2 or NCCL EP, all-to-all, all-gather), the rest (CPU guards,
communication-buffer teardown) under "other". A flex backend the base does not have (NCCL EP
before 0.19, DeepEP v2 outside dev) is n/a in its column, not a failure.

A Megatron-LM checkout carrying the series (``run-tests --checkout DIR``) is recorded as
``checkout-<commit12>`` with its source in words, and with the same release tests' outcomes on
the commit without the series, where each retention test must fail: its row's last cell says
how many failed there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Optional

from moe_release.backends import NAMES, ONLY_SOME_TREES, available
from moe_release.commands.registry import Command, register
from moe_release.common import REPO_ROOT, UserError
from moe_release.series.patches import overlay_label
from moe_release.series.pins import Base, load_pins
from moe_release.series.repo import overlay_files, read_series

RUNS_DIR = Path(".build") / "test-runs"
CHECKOUT_PREFIX = "checkout-"
BEGIN, END = "<!-- moe-release matrix -->", "<!-- /moe-release matrix -->"
COLUMNS = (
    *(f"flex-{name}" for name in NAMES),
    "alltoall",
    "allgather",
    "A2A-overlap",
    "other",
)
# The flex backends a column stands for (a base without the backend has no tests there: n/a).
BACKEND_COLUMNS = {f"flex-{name}": name for name in ONLY_SOME_TREES}


def column(nodeid: str) -> str:
    """The matrix column of a release test's node id (relative to tests/unit_tests)."""
    if nodeid.startswith("a2a_overlap/"):
        return "A2A-overlap"
    params = nodeid.partition("[")[2].lower()
    name = nodeid.lower()
    for key, col in (("deepepv2", "flex-deepepv2"), ("deepep", "flex-deepep"),
                     ("ncclep", "flex-ncclep"), ("hybridep", "flex-hybridep"),
                     ("alltoall", "alltoall"), ("allgather", "allgather")):  # fmt: skip
        if key in params:
            return col
    if "hybridep" in name:
        return "flex-hybridep"
    return "other"


def _nodeid(classname: str, name: str) -> str:
    parts = classname.split(".")
    if "unit_tests" in parts:
        parts = parts[parts.index("unit_tests") + 1 :]
    module = max((i for i, p in enumerate(parts) if p.startswith("test_")), default=len(parts) - 1)
    return "/".join(parts[: module + 1]) + ".py::" + "::".join(parts[module + 1 :] + [name])


# What a test says of itself in the JUnit XML (tests/helpers/trees.py writes it): a guard
# passes with and without the series (it checks what the series must not change); "n/a: WHY"
# where the tree lacks what it tests. Either may pass on the commit without the series.
KIND_PROPERTY = "moe_release"
GUARD = "guard"
# Every release test (marked ``backport``) says so: ``moe_release_test`` = ``backport``.
RELEASE_PROPERTY, RELEASE = "moe_release_test", "backport"


def _property(path: Path, name: str) -> dict[str, str]:
    """{node id: value} of the tests of a JUnit XML file that recorded the property ``name``."""
    out = {}
    for case in _cases(path):
        for prop in case.iter("property"):
            if prop.get("name") == name:
                out[_nodeid(case.get("classname", ""), case.get("name", ""))] = prop.get("value")
    return out


def junit_kinds(path: Path) -> dict[str, str]:
    """{node id: what the test recorded as its ``moe_release`` property} of a JUnit XML file."""
    return _property(path, KIND_PROPERTY)


def junit_release_tests(path: Path) -> set[str]:
    """The node ids of a JUnit XML file's release tests (the tests marked ``backport``)."""
    return {n for n, v in _property(path, RELEASE_PROPERTY).items() if v == RELEASE}


def _cases(path: Path) -> list:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        raise UserError(f"{path}: cannot read the JUnit XML: {exc}") from None
    return list(root.iter("testcase"))


def junit_outcomes(path: Path) -> dict[str, str]:
    """{node id relative to tests/unit_tests: passed|failed|skipped} of a JUnit XML file."""
    out = {}
    for case in _cases(path):
        tags = {child.tag for child in case}
        outcome = (
            "failed"
            if tags & {"failure", "error"}
            else "skipped"
            if "skipped" in tags
            else "passed"
        )
        out[_nodeid(case.get("classname", ""), case.get("name", ""))] = outcome
    return out


def series_label(base: Base, root: Path = REPO_ROOT) -> str:
    """The overlay version the base's series builds now (what a record is compared with)."""
    return f"{base.version}+{overlay_label(base, read_series(base, root), overlay_files(root))}"


def patched_tree_dir(base: Base, root: Path = REPO_ROOT) -> Path:
    """Where ``scripts/run-tests`` materialized the base's patched tree (trees.Tree.dirname)."""
    label = overlay_label(base, read_series(base, root), overlay_files(root))
    return root / ".build" / "trees" / f"{base.name}+{label}"


def record_run(
    name: str,
    junit: Path,
    seconds: int,
    status: int,
    root: Path = REPO_ROOT,
    checkout: Optional[tuple[str, Path, Path]] = None,
) -> Path:
    """Write ``.build/test-runs/<name>.json``: the base's release-test outcomes from one run.
    ``checkout``: (source in words, patched tree, the unpatched run's JUnit XML) of a checkout's
    run, whose name is no pin."""
    outcomes = junit_outcomes(junit) if junit.exists() else {}
    released = junit_release_tests(junit) if junit.exists() else set()
    release = {n: o for n, o in sorted(outcomes.items()) if n in released}
    if checkout is not None:
        source, tree, unpatched = checkout
        if not name.startswith(CHECKOUT_PREFIX):
            raise UserError(f"--record {name}: a checkout's run is named {CHECKOUT_PREFIX}...")
        before = junit_outcomes(unpatched) if unpatched.exists() else {}
        kinds = junit_kinds(unpatched) if unpatched.exists() else {}
        for n, kind in kinds.items():  # a guard's or an n/a test's pass checks no retention
            if before.get(n) == "passed":
                before[n] = f"passed ({kind})"
        extra = {
            "source": source,
            "unpatched_release_tests": {n: before.get(n, "deselected") for n in release},
        }
        backends = available(tree)
    else:
        base = load_pins(root / "patches" / "pins.toml").get(name)
        extra, backends = {"label": series_label(base, root)}, None
    record = {
        "base": name,
        **extra,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "seconds": seconds,
        "exit_status": status,
        "all_tests": {
            k: sum(1 for o in outcomes.values() if o == k) for k in ("passed", "failed", "skipped")
        },  # fmt: skip
        "release_tests": release,
        # The flex backends the tree offers: a backend's column is n/a on a base without it.
        "backends": sorted(
            backends if backends is not None else available(patched_tree_dir(base, root))
        ),
    }
    out = root / RUNS_DIR / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, out)
    return out


def retention_passed_unpatched(record: dict) -> list[str]:
    """The release tests of a checkout's run that passed on the commit without the series
    though they are neither guards nor n/a there: each retention test must fail there."""
    return sorted(t for t, o in record.get("unpatched_release_tests", {}).items() if o == "passed")


def compare_lines(record: dict) -> list[str]:
    """A checkout's run in words: the release tests on the patched commit and, each, on the
    commit without the series (where a retention test must fail)."""
    now, before = record["release_tests"], record.get("unpatched_release_tests", {})
    n = len(now)
    passed = sum(o == "passed" for o in now.values())
    failed_before = sorted(t for t, o in before.items() if o == "failed")
    checks = sorted((t, o) for t, o in before.items() if o.startswith("passed ("))
    wrong = retention_passed_unpatched(record)
    lost = sorted(t for t, o in before.items() if o == "deselected")
    out = [f"{record['base']}: {record['source']}",
           f"  patched: {passed} of {n} release tests passed",
           f"  unpatched: {len(failed_before)} of them failed, {len(checks)} passed as they "
           f"should (guards, n/a), {len(wrong)} retention test(s) passed, {len(lost)} not "
           "collected (the tree lacks what they test)"]  # fmt: skip
    out += [f"    passed unpatched {o[len('passed ') :]}: {t}" for t, o in checks]
    out += [f"    RETENTION TEST PASSED UNPATCHED (it shows no fix): {t}" for t in wrong]
    out += [f"    failed patched: {t}" for t, o in sorted(now.items()) if o != "passed"]
    return out


def _cell(outcomes: list[str]) -> str:
    if not outcomes:
        return "—"
    n, passed = len(outcomes), outcomes.count("passed")
    failed, skipped = outcomes.count("failed"), outcomes.count("skipped")
    if passed == n:
        return f"✓ {n}/{n}"
    parts = [f"{failed} failed"] * bool(failed) + [f"{skipped} skipped"] * bool(skipped)
    return f"✗ {passed}/{n} ({', '.join(parts)})"


def table(root: Path = REPO_ROOT) -> str:
    """The matrix as a markdown table, one row per pinned base with a series."""
    pins = load_pins(root / "patches" / "pins.toml")
    head = ["base", "source"] + list(COLUMNS) + ["last run"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    runs = sorted((root / RUNS_DIR).glob(f"{CHECKOUT_PREFIX}*.json"))
    rows_of = [(n, b) for n, b in pins.bases.items() if (b.series_dir(root) / "series").exists()]
    for name, base in rows_of + [(p.stem, None) for p in runs]:
        record = _load(root / RUNS_DIR / f"{name}.json")
        if base is None:
            if record is None or "source" not in record:
                continue
            source = record["source"]
        elif base.is_commit:
            source = f"Megatron-LM `{base.branch}` `{base.commit[:12]}` ({base.version})"
        else:
            source = f"PyPI `{base.sdist}`"
        if record is None:
            cells = ["not run"] * len(COLUMNS)
            last = "not run"
        else:
            by_col: dict[str, list[str]] = {c: [] for c in COLUMNS}
            for nodeid, outcome in record["release_tests"].items():
                by_col[column(nodeid)].append(outcome)
            backends = set(record.get("backends", ()))
            cells = [
                f"n/a (no {BACKEND_COLUMNS[c]})"
                if not by_col[c] and c in BACKEND_COLUMNS and BACKEND_COLUMNS[c] not in backends
                else _cell(by_col[c])
                for c in COLUMNS
            ]
            stale = base is not None and record["label"] != series_label(base, root)
            last = f"{record['date']}, {record['seconds']} s" + (
                " (stale: the series changed since)" if stale else ""
            )
            before = record.get("unpatched_release_tests")
            if before is not None:
                failed = sum(o == "failed" for o in before.values())
                last += f"; unpatched: {failed}/{len(before)} failed"
            if not record["release_tests"]:
                cells = [f"no release tests ran (exit {record['exit_status']})"] + [""] * (
                    len(COLUMNS) - 1
                )
        rows.append("| " + " | ".join([f"`{name}`", source] + cells + [last]) + " |")
    legend = (
        "Cells: release tests (`-m backport`, one case per fix) that passed / ran at the last "
        "recorded `scripts/run-tests` run of that base; ✗ names failures and skips; — none in "
        "that column; n/a: the base has no such flex backend; \"not run\": no run recorded "
        "here; `checkout-<commit12>`: a Megatron-LM checkout carrying the series "
        "(`run-tests --checkout`), with how many of its release tests failed on the commit "
        "without the series. `moe_release.py matrix --update docs/compatibility.md` "
        "regenerates this table."
    )
    return "\n".join(rows) + "\n\n" + legend + "\n"


def _load(path: Path) -> Optional[dict]:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def update_file(path: Path, text: str) -> bool:
    """Replace the block between the matrix markers in ``path``; returns whether it changed."""
    try:
        old = path.read_text()
    except OSError as exc:
        raise UserError(f"{path}: {exc.strerror or exc}") from None
    if BEGIN not in old or END not in old:
        raise UserError(f"{path}: has no '{BEGIN}' ... '{END}' block to update")
    start = old.index(BEGIN) + len(BEGIN)
    end = old.index(END)
    new = old[:start] + "\n" + text + old[end:]
    if new == old:
        return False
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(new)
    os.replace(tmp, path)
    return True


def configure(parser: argparse.ArgumentParser) -> None:
    """Print, update a file, or record a run."""
    parser.add_argument(
        "--update", metavar="FILE", help="rewrite the table between the markers in FILE"
    )
    parser.add_argument("--record", metavar="BASE", help="record a run of BASE's tests (run-tests)")
    parser.add_argument("--junit", metavar="XML", help="with --record: the run's JUnit XML")
    parser.add_argument("--seconds", type=int, default=0, help="with --record: the run's wall time")
    parser.add_argument("--status", type=int, default=0, help="with --record: pytest's exit status")
    parser.add_argument("--source", help="with --record checkout-<commit12>: the checkout in words")
    parser.add_argument("--tree", help="with --record checkout-<commit12>: its patched tree")
    parser.add_argument("--unpatched-junit", metavar="XML",
                        help="with --record checkout-<commit12>: the run on the commit without "
                        "the series")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """The table, or a run recorded (exit status 1: a retention test passed unpatched)."""
    if args.record:
        if not args.junit:
            raise UserError("--record NAME needs --junit XML (pytest's --junitxml output)")
        checkout = None
        if args.source or args.tree or args.unpatched_junit:
            if not (args.source and args.tree and args.unpatched_junit):
                raise UserError("a checkout's run needs --source, --tree and --unpatched-junit")
            checkout = (args.source, Path(args.tree), Path(args.unpatched_junit))
        path = record_run(args.record, Path(args.junit), args.seconds, args.status,
                          checkout=checkout)  # fmt: skip
        print(path)
        if checkout is not None:
            record = json.loads(path.read_text())
            for line in compare_lines(record):
                print(line)
            return 1 if retention_passed_unpatched(record) else 0
        return 0
    text = table()
    if args.update:
        changed = update_file(Path(args.update), text)
        print(f"{args.update}: {'updated' if changed else 'unchanged'}")
    else:
        print(text, end="")
    return 0


register(
    Command(
        name="matrix",
        help="print the compatibility matrix (base x dispatcher x release tests, last run)",
        description="print the compatibility matrix as a markdown table: per pinned base with a "
        "series, per dispatcher, the release tests that ran and passed at the last run recorded "
        "by scripts/run-tests under .build/test-runs",
        configure=configure,
        run=run,
    )
)
