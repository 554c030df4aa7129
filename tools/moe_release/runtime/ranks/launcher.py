# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Spawn real torch.distributed ranks (gloo on CPU by default) and collect their results.

Each rank is a fresh ``python -m moe_release.runtime.ranks.launcher`` subprocess, so megatron-core
is imported from the tree under test (first on ``PYTHONPATH``) and the CPU ``deep_ep`` emulation can
be registered before megatron's first import. A rank runs ``module:function(**kwargs)`` and saves
its return value (``torch.save``), or its traceback, to a file. The parent waits with a deadline,
kills every rank still running once one fails or time runs out, and raises with every rank's
traceback and output tail.

Tests run on the host with GPUs hidden. The memory report may ask for ``device="cuda"``: ranks
then see the GPUs, each takes ``LOCAL_RANK % device_count`` (ranks may share one GPU over gloo;
NCCL needs one GPU per rank).
"""

import atexit
import faulthandler
import gc
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

from moe_release import settings
from moe_release.common import REPO_ROOT

TOOLS = REPO_ROOT / "tools"


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
    path = [tree, str(TOOLS), str(REPO_ROOT)]
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
    placement: Optional[bool] = None,
) -> List[Any]:
    """Run ``target`` ("package.module:function") on ``world_size`` ranks.

    ``force_emulation`` installs the deep_ep emulation even where a real deep_ep is importable
    (the emulation refuses to shadow one otherwise). ``placement`` turns the CPU ranks'
    placement rules (:mod:`moe_release.runtime.cuda.placement`) on or off for this job (None: as
    ``MOE_RELEASE_PLACEMENT`` says, on by default).

    Returns the per-rank return values (rank order). Raises DistributedTestError with the
    tracebacks of the ranks that failed, or a timeout report; no rank outlives the call.
    """
    if device not in DEVICES or backend not in BACKENDS:
        raise ValueError(f"device must be one of {DEVICES} and backend one of {BACKENDS}")
    if backend == "nccl" and device != "cuda":
        raise ValueError("the nccl backend needs device='cuda'")
    if placement is None:
        placement = placement_rules_enabled()
    args = (target, world_size, tree, kwargs, timeout, emulate_deep_ep, torch_compile)
    for attempt in range(_PORT_ATTEMPTS):
        try:
            return _run_once(*args, device, backend, force_emulation, placement, free_port())
        except DistributedTestError as exc:
            # The free port was taken by another process before rank 0's store bound it (a
            # race of free_port(), not a failure of the job): run it again on another port.
            if "EADDRINUSE" not in str(exc) or attempt == _PORT_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


# Attempts of a job whose rendezvous port was taken before rank 0 bound it.
_PORT_ATTEMPTS = 3


def _run_once(
    target: str,
    world_size: int,
    tree: str,
    kwargs: Optional[Dict[str, Any]],
    timeout: float,
    emulate_deep_ep: bool,
    torch_compile: bool,
    device: str,
    backend: str,
    force_emulation: bool,
    placement: bool,
    port: int,
) -> List[Any]:
    """One launch of :func:`run_distributed`'s job on ``port``."""
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
            "placement": placement and not torch_compile,
        }
        (job / "spec.pkl").write_bytes(pickle.dumps(spec))
        procs, logs = [], []
        zygote = _zygote(tree, spec) if device == "cpu" and not torch_compile else None
        try:
            for rank in range(world_size):
                env = rank_env(tree, rank, world_size, port, torch_compile, device)
                forked = zygote.fork(job, rank, env) if zygote is not None else None
                if forked is not None:
                    procs.append(forked)
                    continue
                log = open(job / f"rank{rank}.log", "w+b")
                logs.append(log)
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "moe_release.runtime.ranks.launcher", str(job)],
                        env=env,
                        cwd=str(REPO_ROOT),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
            failed = _wait_all(procs, time.monotonic() + timeout)
            if failed == "timeout":
                _dump_stacks(procs)
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


# Set per rank (and by pytest per test); a zygote serves every job whose ranks' environments
# agree on all other variables (moe_release.runtime.ranks.zygote). A rank gets its full environment.
_PER_RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "PYTEST_CURRENT_TEST")
_ZYGOTES: Dict[tuple, "_Zygote"] = {}
_MAX_ZYGOTES = 4


def fork_server_enabled() -> bool:
    """``MOE_RELEASE_FORK`` (default on): ``0`` starts every CPU rank as a fresh interpreter
    instead of forking it from a zygote that has imported torch and megatron-core."""
    return settings.fork()


