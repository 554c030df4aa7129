# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""`verify`: does an installed megatron-core match this repository's series (or the series a
checkout carries, as `apply` labelled it)?"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from moe_release.commands.registry import Command, register
from moe_release.common import UserError
from moe_release.series.checkout import is_checkout_manifest, verify_checkout_install
from moe_release.series.pins import load_pins
from moe_release.series.probes import installed_releases
from moe_release.series.sdist import sha256_file
from moe_release.series.source import add_base_options
from moe_release.series.trees import MANIFEST_PATH, Tree, load_tree


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


def configure(parser: argparse.ArgumentParser) -> None:
    """``--base``, ``--checkout`` and the interpreter whose environment is checked."""
    add_base_options(parser)
    parser.add_argument("--python", default=sys.executable, help="interpreter of the environment")


def run(args: argparse.Namespace) -> int:
    """Report whether the install matches; exit status 1 if it does not."""
    load_pins().get(args.base)  # an unknown --base before the interpreter is asked
    core_dir, dist_version = find_installed_core(args.python)
    code = _verify(args, core_dir, dist_version)
    print(f"  the install {installed_releases(core_dir)}")
    return code


register(
    Command(
        name="verify",
        help="report whether an installed megatron-core matches this repo's series",
        configure=configure,
        run=run,
    )
)
