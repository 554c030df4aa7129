# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The fault matrix: what a GPU job meets when something goes wrong, on the CPU runtime.

Each cell runs one scenario on one dispatcher backend over 2 gloo ranks (megatron-core's real
MoELayer, the kernels emulated, :mod:`moe_release.runtime.megatron.moe_harness`), every rank a real
process that exits through the interpreter (atexit hooks, finalization; forked by the zygote with
``MOE_RELEASE_RANK_ENTRY``, or spawned fresh with ``MOE_RELEASE_FORK=0``), and measures per rank:
wall seconds against the scenario's bound, the exit (seconds from its last point to the process
exit, return code), the counted device bytes after each cycle, the communication buffers alive and
the bytes the kernels leaked, every collective entered with its context
(:mod:`moe_release.runtime.measure.faults`), the warnings printed and the threads left. Scenarios
(bounds in :data:`BOUNDS`):

* ``a`` a step, then ``destroy_model_parallel()`` on every rank;
* ``b`` rank 1 raises in the experts after the dispatch, rank 0 goes on into combine and blocks
  (until the groups' short timeout), both unwind uncaught and exit;
* ``c1``/``c2`` rank 0 tears down while rank 1 exits right after the step (c1) or sleeps past
  the bound (c2: it is killed once rank 0 has exited);
* ``d`` in-process restart x5: every group megatron created destroyed (WORLD kept), then
  ``destroy_model_parallel()``, ``initialize_model_parallel()``, the restart recipe (the explicit
  release over the world, where the tree has it), a step;
* ``e`` re-initialise x5 without abort;
* ``f`` microbatch 2's forward re-creates a larger buffer while microbatch 1's backward is
  pending, then rank 1 raises and unwinds (dropping the graphs), and both exit;
* ``g-exc``/``g-ret`` a step, then every rank raises at top level / returns;
* ``h`` colocated RL x5: ``reset_fused_a2a_buffers()`` (where the tree has it), a rollout's
  tensors allocated and freed, a step;
* ``i`` NeMo-RL's refit (NVIDIA-NeMo/RL#2319): a step, the model and optimizer offloaded
  (storage freed), and the bytes the token dispatchers still reach;
* ``j`` restart onto a replaced peer: after a step and the abort, rank 1's process is replaced
  by a fresh one (it re-executes itself, holding none of the old buffers) that joins a new world
  with the survivor; both re-initialize and step without the recipe, then run the explicit
  release (the survivor's old buffers leaked, the new ones freed) and a step;
* ``k`` restart into a new layout: after a step at EP 2 and the abort, PP 2 (a stage per rank,
  EP 1: HybridEP only, as DeepEP has no one-rank layout and NCCL EP needs TPxEP > 1), the
  recipe, and a step through both stages (stage 1 waits for stage 0's activations);
* ``l`` a backward that allocates: a fixture clears the module global between a forward and its
  backward, so the backward (HybridEP: its recomputed forward) makes a new buffer;
* ``m`` the explicit release with a live graph: between a forward and its backward every rank
  calls it (it must refuse on every rank and free nothing), then the backward and the release;
* ``n`` the explicit release called off the main thread on every rank (refused before any
  collective).

This module is the rank side (what a rank process runs); running a cell, its pass rule and
its table are :mod:`moe_release.runtime.megatron.fault_cells`.
"""

import gc
import inspect
import json
import os
import pickle
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, Optional

from moe_release import backends, settings

FLEX = backends.NAMES
DISPATCHERS = ("alltoall", "allgather")
BACKENDS = FLEX + DISPATCHERS
SCENARIOS = (
    "a", "b", "c1", "c2", "d", "e", "f", "g-exc", "g-ret", "h", "i", "j", "k", "l", "m", "n",
)  # fmt: skip
# The scenarios the all-to-all and all-gather dispatchers (no communication buffer) run.
DISPATCHER_SCENARIOS = ("a", "b", "d", "e", "g-exc", "g-ret", "i")
# Wall-time bound of each scenario's work, seconds per rank (process start not included).
BOUNDS = {
    "a": 15.0, "b": 20.0, "c1": 15.0, "c2": 15.0, "d": 60.0, "e": 60.0, "f": 20.0,
    "g-exc": 15.0, "g-ret": 15.0, "h": 60.0, "i": 15.0, "j": 60.0, "k": 30.0, "l": 20.0,
    "m": 20.0, "n": 15.0,
}  # fmt: skip
# Seconds from a rank's last scenario point to its process exit (1-3 s on a quiet host, up to
# 10 s on a loaded one; a peer wait at exit takes DEVICE_BARRIER_TIMEOUT or the groups' timeout).
EXIT_BOUND = 20.0
GLOO_TIMEOUT = 5.0  # the groups' collective timeout: a blocked peer gives up
# In c1/c2 the groups keep a production timeout (megatron's default is 30 min), so a teardown
# that waits for the peer waits its own bound, not gloo's; rank 0 is killed past the bound.
TEARDOWN_GLOO_TIMEOUT = 1800.0
DEVICE_BARRIER_TIMEOUT = 5.0  # a device-side barrier's peers (faults.Fabric)
CYCLES = 5
# Counted bytes that move between cycles with the routing of a step whose weights changed (a
# few host tensors sized by tokens per expert), not a buffer or dispatcher state: tolerated.
BYTES_JITTER = 128
TOKENS = 12
WORLD = 2
# Across nodes (issue 54): 2 emulated nodes x 2 ranks (MOE_RELEASE_RANKS_PER_NODE=2), and the
# scenarios whose frees or waits change there (the others: one node only).
NODES_WORLD, NODES_RANKS_PER_NODE = 4, 2
NODES_SCENARIOS = ("a", "b", "c1", "c2", "d", "h", "i", "j")


def faulty_rank(world: int) -> int:
    """The rank that raises, exits early, sleeps or is replaced: the last one (rank 1 of 2; on
    the other node than rank 0 when the ranks span nodes)."""
    return world - 1


THIS = "moe_release.runtime.megatron.fault_scenarios"


def applies(scenario: str, backend: str) -> bool:
    """Whether the matrix has a cell for ``scenario`` on ``backend`` (NCCL EP's context has a
    capacity fixed at its bootstrap: a larger dispatch is refused, nothing grows, so no f; k's
    new layout has one rank per EP group, which DeepEP and DeepEP v2 have no layout for and NCCL
    EP refuses: it needs TPxEP > 1)."""
    if scenario == "f" and backend == "ncclep":
        return False
    if scenario == "k" and backend != "hybridep":
        return False
    return backend in FLEX or scenario in DISPATCHER_SCENARIOS


# -- rank side -------------------------------------------------------------------------------


class _Rank:
    """What one rank measures while its scenario runs (written to ``rank<N>.json``)."""

    def __init__(self, job: Path, spec: Dict[str, Any]) -> None:
        import torch.distributed as dist

        self.job, self.spec = job, spec
        self.rank = dist.get_rank()
        self.out: Dict[str, Any] = {"bytes": [], "kernel_leaks": [], "teardown_s": []}
        self.threads = {t.ident for t in threading.enumerate()}
        self.start = time.monotonic()

    def mark(self, what: str, **fields: Any) -> None:
        from moe_release.runtime.measure import faults

        faults.record("marker", what=what, **fields)

    def settled_bytes(self) -> None:
        """Counted bytes after a cycle (a garbage collection first, then settled reads)."""
        from moe_release.runtime.measure import cpu_memory

        gc.collect()
        self.out["bytes"].append(cpu_memory.settled())
        self.out["kernel_leaks"].append(kernel_leaked_bytes())

    def teardown(self) -> None:
        from megatron.core import parallel_state

        self.mark("teardown_start")
        start = time.monotonic()
        try:
            parallel_state.destroy_model_parallel()
        finally:
            self.out["teardown_s"].append(time.monotonic() - start)
            self.mark("teardown_end")

    def finish(self, error: Optional[str] = None) -> None:
        """Write what was measured; the rank's last scenario point (its exit is timed from
        here)."""
        self.out.update(
            scenario_s=time.monotonic() - self.start,
            error=error,
            buffers_alive=buffers_alive(),
            # What buffers dropped without their destroy() leak (the kernels' own leaks apart).
            leaked_bytes=kernel_leaked_bytes(all_leaks=True) - kernel_leaked_bytes(),
            threads_left=[
                t.name
                for t in threading.enumerate()
                if t.ident not in self.threads and t.is_alive()
            ],
        )
        self.mark("done")
        tmp = self.job / f"rank{self.rank}.json.tmp"
        tmp.write_text(json.dumps(self.out, default=str))
        os.replace(tmp, self.job / f"rank{self.rank}.json")


def buffers_alive() -> Dict[str, int]:
    """The emulations' communication buffers and contexts still allocated, by kind."""
    from moe_release.runtime.kernels import deepepv2_emulation, ncclep_emulation
    from moe_release.runtime.measure import faults

    out: Dict[str, int] = {}
    for b in list(faults.BUFFERS):
        kind = type(b).__name__
        if kind == "ElasticBuffer":
            continue  # counted by runtime below: a replaced buffer's runtime may outlive it
        if getattr(b, "memory", None) is not None:
            out[kind] = out.get(kind, 0) + 1
    runtimes = [r for r in list(deepepv2_emulation._RUNTIMES) if not r.destroyed]
    if runtimes:
        out["ElasticBuffer"] = len(runtimes)
    if ncclep_emulation.BACKEND.initialized:
        out["NCCL EP context"] = 1
    return out


def kernel_leaked_bytes(all_leaks: bool = False) -> int:
    """Bytes the kernels themselves leak by design: DeepEP's RDMA receive counter per destroy
    (4 B, ``deep_ep.cpp:299-304``) and NCCL EP's device communicator per bootstrap. With
    ``all_leaks`` also what buffers dropped without their ``destroy()`` leak (deep_ep keeps
    them: the caller's fault)."""
    from moe_release.runtime.kernels import deepep_emulation, deepepv2_emulation, ncclep_emulation

    te = sum(t.nbytes for t in ncclep_emulation.LEAKED)
    v1 = [t.nbytes for t in deepep_emulation.LEAKED_BUFFERS if t is not None]
    if not all_leaks:
        return te + sum(n for n in v1 if n == 4)
    v2 = sum(t.nbytes for t in deepepv2_emulation.LEAKED_BUFFERS if t is not None)
    return te + sum(v1) + v2


def _layer(backend: str):
    import torch.distributed as dist

    from moe_release.runtime.megatron.moe_harness import build_moe_layer, model_kwargs, moe_config

    extra: Dict[str, Any] = {}
    if backend in DISPATCHERS:
        extra["moe_token_dispatcher_type"] = backend
    config = moe_config("hybridep" if backend in DISPATCHERS else backend, dist.get_world_size(),
                        **model_kwargs(backend), **extra)  # fmt: skip
    layer = build_moe_layer(config)
    layer.train()
    return layer


def _init() -> None:
    import torch.distributed as dist

    from moe_release.runtime.megatron.moe_harness import init_megatron

    timeout = settings.fault_gloo_timeout(GLOO_TIMEOUT)
    init_megatron(ep=dist.get_world_size(), timeout_minutes=timeout / 60)


def _step(layer, tokens: int = TOKENS, seed: int = 3) -> None:
    from moe_release.runtime.megatron.moe_harness import train_step as step

    step(layer, tokens, seed)


def _forward(layer, tokens: int, seed: int):
    """A forward of ``tokens`` tokens with its graph (for a backward later)."""
    import torch
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    x = torch.randn(tokens, 1, layer.config.hidden_size, generator=gen)
    x = x.to(layer.config.params_dtype).requires_grad_()
    y, _ = layer(x)
    return y


class InjectedFault(RuntimeError):
    """The failure a scenario injects on one rank."""


def _raise_in_experts(layer) -> None:
    """The faulty rank's experts raise: its dispatch has run, its combine never will."""
    import torch.distributed as dist

    rank = dist.get_rank()

    def fail(*args, **kwargs):
        raise InjectedFault(f"rank {rank}: the experts failed after the dispatch")

    layer.experts.forward = fail


def abort_groups() -> int:
    """Destroy every process group parallel_state holds but the default one (an in-process
    restart's abort); returns how many."""
    import torch.distributed as dist

    from megatron.core import parallel_state

    world = dist.GroupMember.WORLD
    groups: Dict[int, Any] = {}
    for value in list(vars(parallel_state).values()):
        values = value if isinstance(value, (list, tuple)) else [value]
        if isinstance(value, dict):
            values = list(value.values())
        for g in values:
            if isinstance(g, dist.ProcessGroup) and g is not world:
                groups[id(g)] = g
    for g in groups.values():
        try:
            dist.destroy_process_group(g)
        except (KeyError, RuntimeError, ValueError):
            pass
    return len(groups)


def release_buffers() -> bool:
    """``reset_fused_a2a_buffers()`` collectively over the world (the restart recipe), with the
    keywords the tree's signature has; False where the tree has no release API."""
    from megatron.core.transformer.moe import fused_a2a

    release = getattr(fused_a2a, "reset_fused_a2a_buffers", None)
    if release is None:
        return False
    import torch.distributed as dist

    params = inspect.signature(release).parameters
    kwargs = {"collective": True} if "collective" in params else {}
    if "group" in params:
        kwargs["group"] = dist.group.WORLD
    release(**kwargs)
    return True


def dispatcher_bytes(layer) -> int:
    """Bytes of the tensors the layer's token dispatcher (and its comm manager) reach through
    their attributes: ``probs``, ``routing_map``, handles, ... (each storage once)."""
    import torch

    seen, total = set(), 0

    def visit(obj, depth: int) -> None:
        nonlocal total
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            key = storage.data_ptr() or id(storage)
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif depth and isinstance(obj, (list, tuple)):
            for v in obj:
                visit(v, depth - 1)
        elif depth and isinstance(obj, dict):
            for v in obj.values():
                visit(v, depth - 1)
        elif depth and hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
            if type(obj).__module__.startswith(("megatron.", "moe_release.runtime.")):
                for v in vars(obj).values():
                    visit(v, depth - 1)

    dispatcher = layer.token_dispatcher
    for v in vars(dispatcher).values():
        visit(v, 3)
    return total


def _scenario(r: _Rank, scenario: str, backend: str) -> None:
    import torch
    import torch.distributed as dist

    rank = r.rank
    _init()
    layer = _layer(backend)
    if scenario == "a":
        _step(layer)
        r.settled_bytes()
        r.teardown()
        r.settled_bytes()
    elif scenario == "b":
        _step(layer)
        if rank == faulty_rank(dist.get_world_size()):
            _raise_in_experts(layer)
        r.mark("fault")
        try:
            _step(layer, seed=4)
        except BaseException as exc:
            r.finish(error=f"{type(exc).__name__}: {str(exc)[:200]}")
            raise
        r.finish()
        raise AssertionError("the step after the fault completed")
    elif scenario in ("c1", "c2"):
        _step(layer)
        if rank == faulty_rank(dist.get_world_size()):
            if scenario == "c2":
                time.sleep(BOUNDS["c2"] + 15.0)  # killed once rank 0 has exited
            r.finish()
            return
        r.teardown()
    elif scenario in ("d", "e"):
        _step(layer)
        r.settled_bytes()  # cycle 0
        for cycle in range(CYCLES):
            del layer
            if scenario == "d":
                r.mark("abort", cycle=cycle + 1)
                abort_groups()
            r.teardown()
            _init()
            if scenario == "d":  # the restart recipe, before the first step
                r.out["release_api"] = release_buffers()
            layer = _layer(backend)
            _step(layer, seed=10)  # the same routing every cycle: the same bytes kept
            r.settled_bytes()
    elif scenario == "f":
        _scenario_f(r, layer, backend)
    elif scenario == "j":
        _scenario_j(r, layer, backend)
    elif scenario == "k":
        _scenario_k(r, layer, backend)
    elif scenario == "l":
        _scenario_l(r, backend)
    elif scenario in ("m", "n"):
        _scenario_mn(r, layer, scenario)
    elif scenario == "g-exc":
        _step(layer)
        r.settled_bytes()
        r.finish()
        raise InjectedFault("every rank: an uncaught exception at top level")
    elif scenario == "g-ret":
        _step(layer)
        r.settled_bytes()
    elif scenario == "h":
        _step(layer)
        r.settled_bytes()
        for cycle in range(CYCLES):
            r.mark("release", cycle=cycle + 1)
            r.out["release_api"] = release_buffers()
            rollout = torch.ones(1 << 20, dtype=torch.uint8)  # another workload's tensors
            del rollout
            _step(layer, seed=20 + cycle)
            r.settled_bytes()
    elif scenario == "i":
        optimizer = torch.optim.Adam(layer.parameters(), lr=1e-3)
        y = _forward(layer, TOKENS, 5)
        y.float().pow(2).sum().backward()
        optimizer.step()
        del y
        r.settled_bytes()
        # offload_after_refit: parameters, gradients and optimizer state leave the device.
        for p in layer.parameters():
            p.grad = None
            p.data.untyped_storage().resize_(0)
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    v.untyped_storage().resize_(0)
        r.settled_bytes()
        r.out["dispatcher_bytes"] = dispatcher_bytes(layer)
    else:
        raise ValueError(f"unknown scenario {scenario!r}")
    if scenario not in ("c1", "c2"):
        dist.barrier()  # the ranks leave together: each exit is timed from one point
    r.finish()


def _scenario_f(r: _Rank, layer, backend: str) -> None:
    """Two forwards, the second larger (the buffer is re-created), the first's backward
    pending; then rank 1 raises and unwinds, dropping both graphs."""
    import torch.distributed as dist

    from moe_release.runtime.measure import faults

    pending = [_forward(layer, TOKENS, 1)]
    made = len(faults.BUFFERS)
    pending.append(_forward(layer, 4 * 160, 2))  # past HybridEP's 512 rows: it regrows
    r.out["buffers_made"] = len(faults.BUFFERS) - made
    r.settled_bytes()
    try:
        if r.rank == faulty_rank(dist.get_world_size()):
            raise InjectedFault(f"rank {r.rank}: failed with two backwards pending")
        for y in reversed(pending):
            y.float().sum().backward()
    except BaseException as exc:  # leaving the handler drops the graphs: finalizers run
        error = f"{type(exc).__name__}: {str(exc)[:200]}"
    else:
        error = None
    del pending
    r.mark("unwound")
    r.settled_bytes()
    r.finish(error=error)
    raise InjectedFault(error or "rank 0: the peer failed")


def _scenario_j(r: _Rank, layer, backend: str) -> None:
    """The survivor's side (rank 0) and the replaced rank's first life (rank 1): a step, the
    abort; rank 1 then re-executes itself as a fresh process (``_replacement``), rank 0 joins
    it in a new world."""
    import torch.distributed as dist

    _step(layer)
    r.settled_bytes()
    del layer
    r.mark("abort")
    abort_groups()
    if r.rank == faulty_rank(int(os.environ["WORLD_SIZE"])):
        r.mark("replaced")
        env = dict(os.environ, MOE_RELEASE_REPLACEMENT="1")
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", THIS, str(r.job)], env)
    r.teardown()
    dist.destroy_process_group()
    from moe_release.runtime.ranks.launcher import free_port

    # The new world's port, chosen now by rank 0 (a port reserved at the cell's start may be
    # taken by then), for the replacement and the other survivors to read from the job's
    # directory.
    if r.rank == 0:
        port = free_port()
        (r.job / "second_port.tmp").write_text(str(port))
        os.replace(r.job / "second_port.tmp", r.job / "second_port")
    else:
        port = _second_port(r.job)
    _new_world(port, r.spec)
    _after_restart(r, backend)


def _second_port(job: Path) -> int:
    """The new world's port rank 0 wrote (j), waited for at most j's bound."""
    deadline = time.monotonic() + BOUNDS["j"]
    while not (job / "second_port").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return int((job / "second_port").read_text())


def _new_world(port: int, spec: Dict[str, Any]) -> None:
    """The world re-formed with the replacement: a new rendezvous on ``port``. The rendezvous
    waits up to j's bound for the replacement, a fresh interpreter that imports torch and
    megatron-core first (seconds on a loaded host); the group's collectives keep the short
    timeout."""
    from datetime import timedelta

    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], port, world, is_master=rank == 0,
                          timeout=timedelta(seconds=BOUNDS["j"]))  # fmt: skip
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world,
        timeout=timedelta(seconds=spec["gloo_timeout"]),
    )  # fmt: skip


