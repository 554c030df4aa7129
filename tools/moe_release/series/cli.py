# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""moe-release: maintain the MoE dispatcher patch series over a pinned megatron-core sdist.

Verbs:
  fetch        download the pinned sdist(s) into the cache and verify their sha256
  materialize  base sdist + series + this repo's new modules -> a complete patched tree
  edit         the same tree as a git repo: base commit (tag `base`) + one commit per patch
  export       write the commits of an `edit` repo back into the series (churn-free)
  check        every series applies with zero fuzz, round-trips byte-for-byte, has trailers
  verify       does an installed megatron-core match this repo's series?
  trees        materialize the base and patched trees the tests run against
  label        print the overlay version label of a base's series
  landed       which patches of a series a (newer) checkout already contains
  upstream     export the series for NVIDIA/Megatron-LM (git am-able, DCO-signed)
  port         carry the primary series onto the backport and upstream variant series (3-way)
  apply        carry the nearest series onto a Megatron-LM checkout at any commit (3-way)
  sweep        apply --dry-run on every first-parent commit of main and dev, and a summary
  matrix       the compatibility matrix: base x dispatcher x release tests at the last run

The logic is pure functions over bytes (parse_series, parse_patch, apply_file_patch, ...); the
verbs are thin I/O around them so tests call both.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path
from typing import NoReturn, Optional, Sequence

from moe_release import settings
from moe_release.common import UserError, log
from moe_release.series.checkout import (
    build_checkout_trees,
    is_checkout_manifest,
    verify_checkout_install,
)
from moe_release.series.git import create_edit_repo, export_series
from moe_release.series.nearest import SERIES_START
from moe_release.series.patches import overlay_label, parse_patch
from moe_release.series.pins import load_pins
from moe_release.series.probes import PATHS as PROBE_PATHS
from moe_release.series.probes import releases_line
from moe_release.series.repo import overlay_files, read_series
from moe_release.series.sdist import fetch_sdist
from moe_release.series.source import CHECKOUT_ENV, available, not_configured, read_base_files
from moe_release.series.trees import (
    MANIFEST_PATH,
    check_target_dir,
    ensure_trees,
    load_tree,
    materialize,
)
from moe_release.series.verbs.apply import (
    choose_series,
    history,
    open_checkout,
    run_apply,
    run_record,
    run_resolve,
)
from moe_release.series.verbs.apply import report_lines as apply_report_lines
from moe_release.series.verbs.check import check_base, find_installed_core, verify_installed
from moe_release.series.verbs.landed import landed_states
from moe_release.series.verbs.matrix import (
    compare_lines,
    record_run,
    retention_passed_unpatched,
    table,
    update_file,
)
from moe_release.series.verbs.port import all_target_names, port_all, report_lines
from moe_release.series.verbs.sweep import LINES as SWEEP_LINES
from moe_release.series.verbs.sweep import markdown, summary_lines, sweep
from moe_release.series.verbs.upstream import (
    PREREQUISITES_DIR,
    apply_command,
    check_checkout_dir,
    check_export,
    check_topic,
    export_upstream,
    identity,
    prerequisite_exports,
    target_series,
)


def _cmd_fetch(args: argparse.Namespace) -> int:
    pins = load_pins()
    bases = pins.bases.values() if args.all else [pins.get(args.base)]
    for base in bases:
        if base.is_commit:
            if not available(base):
                print(f"{base.name}: skipped ({not_configured(base)})")
                continue
            files = read_base_files(base)
            print(f"{base.name}: {settings.megatron_lm()} (commit {base.commit[:12]}, tree "
                  f"{base.tree[:12]}… verified; {len(files)} files)")  # fmt: skip
            continue
        path = fetch_sdist(base)
        print(f"{base.version}: {path} (sha256 {base.sha256[:12]}… verified)")
    return 0


def _cmd_materialize(args: argparse.Namespace) -> int:
    if args.through and args.no_series:
        raise UserError("--through and --no-series exclude each other")
    tree = materialize(Path(args.dir), args.base, series=not args.no_series, through=args.through)
    print(f"{args.dir}: megatron-core {tree.version}")
    if tree.base.is_commit:
        print(f"  base: Megatron-LM {tree.base.branch} {tree.base.commit} (pin {tree.base.name}), "
              "commit and tree verified")  # fmt: skip
    else:
        print(f"  base: {tree.base.sdist} ({tree.base.tag}), sha256 verified")
    print(f"  patches: {len(tree.patches)}" + "".join(f"\n    {p}" for p in tree.patches))
    print(f"  new modules: {len(tree.overlay)}" + "".join(f"\n    {p}" for p in tree.overlay))
    return 0