class _ForkedRank:
    """A rank forked by the zygote: the Popen calls the launcher uses, read from the exit file
    the zygote writes (the rank is the zygote's child, not ours)."""

    def __init__(self, pid: int, exit_file: Path, zygote: Optional[subprocess.Popen] = None):
        self.pid = pid
        self.exit_file = exit_file
        self.zygote = zygote
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None and self.exit_file.exists():
            self.returncode = int(self.exit_file.read_text())
        if self.returncode is None and not _pid_alive(self.pid):
            # Reaped: a live zygote writes the exit file next (until then the job directory
            # is not ours to remove); a zygote that is gone never will.
            if self.zygote is None or self.zygote.poll() is not None:
                self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float = 30.0) -> Optional[int]:
        end = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < end:
            time.sleep(0.02)
        return self.returncode


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Zygote:
    """One fork server (moe_release.runtime.ranks.zygote) for ranks of one tree and rank setup."""

    def __init__(self, env: Dict[str, str], spec: Dict[str, Any]):
        import json

        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moe_release.runtime.ranks.zygote", json.dumps(spec)],
            env=env,
            cwd=str(REPO_ROOT),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            start_new_session=True,
        )
        self.ready = self.proc.stdout.readline().strip() == "ready"

    def fork(self, job: Path, rank: int, env: Dict[str, str]) -> Optional[_ForkedRank]:
        """Fork rank ``rank`` of ``job``; None if the zygote is gone (the caller spawns)."""
        import json

        if not self.ready or self.proc.poll() is not None:
            return None
        try:
            self.proc.stdin.write(f"{job} {rank} {json.dumps(env)}\n")
            self.proc.stdin.flush()
            pid = int(self.proc.stdout.readline())
        except (BrokenPipeError, ValueError):
            self.ready = False
            return None
        return _ForkedRank(pid, job / f"rank{rank}.exit", self.proc)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _kill(self.proc)
        self._log.close()


def _zygote(tree: str, spec: Dict[str, Any]) -> Optional[_Zygote]:
    """The zygote for ``tree`` and this job's rank setup and environment (started on first
    use, kept for the process), or None where ranks are spawned fresh."""
    if not fork_server_enabled():
        return None
    env = rank_env(tree, 0, 1, 0)
    setup = {k: spec[k] for k in ("emulate_deep_ep", "force_emulation")}
    setup["placement"] = spec["placement"]
    key = (tree, tuple(sorted(setup.items())), tuple(sorted(
        (k, v) for k, v in env.items() if k not in _PER_RANK_ENV
    )))  # fmt: skip
    zygote = _ZYGOTES.pop(key, None)
    if zygote is None or not zygote.ready or zygote.proc.poll() is not None:
        if zygote is not None:
            zygote.close()
        while len(_ZYGOTES) >= _MAX_ZYGOTES:  # the least recently used goes (~0.7 GB each)
            _ZYGOTES.pop(next(iter(_ZYGOTES))).close()
        zygote = _Zygote(env, setup)
    _ZYGOTES[key] = zygote  # most recently used last
    return zygote


@atexit.register
def close_zygotes() -> None:
    """Stop every zygote of this process (their running ranks die with them)."""
    while _ZYGOTES:
        _ZYGOTES.popitem()[1].close()


def placement_rules_enabled() -> bool:
    """``MOE_RELEASE_PLACEMENT`` (default on): ``0`` spawns CPU ranks without the placement
    rules of :mod:`runtime.cuda.placement` (to tell a rule's failure from the code's)."""
    return settings.placement()


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


# A rank prints every thread's stack on this signal (faulthandler); the launcher sends it to the
# ranks of a job that timed out, before it kills them. A timer in the rank would instead dump
# at a fixed time, whatever the rank is doing then: faulthandler reads the frames without the
# GIL, and a dump that lands while the main thread is importing can crash the rank (SIGSEGV),
# which then reads as a failure, not as the hang it was.
_DUMP_SIGNAL = signal.SIGUSR1


def _dump_stacks(procs, wait: float = 2.0) -> None:
    """Ask each live rank for its stacks and give them ``wait`` seconds to be written."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        try:
            os.kill(p.pid, _DUMP_SIGNAL)
        except ProcessLookupError:
            pass
    end = time.monotonic() + wait
    while live and time.monotonic() < end:
        time.sleep(0.2)  # the dump is a few write() calls from the signal handler


def _kill(p) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            # A forked rank killed before its setsid(): its group is still the zygote's.
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    p.wait()


def _rank_main(job: Path) -> int:
    rank = int(os.environ["RANK"])
    try:
        spec = pickle.loads((job / "spec.pkl").read_bytes())
        faulthandler.register(_DUMP_SIGNAL, all_threads=True)
        from moe_release.runtime.measure import faults

        # Every collective logged with its context, atexit hooks tagged
        # (moe_release.runtime.measure.faults), before megatron-core is imported; a forked rank has
        # it from its zygote.
        faults.install()
        import torch

        torch.set_num_threads(1)
        if spec["device"] == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        if spec["emulate_deep_ep"]:
            from moe_release.runtime.kernels.install import install_kernel_emulations

            install_kernel_emulations(settings.tree(), spec["force_emulation"])
        placement_on = spec["device"] == "cpu" and spec.get("placement", True)
        if placement_on:
            # CUDA's placement rules on the host (moe_release.runtime.cuda.placement): a rank
            # refuses what a GPU would refuse.
            from moe_release.runtime.cuda import placement

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
        # Every job starts with the collector's counts at zero: a forked rank inherits the
        # zygote's, which depend on what the zygote did before, and the moment a cyclic
        # collection frees an autograd graph moves allocator peaks between runs of one job.
        gc.collect()
        if spec["device"] == "cpu" and placement_on:
            # The emulated GPU counts its memory from the job's start, as a GPU always can
            # (torch.cuda.mem_get_info: the explicit release measures what it frees with it).
            from moe_release.runtime.measure import cpu_memory

            cpu_memory.install()
        try:
            result = func(**spec["kwargs"])
        finally:
            from moe_release.runtime.cuda.compat import teardown_megatron_state

            teardown_megatron_state()
            if dist.is_initialized():  # a job may destroy its groups itself (an abort)
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
