# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Materialized trees: base + series + overlay in memory, the manifest, atomic writes."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import py_compile
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Optional, Sequence

from moe_release.common import REPO_ROOT, UserError, log
from moe_release.series.patches import (
    apply_file_patch,
    overlay_label,
    parse_patch,
    sha256_bytes,
    stamp_package_info,
)
from moe_release.series.pins import Base, load_pins
from moe_release.series.repo import overlay_files, read_series
from moe_release.series.source import read_base_files

MANIFEST_PATH = "megatron/core/_moe_release_manifest.json"
PACKAGE_INFO = "megatron/core/package_info.py"


@dataclasses.dataclass
class Tree:
    """A materialized tree in memory."""

    base: Base
    files: dict[str, bytes]
    patches: list[str]
    touched: list[str]  # files changed by the series
    overlay: list[str]  # files added from this repo
    label: str

    @property
    def version(self) -> str:
        """The overlay's PEP 440 version."""
        return f"{self.base.version}+{self.label}"

    @property
    def dirname(self) -> str:
        """The directory name of this tree under .build/trees: the pin's name and the label."""
        return f"{self.base.name}+{self.label}"


def build_tree(
    base: Base,
    base_files: dict[str, bytes],
    patches: Sequence[tuple[str, bytes]],
    overlay: Sequence[tuple[str, bytes]],
    stamp: bool = True,
    compile_check: bool = False,
) -> Tree:
    """Apply the series and add the overlay, in memory; raises UserError naming what failed."""
    files = dict(base_files)
    touched: list[str] = []
    for name, data in patches:
        patch = parse_patch(data, name)
        changed = []
        for fp in patch.files:
            new = apply_file_patch(files.get(fp.path), fp, name)
            if new is None:
                files.pop(fp.path, None)
            else:
                files[fp.path] = new
                changed.append(fp.path)
            if fp.path not in touched:
                touched.append(fp.path)
        if compile_check:
            _compile_sources(name, {p: files[p] for p in changed if p.endswith(".py")})
    names = []
    for rel, data in overlay:
        if rel in base_files:
            raise UserError(f"overlay file {rel} collides with upstream {base.describe()}")
        if rel in files:
            raise UserError(f"overlay file {rel} collides with a file created by the series")
        files[rel] = data
        names.append(rel)
    label = overlay_label(base, patches, overlay)
    tree = Tree(base, files, [n for n, _ in patches], touched, names, label)
    if stamp:
        files[PACKAGE_INFO] = stamp_package_info(
            files[PACKAGE_INFO].decode(), tree.version
        ).encode()
        if MANIFEST_PATH in base_files:
            raise UserError(f"{MANIFEST_PATH} collides with upstream {base.describe()}")
        files[MANIFEST_PATH] = manifest_bytes(tree)
    return tree


def manifest_bytes(tree: Tree) -> bytes:
    """What this tree was built from, and the hashes `verify` compares."""
    hashed = sorted(set(tree.touched + tree.overlay + [PACKAGE_INFO]) & set(tree.files))
    manifest = {
        "name": "megatron-core",
        "version": tree.version,
        "base": base_record(tree.base),
        "series": tree.patches,
        "files": {p: sha256_bytes(tree.files[p]) for p in hashed},
    }
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()


def base_record(base: Base) -> dict:
    """What the manifest records of the base: the sdist and its sha256, or the commit."""
    if base.is_commit:
        return {"name": base.name, "version": base.version, "commit": base.commit,
                "tree": base.tree, "branch": base.branch}  # fmt: skip
    return {"version": base.version, "sdist": base.sdist, "sha256": base.sha256, "tag": base.tag}


