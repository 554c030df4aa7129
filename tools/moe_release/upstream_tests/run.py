# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Run upstream Megatron-LM unit tests in a checkout on CPU ranks over gloo, and count them.

Usage (from anywhere; the venv's python)::

    python scripts/upstream_cpu/run.py CHECKOUT [--nproc 8] [--timeout 1800] [--json OUT]
        [--deep-ep-emulation] [--te-local-spec] [--fp32-gemm] [--no-stream-order]
        [--no-placement] [--] [PYTEST ARGS...]

    # e.g. upstream's own MoE dispatcher and layer tests on core_r0.19.0:
    python scripts/upstream_cpu/run.py /tmp/Megatron-LM \\
        tests/unit_tests/transformer/moe/test_token_dispatcher.py \\
        tests/unit_tests/transformer/moe/test_a2a_token_dispatcher.py \\
        tests/unit_tests/transformer/moe/test_moe_layer.py

It launches ``python -m torch.distributed.run --nproc-per-node N -m pytest -p
moe_release.upstream_tests.plugin PYTEST ARGS`` in CHECKOUT, as upstream's CI launches its unit
tests on a node (every rank runs pytest; upstream's ``Utils`` reads ``WORLD_SIZE``, ``RANK``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), with CHECKOUT first on ``PYTHONPATH`` (its
``megatron`` and ``tests`` packages win over an installed megatron-core), ``tools/`` after it (the
plugin and the CPU runtime), no visible GPU, one thread per rank and a free port. The plugin
(:mod:`moe_release.upstream_tests.plugin`) runs the ranks under the CPU runtime's placement rules
(CUDA's rules on host tensors; ``--no-stream-order``: without their stream-ordering check;
``--no-placement``: the plugin's plain CUDA-to-host mapping) and maps NCCL to gloo;
``--deep-ep-emulation`` registers the CPU deep_ep kernels, ``--te-local-spec`` runs the tests that
need Transformer Engine only for its modules on megatron-core's local ones, ``--fp32-gemm`` runs
bf16/fp16 GEMMs in float32 (rounded once, as tensor cores accumulate). N defaults to 8, the GPUs of
upstream's runners, which its parametrizations (TP 8, EP 8, TP 4 x EP 2) assume.

Only rank 0's pytest output is shown. Afterwards every test's outcome is aggregated over the
ranks (failed on any rank: failed; skipped on rank 0: skipped; else passed) and counted per
file, with the reasons for skips and failures grouped; ``--json`` writes the same as one
object (``files``: per file ``passed``/``failed``/``skipped``; ``tests``: nodeid -> outcome,
reason). The whole run is bounded by ``--timeout`` seconds: past it every rank is killed (its
process group) and the tests that did not report count as not run.

Exit status: 0 when every collected test passed or skipped, 1 when one failed or the run did
not finish, 2 on a usage error.
"""

import argparse
import collections
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from moe_release.common import REPO_ROOT

TOOLS = REPO_ROOT / "tools"


def free_port() -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(
    checkout: Path,
    report_dir: Path,
    deep_ep_emulation: bool,
    placement: bool = True,
    te_local_spec: bool = False,
    fp32_gemm: bool = False,
    stream_order: bool = True,
) -> Dict[str, str]:
    """The environment every rank inherits from the launcher."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(checkout), str(TOOLS), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    env.update(
        UPSTREAM_CPU_CHECKOUT=str(checkout),
        UPSTREAM_CPU_REPORT_DIR=str(report_dir),
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        PYTHONDONTWRITEBYTECODE="1",
        TORCHELASTIC_ERROR_FILE=str(report_dir / "error.json"),
        UPSTREAM_CPU_PLACEMENT="1" if placement else "0",
        UPSTREAM_CPU_STREAM_ORDER="1" if stream_order else "0",
    )
    env.pop("UPSTREAM_CPU_DEEP_EP", None)
    env.pop("UPSTREAM_CPU_TE", None)
    env.pop("UPSTREAM_CPU_FP32_GEMM", None)
    if deep_ep_emulation:
        env.update(UPSTREAM_CPU_DEEP_EP="emulation")
    if te_local_spec:
        env.update(UPSTREAM_CPU_TE="local")
    if fp32_gemm:
        env.update(UPSTREAM_CPU_FP32_GEMM="1")
    return env


def launch_command(nproc: int, port: int, pytest_args: List[str]) -> List[str]:
    """``torch.distributed.run`` running pytest with the plugin on every rank."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        "--local-ranks-filter=0",
        "-m",
        "pytest",
        "-p",
        "moe_release.upstream_tests.plugin",
        "-p",
        "no:cacheprovider",
        # A module that fails to collect is counted (failed) and the others still run.
        "--continue-on-collection-errors",
        *pytest_args,
    ]


def run_ranks(cmd: List[str], cwd: Path, env: Dict[str, str], timeout: float) -> Optional[int]:
    """Run ``cmd`` in its own process group; kill the group past ``timeout`` (returns None)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"upstream_cpu: timed out after {timeout:.0f} s; killing the ranks", flush=True)
        return None
    finally:
        # Reap the whole group, also ranks left behind by a launcher that already exited.
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and _group_alive(proc.pid):
                proc.poll()  # reap the launcher, so its zombie does not count as alive
                time.sleep(0.2)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _final_outcome(phases: List[dict]) -> tuple:
    for p in phases:
        if p["outcome"] == "failed":
            return "failed", f"{p['when']}: {_last_error_line(p['detail'])}"
    for p in phases:
        if p["outcome"] == "skipped":
            return "skipped", p["detail"]
    if any(p["when"] == "call" and p["outcome"] == "passed" for p in phases):
        return "passed", ""
    return "incomplete", "no call phase reported"


