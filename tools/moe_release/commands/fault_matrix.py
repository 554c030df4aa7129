#!/usr/bin/env python3
# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The fault matrix (docs/fault-matrix.md): every scenario x backend x tree on the CPU runtime.

Rows are trees materialized under ``.build/fault-matrix/``: the unpatched base, each prefix of the
upstream PR stack in merge order (``dispatcher-state`` = the first four patches, ``+ a2a-overlap``,
``+ hybridep-groups``, ``+ comm-buffers`` = the whole series), and ``hybridep-groups +
comm-buffers`` without ``dispatcher-state`` (the CPU-import patch kept). The series is read from the
working tree, or from a commit with ``--series-from REV``. Each cell is
:func:`moe_release.runtime.megatron.fault_cells.run_cell`; the table and the failures with their
figures go to ``--out`` (markdown) and ``--json``; ``--record-golden PATH`` writes the base row's
figures as the golden values ``test_comm_buffer_faults.py`` compares with. A long run
(minutes per tree), not part of CI::

    python scripts/fault_matrix.py --rows base,series --out docs/fault-matrix.md
    python scripts/fault_matrix.py --rows base --record-golden \\
        tests/unit_tests/transformer/moe/golden_values/fault_matrix_base.json
"""

import argparse
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from moe_release.commands.registry import Command, register
from moe_release.common import REPO_ROOT
from moe_release.runtime.megatron import fault_cells as fc
from moe_release.runtime.megatron import fault_scenarios as fs

OUT_DIR = REPO_ROOT / ".build" / "fault-matrix"
# Each row: the series patches it applies, by a name fragment of the last one (None: all;
# "" no series), or an explicit list of name fragments.
ROWS = {
    "base": "",
    "dispatcher-state": "Release-all-gather-dispatcher-state",
    "a2a-overlap": "A2A-overlap-release-the-chunk-state",
    "hybridep-groups": "Keep-one-HybridEP-buffer",
    "comm-buffers": "Release-NCCL-EP",
    "series": None,
    "hybridep-groups+comm-buffers": [
        "import-and-build",
        "Keep-one-HybridEP-buffer",
        "Free-the-HybridEP-and-DeepEP-buffers",
        "Release-NCCL-EP",
        "Take-the-comm-buffers-out-of-use",
    ],
}


def markers(base: str):
    """The markers around one base's generated tables in ``--out`` (one block per base)."""
    return f"<!-- fault-matrix:begin {base} -->", f"<!-- fault-matrix:end {base} -->"


SNAPSHOT_DIRS = ("patches", "megatron", "scripts", "tools")

GOLDEN_COMMAND = (
    "python scripts/fault_matrix.py --rows base --record-golden "
    "tests/unit_tests/transformer/moe/golden_values/fault_matrix_base.json"
)