def _cmd_edit(args: argparse.Namespace) -> int:
    base = load_pins().get(args.base)
    check_target_dir(Path(args.dir))
    patches = read_series(base)
    create_edit_repo(Path(args.dir), base, read_base_files(base), patches)
    print(f"{args.dir}: {base.describe()} at tag `base`, {len(patches)} patch commit(s)")
    print("  edit with git (commit --fixup, rebase -i base), then run: export " + args.dir)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    base, written, deleted = export_series(Path(args.dir))
    if not written and not deleted:
        print(f"{base.series}: unchanged")
    for name in written:
        print(f"{base.series}/{name}: written")
    for name in deleted:
        print(f"{base.series}/{name}: deleted")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    pins = load_pins()
    versions = [args.base] if args.base else sorted(pins.bases, key=lambda v: v != pins.primary)
    failed = False
    for version in versions:
        base = pins.get(version)
        if not (base.series_dir() / "series").exists():
            if version == pins.primary:
                print(f"{version}: FAIL no series file in {base.series}")
                failed = True
            else:
                print(f"{version}: no series yet ({base.series})")
            continue
        if not available(base):
            if args.base:
                read_base_files(base)  # named: refused, saying what to set
            print(f"{version}: skipped ({not_configured(base)})")
            continue
        log(f"checking the series for {version}")
        problems = check_base(base)
        n = len(read_series(base)) if not problems else None
        if problems:
            failed = True
            print(f"{version}: FAIL")
            for problem in problems:
                print(f"  {problem}")
        else:
            print(f"{version}: OK ({n} patches apply with zero fuzz, round-trip, trailers present)")
    return 1 if failed else 0


def _cmd_verify(args: argparse.Namespace) -> int:
    load_pins().get(args.base)  # an unknown --base before the interpreter is asked
    core_dir, dist_version = find_installed_core(args.python)
    code = _verify(args, core_dir, dist_version)
    print(f"  the install {installed_releases(core_dir)}")
    return code


def installed_releases(core_dir: Path) -> str:
    """What an installed megatron-core releases, of the backends and paths it has, and what it
    leaves unreleased (probes.releases_line on its files)."""
    top = core_dir.parent.parent
    files = {}
    for path in PROBE_PATHS:
        try:
            files[path] = (top / path).read_bytes()
        except OSError:
            files[path] = None
    return releases_line(files)


def _verify(args: argparse.Namespace, core_dir: Path, dist_version: Optional[str]) -> int:
    manifest = _installed_manifest(core_dir)
    if args.base is None and manifest is not None and is_checkout_manifest(manifest):
        return _verify_checkout(core_dir, dist_version, manifest)
    base = args.base if args.base is not None else _installed_pin(manifest)
    tree = load_tree(base)
    problems = verify_installed(core_dir, dist_version, tree)
    if problems:
        print(
            f"MISMATCH: megatron-core at {core_dir} does not match this repo's series "
            f"({tree.version})"
        )
        for problem in problems:
            print(f"  {problem}")
        print(f"  to fix: reinstall it from this repository (`MOE_RELEASE_BASE={tree.base.name} "
              "pip install .`), or name the base it was built on with --base")  # fmt: skip
        return 1
    n = len(json.loads(tree.files[MANIFEST_PATH])["files"])
    print(f"OK: megatron-core {dist_version} at {core_dir} matches the series ({n} files hashed)")
    return 0


def _installed_pin(manifest: Optional[dict]) -> Optional[str]:
    """The pinned base an installed wheel's manifest names (its sdist's sha256); None (the
    primary) if there is no manifest or it names no pinned base."""
    sha = ((manifest or {}).get("base") or {}).get("sha256")
    for base in load_pins().bases.values():
        if sha and not base.is_commit and base.sha256 == sha:
            return base.name
    return None


