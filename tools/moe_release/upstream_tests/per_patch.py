# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Run each patch's upstream-layout tests on the tree without it and on the tree with it.

Usage (the venv's python)::

    python scripts/upstream_cpu/per_patch.py [--base V] [--patch NAME ...] [--first]
        [--ends] [--timeout S] [--json OUT] [--keep DIR]

``patches/topics.toml`` names (``[patch.<name>.tests]``), for every patch of the series, the
upstream-layout tests (pytest node ids under ``patches/upstream/tests``) that show it:
``fails_without`` must fail on the tree without the patch, with an error containing ``reason``
(or one of a list of them), and pass on the tree with it; ``guards`` (values the patch must not
change) must pass with it; ``nproc`` (default 8) is the ranks its tests need; ``base_reason``
also counts on the unpatched base (``--ends``), where a test may first fail at what an earlier
patch of the series adds. ``branch.<B>`` changes an entry on release branch B's bases (B lacks
what some of its tests test, or its patch is another change): ``fails_without``, ``guards``,
``reason`` and ``base_reason`` replace the entry's, ``skips`` are tests that must skip there
(with ``skip_reason``) with and without the patch; ``[patch-tests.branch.<B>]``
``base_reason`` applies to every entry on B (the unpatched base fails every test earlier).

The trees are the base's sdist with a prefix of its series applied, in series order: patch k is
tested on prefix k-1 (without) and prefix k (with), so every commit of the series is shown to be the
one that makes its tests pass. One launch of :mod:`moe_release.upstream_tests.run` per tree (gloo
ranks, as many as its tests' entries ask for; the deep_ep emulation; the options the manifest gives)
runs the tests of the patch before it and after it together. Each tree is a scratch
Megatron-LM-shaped checkout: the tree's ``megatron/``, our ``patches/upstream/tests`` and
:mod:`moe_release.upstream_tests.standin_utils` as upstream's ``Utils`` (the sdist has no
``tests/``).