def snapshot(rev: Optional[str], dest: Path) -> Path:
    """The tooling and the series at ``rev`` (None: the working tree) in ``dest``."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    # The tooling moved from scripts/ to tools/ (a revision before the move has no tools/).
    if rev is None:
        for name in SNAPSHOT_DIRS:
            ignore = shutil.ignore_patterns("__pycache__")
            shutil.copytree(REPO_ROOT / name, dest / name, ignore=ignore)
    else:
        listed = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "ls-tree", "--name-only", rev, *SNAPSHOT_DIRS],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        data = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "archive", rev, *listed],
            check=True,
            capture_output=True,
        ).stdout
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(dest, filter="data")
    return dest


def series_file(src: Path, base: Optional[str]) -> Path:
    """The series file of ``base`` in the snapshot (the primary, or a variant's)."""
    if base in (None, "0.19.2"):
        return src / "patches" / "series"
    for kind in ("upstream", "backports"):
        for path in (src / "patches" / kind).glob("*/series"):
            if base.split("-")[0] in path.parent.name or base in path.read_text():
                return path
    raise SystemExit(f"fault_matrix: no series for base {base}")


def materialize(src: Path, row: str, base: Optional[str], checkout: Optional[str]) -> Path:
    """The tree of ``row`` (reused when its series files are unchanged)."""
    spec = ROWS[row]
    series = series_file(src, base)
    names = [
        line.split()[0]
        for line in series.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    if isinstance(spec, list):
        names = [n for n in names if any(f in n for f in spec)]
    elif spec == "":
        names = []
    elif spec is not None:
        names = names[: next(i for i, n in enumerate(names) if spec in n) + 1]
    digest = hashlib.sha256()
    for name in names:
        digest.update(name.encode() + (series.parent / name).read_bytes())
    # "<base>+...": test_comm_buffer_faults.base_key reads the base from the name.
    tree = OUT_DIR / "trees" / f"{base or '0.19.2'}+fault-{row}-{digest.hexdigest()[:12]}"
    if (tree / "megatron" / "core").is_dir():
        return tree
    if isinstance(spec, list):  # a series of its own, in a copy of the snapshot
        own = src.with_name(f"{src.name}-{row}")
        if own.exists():
            shutil.rmtree(own)
        shutil.copytree(src, own)
        series = own / series.relative_to(src)
        for path in series.parent.glob("*.patch"):
            if path.name not in names:
                path.unlink()
        series.write_text("".join(n + "\n" for n in names))
        src = own
    if tree.exists():
        shutil.rmtree(tree)
    cmd = [sys.executable, str(src / "scripts" / "moe_release.py"), "materialize"]
    if base:
        cmd += ["--base", base]
    if checkout:
        cmd += ["--checkout", checkout]
    if not names:
        cmd.append("--no-series")
    elif spec is not None and not isinstance(spec, list):
        cmd += ["--through", names[-1]]
    tree.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(cmd + [str(tree)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"fault_matrix: materializing {row} failed:\n{done.stderr[-2000:]}")
    return tree


def run_row(
    tree: Path, backends, scenarios, label: str, nodes: Optional[tuple] = None
) -> Dict[str, dict]:
    """Every cell of one tree: ``{"scenario/backend": summary}``; ``nodes``: (nodes, ranks
    per node) of an emulated multi-node layout (None: 2 ranks on one node)."""
    layout = {} if nodes is None else {"world": nodes[0] * nodes[1], "ranks_per_node": nodes[1]}
    from moe_release.backends import available

    has = set(available(str(tree))) | set(fs.DISPATCHERS)
    out = {}
    for backend in backends:
        if backend not in has:
            continue
        for scenario in scenarios:
            if not fs.applies(scenario, backend):
                continue
            start = time.monotonic()
            summary = fc.summary(fc.run_cell(str(tree), scenario, backend, **layout))
            out[f"{scenario}/{backend}"] = summary
            bad = fc.violations(scenario, summary, None)
            verdict = "pass" if not bad else "FAIL: " + "; ".join(bad)
            print(
                f"[{label}] {scenario}/{backend} ({time.monotonic() - start:.1f} s): {verdict}",
                flush=True,
            )
    return out


def failures(rows: Dict[str, Dict[str, dict]], base_row: str) -> List[str]:
    """Per tree, the cells that break the pass rule, with the figures."""
    lines = []
    for tree, cells in rows.items():
        base = rows.get(base_row, {}) if tree != base_row else {}
        bad = []
        for key, summary in cells.items():
            why = fc.violations(key.split("/")[0], summary, base.get(key))
            if why:
                bad.append(f"  - `{key}`: " + "; ".join(why))
        lines.append(f"- **{tree}**: {len(bad)} of {len(cells)} cells fail")
        lines += bad
    return lines


def main(argv: Optional[List[str]] = None, prog: Optional[str] = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated: {list(ROWS)}")
    parser.add_argument("--base", help="base from patches/pins.toml (default: primary)")
    parser.add_argument("--checkout", help="Megatron-LM checkout for a commit base")
    parser.add_argument("--series-from", metavar="REV", help="read the series at this commit")
    parser.add_argument("--backends", default=",".join(fs.BACKENDS))
    parser.add_argument(
        "--scenarios",
        help="comma-separated (default: every scenario; with "
        f"--nodes those that change across nodes, {','.join(fs.NODES_SCENARIOS)})",
    )
    parser.add_argument("--nodes", metavar="NxR", help="emulated nodes x ranks per node, e.g. "
                        f"{fs.NODES_WORLD // fs.NODES_RANKS_PER_NODE}x{fs.NODES_RANKS_PER_NODE} "
                        "(default: 2 ranks on one node)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    parser.add_argument("--json", type=Path, help="write every cell's figures here")
    parser.add_argument("--record-golden", type=Path, metavar="PATH")
    parser.add_argument(
        "--from-json", type=Path, action="append", help="render these results, run nothing"
    )
    args = parser.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}")
    nodes = None
    if args.nodes:
        try:
            nodes = tuple(int(x) for x in args.nodes.lower().split("x"))
        except ValueError:
            nodes = ()
        if len(nodes) != 2 or min(nodes) < 1:
            parser.error(f"--nodes {args.nodes}: expected NxR, e.g. 2x2")
    scenarios = args.scenarios or ",".join(fs.NODES_SCENARIOS if nodes else fs.SCENARIOS)
    where = f"{args.base or '0.19.2'}" + (f", {nodes[0]} x {nodes[1]} nodes" if nodes else "")
    label = args.series_from or "worktree"
    results: Dict[str, Dict[str, dict]] = {}
    for path in args.from_json or ():
        results.update(json.loads(path.read_text()))
    if args.from_json:
        rows = list(results)
    else:
        src = snapshot(args.series_from, OUT_DIR / "src" / label.replace("/", "_"))
    for row in rows if not args.from_json else ():
        try:
            tree = materialize(src, row, args.base, args.checkout)
        except SystemExit as exc:  # a row whose series does not apply is a finding, not a stop
            print(f"[{row}] not measured: {exc}", flush=True)
            continue
        print(f"[{row}] {tree}", flush=True)
        results[row] = run_row(
            tree, args.backends.split(","), scenarios.split(","), f"{where} {row}", nodes
        )
        if args.json:  # after each row: a long run stopped early keeps what it measured
            args.json.write_text(json.dumps(results, indent=1, default=str))
    series = (
        f"the series at {args.series_from}" if args.series_from else "the working tree's series"
    )
    if args.from_json:
        series = "rendered from " + ", ".join(p.name for p in args.from_json)
    table = fc.markdown(results, "base")
    text = "\n".join(failures(results, "base"))
    if args.out:
        begin, end = markers(where)
        generated = (
            f"{begin}\n<!-- fault_matrix.py --rows {','.join(rows)}: {where}, "
            f"{series} -->\n{table}\n{text}\n{end}"
        )
        old = args.out.read_text() if args.out.exists() else ""
        if begin in old and end in old:  # the hand-written text and other bases' blocks stay
            generated = old[: old.index(begin)] + generated + old[old.index(end) + len(end) :]
        elif old:
            generated = old.rstrip("\n") + "\n\n" + generated + "\n"
        args.out.write_text(generated)
    else:
        print(table)
        print(text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    if args.record_golden:
        if "base" not in results:
            parser.error("--record-golden needs the base row")
        path = args.record_golden
        data = json.loads(path.read_text()) if path.exists() else {"bases": {}}
        data["command"] = GOLDEN_COMMAND
        data["bases"][args.base or "0.19.2"] = results["base"]
        path.write_text(json.dumps(data, indent=1, sort_keys=True, default=str) + "\n")
    return 0


def run(args: argparse.Namespace) -> int:
    """:func:`main` on the words after the command's name."""
    return main(args.argv, prog=args.prog)


register(
    Command(
        name="fault-matrix",
        help="the fault matrix: every scenario x backend x tree on the CPU runtime",
        run=run,
        aliases=('fault_matrix',),
        own_parser=True,
    )
)