def _installed_manifest(core_dir: Path) -> Optional[dict]:
    path = core_dir.parent.parent / MANIFEST_PATH
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _verify_checkout(core_dir: Path, dist_version: Optional[str], manifest: dict) -> int:
    """verify of an install of a checkout carrying the series (apply's label commit)."""
    base = manifest["base"]
    what = f"the series of {base['pin']} applied on Megatron-LM {base['commit'][:12]}"
    problems = verify_checkout_install(core_dir, dist_version, manifest)
    if problems:
        print(f"MISMATCH: megatron-core at {core_dir} does not match {what}")
        for problem in problems:
            print(f"  {problem}")
        return 1
    print(f"OK: megatron-core {dist_version} at {core_dir} matches {what} "
          f"({len(manifest['files'])} files hashed)")  # fmt: skip
    return 0


def _cmd_trees(args: argparse.Namespace) -> int:
    if args.from_checkout:
        return _checkout_trees(args)
    if args.ref or args.base_ref:
        raise UserError("--ref and --base-ref go with --from-checkout")
    if args.list:
        print(" ".join(listed_bases()))
        return 0
    base, patched = ensure_trees(version=args.base)
    print(f"export MOE_RELEASE_BASE_TREE={shlex.quote(str(base))}")
    print(f"export MOE_RELEASE_TREE={shlex.quote(str(patched))}")
    return 0


def _checkout_trees(args: argparse.Namespace) -> int:
    """trees --from-checkout: a checkout's patched and unpatched trees, as shell exports."""
    co = open_checkout(Path(args.from_checkout))
    mirror = settings.megatron_lm()
    with tempfile.TemporaryDirectory(prefix="moe-trees-") as tmp:

        def line_of(commit: str) -> Optional[str]:
            try:
                hist = history(co, Path(mirror) if mirror else None, Path(tmp))
                return choose_series(hist, commit).line
            except UserError:
                return None  # no stored base in reach: the source names the commit only

        trees = build_checkout_trees(co, args.ref, args.base_ref, line_of=line_of)
    for key, value in (("MOE_RELEASE_BASE_TREE", trees.base), ("MOE_RELEASE_TREE", trees.patched),
                       ("MOE_RELEASE_RUN_NAME", trees.name),
                       ("MOE_RELEASE_RUN_SOURCE", trees.source)):  # fmt: skip
        print(f"export {key}={shlex.quote(str(value))}")
    return 0


BASES_ENV = settings.BASES


def listed_bases() -> list[str]:
    """What `trees --list` prints (and `run-tests` loops over): the primary base first, then
    every base with a series whose files can be read here, in pins.toml order; a base pinned
    with ``ci = false`` only when ``$MOE_RELEASE_BASES`` asks for it. ``$MOE_RELEASE_BASES``
    (names, space- or comma-separated, or ``all``) replaces the default selection."""
    pins = load_pins()
    chosen = settings.bases()
    for name in chosen:
        if name != "all":
            pins.get(name)  # an unknown name is an error, not an empty loop
    out = [pins.primary]
    for name, base in pins.bases.items():
        if name == pins.primary or not (base.series_dir() / "series").exists():
            continue
        if chosen and "all" not in chosen and name not in chosen:
            continue
        if not chosen and not base.ci:
            log(f"skipping {name}: ci = false in patches/pins.toml ({BASES_ENV}={name} runs it)")
            continue
        if not available(base):
            log(f"skipping {name}: {not_configured(base)}")
            continue
        out.append(name)
    return out


def _cmd_label(args: argparse.Namespace) -> int:
    base = load_pins().get(args.base)
    patches = read_series(base) if not args.no_series else []
    print(f"{base.version}+{overlay_label(base, patches, overlay_files())}")
    return 0


def _cmd_landed(args: argparse.Namespace) -> int:
    if args.target:
        series, what = target_series(args.target), f"upstream {args.target} series"
    else:
        base = load_pins().get(args.base)
        series, what = read_series(base), f"series for {base.version}"
    patches = [parse_patch(data, name) for name, data in series]
    checkout = Path(args.checkout)
    states = landed_states(checkout, patches)
    print(f"{what} against {checkout}:")
    for state in states:
        print(f"  {state.verdict:22} {state.name} ({state.counts()})")
    landed = [s.name for s in states if s.verdict == "landed"]
    print(f"{len(landed)} of {len(states)} landed" + (": drop them on rebase" if landed else ""))
    return 0


