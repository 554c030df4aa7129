# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""A Megatron-LM checkout carrying the series (the branch ``apply`` makes): the trees its
release tests run on, the build label ``apply`` commits last, and ``verify`` of what ``pip
install`` of the checkout installed.

The patched tree is the checkout's megatron-core at REF (read with git: the work tree does
not matter); the unpatched tree is the commit the series was applied on: REF's first-parent
history less the commits on top whose subjects are a stored series patch's or the label's
(``--base-ref`` names it instead). Both get this repository's new modules where they lack
them, as the pinned bases' trees do.

The label commit makes ``pip install CHECKOUT`` build ``<version>+moerelease.N.HASH``, as
``pip install .`` here does: it stamps ``megatron/core/package_info.py`` (Megatron-LM's
pyproject reads the version from it), adds the new modules and the manifest ``verify`` reads,
and lists the manifest in ``MANIFEST.in`` so the wheel carries it. N counts the series'
commits on the branch; HASH covers the commit applied on, the stored series and its
resolutions for that commit, and the new modules, so ``verify`` recomputes it from this
repository and the manifest alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Callable, Optional

from moe_release.common import REPO_ROOT, UserError, log
from moe_release.series.patches import LABEL_PREFIX, parse_patch, sha256_bytes, stamp_package_info
from moe_release.series.pins import Base, load_pins
from moe_release.series.repo import overlay_files, read_series
from moe_release.series.sdist import sha256_file
from moe_release.series.source import package_version, wanted
from moe_release.series.trees import MANIFEST_PATH, PACKAGE_INFO, write_tree_atomic

LABEL_SUBJECT = "moe-release: label the build megatron-core "
MANIFEST_IN = "MANIFEST.in"
MANIFEST_IN_LINE = f"include {MANIFEST_PATH}\n"
TREES = Path(".build") / "trees"
APPLY_DIR = "apply"  # <series dir>/apply/<commit12>/<patch stem>.diff: resolutions for a commit

Reader = Callable[[str, list[str]], dict[str, Optional[bytes]]]  # (rev, paths) -> files


def bare_subject(subject: str) -> str:
    """A subject without the leading ``[...]`` tags ``git am`` strips."""
    return re.sub(r"^(\[[^]]*\]\s*)+", "", subject)


def series_subjects(root: Path = REPO_ROOT) -> set[str]:
    """The bare subjects of every stored series' patches."""
    out = set()
    for base in load_pins(root / "patches" / "pins.toml").bases.values():
        if (base.series_dir(root) / "series").exists():
            out |= {bare_subject(parse_patch(d, n).subject) for n, d in read_series(base, root)}
    return out


# ----------------------------------------------------------------------------- the label


def checkout_label(
    ref: str, base: Base, applied: int, resolutions: dict[str, bytes], root: Path = REPO_ROOT
) -> str:
    """``moerelease.N.HASH`` of the series of ``base`` applied on commit ``ref``: N its commits
    there, HASH over the commit, the stored series, the resolutions replayed there (file name
    -> bytes) and the new modules (what ``verify`` recomputes)."""
    digest = hashlib.sha256(f"checkout:{ref}".encode())
    items = list(read_series(base, root)) + [(f"{APPLY_DIR}/{n}", d)
                                             for n, d in sorted(resolutions.items())]  # fmt: skip
    for name, data in items + sorted(overlay_files(root)):
        digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return f"{LABEL_PREFIX}.{applied}.{digest.hexdigest()[:10]}"


def stored_resolutions(base: Base, where: Optional[str], root: Path = REPO_ROOT) -> dict:
    """The resolutions stored in ``<series>/apply/<where>/`` (file name -> bytes; none for
    ``where`` None)."""
    rdir = base.series_dir(root) / APPLY_DIR / where if where else None
    if rdir is None or not rdir.is_dir():
        return {}
    return {p.name: p.read_bytes() for p in sorted(rdir.glob("*.diff"))}