``--base V`` runs a backport series (its patches carry their primary patch's ``Patch-Name:``);
``--patch`` chooses patches (by file name or a unique part of it); ``--first`` runs only the
first ``fails_without`` test of each (quick); ``--ends`` instead runs every chosen patch's tests
on the unpatched base (each ``fails_without`` test must fail) and on the whole series (all must
pass): two launches. Exit status 0 when every expectation holds, 1 when one does not, 2 on a
usage error (an unknown patch, a manifest entry naming a missing file, a patch without tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from moe_release.common import REPO_ROOT, UserError
from moe_release.series import patches
from moe_release.series.patches import parse_patch
from moe_release.series.pins import Base, load_pins
from moe_release.series.repo import read_series
from moe_release.series.source import read_base_files
from moe_release.series.trees import build_tree, write_files
from moe_release.upstream_tests import run as harness

MANIFEST = REPO_ROOT / "patches" / "topics.toml"
UPSTREAM_TESTS = REPO_ROOT / "patches" / "upstream" / "tests"
STANDIN_UTILS = Path(__file__).resolve().parent / "standin_utils.py"
# Ranks per launch unless an entry says otherwise: the GPUs of upstream's runners, which the
# tests' parametrizations (TP 8, EP 8, TP 2 x EP 4) assume.
DEFAULT_NPROC = 8


@dataclasses.dataclass
class PatchTests:
    """One manifest entry: the tests that show a primary patch."""

    patch: str
    fails_without: List[str]
    reason: List[str]
    guards: List[str]
    options: List[str]
    nproc: int = DEFAULT_NPROC
    # On the unpatched base (--ends) a test may fail first at what an earlier patch adds.
    base_reason: List[str] = dataclasses.field(default_factory=list)
    # Tests that must skip (on a release branch without what they test), and why.
    skips: List[str] = dataclasses.field(default_factory=list)
    skip_reason: List[str] = dataclasses.field(default_factory=list)
    # Release branch -> the fields that change there (``on``).
    branches: Dict[str, dict] = dataclasses.field(default_factory=dict)

    def on(self, branch: str) -> PatchTests:
        """The entry as it applies on release branch ``branch``'s bases."""
        e = dataclasses.replace(self, **self.branches.get(branch, {}), branches={})
        e.fails_without = [t for t in e.fails_without if t not in e.skips]
        e.guards = [t for t in e.guards if t not in e.skips]
        return e


BRANCH_KEYS = {"fails_without", "guards", "reason", "base_reason", "skips", "skip_reason"}


def load_manifest(path: Path = MANIFEST, tests_dir: Path = UPSTREAM_TESTS) -> Dict[str, PatchTests]:
    """The manifest by primary patch name; UserError naming the entry that is wrong."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise UserError(f"{path}: {exc}") from None
    out = {}
    for key, table in data.get("patch", {}).items():
        name = f"{key}.patch"
        where = f"{path.name}: [patch.{key}.tests]"
        entry = table.get("tests", {}) if isinstance(table, dict) else {}
        known = {"file", "fails_without", "reason", "base_reason", "guards", "options", "nproc"}
        known.add("branch")
        unknown = set(entry) - known
        if unknown:
            raise UserError(f"{where}: unknown key {sorted(unknown)[0]!r}")
        tests = PatchTests(
            name,
            _nodeids(entry, "fails_without"),
            _reasons(entry.get("reason", []), where),
            _nodeids(entry, "guards"),
            list(entry.get("options", [])),
            entry.get("nproc", DEFAULT_NPROC),
            _reasons(entry.get("base_reason", []), where, "base_reason"),
        )
        if not isinstance(tests.nproc, int) or isinstance(tests.nproc, bool) or tests.nproc < 1:
            raise UserError(f"{where}: nproc must be a positive integer, got {tests.nproc!r}")
        tests.branches = _branches(entry, where, data.get("patch-tests", {}).get("branch", {}))
        if not tests.fails_without:
            raise UserError(f"{where}: no fails_without test (each patch needs one)")
        named = [t for b in tests.branches.values() for k in ("fails_without", "guards", "skips")
                 for t in b.get(k, [])]  # fmt: skip
        for nodeid in tests.fails_without + tests.guards + named:
            file = nodeid.split("::", 1)[0]
            if not file.startswith("tests/") or not (tests_dir.parent / file).is_file():
                raise UserError(f"{where}: {nodeid}: no such file under {tests_dir}")
        out[name] = tests
    return out


def _reasons(value, where: str, key: str = "reason") -> List[str]:
    """``reason``: one substring or a list of them (a failure must contain one)."""
    reasons = [value] if isinstance(value, str) else value
    if not isinstance(reasons, list) or not all(isinstance(r, str) and r for r in reasons):
        raise UserError(f"{where}: {key} must be a non-empty string or a list of them")
    return reasons


def _branches(entry: dict, where: str, common: dict) -> Dict[str, dict]:
    """An entry's ``branch.<B>`` overrides, with the top-level ``[branch.<B>]``
    ``base_reason`` added to each; UserError naming a bad key."""
    out: Dict[str, dict] = {}
    for branch, spec in common.items():
        if not isinstance(spec, dict) or set(spec) - {"base_reason"}:
            raise UserError(f"[patch-tests.branch.{branch!r}]: only base_reason may be set there")
    for branch in set(entry.get("branch", {})) | set(common):
        spec = entry.get("branch", {}).get(branch, {})
        here = f"{where}: branch.{branch}"
        if not isinstance(spec, dict) or set(spec) - BRANCH_KEYS:
            bad = sorted(set(spec) - BRANCH_KEYS)[0] if isinstance(spec, dict) else spec
            raise UserError(f"{here}: unknown key {bad!r}")
        fields: Dict[str, object] = {}
        for key in ("fails_without", "guards", "skips"):
            if key in spec:
                fields[key] = _nodeids(dict(spec, file=entry.get("file", "")), key)
        for key in ("reason", "skip_reason", "base_reason"):
            if key in spec:
                fields[key] = _reasons(spec[key], here, key)
        if "skips" in fields and "skip_reason" not in fields:
            raise UserError(f"{here}: skips needs a skip_reason")
        if "base_reason" in common.get(branch, {}):
            own = fields.get("base_reason")
            if own is None:
                own = _reasons(entry.get("base_reason", []), here, "base_reason")
            extra = _reasons(common[branch]["base_reason"], f"[branch.{branch!r}]", "base_reason")
            fields["base_reason"] = own + [r for r in extra if r not in own]
        out[branch] = fields
    return out


def _nodeids(entry: dict, key: str) -> List[str]:
    """An entry's node ids under ``key``, each naming its file (the entry's ``file`` if not)."""
    file = entry.get("file", "")
    ids = list(entry.get(key, []))
    return [i if i.startswith("tests/") or not file else f"{file}::{i}" for i in ids]


def primary_name(name: str, data: bytes) -> str:
    """The primary patch a series patch is (the name it carries, the same in every series)."""
    return patches.primary_name(parse_patch(data, name))


def standin_checkout(root: Path, megatron: Path, tests_dir: Path = UPSTREAM_TESTS) -> Path:
    """A Megatron-LM-shaped checkout at ``root``: ``megatron`` (a tree's package directory,
    linked), a copy of ``tests_dir`` (with ``__init__.py`` in every package, as upstream's
    ``tests/unit_tests/transformer/moe`` has) and the stand-in ``Utils``."""
    root.mkdir(parents=True)
    (root / "megatron").symlink_to(megatron.resolve(), target_is_directory=True)
    shutil.copytree(tests_dir, root / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    for directory in [root / "tests", *(p for p in (root / "tests").rglob("*") if p.is_dir())]:
        (directory / "__init__.py").touch()
    shutil.copy(STANDIN_UTILS, root / "tests" / "unit_tests" / "test_utilities.py")
    return root


def select(series: Sequence[tuple[str, bytes]], wanted: Sequence[str]) -> List[int]:
    """Indices (1-based positions in the series) of the patches ``wanted`` names (all if
    empty); UserError for a name that matches none or several."""
    names = [n for n, _ in series]
    if not wanted:
        return list(range(1, len(names) + 1))
    picked = []
    for want in wanted:
        hits = [i for i, n in enumerate(names, 1) if n == want] or [
            i for i, n in enumerate(names, 1) if want in n
        ]
        if len(hits) != 1:
            found = "matches none" if not hits else f"matches {len(hits)}"
            raise UserError(f"--patch {want!r} {found} of the series ({', '.join(names)})")
        picked.append(hits[0])
    return sorted(set(picked))


@dataclasses.dataclass
class Launch:
    """One harness launch: a prefix of the series and the tests to run on it."""

    prefix: int
    tests: List[str]
    options: List[str]
    nproc: int = 1


def plan(entries: Dict[int, PatchTests], ends: bool, n: int) -> List[Launch]:
    """The launches: per prefix tree, the tests of the patch before and after it."""
    by_prefix: Dict[int, Launch] = {}

    def add(prefix: int, tests: Sequence[str], e: PatchTests) -> None:
        launch = by_prefix.setdefault(prefix, Launch(prefix, [], []))
        launch.tests += [t for t in tests if t not in launch.tests]
        launch.options += [o for o in e.options if o not in launch.options]
        launch.nproc = max(launch.nproc, e.nproc)

    for k, e in entries.items():
        if ends:
            add(0, e.fails_without + e.skips, e)
            add(n, e.fails_without + e.guards + e.skips, e)
        else:
            add(k - 1, e.fails_without + e.skips, e)
            add(k, e.fails_without + e.guards + e.skips, e)
    return [by_prefix[k] for k in sorted(by_prefix)]


def expectations(entries: Dict[int, PatchTests], ends: bool, n: int) -> List[dict]:
    """What must hold: (patch, test, prefix, outcome, reason substring)."""
    out = []
    for k, e in entries.items():
        without, with_ = (0, n) if ends else (k - 1, k)
        for t in e.skips:
            for prefix in (without, with_):
                out.append(
                    dict(patch=e.patch, test=t, prefix=prefix, want="skipped", reason=e.skip_reason)
                )
        for t in e.fails_without:
            reason = e.reason + e.base_reason if ends else e.reason
            out.append(dict(patch=e.patch, test=t, prefix=without, want="failed", reason=reason))
            out.append(dict(patch=e.patch, test=t, prefix=with_, want="passed", reason=[]))
        for t in e.guards:
            out.append(dict(patch=e.patch, test=t, prefix=with_, want="passed", reason=[]))
    return out


def run(
    base: Base,
    wanted: Sequence[str] = (),
    first: bool = False,
    ends: bool = False,
    timeout: float = 1800,
    keep: Optional[Path] = None,
    manifest: Path = MANIFEST,
) -> dict:
    """Build the trees, run the launches, check the expectations; the result as a dict."""
    series = read_series(base)
    tests = load_manifest(manifest)
    primaries = [primary_name(n, d) for n, d in series]
    entries = {}
    for k in select(series, wanted):
        if primaries[k - 1] not in tests:
            raise UserError(f"{manifest.name}: no entry for {primaries[k - 1]} (its tests)")
        e = tests[primaries[k - 1]].on(base.branch)
        if first:
            e = dataclasses.replace(e, fails_without=e.fails_without[:1], guards=[])
        entries[k] = dataclasses.replace(e, patch=series[k - 1][0])
    launches = plan(entries, ends, len(series))
    base_files = read_base_files(base)
    outcomes: Dict[int, dict] = {}
    work = Path(tempfile.mkdtemp(prefix="per_patch.", dir=keep))
    try:
        for launch in launches:
            tree = build_tree(base, base_files, series[: launch.prefix], [], stamp=False)
            tree_dir = work / f"tree{launch.prefix}"
            write_files(tree_dir, tree.files)
            checkout = standin_checkout(work / f"checkout{launch.prefix}", tree_dir / "megatron")
            out = work / f"prefix{launch.prefix}.json"
            print(
                f"per_patch: {base.version} + {launch.prefix} patch(es): "
                f"{len(launch.tests)} test(s) on {launch.nproc} rank(s) {' '.join(launch.options)}",
                flush=True,
            )
            harness.main(
                [str(checkout), "--nproc", str(launch.nproc), "--deep-ep-emulation"]
                + ["--timeout", str(timeout), "--json"]
                + [str(out), *launch.options, "--", "-q", "-p", "no:warnings", *launch.tests]
            )
            result = json.loads(out.read_text()) if out.exists() else {"tests": {}}
            outcomes[launch.prefix] = result["tests"]
    finally:
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)
    checks = evaluate(expectations(entries, ends, len(series)), outcomes)
    return dict(base=base.version, ends=ends, series=[n for n, _ in series], checks=checks)


def evaluate(wanted: List[dict], outcomes: Dict[int, dict]) -> List[dict]:
    """Each expectation with what the launch on its tree reported (``outcomes``: prefix ->
    nodeid -> {outcome, reason}, as :func:`.run.aggregate` gives) and ``ok``."""
    checks = []
    for x in wanted:
        got = outcomes.get(x["prefix"], {}).get(x["test"], dict(outcome="not run", reason=""))
        why = got.get("reason", "")
        ok = got["outcome"] == x["want"] and (not x["reason"] or any(r in why for r in x["reason"]))
        checks.append(dict(x, outcome=got["outcome"], got_reason=got.get("reason", ""), ok=ok))
    return checks


def print_report(result: dict) -> None:
    """One line per check: the patch, the test, the tree, the outcome (and why, if failed)."""
    print(f"\nper_patch: {result['base']} ({'base vs series' if result['ends'] else 'per patch'})")
    for c in result["checks"]:
        mark = "ok  " if c["ok"] else "FAIL"
        test = c["test"].split("::", 1)[1]
        why = f"  ({c['got_reason'][:140]})" if c["outcome"] in ("failed", "skipped") else ""
        print(f"  {mark} {c['patch'][:44]:44} +{c['prefix']:<2} {c['outcome']:7} {test}{why}")
        if not c["ok"]:
            want = c["want"] + (f" with one of {c['reason']}" if c["reason"] else "")
            print(f"       wanted {want}")
    bad = sum(not c["ok"] for c in result["checks"])
    print(f"  {len(result['checks']) - bad} of {len(result['checks'])} expectations hold")


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    """Parse the arguments, run, print the report (and write it)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="a base from patches/pins.toml (default: primary)")
    parser.add_argument("--patch", action="append", default=[], help="a patch (repeatable)")
    parser.add_argument("--first", action="store_true", help="only each patch's first test")
    parser.add_argument("--ends", action="store_true", help="unpatched base vs whole series")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    parser.add_argument("--json", type=Path, help="write the checks here")
    parser.add_argument("--keep", type=Path, help="keep the trees and reports under this dir")
    args = parser.parse_args(argv)
    try:
        base = load_pins(REPO_ROOT / "patches" / "pins.toml").get(args.base)
        result = run(base, args.patch, args.first, args.ends, args.timeout, args.keep)
    except UserError as exc:
        print(f"per_patch: {exc}", file=sys.stderr)
        return 2
    print_report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if all(c["ok"] for c in result["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
