# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Spawn real torch.distributed ranks (gloo on CPU by default) and collect their results.

Each rank is a fresh ``python -m cpu_runtime.launcher`` subprocess, so megatron-core is
imported from the tree under test (first on ``PYTHONPATH``) and the CPU ``deep_ep`` emulation
can be registered before megatron's first import. A rank runs ``module:function(**kwargs)`` and
saves its return value (``torch.save``), or its traceback, to a file. The parent waits with a
deadline, kills every rank still running once one fails or time runs out, and raises with every
rank's traceback and output tail.

Tests run on the host with GPUs hidden. The memory report may ask for ``device="cuda"``: ranks
then see the GPUs, each takes ``LOCAL_RANK % device_count`` (ranks may share one GPU over gloo;
NCCL needs one GPU per rank).
"""

import faulthandler
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = REPO_ROOT / "scripts"


class DistributedTestError(AssertionError):
    """One or more ranks failed; the message carries their tracebacks."""


def free_port() -> int:
    """A TCP port that was free a moment ago (the rendezvous binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DEVICES = ("cpu", "cuda")
BACKENDS = ("gloo", "nccl")


def rank_env(
    tree: str,
    rank: int,
    world_size: int,
    port: int,
    torch_compile: bool = False,
    device: str = "cpu",
) -> Dict[str, str]:
    """Environment of one rank: tree first on the path, one thread, no VCS lookup, and no
    visible GPU unless ``device`` is "cuda"."""
    env = dict(os.environ)
    # The runtime itself, then the repository root for targets in tests/.
    path = [tree, str(SCRIPTS), str(REPO_ROOT)]
    env.update(
        PYTHONPATH=os.pathsep.join(path),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        # With 2 ranks on 2 cores more threads per rank slow steps down several times.
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        NO_VCS_VERSION="1",
        MOE_RELEASE_TREE=tree,
    )
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        # cuBLAS is deterministic only with a fixed workspace (torch's reproducibility notes).
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if not torch_compile:
        # megatron's jit_fuser wraps e.g. dispatch_preprocess in torch.compile; compiling on
        # CPU costs 2-20 s per process. The same Python code then runs eagerly.
        env["TORCHDYNAMO_DISABLE"] = "1"
    return env


def run_distributed(
    target: str,
    world_size: int,
    tree: str,
    kwargs: Optional[Dict[str, Any]] = None,
    timeout: float = 300.0,
    emulate_deep_ep: bool = True,
    torch_compile: bool = False,
    device: str = "cpu",
    backend: str = "gloo",
    force_emulation: bool = False,
) -> List[Any]:
    """Run ``target`` ("package.module:function") on ``world_size`` ranks.

    ``force_emulation`` installs the deep_ep emulation even where a real deep_ep is importable
    (the emulation refuses to shadow one otherwise).

    Returns the per-rank return values (rank order). Raises DistributedTestError with the
    tracebacks of the ranks that failed, or a timeout report; no rank outlives the call.
    """
    if device not in DEVICES or backend not in BACKENDS:
        raise ValueError(f"device must be one of {DEVICES} and backend one of {BACKENDS}")
    if backend == "nccl" and device != "cuda":
        raise ValueError("the nccl backend needs device='cuda'")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="moe_dist_") as tmp:
        job = Path(tmp)
        spec = {
            "target": target,
            "kwargs": kwargs or {},
            "emulate_deep_ep": emulate_deep_ep,
            "force_emulation": force_emulation,
            "device": device,
            "backend": backend,
            # torch.compile traces the function mode's handlers; those jobs run without it.
            "placement": placement_rules_enabled() and not torch_compile,
            # Hung ranks print their stacks shortly before the parent kills them.
            "dump_after": max(timeout - 10.0, 1.0),
        }
        (job / "spec.pkl").write_bytes(pickle.dumps(spec))
        procs, logs = [], []
        try:
            for rank in range(world_size):
                log = open(job / f"rank{rank}.log", "w+b")
                logs.append(log)
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "cpu_runtime.launcher", str(job)],
                        env=rank_env(tree, rank, world_size, port, torch_compile, device),
                        cwd=str(REPO_ROOT),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
            failed = _wait_all(procs, time.monotonic() + timeout)
        finally:
            for p in procs:
                _kill(p)
            for log in logs:
                log.close()
        results, errors = [], []
        for rank, p in enumerate(procs):
            out = job / f"rank{rank}.result"
            err = job / f"rank{rank}.error"
            if out.exists():
                results.append(_load_result(out))
                continue
            results.append(None)
            tail = (job / f"rank{rank}.log").read_bytes()[-4000:].decode(errors="replace")
            why = err.read_text() if err.exists() else f"no result (exit code {p.returncode})"
            errors.append(f"--- rank {rank} ---\n{why}\n--- rank {rank} output tail ---\n{tail}")
        if failed == "timeout":
            errors.insert(0, f"timed out after {timeout:.0f}s")
        if errors:
            raise DistributedTestError(
                f"{target} on {world_size} ranks failed:\n" + "\n".join(errors)
            )
        return results


