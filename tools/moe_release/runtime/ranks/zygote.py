# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""A fork server for CPU ranks: import torch and megatron-core once, fork each rank from there.

A fresh rank spends most of a short test importing torch and megatron-core (about 10 s on 2 cores,
in every rank of every job). The zygote is started once per tree and rank setup (the environment,
the deep_ep emulation, the placement rules): it does what
``moe_release.runtime.ranks.launcher._rank_main`` does before it imports the target, imports
megatron-core's heavy modules, and then forks one child per rank request. A child is what a spawned
rank is at the same point: the same modules imported in the same order, nothing run yet (no process
group, no model, no tensor of a job), its own session, its output in the rank's log.

A child whose environment names ``MOE_RELEASE_RANK_ENTRY`` (``module:function``) runs that
function on its job directory instead of ``_rank_main`` and then exits as a process does, through
the interpreter (atexit hooks, finalization; an uncaught exception printed, exit status 1): the
fault matrix measures such exits (:mod:`moe_release.runtime.megatron.fault_scenarios`).

Protocol (text lines): the parent writes ``<job dir> <rank> <env as JSON>``; the zygote forks,
answers the child's pid, and once the child exits writes its exit status to
``<job dir>/rank<N>.exit`` (the parent cannot wait on its grandchildren). End of input ends the
zygote; children still running are killed with it.
"""

import json
import os
import select
import signal
import sys
from pathlib import Path

from moe_release import settings

# What every CPU rank of the suite imports: megatron-core's model, MoE and schedule modules.
# A module the tree lacks is skipped (older bases); an import error is left for the rank.
PRELOAD = (
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.transformer.transformer_config",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.fused_a2a",
    "megatron.core.pipeline_parallel",
    "megatron.core.models.gpt",
)


def _prepare(spec: dict) -> None:
    """What a rank does before importing its target (launcher._rank_main)."""
    from moe_release.runtime.measure import faults

    # Before megatron-core is imported: the atexit hooks it registers run tagged, and every
    # collective a rank enters is logged with its context (moe_release.runtime.measure.faults).
    faults.install()
    import torch

    torch.set_num_threads(1)
    if spec["emulate_deep_ep"]:
        from moe_release.runtime.kernels.install import install_kernel_emulations

        install_kernel_emulations(settings.tree(), spec["force_emulation"])
    if spec["placement"]:
        from moe_release.runtime.cuda import placement

        placement.install()
    preload()


def preload() -> None:
    """Import :data:`PRELOAD` (what is already imported stays as it is)."""
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the rank imports it again and reports the error
            pass


def _child(job: Path, rank: int, env: dict) -> None:
    os.setsid()
    log = os.open(job / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.stdin.close()
    os.environ.clear()
    os.environ.update(env)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    entry = env.get("MOE_RELEASE_RANK_ENTRY")
    if entry:
        # A rank that exits as a process does (the fault matrix,
        # moe_release.runtime.megatron.fault_scenarios): what its entry returns or raises leaves
        # through main() to the interpreter, which prints an uncaught exception, runs the atexit
        # hooks and finalizes.
        import importlib

        module, name = entry.split(":")
        getattr(importlib.import_module(module), name)(job)
        raise SystemExit(0)
    from moe_release.runtime.ranks.launcher import _rank_main

    code = 1
    try:
        code = _rank_main(job)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(children: dict) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        exit_file = children.pop(pid, None)
        if exit_file is not None:
            tmp = exit_file.with_suffix(".exit.tmp")
            tmp.write_text(str(os.waitstatus_to_exitcode(status)))
            os.replace(tmp, exit_file)


def main() -> int:
    spec = json.loads(sys.argv[1])
    _prepare(spec)
    zygote = os.getpid()
    children: dict = {}
    out = sys.stdout
    print("ready", file=out, flush=True)
    try:
        while True:
            readable, _, _ = select.select([sys.stdin], [], [], 0.05)
            _reap(children)
            if not readable:
                continue
            line = sys.stdin.readline()
            if not line:
                return 0
            job, rank, env = line.rstrip("\n").split(" ", 2)
            pid = os.fork()
            if pid == 0:
                _child(Path(job), int(rank), json.loads(env))
            children[pid] = Path(job) / f"rank{rank}.exit"
            print(pid, file=out, flush=True)
    finally:
        # Not in a child leaving through here (MOE_RELEASE_RANK_ENTRY): its copy of the table
        # names its siblings.
        for pid in list(children) if os.getpid() == zygote else ():
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    sys.exit(main())