def label_files(
    ref: str,
    head: str,
    base: Base,
    applied: list[str],
    read: Reader,
    changed: list[str],
    resolutions: Optional[dict[str, bytes]] = None,
    root: Path = REPO_ROOT,
) -> tuple[str, dict[str, bytes]]:
    """(version, files) of the label commit on ``head`` (the series applied on ``ref``):
    package_info.py stamped, the new modules, the manifest and MANIFEST.in listing it.
    ``read(rev, paths)`` reads files at a commit; ``changed`` the paths the series changed;
    ``resolutions`` those replayed (file name, or ``<commit12>/<file name>`` for one recorded
    at an earlier commit -> bytes)."""
    overlay = dict(overlay_files(root))
    at_head = read(head, sorted({PACKAGE_INFO, MANIFEST_IN, MANIFEST_PATH, *overlay, *changed}))
    why = None
    if at_head.get(PACKAGE_INFO) is None:
        why = f"has no {PACKAGE_INFO} to carry the build label"
    elif at_head.get(MANIFEST_PATH) is not None:
        why = f"already has {MANIFEST_PATH}"
    elif not package_version(at_head[PACKAGE_INFO]):
        why = f"{PACKAGE_INFO} spells no MAJOR/MINOR/PATCH/PRE_RELEASE"
    for rel, data in overlay.items():
        if why is None and at_head.get(rel) not in (None, data):
            why = f"new module {rel} collides with the checkout's file"
    if why is not None:
        raise UserError(f"{ref[:12]}: {why} (--no-label leaves the label commit out)")
    upstream = package_version(at_head[PACKAGE_INFO])
    label = checkout_label(ref, base, len(applied), resolutions or {}, root)
    version = f"{upstream}+{label}"
    files = dict(overlay)
    files[PACKAGE_INFO] = stamp_package_info(at_head[PACKAGE_INFO].decode(), version).encode()
    manifest_in = at_head.get(MANIFEST_IN) or b""
    if MANIFEST_IN_LINE.encode() not in manifest_in:
        sep = b"" if not manifest_in or manifest_in.endswith(b"\n") else b"\n"
        files[MANIFEST_IN] = manifest_in + sep + MANIFEST_IN_LINE.encode()
    final = {p: d for p, d in at_head.items() if d is not None}
    final.update(files)
    hashed = sorted({p for p in [*changed, *overlay, PACKAGE_INFO] if p.startswith("megatron/")}
                    & set(final))  # fmt: skip
    manifest = {
        "name": "megatron-core",
        "version": version,
        "base": {
            "checkout": True,
            "commit": ref,
            "pin": base.name,
            "series": base.series,
            "resolutions": sorted(resolutions or {}),
        },
        "series": applied,
        "files": {p: sha256_bytes(final[p]) for p in hashed},
    }
    files[MANIFEST_PATH] = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    return version, files


def is_checkout_manifest(manifest: dict) -> bool:
    """Whether an installed manifest is of a checkout's build (``apply``'s label commit)."""
    return bool(manifest.get("base", {}).get("checkout"))


def verify_checkout_install(
    core_dir: Path, dist_version: Optional[str], manifest: dict, root: Path = REPO_ROOT
) -> list[str]:
    """Mismatches between an install of a labelled checkout and its manifest, and between its
    label and the one this repository's series gives that commit now (empty: matches)."""
    problems = []
    top = core_dir.parent.parent
    if dist_version != manifest["version"]:
        problems.append(f"installed distribution is megatron-core {dist_version}, its manifest "
                        f"says {manifest['version']}")  # fmt: skip
    for rel, digest in sorted(manifest["files"].items()):
        path = top / rel
        if not path.exists():
            problems.append(f"{rel}: missing")
        elif sha256_file(path) != digest:
            problems.append(f"{rel}: differs from the series")
    record = manifest["base"]
    pins = load_pins(root / "patches" / "pins.toml")
    if record["pin"] not in pins.bases:
        problems.append(f"built with the series of {record['pin']}, which patches/pins.toml no "
                        "longer has")  # fmt: skip
        return problems
    label = manifest["version"].partition("+")[2]
    base = pins.bases[record["pin"]]
    n = len(manifest["series"])
    adir = base.series_dir(root) / APPLY_DIR
    eras = [None] + (sorted(p.name for p in adir.iterdir() if p.is_dir()) if adir.is_dir() else [])
    sets = [stored_resolutions(base, era, root) for era in eras]
    named = {}  # the resolutions the manifest names (<commit12>/<file>: recorded at another)
    for key in record.get("resolutions", []):
        path = adir / (key if "/" in key else f"{record['commit'][:12]}/{key}")
        named[key] = path.read_bytes() if path.is_file() else b""
    labels = [checkout_label(record["commit"], base, n, s, root) for s in [*sets, named]]
    now = labels[0]
    if label not in labels:
        problems.append(f"built from another series than this repository's: label {label}, "
                        f"now {now} (apply again at {record['commit'][:12]})")  # fmt: skip
    return problems


# ----------------------------------------------------------------------------- the trees


@dataclasses.dataclass
class CheckoutTrees:
    """The release tests' trees of a checkout."""

    name: str  # checkout-<commit12>: its name in the matrix
    commit: str  # the patched commit (REF)
    base_commit: str  # the commit without the series
    source: str  # the matrix's source column
    patched: Path
    base: Path
    series_commits: int


ORIGIN = "vendor, moe-release"  # the Origin: trailer every stored series patch carries
LOG_FORMAT = "%H%x00%s%x00%(trailers:key=Origin,valueonly,separator=%x2C)"


def is_series_commit(subject: str, origin: str, subjects: set[str]) -> bool:
    """A commit of the series: its ``Origin:`` trailer is the series' (what apply, --resolve
    and ``git am`` of apply's files commit), or, for a message without trailers, its subject is
    a stored series patch's."""
    return origin.strip() == ORIGIN or bare_subject(subject) in subjects