def placement_rules_enabled() -> bool:
    """``MOE_RELEASE_PLACEMENT`` (default on): ``0`` spawns CPU ranks without the placement
    rules of :mod:`cpu_runtime.placement` (to tell a rule's failure from the code's)."""
    return os.environ.get("MOE_RELEASE_PLACEMENT", "1") != "0"


def _load_result(path: Path) -> Any:
    """A rank's return value (our own file: full unpickling is intended)."""
    import torch

    return torch.load(path, weights_only=False)


def _wait_all(procs: List[subprocess.Popen], deadline: float) -> Optional[str]:
    """Wait until all ranks exit; stop early when one fails (the others would hang)."""
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return "failed" if any(codes) else None
        if any(c not in (None, 0) for c in codes):
            # Give the survivors a moment to report their own error, then stop them.
            end = time.monotonic() + 5
            while time.monotonic() < end and any(p.poll() is None for p in procs):
                time.sleep(0.05)
            return "failed"
        if time.monotonic() > deadline:
            return "timeout"
        time.sleep(0.05)


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()


def _rank_main(job: Path) -> int:
    rank = int(os.environ["RANK"])
    try:
        spec = pickle.loads((job / "spec.pkl").read_bytes())
        faulthandler.dump_traceback_later(spec["dump_after"], exit=False)
        import torch

        torch.set_num_threads(1)
        if spec["device"] == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        if spec["emulate_deep_ep"]:
            from cpu_runtime.compat import load_deep_ep_emulation

            emulation = load_deep_ep_emulation()
            emulation.install(force=spec["force_emulation"])
        if spec["device"] == "cpu" and spec.get("placement", True):
            # CUDA's placement rules on the host (cpu_runtime.placement): a rank refuses
            # what a GPU would refuse.
            from cpu_runtime import placement

            placement.install()
        import importlib

        import torch.distributed as dist

        module_name, func_name = spec["target"].split(":")
        func = getattr(importlib.import_module(module_name), func_name)
        dist.init_process_group(
            spec["backend"],
            init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
            rank=rank,
            world_size=int(os.environ["WORLD_SIZE"]),
        )
        try:
            result = func(**spec["kwargs"])
        finally:
            from cpu_runtime.compat import teardown_megatron_state

            teardown_megatron_state()
            dist.destroy_process_group()
        # torch.save, not pickle: megatron-core replaces how torch storages pickle (with a
        # loader in megatron.core.safe_globals), which a parent without megatron can't load.
        torch.save(result, job / f"rank{rank}.result")
        return 0
    except BaseException:
        (job / f"rank{rank}.error").write_text(traceback.format_exc())
        return 1


if __name__ == "__main__":
    sys.exit(_rank_main(Path(sys.argv[1])))
