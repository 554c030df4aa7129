# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""``scripts/device-check kernels prepare``: everything a lent GPU needs to build deep_ep and run
the release with the real HybridEP and DeepEP kernels, in one ignored folder that travels.

The device machine cannot download anything: what it needs travels with the working tree (the
device tool's ``carry``, 64 MiB in all with the tracked files). :func:`prepare` writes, under
``.build/device-kernels/`` (ignored):

- ``deep_ep/``: the deep_ep source at the commit megatron-core's pin names
  (:data:`DEEP_EP_PIN`), or, where the source repository lacks it, at the nearest one it has
  (:data:`DEEP_EP_NEAREST`, the commit the CPU runtime's emulations are read from), extracted
  with ``git archive``; ``SOURCE.txt`` says which and why;
- ``trees/base`` and ``trees/patched``: the materialized base and patched trees (the sdist and
  the sdist with the series, both with this repository's new modules);
- ``run.sh``: the build-and-run script (``scripts/device-kernels.sh``, copied), which reads only
  this folder and the repository's tracked files.

It prints the ``carry`` list and the command. No upstream file is ever written outside the
ignored folder, and none is committed.
"""

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence

from moe_release.commands.registry import Command, register
from moe_release.common import REPO_ROOT

FOLDER = Path(".build") / "device-kernels"
SCRIPT = Path("scripts") / "device-kernels.sh"
# megatron-core 0.19.2's CI pins DeepEP de0dd11 (docker/Dockerfile.ci.dev:85 of core_r0.19.0).
DEEP_EP_PIN = "de0dd1185142c727b9c118aeb4cc4702e34deeba"
# The newest hybrid-ep commit the read-only mirror has, the emulations' source.
DEEP_EP_NEAREST = "94a9f8f6b146c07d97ec58f67cd6d303296d6098"
# What travels: the device tool's limit on the working tree plus carried paths.
CARRY_LIMIT = 64 * 1024 * 1024


class PrepareError(Exception):
    """Bad input or a failed step; one line, nothing half-written."""


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True)


def has_commit(repo: Path, commit: str) -> bool:
    """Whether the git repository ``repo`` has ``commit``."""
    return _git(repo, "cat-file", "-e", f"{commit}^{{commit}}").returncode == 0


def choose_commit(repo: Path, pin: str = DEEP_EP_PIN, nearest: str = DEEP_EP_NEAREST) -> tuple:
    """(the commit to carry, why): the pin where ``repo`` has it, else ``nearest``."""
    if has_commit(repo, pin):
        return pin, f"the pin megatron-core 0.19.2 names ({pin[:7]})"
    if has_commit(repo, nearest):
        return nearest, (f"the pin {pin[:7]} is not in {repo}; {nearest[:7]}, the newest "
                         "hybrid-ep commit there (the emulations' source)")  # fmt: skip
    raise PrepareError(f"{repo}: has neither the pin {pin[:7]} nor {nearest[:7]} (a deep_ep "
                       "clone with the hybrid-ep branch: git fetch origin hybrid-ep)")  # fmt: skip


def extract(repo: Path, commit: str, dest: Path) -> None:
    """``git archive`` of ``commit`` into ``dest``."""
    done = _git(repo, "archive", "--format=tar", commit)
    if done.returncode:
        raise PrepareError(f"git archive {commit[:12]} in {repo}: {done.stderr.decode()[-300:]}")
    with tempfile.TemporaryFile() as tmp:
        tmp.write(done.stdout)
        tmp.seek(0)
        with tarfile.open(fileobj=tmp) as tar:
            tar.extractall(dest, filter="data")


def size(path: Path) -> int:
    """Bytes of the files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def tracked_size(repo: Path = REPO_ROOT) -> int:
    """Bytes of the repository's tracked files (what travels besides ``carry``)."""
    out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z"], capture_output=True).stdout
    return sum((repo / p).stat().st_size for p in out.decode().split("\0")
               if p and (repo / p).is_file())  # fmt: skip


def prepare(
    dest: Path,
    deep_ep_repo: Path,
    base_tree: Path,
    patched_tree: Path,
    repo: Path = REPO_ROOT,
    pin: str = DEEP_EP_PIN,
    nearest: str = DEEP_EP_NEAREST,
) -> List[str]:
    """Write the folder ``dest`` (replaced as a whole: built beside it, then renamed); returns
    the lines to print (what was chosen, the sizes, the carry list and the command)."""
    if not (deep_ep_repo / "HEAD").exists() and not (deep_ep_repo / ".git").exists():
        raise PrepareError(f"{deep_ep_repo}: not a git repository (DEEP_EP_SRC or --deep-ep)")
    for tree in (base_tree, patched_tree):
        if not (tree / "megatron" / "core" / "package_info.py").is_file():
            raise PrepareError(f"{tree}: not a materialized megatron-core tree")
    commit, why = choose_commit(deep_ep_repo, pin, nearest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        extract(deep_ep_repo, commit, work / "deep_ep")
        for name, tree in (("base", base_tree), ("patched", patched_tree)):
            shutil.copytree(tree, work / "trees" / name,
                            ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
        shutil.copy2(repo / SCRIPT, work / "run.sh")
        (work / "SOURCE.txt").write_text(
            f"deep_ep {commit}: {why}\nbase tree: {base_tree.name}\n"
            f"patched tree: {patched_tree.name}\n"
        )
        total = size(work) + tracked_size(repo)
        if total > CARRY_LIMIT:
            raise PrepareError(f"{dest}: {total:,} B with the tracked files, over the device "
                               f"tool's {CARRY_LIMIT:,} B")  # fmt: skip
        if dest.exists():
            shutil.rmtree(dest)
        work.rename(dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rel = dest.relative_to(repo) if dest.is_relative_to(repo) else dest
    return [
        f"deep_ep {commit[:12]}: {why}",
        f"{rel}: {size(dest):,} B; with the tracked files {total:,} B (limit {CARRY_LIMIT:,} B)",
        f'carry: ["{rel}"]',
        f"command: bash {rel}/run.sh",
    ]


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    from moe_release import settings
    from moe_release.series.trees import ensure_trees

    parser = argparse.ArgumentParser(
        prog=prog or "device-check kernels", description=__doc__.split("\n")[0]
    )
    parser.add_argument("verb", choices=["prepare"])
    parser.add_argument("--deep-ep", type=Path, default=None,
                        help="a deep_ep git repository (default: $DEEP_EP_SRC)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=REPO_ROOT / FOLDER)
    args = parser.parse_args(argv)
    source = args.deep_ep or settings.deep_ep_src()
    try:
        if source is None:
            raise PrepareError("name a deep_ep git repository with the hybrid-ep branch: "
                               "--deep-ep PATH or DEEP_EP_SRC=PATH")  # fmt: skip
        base, patched = ensure_trees(REPO_ROOT)
        lines = prepare(args.out, Path(source), base, patched)
    except PrepareError as exc:
        print(f"device-check kernels: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


def run(args: argparse.Namespace) -> int:
    """:func:`main` on the words after the command's name."""
    return main(args.argv, prog=args.prog)


register(
    Command(
        name="device-kernels",
        help="prepare the folder a lent GPU needs to run the real HybridEP and DeepEP kernels",
        run=run,
        aliases=("device_kernels",),  # scripts/device-check kernels: its usage line
        own_parser=True,
    )
)
