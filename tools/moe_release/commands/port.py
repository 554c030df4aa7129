# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""`port`: carry the primary series onto another base's series with a 3-way merge.

A target is a series over another base: a backport series (``patches/backports/<branch>/``,
over the sdist pinned for that branch) or an upstream variant (``patches/upstream/<name>/``,
over the Megatron-LM commit its ``series`` header names, read from a checkout or mirror).
Each primary patch is merged onto the target's tree with the target's already-ported
predecessors, file by file, as ``git apply --3way`` merges: base = the primary tree before the
patch, theirs = after it, ours = the target's tree (``git merge-file``). Per patch the result is

- ``applied``: the merge is clean and nothing is stored for it;
- ``applied, resolution replayed``: what a person changed on top of the merge (conflict markers
  resolved, a part not carried, an adaptation) is stored in the target's
  ``resolutions/<primary patch>.diff`` and replayed;
- ``landed``: the change is already in the target's tree (hunkstate.py's hunk test), dropped;
- ``not carried``: ``resolutions/<primary patch>.skip`` says the target does not take it;
- ``conflict``: the merge left conflicts no stored resolution accounts for (file, hunk and
  both sides reported); nothing is written for that target.

The ported series is written with the export machinery (format-patch flags of git.py): a
patch the target already carries keeps its message, author and date (backports: ``cp:
`fix(moe): …` into `<branch>```, the primary's ``Patch-Name:``); a new one gets the target's
conventions. ``--record`` takes the target's series as it is now as the resolved result and
stores, per patch, the difference between the mechanical merge and it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import tempfile
import textwrap
from pathlib import Path
from typing import Callable, Optional, Sequence

from moe_release import settings
from moe_release.commands.registry import Command, register
from moe_release.common import REPO_ROOT, UserError, log
from moe_release.series.git import GIT_AM_FLAGS, format_patches, git, git_env
from moe_release.series.hunkstate import files_state
from moe_release.series.merge import (
    Conflict,
    Files,
    Resolution,
    apply_with_offset,
    file_diff,
    has_markers,
    merge_patch,
    parse_diff,
    series_states,
)
from moe_release.series.patches import (
    NAME_TRAILER,
    Patch,
    apply_file_patch,
    name_of,
    parse_patch,
    parse_series,
    patch_author,
    patch_stem,
    series_header,
    upstream_subject,
)
from moe_release.series.pins import Base, load_pins
from moe_release.series.repo import read_series, read_series_dir
from moe_release.series.source import available, not_configured, read_base_files
from moe_release.series.trees import os_error

RESOLUTIONS = "resolutions"

APPLIED, REPLAYED, LANDED, SKIPPED, CONFLICT, KEPT = (
    "applied",
    "applied, resolution replayed",
    "landed",
    "not carried",
    "conflict",
    "kept as it is",
)


# ----------------------------------------------------------------------------- targets


@dataclasses.dataclass
class Target:
    """A series over another base that the primary series is ported to."""

    name: str  # the branch (core_r0.18.0) or the variant (main, dev)
    kind: str  # "backport" or "variant"
    sdir: Path
    what: str  # the base, in words
    read: Callable[[Sequence[str]], Files]  # the base's files at these paths (None: absent)
    branch: str = ""
    version: str = ""

    def describe(self) -> str:
        return f"{self.name} ({self.what})"


def target_name(base: Base) -> str:
    """The port target's name for a non-primary base: a commit base's branch (``main``,
    ``dev``), a release branch for the base whose series is ``patches/backports/<branch>``, the
    pin's name for another base of that branch (``0.18.0``)."""
    if base.is_commit or Path(base.series).name == base.branch:
        return base.branch
    return base.name


def all_target_names(root: Path = REPO_ROOT) -> list[str]:
    """Every target, in pins.toml order: the backports, then the commit bases (main, dev)."""
    pins = load_pins(root / "patches" / "pins.toml")
    others = [b for v, b in pins.bases.items() if v != pins.primary]
    return [target_name(b) for b in others if not b.is_commit] + [
        target_name(b) for b in others if b.is_commit
    ]


def get_target(name: str, mirror: Optional[Path], root: Path = REPO_ROOT) -> Target:
    """The target called ``name`` (see :func:`target_name`; a pin's name is accepted too)."""
    pins = load_pins(root / "patches" / "pins.toml")
    for version, base in pins.bases.items():
        if version == pins.primary or name not in (target_name(base), version):
            continue
        if base.is_commit:
            if mirror is None and not available(base):
                raise UserError(
                    f"upstream {base.branch} is {not_configured(base)}, or give --mirror CHECKOUT"
                )
            read_base_files(base, mirror)  # a wrong checkout is refused before any work
            return Target(
                name=target_name(base), kind="variant", sdir=base.series_dir(root),
                what=f"Megatron-LM {base.branch} {base.commit[:12]}",
                read=lambda paths, b=base: _base_reader(b, paths, mirror),
                branch=base.branch, version=version,
            )  # fmt: skip
        return Target(
            name=target_name(base), kind="backport", sdir=base.series_dir(root),
            what=f"megatron-core {version}",
            read=lambda paths, b=base: _base_reader(b, paths, None),
            branch=base.branch, version=version,
        )  # fmt: skip
    known = ", ".join(all_target_names(root))
    raise UserError(f"unknown port target {name!r} (one of {known})")


def _base_reader(base: Base, paths: Sequence[str], checkout: Optional[Path]) -> Files:
    files = read_base_files(base, checkout)
    return {p: files.get(p) for p in paths}


# ----------------------------------------------------------------------------- the port


@dataclasses.dataclass
class Step:
    """What happened to one primary patch on one target."""

    patch: str
    verdict: str
    conflicts: list[Conflict] = dataclasses.field(default_factory=list)
    note: str = ""


@dataclasses.dataclass
class PortResult:
    target: Target
    steps: list[Step]
    patches: list[tuple[str, bytes]]  # the ported series (file name, mbox)
    resolutions: dict[str, Optional[bytes]]  # file name under resolutions/ -> bytes (None: delete)
    ok: bool


def _primary_states(root: Path) -> tuple[list[tuple[str, Patch, Files, Files]], str]:
    """Per primary patch: (name, patch, its files before, after) and the primary version."""
    pins = load_pins(root / "patches" / "pins.toml")
    base = pins.get(None)
    series = read_series(base, root)
    states = series_states(read_base_files(base), series)
    return [(name, *state) for (name, _), state in zip(series, states)], base.version


def _counterpart(patch: Patch, target: Target, primary_names: list[str]) -> str:
    """The primary patch a target's patch comes from."""
    carried = name_of(patch)
    if carried is None:
        raise UserError(f"{target.sdir / patch.name}: lacks a {NAME_TRAILER}: trailer")
    name = f"{carried}.patch"
    if name not in primary_names:
        raise UserError(f"{target.sdir / patch.name}: comes from {name}, not in patches/series")
    return name


def backport_message(patch: Patch, name: str, target: Target, primary_version: str) -> str:
    """A new backport's message, in the backport series' conventions."""
    subject = f"cp: `{upstream_subject(patch.subject)}` into `{target.branch}`"
    intro = textwrap.fill(
        f'Backport of "{patch.subject}" (primary series over megatron-core {primary_version}, '
        f"patches/{name}) to {target.branch} ({target.what}).",
        width=72, break_on_hyphens=False,
    )  # fmt: skip
    lines = patch.message.rstrip("\n").split("\n")
    trailers = []
    while lines and re.match(r"^[A-Za-z-]+: ", lines[-1]):
        trailers.insert(0, lines.pop())
    while lines and not lines[-1].strip():
        lines.pop()
    sign = [t for t in trailers if t.startswith("Signed-off-by: ")]
    rest = [t for t in trailers if not t.startswith("Signed-off-by: ")]
    tail = sign + rest  # the primary's Patch-Name: among them: one name in every series
    return f"{subject}\n\n{intro}\n\n" + "\n".join(lines) + "\n\n" + "\n".join(tail) + "\n"


class _Repo:
    """A scratch git repository: the target base's touched files, the target's existing
    commits (for their messages) and the ported commits."""

    def __init__(self, path: Path):
        self.path = path
        git(path, "init", "--quiet", "--initial-branch=main")
        git(path, "config", "core.autocrlf", "false")
        self.index = path / ".git" / "port-index"

    def commit(self, files: Files, parent: Optional[str], header: Optional[bytes], msg: str,
               author: tuple[str, str, str]) -> str:  # fmt: skip
        env = git_env({"GIT_INDEX_FILE": str(self.index)})
        git(self.path, "read-tree", "--empty", env=env)
        entries = []
        for path, data in sorted(files.items()):
            if data is None:
                continue
            blob = git(self.path, "hash-object", "-w", "--stdin", input=data).decode().strip()
            entries.append(f"100644 {blob}\t{path}\n")
        git(self.path, "update-index", "--index-info", env=env, input="".join(entries).encode())
        tree = git(self.path, "write-tree", env=env).decode().strip()
        if header is not None:  # an existing commit, given another tree and parent
            head, sep, message = header.partition(b"\n\n")
            out = [f"tree {tree}".encode()] + ([f"parent {parent}".encode()] if parent else [])
            out += [h for h in head.split(b"\n") if not h.startswith((b"tree ", b"parent "))]
            raw = b"\n".join(out) + sep + message
            return (
                git(self.path, "hash-object", "-t", "commit", "-w", "--stdin", input=raw)
                .decode().strip()
            )  # fmt: skip
        name, email, date = author
        env = git_env(dict(GIT_AUTHOR_NAME=name, GIT_AUTHOR_EMAIL=email, GIT_AUTHOR_DATE=date,
                           GIT_COMMITTER_DATE=date))  # fmt: skip
        args = ["commit-tree", tree, "-F", "-"] + (["-p", parent] if parent else [])
        return git(self.path, *args, env=env, input=msg.encode()).decode().strip()


def port_target(
    target: Target,
    only: Optional[str] = None,
    record: bool = False,
    root: Path = REPO_ROOT,
    primary: Optional[tuple[list, str]] = None,
) -> PortResult:
    """Port the primary series (or only the patch ``only``) onto ``target``, in memory."""
    states, primary_version = primary or _primary_states(root)
    pnames = [s[0] for s in states]
    if only is not None and only not in pnames:
        raise UserError(f"--patch {only}: not in patches/series (one of {', '.join(pnames)})")
    by_name = {s[0]: s for s in states}
    existing: dict[str, tuple[str, bytes, Patch]] = {}
    order: list[str] = []
    if (target.sdir / "series").exists():
        for fname, data in read_series_dir(target.sdir):
            patch = parse_patch(data, fname)
            origin = _counterpart(patch, target, pnames)
            if origin in existing:
                raise UserError(f"{target.sdir}: two patches come from {origin}")
            existing[origin] = (fname, data, patch)
            order.append(origin)
    rdir = target.sdir / RESOLUTIONS
    stored: dict[str, bytes] = {}
    if rdir.is_dir():
        for path in sorted(rdir.iterdir()):
            stored[path.name] = path.read_bytes()
    stems = {patch_stem(n) for n in pnames}
    stale = [n for n in stored if n.rsplit(".", 1)[0] not in stems]
    if stale:
        raise UserError(
            f"{rdir / stale[0]}: a resolution for no patch of patches/series (renamed or "
            "dropped?): delete it, or record the target again"
        )
    for k, name in enumerate(pnames):  # a patch the target does not carry yet goes after the
        if name in order:  # target's patch from its nearest primary predecessor
            continue
        after = [order.index(p) for p in pnames[:k] if p in order]
        order.insert(max(after) + 1 if after else 0, name)

    paths = sorted(
        {fp.path for s in states for fp in s[1].files}
        | {fp.path for *_, p in existing.values() for fp in p.files}
        | {
            fp.path
            for name, data in stored.items()
            if name.endswith(".diff")
            for fp in parse_diff(Resolution.parse(data).diff, f"{RESOLUTIONS}/{name}")
        }
    )
    base_files = target.read(paths)
    steps: list[Step] = []
    new_resolutions: dict[str, Optional[bytes]] = {}
    ok = True
    with tempfile.TemporaryDirectory(prefix="moe-port-") as tmp:
        repo = _Repo(Path(tmp))
        base_commit = repo.commit(
            base_files, None, None, "base\n", ("base", "base@x", "2000-01-01T00:00:00+00:00")
        )
        git(repo.path, "tag", "base", base_commit)
        # The target's existing commits, for their exact messages, authors and dates.
        git(repo.path, "checkout", "--quiet", "-f", base_commit)
        headers: dict[str, bytes] = {}
        for origin in order:
            if origin in existing:
                fname, data, _ = existing[origin]
                try:
                    git(repo.path, *GIT_AM_FLAGS, input=data)
                except UserError as exc:
                    raise UserError(
                        f"{target.sdir / fname}: does not apply to {target.what}: {exc}"
                    ) from None
                raw = git(repo.path, "cat-file", "commit", "HEAD")
                headers[origin] = raw
        ours: Files = dict(base_files)
        parent = base_commit
        for origin in order:
            _, ppatch, before, after = by_name[origin]
            have = existing.get(origin)
            selected = only is None or origin == only
            step = Step(origin, APPLIED)
            steps.append(step)
            if not selected:
                if have is None:
                    step.verdict, step.note = KEPT, "not carried yet; not selected"
                    continue
                try:
                    for fp in have[2].files:
                        ours[fp.path] = apply_file_patch(ours.get(fp.path), fp, have[0])
                except UserError as exc:
                    step.verdict, step.note = CONFLICT, f"kept as it is, but: {exc}"
                    ok = False
                    break
                step.verdict = KEPT
                parent = repo.commit(ours, parent, headers[origin], "", ("", "", ""))
                continue
            skip = stored.get(f"{patch_stem(origin)}.skip")
            if skip is not None and not record:
                step.verdict, step.note = SKIPPED, skip.decode().strip().splitlines()[0]
                continue
            merged, conflicts = merge_patch(ours, before, after, ppatch)
            result: Files = dict(ours)
            result.update(merged)
            if record:
                if have is None:
                    reason = f"not carried on {target.name}: its series has no patch from it"
                    new_resolutions[f"{patch_stem(origin)}.skip"] = (reason + "\n").encode()
                    new_resolutions[f"{patch_stem(origin)}.diff"] = None
                    step.verdict, step.note = SKIPPED, "recorded"
                    continue
                resolved: Files = dict(ours)
                for fp in have[2].files:
                    resolved[fp.path] = apply_file_patch(resolved.get(fp.path), fp, have[0])
                changed = sorted(
                    p for p in set(result) | set(resolved) if result.get(p) != resolved.get(p)
                )
                diff = b"".join(file_diff(p, result.get(p), resolved.get(p)) for p in changed)
                absent = sorted({c.path for c in conflicts if c.absent})
                new_resolutions[f"{patch_stem(origin)}.skip"] = None
                if diff or absent:
                    res = Resolution(diff, absent)
                    new_resolutions[f"{patch_stem(origin)}.diff"] = res.to_bytes(
                        origin, target.name
                    )
                    step.verdict = (
                        "applied, resolution recorded"
                        if not conflicts
                        else f"{CONFLICT}, resolution recorded"
                    )
                else:
                    new_resolutions[f"{patch_stem(origin)}.diff"] = None
                step.conflicts = conflicts
                result = resolved
            else:
                stored_res = stored.get(f"{patch_stem(origin)}.diff")
                if stored_res is None and have is None and not conflicts:
                    state = files_state({p: ours.get(p) for p in before}, ppatch)
                    if state.verdict == "landed":
                        step.verdict = LANDED
                        continue
                if stored_res is not None:
                    res = Resolution.parse(stored_res)
                    try:
                        for fp in parse_diff(res.diff, f"{RESOLUTIONS}/{patch_stem(origin)}.diff"):
                            result[fp.path] = apply_with_offset(
                                result.get(fp.path), fp, f"{RESOLUTIONS}/{patch_stem(origin)}.diff"
                            )
                    except UserError as exc:
                        step.verdict, step.note, step.conflicts = CONFLICT, str(exc), conflicts
                        ok = False
                        break
                    unresolved = [c for c in conflicts if c.absent and c.path not in res.absent]
                    unresolved += [
                        c for c in conflicts if not c.absent and has_markers(result.get(c.path))
                    ]
                    step.verdict = f"{CONFLICT}, resolution replayed" if conflicts else REPLAYED
                    if conflicts:
                        step.note = f"{len(conflicts)} conflict(s): " + "; ".join(
                            c.describe().split(" (")[0] for c in conflicts
                        )
                    if unresolved:
                        step.verdict, step.conflicts = CONFLICT, unresolved
                        step.note = "the stored resolution does not resolve these"
                        ok = False
                        break
                elif conflicts:
                    step.verdict, step.conflicts = CONFLICT, conflicts
                    ok = False
                    break
            if all(result.get(p) == ours.get(p) for p in result):
                step.verdict, step.note = LANDED, "nothing left to change"
                continue
            ours = result
            if have is not None:
                parent = repo.commit(ours, parent, headers[origin], "", ("", "", ""))
            elif target.kind == "backport":
                msg = backport_message(ppatch, origin, target, primary_version)
                parent = repo.commit(ours, parent, None, msg, patch_author(ppatch))
            else:
                msg = ppatch.subject + "\n\n" + ppatch.message.strip("\n") + "\n"
                parent = repo.commit(ours, parent, None, msg, patch_author(ppatch))
        patches: list[tuple[str, bytes]] = []
        if ok:
            git(repo.path, "update-ref", "--no-deref", "HEAD", parent)
            patches = format_patches(repo.path)
    res_files = {}
    if record:
        res_files = new_resolutions
    return PortResult(target, steps, patches, res_files, ok)


def write_port(result: PortResult) -> tuple[list[str], list[str]]:
    """Write a ported series (and recorded resolutions) into the target's directory; returns
    (written, deleted) file names relative to it. Staged first: a failure leaves it intact."""
    sdir = result.target.sdir
    series_file = sdir / "series"
    old_text = series_file.read_text() if series_file.exists() else ""
    header = series_header(old_text) or (
        f"# Series over {result.target.what} for {result.target.name}, ported from the "
        "primary series (patches/series) by `moe_release.py port`.\n"
    )
    new_series = header + "".join(f"{n}\n" for n, _ in result.patches)
    staged: list[tuple[Path, bytes]] = []
    written, deleted = [], []
    for name, data in result.patches:
        path = sdir / name
        if not path.exists() or path.read_bytes() != data:
            staged.append((path, data))
            written.append(name)
    if old_text != new_series:
        staged.append((series_file, new_series.encode()))
        written.append("series")
    removals = []
    keep = {n for n, _ in result.patches}
    old_names = parse_series(old_text, str(series_file)) if old_text else []
    for name in old_names + [p.name for p in sdir.glob("*.patch")]:
        if name not in keep and (sdir / name).exists() and (sdir / name) not in removals:
            removals.append(sdir / name)
    rdir = sdir / RESOLUTIONS
    for name, data in sorted(result.resolutions.items()):
        path = rdir / name
        if data is None:
            if path.exists():
                removals.append(path)
        elif not path.exists() or path.read_bytes() != data:
            staged.append((path, data))
            written.append(f"{RESOLUTIONS}/{name}")
    tmp_paths: list[tuple[Path, Path]] = []
    try:
        for path, data in staged:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp_paths.append((tmp, path))
            tmp.write_bytes(data)
        for tmp, path in tmp_paths:
            os.replace(tmp, path)
        for path in removals:
            path.unlink()
            deleted.append(str(path.relative_to(sdir)))
        if rdir.is_dir() and not any(rdir.iterdir()):
            rdir.rmdir()
    except OSError as exc:
        for tmp, _ in tmp_paths:
            tmp.unlink(missing_ok=True)
        raise os_error(exc, str(sdir)) from None
    return written, deleted


def report_lines(result: PortResult) -> list[str]:
    """The port's report for one target: per patch its verdict, conflicts with both sides."""
    sdir = result.target.sdir
    where = sdir.relative_to(REPO_ROOT) if sdir.is_relative_to(REPO_ROOT) else sdir
    out = [f"{result.target.describe()} -> {where}:"]
    for step in result.steps:
        note = f" ({step.note})" if step.note else ""
        out.append(f"  {step.verdict:32} {step.patch}{note}")
        for c in step.conflicts:
            out.append(f"      {c.describe()}")
            if c.absent:
                continue
            for side, lines in (("target", c.ours), ("primary", c.theirs)):
                out.append(f"        {side}:")
                shown = (line.decode(errors="replace").rstrip("\n") for line in lines[:12])
                out.extend("          | " + line for line in shown)
                if len(lines) > 12:
                    out.append(f"          | ... ({len(lines) - 12} more lines)")
    return out


def port_all(
    names: Sequence[str],
    mirror: Optional[Path] = None,
    only: Optional[str] = None,
    record: bool = False,
    write: bool = True,
    root: Path = REPO_ROOT,
) -> list[tuple[PortResult, Optional[tuple[list[str], list[str]]]]]:
    """Port onto each target in ``names`` (what the verb runs); a target whose port conflicts is
    not written. Returns (result, (written, deleted) or None) per target."""
    targets = [get_target(name, mirror, root) for name in names]  # bad names before any work
    primary = _primary_states(root)
    out = []
    for target in targets:
        log(f"porting onto {target.describe()}")
        result = port_target(target, only=only, record=record, root=root, primary=primary)
        out.append((result, write_port(result) if result.ok and write else None))
    return out


def configure(parser: argparse.ArgumentParser) -> None:
    """The targets, one patch, the mirror, record or dry run."""
    parser.add_argument(
        "--target",
        action="append",
        metavar="TARGET",
        help="a target (repeatable): a backport branch or base version, main, dev",
    )
    parser.add_argument(
        "--all", action="store_true", help="every target (main and dev need --mirror)"
    )
    parser.add_argument("--patch", metavar="NAME", help="port only this primary patch (file name)")
    parser.add_argument(
        "--mirror",
        metavar="CHECKOUT",
        default=settings.megatron_lm(),
        help="a Megatron-LM clone or mirror holding the main/dev variants' commits "
        "(default: $MOE_RELEASE_MEGATRON_LM)",
    )
    parser.add_argument(
        "--record",
        action="store_true",
        help="take each target's series as it is now as resolved: store, per patch, "
        "its difference from the 3-way merge in the target's resolutions/",
    )
    parser.add_argument("--dry-run", action="store_true", help="report only, write nothing")


def run(args: argparse.Namespace) -> int:
    """Port and report per target; exit status 1 if a target conflicts."""
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


register(
    Command(
        name="port",
        help="carry the primary series onto the backport and upstream variant series (3-way)",
        description="merge each primary patch (or only --patch NAME) onto each target's series "
        "(backports: core_r0.18.0, core_r0.17.0, core_r0.16.0; upstream variants: main, dev), "
        "replaying the resolutions stored in the target's resolutions/, and write the ported "
        "series; reports per target and patch: applied, landed, not carried or conflict "
        "(file, hunk, both sides). Exit status 1 if a target conflicts (it is not written).",
        configure=configure,
        run=run,
    )
)