def _after_restart(r: _Rank, backend: str) -> None:
    """Both ranks of j in the new world (rank 1 a fresh process): initialize and a step without
    the recipe (the hard case: the survivor then holds the old lifetime's buffers beside the
    new ones, on the same ranks), the explicit release (it must leak the old and free the new,
    waiting on no one), a step, the teardown."""
    _init()
    layer = _layer(backend)
    _step(layer, seed=10)
    r.settled_bytes()
    r.out["release_api"] = release_buffers()
    _step(layer, seed=11)
    r.settled_bytes()
    r.teardown()


def _scenario_k(r: _Rank, layer, backend: str) -> None:
    """A step at EP 2, the abort and teardown, then PP 2 with a stage per rank (EP 1), the
    recipe, and a step through both stages: stage 1 waits for stage 0's activations."""
    import torch
    import torch.distributed as dist

    from moe_release.runtime.megatron.moe_harness import init_megatron

    _step(layer)
    r.settled_bytes()
    del layer
    r.mark("abort")
    abort_groups()
    r.teardown()
    init_megatron(ep=1, pp=2, timeout_minutes=settings.fault_gloo_timeout(GLOO_TIMEOUT) / 60)
    r.out["release_api"] = release_buffers()
    stage = _layer(backend)
    hidden, dtype = stage.config.hidden_size, stage.config.params_dtype
    if r.rank == 0:
        gen = torch.Generator().manual_seed(7)
        x = torch.randn(TOKENS, 1, hidden, generator=gen).to(dtype).requires_grad_()
        y, _ = stage(x)
        dist.send(y.detach().contiguous(), 1)
        grad = torch.empty_like(y)
        dist.recv(grad, 1)
        y.backward(grad)
    else:
        x = torch.empty(TOKENS, 1, hidden, dtype=dtype)
        dist.recv(x, 0)
        x.requires_grad_()
        y, _ = stage(x)
        y.float().sum().backward()
        dist.send(x.grad.contiguous(), 0)
    r.settled_bytes()