def _compile_sources(patch_name: str, sources: dict[str, bytes]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for rel, data in sources.items():
            path = Path(tmp) / "src.py"
            path.write_bytes(data)
            try:
                py_compile.compile(str(path), cfile=str(Path(tmp) / "src.pyc"), doraise=True)
            except py_compile.PyCompileError as exc:
                raise UserError(
                    f"{patch_name}: {rel} does not compile after this patch: {exc.msg}"
                ) from None


def series_through(patches: list, through: str, series_name: str) -> list:
    """The series up to and including the one patch whose name contains ``through``."""
    found = [i for i, (name, _) in enumerate(patches) if through in name]
    if len(found) != 1:
        names = "".join(f"\n  {name}" for name, _ in patches)
        what = "no patch" if not found else f"{len(found)} patches"
        raise UserError(f"--through {through}: {what} of {series_name} match; its patches:{names}")
    return patches[: found[0] + 1]


def load_tree(
    version: Optional[str] = None,
    series: bool = True,
    root: Path = REPO_ROOT,
    compile_check: bool = False,
    through: Optional[str] = None,
) -> Tree:
    """Pins + the base's files (cached sdist or Megatron-LM checkout) + repo series + overlay ->
    Tree. ``through``: only the series' patches up to the one whose name contains it."""
    pins = load_pins(root / "patches" / "pins.toml")
    base = pins.get(version)
    patches = read_series(base, root) if series else []
    if through is not None:
        patches = series_through(patches, through, f"the series of {base.name}")
    base_files = read_base_files(base)
    return build_tree(base, base_files, patches, overlay_files(root), compile_check=compile_check)


def check_target_dir(dest: Path) -> Path:
    """The absolute path of an output directory a user named, refused (UserError naming it)
    unless it can be written as a whole: absent or an empty directory, inside an existing,
    writable directory. Nothing is created here; parents are not made up."""
    dest = dest.absolute()
    if dest.is_symlink() or dest.exists():
        if not dest.is_dir():
            raise UserError(f"{dest}: target exists and is not a directory")
        if any(dest.iterdir()):
            raise UserError(f"{dest}: target exists and is not empty")
    parent = dest.parent
    if not parent.exists():
        raise UserError(f"{parent}: the target's parent directory does not exist (create it first)")
    if not parent.is_dir():
        raise UserError(f"{parent}: the target's parent is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{parent}: the target's parent directory is not writable")
    return dest


def os_error(exc: OSError, what: str) -> UserError:
    """A UserError naming the path an OSError is about (or ``what``) and why, on one line."""
    path = exc.filename if exc.filename is not None else what
    return UserError(f"{path}: {exc.strerror or exc}")


@contextlib.contextmanager
def atomic_directory(dest: Path, make_parents: bool = True) -> Iterator[Path]:
    """A fresh temp dir beside dest, renamed to dest when the block succeeds, removed if not.

    dest must be absent or an empty directory; nothing is left half-written either way. With
    ``make_parents`` false, a missing parent is refused instead of created (what a user names).
    An OS error (read-only file system, no space, ...) is a UserError naming the path.
    """
    dest = dest.absolute()
    if not make_parents:
        check_target_dir(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UserError(f"{dest}: target exists and is not empty")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp-"))
    except OSError as exc:
        raise UserError(f"{dest}: cannot create the target: {exc.strerror or exc}") from None
    try:
        try:
            yield tmp
            if dest.exists():
                dest.rmdir()
            os.rename(tmp, dest)
        except OSError as exc:
            raise os_error(exc, str(dest)) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_files(root: Path, files: dict[str, bytes]) -> None:
    """Write {relative path: bytes} under root."""
    for rel, data in sorted(files.items()):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def write_tree_atomic(files: dict[str, bytes], dest: Path, make_parents: bool = True) -> None:
    """Write files under a fresh temp dir beside dest, then rename it into place."""
    with atomic_directory(dest, make_parents) as tmp:
        write_files(tmp, files)


def materialize(
    dest: Path,
    version: Optional[str] = None,
    series: bool = True,
    root: Path = REPO_ROOT,
    through: Optional[str] = None,
) -> Tree:
    """Write a complete patched megatron-core tree to dest (absent or empty, in an existing
    directory); ``through``: the series up to the patch whose name contains it."""
    dest = check_target_dir(dest)
    tree = load_tree(version, series=series, root=root, through=through)
    write_tree_atomic(tree.files, dest, make_parents=False)
    return tree


def ensure_trees(root: Path = REPO_ROOT, version: Optional[str] = None) -> tuple[Path, Path]:
    """(base tree, patched tree) of a pinned base under .build/trees, what tests and the report
    run against (default: the primary base).

    The base tree is the pristine sdist plus this repo's new modules (no series). Each tree's
    directory is named by its version label, so a changed series or module gets a fresh one;
    trees of other labels of the same base version are removed, other bases' trees are kept.
    """
    trees_dir = root / ".build" / "trees"
    base = load_tree(version, series=False, root=root)
    patched = load_tree(version, root=root)
    wanted = {f"base-{base.dirname}": base, patched.dirname: patched}
    for name, tree in wanted.items():
        if not (trees_dir / name).exists():
            log(f"materializing {trees_dir / name}")
            write_tree_atomic(tree.files, trees_dir / name)
    same_base = (f"base-{base.base.name}+", f"{base.base.name}+")
    for old in trees_dir.iterdir():
        if old.name not in wanted and old.name.startswith(same_base):
            shutil.rmtree(old, ignore_errors=True)
    return trees_dir / f"base-{base.dirname}", trees_dir / patched.dirname
