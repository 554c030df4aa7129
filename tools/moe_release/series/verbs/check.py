# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""`check` (a series applies, compiles, round-trips, has trailers) and `verify` (an
installed megatron-core matches the series)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

from moe_release.common import REPO_ROOT, UserError
from moe_release.series.git import create_edit_repo, format_patches
from moe_release.series.patches import check_trailers, name_problems, parse_patch, parse_series
from moe_release.series.pins import Base
from moe_release.series.repo import overlay_files, read_series
from moe_release.series.sdist import sha256_file
from moe_release.series.source import read_base_files
from moe_release.series.trees import MANIFEST_PATH, Tree, build_tree

# What `patch`/`git apply --reject`/editors leave behind; a patch adding one vendors a copy.
LEFTOVER_SUFFIXES = (".orig", ".rej", ".porig", "~")


def check_base(base: Base, root: Path = REPO_ROOT) -> list[str]:
    """Problems with one base's series (empty when it is good)."""
    problems: list[str] = []
    try:
        patches = read_series(base, root)
    except UserError as exc:
        return [str(exc)]
    primary_file = root / "patches" / "series"
    primary = parse_series(primary_file.read_text(), str(primary_file))
    for name, _ in patches:
        if name not in primary:
            problems.append(
                f"{base.series_dir(root) / name}: names no patch of {primary_file} (a backport "
                "or upstream variant carries its primary patch's Patch-Name:)"
            )
    for name, data in patches:
        try:
            patch = parse_patch(data, name)
        except UserError as exc:
            problems.append(str(exc))
            continue
        missing = check_trailers(patch)
        if missing:
            problems.append(f"{name}: lacks trailer(s) {', '.join(missing)}")
        problems += name_problems(patch)
        for fp in patch.files:
            if fp.path.endswith(LEFTOVER_SUFFIXES):
                problems.append(f"{name}: adds {fp.path}, a leftover of patch/merge (remove it)")
    if problems:
        return problems
    base_files = read_base_files(base)
    try:
        build_tree(base, base_files, patches, overlay_files(root), compile_check=True)
    except UserError as exc:
        return [str(exc)]
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "edit"
        try:
            create_edit_repo(repo, base, base_files, patches)
            exported = format_patches(repo)
        except UserError as exc:
            return [str(exc)]
    if [n for n, _ in exported] != [n for n, _ in patches]:
        problems.append(
            f"series order/names do not round-trip: {[n for n, _ in patches]} -> "
            f"{[n for n, _ in exported]}"
        )
    for (name, data), (_, again) in zip(patches, exported):
        if data != again:
            problems.append(f"{name}: import+export changes the file (run edit, then export)")
    return problems


def find_installed_core(python: str) -> tuple[Path, Optional[str]]:
    """(megatron/core directory, distribution version) as seen by `python`, without importing it."""
    code = (
        "import importlib.util, importlib.metadata, json\n"
        "spec = importlib.util.find_spec('megatron')\n"
        "locs = list(spec.submodule_search_locations) if spec else []\n"
        "isfile = __import__('os').path.isfile\n"
        "core = [l + '/core' for l in locs if isfile(l + '/core/__init__.py')]\n"
        "try:\n    v = importlib.metadata.version('megatron-core')\n"
        "except importlib.metadata.PackageNotFoundError:\n    v = None\n"
        "print(json.dumps({'core': core[0] if core else None, 'version': v}))\n"
    )
    found = shutil.which(python) if os.sep not in python else python
    if found is None:
        raise UserError(f"{python}: no such interpreter on PATH")
    path = Path(found)
    if not path.exists():
        raise UserError(f"{python}: interpreter does not exist")
    if path.is_dir():
        raise UserError(f"{python}: is a directory, not an interpreter")
    if not os.access(path, os.X_OK):
        raise UserError(f"{python}: is not executable")
    try:
        result = subprocess.run(
            [found, "-c", code], capture_output=True, text=True, cwd=tempfile.gettempdir()
        )
    except OSError as exc:
        raise UserError(f"{python}: cannot run it: {exc.strerror or exc}") from None
    if result.returncode != 0:
        why = (result.stderr.strip().splitlines() or ["no output"])[-1][-200:]
        raise UserError(f"{python}: cannot inspect the environment: {why}")
    try:
        info = json.loads(result.stdout)
        info["core"], info["version"]
    except (ValueError, TypeError, KeyError):
        raise UserError(f"{python}: does not answer as a Python interpreter") from None
    if not info["core"]:
        raise UserError(f"{python}: megatron-core is not installed")
    return Path(info["core"]), info["version"]


def verify_installed(core_dir: Path, dist_version: Optional[str], tree: Tree) -> list[str]:
    """Mismatches between an installed megatron/core and the expected tree (empty: matches)."""
    problems = []
    root = core_dir.parent.parent
    if dist_version != tree.version:
        problems.append(
            f"installed distribution is megatron-core {dist_version}, expected {tree.version}"
        )
    expected = json.loads(tree.files[MANIFEST_PATH])["files"]
    for rel, digest in sorted(expected.items()):
        path = root / rel
        if not path.exists():
            problems.append(f"{rel}: missing")
        elif sha256_file(path) != digest:
            problems.append(f"{rel}: differs from the series")
    if not (root / MANIFEST_PATH).exists():
        problems.append(f"{MANIFEST_PATH}: missing (not a moe-release build)")
    return problems