def _scenario_l(r: _Rank, backend: str) -> None:
    """A forward, then a fixture clears the module global, then the backward: DeepEP's backward
    fetches a buffer (a new one), HybridEP's recomputed forward makes one."""
    import torch.distributed as dist

    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.megatron.moe_harness import build_moe_layer, model_kwargs, moe_config

    config = moe_config(backend, dist.get_world_size(), recompute=backend == "hybridep",
                        **model_kwargs(backend))  # fmt: skip
    layer = build_moe_layer(config)
    layer.train()
    y = _forward(layer, TOKENS, 5)
    alias = backends.get(backend).module_global
    if alias is not None and hasattr(fused_a2a, alias):
        setattr(fused_a2a, alias, None)  # a fixture's clear
    r.mark("backward")
    y.float().sum().backward()
    del y
    r.settled_bytes()
    r.out["release_api"] = release_buffers()


def _scenario_mn(r: _Rank, layer, scenario: str) -> None:
    """m: the explicit release between a forward and its backward, on every rank; n: the
    explicit release on another thread, on every rank. Each attempt must be refused and free
    nothing; then (m) the backward and the release."""
    from moe_release.runtime.measure import cpu_memory

    y = _forward(layer, TOKENS, 5) if scenario == "m" else None
    gc.collect()
    before = cpu_memory.settled()
    r.mark("attempt_start")
    if scenario == "m":
        r.out["refused"] = _attempt(release_buffers)
    else:
        result: Dict[str, Any] = {}
        thread = threading.Thread(target=lambda: result.update(refused=_attempt(release_buffers)))
        thread.start()
        thread.join(timeout=BOUNDS[scenario])
        r.out["refused"] = result.get("refused", "still running")
    r.mark("attempt_end")
    gc.collect()
    r.out["freed_by_attempt"] = before - cpu_memory.settled()
    if y is not None:
        y.float().sum().backward()
        del y
    r.out["release_api"] = release_buffers()
    r.settled_bytes()