def _cmd_upstream(args: argparse.Namespace) -> int:
    target_series(args.target)  # bad arguments first, before anything is written
    check_topic(args.topic, exported=True)
    outdir = check_target_dir(Path(args.outdir))
    if args.check:
        check_checkout_dir(Path(args.check))
    ident = identity()
    notes: list = []
    paths = export_upstream(args.target, outdir, ident, args.topic, notes=notes)
    print(f"wrote {len(paths)} {args.topic} patches for {args.target} to {outdir}, "
          f"signed off by {ident[0]} <{ident[1]}>")  # fmt: skip
    first = prerequisite_exports(outdir)
    if first:
        print(f"the {args.topic} PR builds on {len(first)} PRs, which must merge first; their "
              f"exports (as `upstream {args.target} DIR --topic T` writes them) are in "
              f"{outdir / PREREQUISITES_DIR}, in merge order:")  # fmt: skip
        for k, (dep, dep_paths) in enumerate(first, 1):
            print(f"  {k}. {dep}: {len(dep_paths)} patches in "
                  f"{outdir / PREREQUISITES_DIR / f'{k}-{dep}'}")  # fmt: skip
    for note in notes:
        print(f"note: {note}")
    if paths:
        what = ", prerequisites first" if first else ""
        print(f"to apply to {args.target}{what}: {apply_command(outdir)}")
    if args.check:
        lines = check_export(paths, Path(args.check), args.ref or args.target, ident, first)
        for line in lines:
            print(f"check: {line}")
    return 0


def _cmd_port(args: argparse.Namespace) -> int:
    if args.all == bool(args.target):
        raise UserError("name the targets: --target TARGET (repeatable) or --all")
    names = all_target_names() if args.all else args.target
    mirror = Path(args.mirror) if args.mirror else None
    results = port_all(names, mirror, args.patch, args.record, write=not args.dry_run)
    failed = False
    for result, written in results:
        for line in report_lines(result):
            print(line)
        if not result.ok:
            failed = True
            print("  CONFLICT: nothing written for this target; resolve it in the target's series "
                  "(edit --base / export), then record it: port --record --target "
                  f"{result.target.name} --patch NAME")  # fmt: skip
        elif written is None:
            print("  (dry run: nothing written)")
        elif not written[0] and not written[1]:
            print("  unchanged")
        else:
            for name in written[0]:
                print(f"  written: {name}")
            for name in written[1]:
                print(f"  deleted: {name}")
    return 1 if failed else 0


def _cmd_apply(args: argparse.Namespace) -> int:
    mirror = Path(args.mirror) if args.mirror else None
    if args.record:
        if args.dry_run or args.out or args.branch:
            raise UserError("--record writes resolutions only: no --dry-run, --out or --branch")
        for line in run_record(Path(args.checkout), args.ref, args.record, mirror,
                               series_name=args.series):  # fmt: skip
            print(line)
        return 0
    if args.resolve:
        if args.dry_run or args.out or args.branch:
            raise UserError("--resolve makes its own branch: no --dry-run, --out or --branch")
        done_all, lines = run_resolve(Path(args.checkout), args.ref, Path(args.resolve), mirror,
                                      series_name=args.series,
                                      label=not args.no_label)  # fmt: skip
        for line in lines:
            print(line)
        return 0 if done_all else 1
    co, result, done = run_apply(
        Path(args.checkout), args.ref, args.dry_run,
        Path(args.out) if args.out else None, args.branch,
        mirror, series_name=args.series, label=not args.no_label,
    )  # fmt: skip
    for line in apply_report_lines(co, result):
        print(line)
    if not result.ok:
        ref = f" --ref {result.ref[:12]}"
        print(f"CONFLICT: nothing written; the checkout is as it was. To resolve it by hand: "
              f"`moe_release.py apply {args.checkout}{ref} --resolve DIR` (a work tree for you, "
              "then --record stores what you did), or apply at another --ref")  # fmt: skip
        return 1
    for line in done:
        print(line)
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    co = open_checkout(Path(args.checkout))
    lines = tuple(args.line or SWEEP_LINES)
    rows, facts = sweep(co, lines, args.since, args.until, args.every,
                        Path(args.mirror) if args.mirror else None,
                        progress=lambda m: log(m))  # fmt: skip
    if not args.quiet:
        for r in rows:
            print(f"{r.line:4} {r.date} {r.commit[:12]} {r.series:14} {r.codes}"
                  + (f"  {r.conflict}" if r.conflict else ""))  # fmt: skip
    for line in summary_lines(rows, facts):
        print(line)
    if args.write:
        command = "moe_release.py sweep CHECKOUT " + " ".join(
            f"--{k} {v}" for k, v in (("since", args.since), ("until", args.until),
                                      ("every", args.every)) if v not in (None, 1))  # fmt: skip
        out = Path(args.write)
        tmp = out.with_name(f".{out.name}.tmp")
        try:
            tmp.write_text(markdown(rows, facts, command.strip()))
            os.replace(tmp, out)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise UserError(f"--write {out}: {exc.strerror or exc}") from None
        print(f"written: {args.write}")
    return 0 if all(r.whole for r in rows) else 1