def unpatched_commit(log_lines: list[tuple[str, ...]], subjects: set[str]) -> tuple[str, int, list]:
    """From a first-parent log, newest first (commit, subject[, Origin trailer]): (the parent
    of the oldest series commit, the series commits, the other commits above it: a person's
    fixes, newest first, as (commit, subject)). Series commits are found by their trailer
    (:func:`is_series_commit`), never by counting; the label commit is neither. Refused where
    the log has no series commit."""
    oldest = None
    for i, (_, subject, *origin) in enumerate(log_lines):
        if not subject.startswith(LABEL_SUBJECT) and is_series_commit(
            subject, origin[0] if origin else "", subjects
        ):
            oldest = i
    if oldest is None or oldest + 1 >= len(log_lines):
        raise UserError("REF carries no series commit (the commits `apply` makes, with the "
                        f"trailer 'Origin: {ORIGIN}')")  # fmt: skip
    n, extra = 0, []
    for commit, subject, *origin in log_lines[: oldest + 1]:
        if subject.startswith(LABEL_SUBJECT):
            continue
        if is_series_commit(subject, origin[0] if origin else "", subjects):
            n += 1
        else:
            extra.append((commit, subject))
    return log_lines[oldest + 1][0], n, extra


def series_branches_hint(co, ref: Optional[str]) -> str:  # co: apply.Checkout
    """The branches apply made in the checkout, for a message (apply's ``moe-release/<commit12>``
    and --resolve's ``...-resolve``; those of the commit ``ref`` names first); "" if none."""
    names = co.out("for-each-ref", "--format=%(refname:short)", "refs/heads/moe-release/").split()
    if not names:
        return ""
    key = (ref or "").rsplit("/", 1)[-1].removesuffix("-resolve")
    names.sort(key=lambda n: (not (key and key in n), n))
    return f" (the branches apply made here: {', '.join(names[:6])})"


def read_tree_files(read_listing: Callable[[str], list[str]], read: Reader, rev: str) -> dict:
    """The sdist-layout files of ``rev`` (megatron/core, megatron/training, packaging)."""
    paths = [p for p in read_listing(rev) if wanted(p)]
    return {p: d for p, d in read(rev, paths).items() if d is not None}


def build_checkout_trees(
    co,  # apply.Checkout
    ref: Optional[str],
    base_ref: Optional[str],
    root: Path = REPO_ROOT,
    line_of: Optional[Callable[[str], Optional[str]]] = None,
) -> CheckoutTrees:
    """Write the patched and unpatched trees of a checkout under
    .build/trees/checkout-<commit12>/{patched,base} (afresh each time) and say what they are;
    ``line_of(commit)``: the Megatron-LM line a commit is on, for the source in words."""
    commit = co.has(ref or "HEAD")
    if commit is None:
        raise UserError(f"{co.path}: unknown ref {ref!r}{series_branches_hint(co, ref)}")
    n, extra = 0, []
    if base_ref is not None:
        base_commit = co.has(base_ref)
        if base_commit is None:
            raise UserError(f"{co.path}: unknown ref {base_ref!r} (--base-ref)")
    else:
        text = co.out("log", "--first-parent", "-n", "128", f"--format={LOG_FORMAT}", commit)
        rows = [tuple(x.split("\0")) for x in text.splitlines()]
        try:
            base_commit, n, extra = unpatched_commit(rows, series_subjects(root))
        except UserError as exc:
            what = f"--ref {ref}" if ref else "HEAD (no --ref given)"
            raise UserError(f"{co.path}: {what}: {exc}; give --ref the branch apply made"
                            f"{series_branches_hint(co, ref)}, or name the commit without the "
                            "series with --base-ref REF0") from None  # fmt: skip

    def listing(rev: str) -> list[str]:
        out = co.out("ls-tree", "-r", "-z", "--full-tree", "--name-only", rev, "--", "megatron")
        top = co.out("ls-tree", "-z", "--name-only", rev)
        return [p for p in (out + "\0" + top).split("\0") if p]

    name = f"checkout-{commit[:12]}"
    dest = root / TREES / name
    shutil.rmtree(dest, ignore_errors=True)
    overlay = dict(overlay_files(root))
    trees = {}
    for kind, rev in (("patched", commit), ("base", base_commit)):
        files = read_tree_files(listing, co.files, rev)
        if "megatron/core/__init__.py" not in files:
            raise UserError(f"{co.path}: {rev[:12]} has no megatron/core")
        for rel, data in overlay.items():
            files.setdefault(rel, data)
        log(f"materializing {dest / kind} ({rev[:12]})")
        write_tree_atomic(files, dest / kind)
        trees[kind] = dest / kind
    version = package_version(co.files(base_commit, [PACKAGE_INFO]).get(PACKAGE_INFO) or b"")
    line = line_of(base_commit) if line_of else None
    where = f"`{line}` " if line else ""
    source = f"Megatron-LM {where}`{base_commit[:12]}` ({version or '?'})"
    if base_ref is None:
        source += f" + {n} series commits"
        if extra:
            source += f" + {len(extra)} of yours"
    else:
        source += f", patched: `{commit[:12]}`"
    return CheckoutTrees(name, commit, base_commit, source, trees["patched"], trees["base"], n)