def _last_error_line(text: str) -> str:
    errors = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    if errors:
        return errors[0][:300]
    return (text.strip().splitlines() or [""])[-1][:300]


def aggregate(report_dir: Path, nproc: int) -> Dict[str, dict]:
    """Every test's outcome over the ranks' reports: nodeid -> {outcome, reason, ranks}."""
    per_rank: Dict[int, Dict[str, List[dict]]] = {}
    for rank in range(nproc):
        path = report_dir / f"rank{rank}.jsonl"
        tests: Dict[str, List[dict]] = collections.defaultdict(list)
        if path.exists():
            for line in path.read_text().splitlines():
                record = json.loads(line)
                tests[record["nodeid"]].append(record)
        per_rank[rank] = tests
    nodeids = list(dict.fromkeys(n for tests in per_rank.values() for n in tests))
    result = {}
    for nodeid in nodeids:
        outcomes = {
            r: _final_outcome(per_rank[r][nodeid]) for r in per_rank if nodeid in per_rank[r]
        }
        failed = {r: o for r, o in outcomes.items() if o[0] == "failed"}
        if failed:
            rank, (_, reason) = next(iter(failed.items()))
            result[nodeid] = dict(outcome="failed", reason=f"rank {rank}: {reason}")
        elif any(o[0] == "incomplete" for o in outcomes.values()):
            result[nodeid] = dict(outcome="incomplete", reason="no call phase reported")
        elif 0 in outcomes and outcomes[0][0] == "skipped":
            result[nodeid] = dict(outcome="skipped", reason=outcomes[0][1])
        elif len(outcomes) == nproc and all(o[0] == "passed" for o in outcomes.values()):
            result[nodeid] = dict(outcome="passed", reason="")
        else:
            missing = sorted(set(range(nproc)) - set(outcomes))
            result[nodeid] = dict(outcome="incomplete", reason=f"ranks without a result: {missing}")
    return result


def summarize(tests: Dict[str, dict]) -> dict:
    """Counts per file and the grouped reasons for skips and failures."""
    files: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    reasons: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for nodeid, t in tests.items():
        files[nodeid.split("::")[0]][t["outcome"]] += 1
        if t["outcome"] != "passed":
            reasons[t["outcome"]][t["reason"]] += 1
    return dict(
        files={f: dict(c) for f, c in files.items()},
        reasons={k: dict(c.most_common()) for k, c in reasons.items()},
    )