def _attempt(release) -> Optional[str]:
    """What the release raised (None: it returned, or the tree has no release API)."""
    try:
        release()
    except Exception as exc:  # noqa: BLE001 - recorded, the scenario goes on
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return None


def rank_entry(job: str) -> None:
    """A rank of one cell (``MOE_RELEASE_RANK_ENTRY``): set up as a launcher rank, run the
    scenario, and leave through the interpreter."""
    import faulthandler
    from datetime import timedelta

    job_dir = Path(job)
    rank = int(os.environ["RANK"])
    spec = pickle.loads((job_dir / "spec.pkl").read_bytes())
    os.environ["MOE_RELEASE_DEVICE_BARRIER_TIMEOUT"] = str(spec["device_barrier_timeout"])
    os.environ["MOE_RELEASE_FAULT_GLOO_TIMEOUT"] = str(spec["gloo_timeout"])
    from moe_release.runtime.measure import faults

    faults.install(str(job_dir / f"rank{rank}.faults"))
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _log_warnings()
    replacement = settings.fault_replacement()
    if replacement:  # j's fresh process: it joins the re-formed world only, on rank 0's port
        _new_world(_second_port(job_dir), spec)
    else:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
            rank=rank,
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timedelta(seconds=spec["gloo_timeout"]),
        )
    from moe_release.runtime.measure import cpu_memory

    cpu_memory.install()
    gc.collect()
    r = _Rank(job_dir, spec)
    r.mark("start")
    if replacement:
        r.mark("replacement_start")
        _after_restart(r, spec["backend"])
        dist.barrier()  # the ranks leave together: each exit is timed from one point
        r.finish()
        return
    _scenario(r, spec["scenario"], spec["backend"])


def _log_warnings() -> None:
    """megatron-core's logger warnings, into the rank's fault log."""
    import logging

    from moe_release.runtime.measure import faults

    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: faults.record("warning", text=record.getMessage()[:300])
    logging.getLogger("megatron").addHandler(handler)


if __name__ == "__main__":  # a spawned rank (MOE_RELEASE_FORK=0)
    from moe_release.runtime.ranks import zygote

    zygote._prepare({"emulate_deep_ep": True, "force_emulation": False, "placement": True})
    rank_entry(sys.argv[1])