def _cmd_matrix(args: argparse.Namespace) -> int:
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


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose error for an unknown verb or flag names the closest known one."""

    def error(self, message: str) -> NoReturn:
        word, known = None, []
        choice = re.search(r"invalid choice: '([^']*)'", message)
        if choice:
            word, known = choice.group(1), [str(c) for c in self._subparser_choices()]
        extra = re.search(r"unrecognized arguments: (\S+)", message)
        if extra:
            word = extra.group(1).split("=")[0]
            known = [o for p in (self, *self._subparser_choices().values())
                     for a in p._actions for o in a.option_strings]  # fmt: skip
        near = difflib.get_close_matches(word, known, n=1, cutoff=0.6) if word else []
        super().error(message + (f"; did you mean {near[0]}?" if near else ""))

    def _subparser_choices(self) -> dict:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = _Parser(prog="moe_release.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    def verb(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("--base", help="base from patches/pins.toml (default: primary)")
        p.add_argument(
            "--checkout",
            dest="megatron_lm",
            metavar="PATH",
            help="Megatron-LM clone or `git archive` (tar or extracted) of a commit base "
            f"(default: ${CHECKOUT_ENV})",
        )
        return p

    p = verb("fetch", "download the pinned sdist into the cache and verify its sha256")
    p.add_argument("--all", action="store_true", help="every pinned base")
    p.set_defaults(func=_cmd_fetch)
    p = verb("materialize", "write base + series + new modules as a complete tree to DIR")
    p.add_argument("dir", metavar="DIR", help="target directory (absent or empty)")
    p.add_argument("--no-series", action="store_true", help="base and new modules only")
    p.add_argument(
        "--through",
        metavar="PATCH",
        help="apply the series only up to the patch whose name contains PATCH (bisecting, "
        "measuring one patch's effect)",
    )
    p.set_defaults(func=_cmd_materialize)
    p = verb("edit", "create a git repo at DIR: base commit (tag `base`) + one commit per patch")
    p.add_argument("dir", metavar="DIR", help="target directory (absent or empty)")
    p.set_defaults(func=_cmd_edit)
    p = sub.add_parser("export", help="write an edit repo's commits back into the series",
                       description="write an edit repo's commits back into the series")  # fmt: skip
    p.add_argument("dir", metavar="DIR", help="a repo made by `edit`")
    p.set_defaults(func=_cmd_export)
    p = verb("check", "apply every series with zero fuzz, round-trip it, check trailers")
    p.set_defaults(func=_cmd_check)
    p = verb("verify", "report whether an installed megatron-core matches this repo's series")
    p.add_argument("--python", default=sys.executable, help="interpreter of the environment")
    p.set_defaults(func=_cmd_verify)
    p = verb(
        "trees", "materialize the base and patched trees the tests run against, under .build/trees"
    )
    p.description = (
        "materialize a base's pristine and patched trees under .build/trees; prints shell "
        "exports of MOE_RELEASE_BASE_TREE and MOE_RELEASE_TREE"
    )
    p.add_argument(
        "--list",
        action="store_true",
        help="print the bases whose release tests run-tests runs: the primary, then each base "
        f"with a series that can be read here (commit bases need ${CHECKOUT_ENV}; "
        f"${BASES_ENV} chooses)",
    )
    p.add_argument(
        "--from-checkout",
        metavar="DIR",
        help="instead: the trees of a Megatron-LM git checkout carrying the series (apply's "
        "branch), under .build/trees/checkout-<commit12>: patched = DIR at --ref as committed, "
        "unpatched = the commit below its series commits (or --base-ref)",
    )
    p.add_argument("--ref", help="with --from-checkout: the patched commit (default: HEAD)")
    p.add_argument("--base-ref", metavar="REF0",
                   help="with --from-checkout: the commit without the series")  # fmt: skip
    p.set_defaults(func=_cmd_trees)
    p = verb("label", "print the overlay version (base+label) of the series")
    p.add_argument("--no-series", action="store_true", help="label of the base + new modules only")
    p.set_defaults(func=_cmd_label)
    p = verb("landed", "report which patches a newer checkout already contains (rebase aid)")
    p.add_argument("checkout", metavar="CHECKOUT", help="a tree holding megatron/core")
    p.add_argument("--target", help="check the series `upstream TARGET` exports (e.g. dev)")
    p.set_defaults(func=_cmd_landed)
    p = sub.add_parser(
        "upstream",
        help="export the series for NVIDIA/Megatron-LM: git am-able, DCO-signed, upstream style",
        description="write the series for TARGET (core_r0.19.0: the primary series; main, dev: "
        "their variants in patches/upstream/; core_r0.18.0, core_r0.17.0, core_r0.16.0: the "
        "backport series) as 0001-... mboxes into OUTDIR",
    )
    p.add_argument("target", metavar="TARGET", help="upstream ref the export is for")
    p.add_argument("outdir", metavar="OUTDIR", help="target directory (absent or empty)")
    p.add_argument(
        "--check", metavar="CHECKOUT", help="git am the export (prerequisites first) onto a clone"
    )
    p.add_argument("--ref", help="ref of CHECKOUT to apply to (default: TARGET)")
    p.add_argument("--topic", default="memory",
                   help="which PR (patches/topics.toml): dispatcher-state, a2a-overlap, "
                   "hybridep-groups, comm-buffers (which builds on dispatcher-state and "
                   "hybridep-groups: their exports go to OUTDIR/prerequisites/), cpu-import, or "
                   "memory (the first four as one series, the default)")  # fmt: skip
    p.set_defaults(func=_cmd_upstream)
    p = sub.add_parser(
        "port",
        help="carry the primary series onto the backport and upstream variant series (3-way)",
        description="merge each primary patch (or only --patch NAME) onto each target's series "
        "(backports: core_r0.18.0, core_r0.17.0, core_r0.16.0; upstream variants: main, dev), "
        "replaying the resolutions stored in the target's resolutions/, and write the ported "
        "series; reports per target and patch: applied, landed, not carried or conflict "
        "(file, hunk, both sides). Exit status 1 if a target conflicts (it is not written).",
    )
    p.add_argument(
        "--target",
        action="append",
        metavar="TARGET",
        help="a target (repeatable): a backport branch or base version, main, dev",
    )
    p.add_argument("--all", action="store_true", help="every target (main and dev need --mirror)")
    p.add_argument("--patch", metavar="NAME", help="port only this primary patch (file name)")
    p.add_argument(
        "--mirror",
        metavar="CHECKOUT",
        default=settings.megatron_lm(),
        help="a Megatron-LM clone or mirror holding the main/dev variants' commits "
        "(default: $MOE_RELEASE_MEGATRON_LM)",
    )
    p.add_argument(
        "--record",
        action="store_true",
        help="take each target's series as it is now as resolved: store, per patch, "
        "its difference from the 3-way merge in the target's resolutions/",
    )
    p.add_argument("--dry-run", action="store_true", help="report only, write nothing")
    p.set_defaults(func=_cmd_port)  # fmt: skip
    p = sub.add_parser(
        "apply",
        help="carry the nearest series onto a Megatron-LM git checkout at any commit (3-way)",
        description="find the stored series nearest to REF (REF on main, dev or a release "
        "branch; of the stored bases, the one whose files the series change differ least from "
        "REF's, then the fewest commits apart), merge each of its patches onto REF (3-way, "
        "replaying resolutions stored in <series>/apply/<commit12>/) and commit each on a new "
        "branch, or write git am -3-able files to --out. Reports per patch: applied, landed, "
        "not applicable (with the evidence) or conflict (file, hunk, both sides). Exit status "
        "1 on a conflict (nothing is written), 2 on bad input; HEAD, the index and the work "
        "tree are never touched.",
    )
    p.add_argument("checkout", metavar="CHECKOUT", help="a Megatron-LM git checkout (clean)")
    p.add_argument("--ref", help="the commit to apply to (default: HEAD)")
    p.add_argument("--dry-run", action="store_true", help="report only, write nothing")
    p.add_argument("--series", metavar="PIN",
                   help="take this pinned base's series (e.g. main-d98e8a6, 0.18.0) instead of "
                   "the nearest")  # fmt: skip
    p.add_argument("--out", metavar="DIR", help="write git am-able files here instead of a branch")
    p.add_argument("--branch", metavar="NAME",
                   help="the new branch (default: moe-release/<commit12>)")  # fmt: skip
    p.add_argument("--no-label", action="store_true",
                   help="leave out the last commit, which makes pip install of the checkout "
                   "build <version>+moerelease.N.HASH (stamps package_info.py, adds the new "
                   "modules and the manifest verify reads)")  # fmt: skip
    p.add_argument(
        "--record",
        metavar="RESOLVED",
        help="store what a person did: RESOLVED is a commit of CHECKOUT on REF with one "
        "commit per patch to apply there, in order; per patch its difference from the 3-way "
        "merge is stored in <series>/apply/<commit12>/ (nothing else is written)",
    )
    p.add_argument(
        "--resolve",
        metavar="DIR",
        help="a work tree DIR (added on branch moe-release/<commit12>-resolve) where a person "
        "resolves the conflicts: the patches are committed in turn up to the first conflict, "
        "whose 3-way merge (conflict markers included) is left in DIR; commit the resolution "
        "and run the same command again. A finished branch gets the label commit (not with "
        "--no-label), so pip install and verify know it; --record it to store the resolutions "
        "for others (exit 1 while a conflict or a failed probe is left)",
    )
    p.add_argument(
        "--mirror",
        metavar="CHECKOUT",
        default=settings.megatron_lm(),
        help="a Megatron-LM git mirror whose history and bases' files count too, for a "
        "CHECKOUT that has not fetched the stored bases (default: $MOE_RELEASE_MEGATRON_LM)",
    )
    p.set_defaults(func=_cmd_apply)
    p = sub.add_parser(
        "sweep",
        help="apply --dry-run on every first-parent commit of main and dev since a date",
        description="Choose and merge the series as apply --dry-run does on every first-parent "
        "commit of main and dev since --since (every Nth with --every), with no work tree: per "
        "commit the series and each patch's verdict, then per line how many take the whole "
        "series with no person and the conflicts grouped by hunk. Exit status 1 if a commit "
        "conflicts, 2 on bad input.",
    )
    p.add_argument("checkout", metavar="CHECKOUT", help="a Megatron-LM clone or mirror")
    p.add_argument("--since", default=str(SERIES_START), help="first date (default %(default)s)")
    p.add_argument("--until", help="last date (default: the line's head)")
    p.add_argument("--line", action="append", choices=SWEEP_LINES,
                   help="main or dev (repeatable; default both)")  # fmt: skip
    p.add_argument("--every", type=int, default=1, help="keep every Nth commit (default 1)")
    p.add_argument("--mirror", metavar="CHECKOUT",
                   help="a Megatron-LM mirror to read the stored bases from")  # fmt: skip
    p.add_argument("--write", metavar="FILE", help="write the table of every commit (markdown)")
    p.add_argument("--quiet", action="store_true", help="print the summary only")
    p.set_defaults(func=_cmd_sweep)
    p = sub.add_parser(
        "matrix",
        help="print the compatibility matrix (base x dispatcher x release tests, last run)",
        description="print the compatibility matrix as a markdown table: per pinned base with a "
        "series, per dispatcher, the release tests that ran and passed at the last run recorded "
        "by scripts/run-tests under .build/test-runs",
    )
    p.add_argument("--update", metavar="FILE", help="rewrite the table between the markers in FILE")
    p.add_argument("--record", metavar="BASE", help="record a run of BASE's tests (run-tests)")
    p.add_argument("--junit", metavar="XML", help="with --record: the run's JUnit XML")
    p.add_argument("--seconds", type=int, default=0, help="with --record: the run's wall time")
    p.add_argument("--status", type=int, default=0, help="with --record: pytest's exit status")
    p.add_argument("--source", help="with --record checkout-<commit12>: the checkout in words")
    p.add_argument("--tree", help="with --record checkout-<commit12>: its patched tree")
    p.add_argument("--unpatched-junit", metavar="XML",
                   help="with --record checkout-<commit12>: the run on the commit without the "
                   "series")  # fmt: skip
    p.set_defaults(func=_cmd_matrix)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: user errors are one line on stderr and exit status 2."""
    args = build_parser().parse_args(argv)
    if getattr(args, "megatron_lm", None):
        os.environ[CHECKOUT_ENV] = args.megatron_lm
    try:
        return args.func(args)
    except UserError as exc:
        print(f"moe_release.py {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