def print_summary(summary: dict, wall_s: float) -> None:
    """The counts per file and the reasons, one line each."""
    print("\nupstream_cpu summary (aggregated over ranks)")
    for f, c in summary["files"].items():
        counts = ", ".join(f"{c.get(k, 0)} {k}" for k in ("passed", "failed", "skipped"))
        extra = f", {c['incomplete']} incomplete" if c.get("incomplete") else ""
        print(f"  {f}: {counts}{extra}")
    for outcome, reasons in summary["reasons"].items():
        print(f"  {outcome} because:")
        for reason, n in reasons.items():
            print(f"    {n:4d} x {reason}")
    print(f"  wall time: {wall_s:.0f} s")


def main(argv: Optional[List[str]] = None, prog: Optional[str] = None) -> int:
    """Parse the arguments, run the ranks, print (and write) the counts."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=Path, help="a Megatron-LM checkout (has tests/unit_tests)")
    parser.add_argument("--nproc", type=int, default=8, help="ranks (default 8, as upstream CI)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the whole run")
    parser.add_argument("--json", type=Path, help="write the outcomes and counts here")
    parser.add_argument(
        "--deep-ep-emulation",
        action="store_true",
        help="register this repository's CPU deep_ep emulation (runs the flex-dispatcher tests)",
    )
    parser.add_argument(
        "--te-local-spec",
        action="store_true",
        help="run tests that need Transformer Engine only for its modules on the local spec",
    )
    parser.add_argument(
        "--fp32-gemm",
        action="store_true",
        help="run bf16/fp16 GEMMs in float32, rounded once (fast on a host without native bf16)",
    )
    parser.add_argument(
        "--no-stream-order",
        action="store_true",
        help="the placement rules without their stream-ordering check",
    )
    parser.add_argument(
        "--no-placement",
        action="store_true",
        help="without the CPU runtime's placement rules (the plain CUDA-to-host mapping)",
    )
    args, pytest_args = parser.parse_known_args(argv)
    if pytest_args[:1] == ["--"]:
        pytest_args = pytest_args[1:]
    checkout = args.checkout.resolve()
    if not (checkout / "tests" / "unit_tests" / "test_utilities.py").is_file():
        print(
            f"upstream_cpu: {checkout} has no tests/unit_tests/test_utilities.py", file=sys.stderr
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="moe_release.upstream_tests.") as tmp:
        report_dir = Path(tmp)
        env = rank_environment(
            checkout,
            report_dir,
            args.deep_ep_emulation,
            placement=not args.no_placement,
            te_local_spec=args.te_local_spec,
            fp32_gemm=args.fp32_gemm,
            stream_order=not args.no_stream_order,
        )
        cmd = launch_command(args.nproc, free_port(), pytest_args)
        start = time.monotonic()
        rc = run_ranks(cmd, checkout, env, args.timeout)
        wall = time.monotonic() - start
        tests = aggregate(report_dir, args.nproc)
    summary = summarize(tests)
    print_summary(summary, wall)
    if not tests:
        print("  no test reported: the plugin or pytest failed before any test ran (see above)")
    if args.json:
        args.json.write_text(
            json.dumps(
                dict(
                    summary,
                    tests=tests,
                    returncode=rc,
                    wall_s=round(wall, 1),
                    placement=not args.no_placement,
                    deep_ep_emulation=args.deep_ep_emulation,
                    te_local_spec=args.te_local_spec,
                    fp32_gemm=args.fp32_gemm,
                    stream_order=not args.no_stream_order,
                ),
                indent=1,
            )
        )
    bad = rc is None or any(t["outcome"] in ("failed", "incomplete") for t in tests.values())
    if rc not in (0, None) and not bad and tests:
        bad = True
    return 1 if bad or not tests else 0


if __name__ == "__main__":
    sys.exit(main())
