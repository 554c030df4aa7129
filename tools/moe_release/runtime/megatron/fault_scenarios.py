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
  ``destroy_model_parallel()``, ``initialize_model_parallel()``, a step;
* ``e`` re-initialise x5 without abort;
* ``f`` microbatch 2's forward re-creates a larger buffer while microbatch 1's backward is
  pending, then rank 1 raises and unwinds (dropping the graphs), and both exit;
* ``g-exc``/``g-ret`` a step, then every rank raises at top level / returns;
* ``h`` colocated RL x5: ``reset_fused_a2a_buffers()`` (where the tree has it), a rollout's
  tensors allocated and freed, a step;
* ``i`` NeMo-RL's refit (NVIDIA-NeMo/RL#2319): a step, the model and optimizer offloaded
  (storage freed), and the bytes the token dispatchers still reach.

The pass rule (:func:`violations`) and the table (:func:`markdown`) are what
``scripts/fault_matrix.py`` and ``test_comm_buffer_faults.py`` use.
"""

import gc
import inspect
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from moe_release import backends, settings

FLEX = backends.NAMES
DISPATCHERS = ("alltoall", "allgather")
BACKENDS = FLEX + DISPATCHERS
SCENARIOS = ("a", "b", "c1", "c2", "d", "e", "f", "g-exc", "g-ret", "h", "i")
# The scenarios the all-to-all and all-gather dispatchers (no communication buffer) run.
DISPATCHER_SCENARIOS = ("a", "b", "d", "e", "g-exc", "g-ret", "i")
# Wall-time bound of each scenario's work, seconds per rank (process start not included).
BOUNDS = {
    "a": 15.0, "b": 20.0, "c1": 15.0, "c2": 15.0, "d": 60.0, "e": 60.0, "f": 20.0,
    "g-exc": 15.0, "g-ret": 15.0, "h": 60.0, "i": 15.0,
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
THIS = "moe_release.runtime.megatron.fault_scenarios"


def applies(scenario: str, backend: str) -> bool:
    """Whether the matrix has a cell for ``scenario`` on ``backend`` (NCCL EP's context has a
    capacity fixed at its bootstrap: a larger dispatch is refused, nothing grows, so no f)."""
    if scenario == "f" and backend == "ncclep":
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
    from moe_release.runtime.kernels import deepep_v2_emulation, te_ep_emulation
    from moe_release.runtime.measure import faults

    out: Dict[str, int] = {}
    for b in list(faults.BUFFERS):
        kind = type(b).__name__
        if kind == "ElasticBuffer":
            continue  # counted by runtime below: a replaced buffer's runtime may outlive it
        if getattr(b, "memory", None) is not None:
            out[kind] = out.get(kind, 0) + 1
    runtimes = [r for r in list(deepep_v2_emulation._RUNTIMES) if not r.destroyed]
    if runtimes:
        out["ElasticBuffer"] = len(runtimes)
    if te_ep_emulation.BACKEND.initialized:
        out["NCCL EP context"] = 1
    return out


def kernel_leaked_bytes(all_leaks: bool = False) -> int:
    """Bytes the kernels themselves leak by design: DeepEP's RDMA receive counter per destroy
    (4 B, ``deep_ep.cpp:299-304``) and NCCL EP's device communicator per bootstrap. With
    ``all_leaks`` also what buffers dropped without their ``destroy()`` leak (deep_ep keeps
    them: the caller's fault)."""
    from moe_release.runtime.kernels import deepep_emulation, deepep_v2_emulation, te_ep_emulation

    te = sum(t.nbytes for t in te_ep_emulation.LEAKED)
    v1 = [t.nbytes for t in deepep_emulation.LEAKED_BUFFERS if t is not None]
    if not all_leaks:
        return te + sum(n for n in v1 if n == 4)
    v2 = sum(t.nbytes for t in deepep_v2_emulation.LEAKED_BUFFERS if t is not None)
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
    """Rank 1's experts raise: its dispatch has run, its combine never will."""

    def fail(*args, **kwargs):
        raise InjectedFault("rank 1: the experts failed after the dispatch")

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
    """``reset_fused_a2a_buffers()`` collectively, with the keywords the tree's signature has;
    False where the tree has no release API."""
    from megatron.core.transformer.moe import fused_a2a

    release = getattr(fused_a2a, "reset_fused_a2a_buffers", None)
    if release is None:
        return False
    params = inspect.signature(release).parameters
    release(**({"collective": True} if "collective" in params else {}))
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
        if rank == 1:
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
        if rank == 1:
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
            layer = _layer(backend)
            _step(layer, seed=10)  # the same routing every cycle: the same bytes kept
            r.settled_bytes()
    elif scenario == "f":
        _scenario_f(r, layer, backend)
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
    from moe_release.runtime.measure import faults

    pending = [_forward(layer, TOKENS, 1)]
    made = len(faults.BUFFERS)
    pending.append(_forward(layer, 4 * 160, 2))  # past HybridEP's 512 rows: it regrows
    r.out["buffers_made"] = len(faults.BUFFERS) - made
    r.settled_bytes()
    try:
        if r.rank == 1:
            raise InjectedFault("rank 1: failed with two backwards pending")
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
    _scenario(r, spec["scenario"], spec["backend"])


def _log_warnings() -> None:
    """megatron-core's logger warnings, into the rank's fault log."""
    import logging

    from moe_release.runtime.measure import faults

    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: faults.record("warning", text=record.getMessage()[:300])
    logging.getLogger("megatron").addHandler(handler)


# -- parent side -----------------------------------------------------------------------------


def run_cell(tree: str, scenario: str, backend: str, log: Callable[[str], None] = print) -> dict:
    """Run one cell on ``tree`` (2 rank processes, bounded, always reaped); its measurements."""
    from moe_release.runtime.ranks import launcher

    bound = BOUNDS[scenario]
    # Start (import, rendezvous) + the scenario's bound + the exit's, and some slack for a
    # loaded host.
    deadline_s = 60.0 + bound + EXIT_BOUND
    spec = {
        "scenario": scenario,
        "backend": backend,
        "gloo_timeout": TEARDOWN_GLOO_TIMEOUT if scenario in ("c1", "c2") else GLOO_TIMEOUT,
        "device_barrier_timeout": DEVICE_BARRIER_TIMEOUT,
    }
    setup = {"emulate_deep_ep": True, "force_emulation": False, "placement": True}
    with tempfile.TemporaryDirectory(prefix="moe_fault_") as tmp:
        job = Path(tmp)
        (job / "spec.pkl").write_bytes(pickle.dumps(spec))
        port = launcher.free_port()
        zygote = launcher._zygote(tree, setup) if launcher.fork_server_enabled() else None
        procs, logs = [], []
        started = time.time()
        try:
            for rank in range(WORLD):
                env = launcher.rank_env(tree, rank, WORLD, port)
                env["MOE_RELEASE_RANK_ENTRY"] = f"{THIS}:rank_entry"
                forked = zygote.fork(job, rank, env) if zygote is not None else None
                if forked is None:
                    out = open(job / f"rank{rank}.log", "w+b")
                    logs.append(out)
                    forked = subprocess.Popen(
                        [sys.executable, "-m", THIS, str(job)], env=env,
                        cwd=str(launcher.REPO_ROOT), stdout=out, stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )  # fmt: skip
                procs.append(forked)
            exited = _wait(procs, scenario, started + deadline_s, job / "rank0.faults", bound)
        finally:
            for p in procs:
                launcher._kill(p)
            for out in logs:
                out.close()
        cell = _collect(job, procs, exited, spec)
    cell.update(tree=tree, scenario=scenario, backend=backend, bound=bound)
    return cell


def _wait(procs, scenario: str, deadline: float, log0: Path, bound: float) -> List[Optional[float]]:
    """Each rank's exit time (None: killed at the deadline). In c2 rank 1 is killed once rank
    0 has exited (it only sleeps); in c1/c2 rank 0 is killed 3 s past the bound of a teardown
    that has not returned."""
    exited: List[Optional[float]] = [None] * len(procs)
    checked = 0.0
    while time.time() < deadline:
        if scenario in ("c1", "c2") and exited[0] is None and time.time() - checked > 0.5:
            checked = time.time()
            marks = {m.get("what"): m["t"] for m in _read_log(log0) if m.get("kind") == "marker"}
            if "teardown_start" in marks and "teardown_end" not in marks:
                if checked - marks["teardown_start"] > bound + 3.0:
                    return exited
        for i, p in enumerate(procs):
            if exited[i] is None and p.poll() is not None:
                exited[i] = time.time()
        if scenario == "c2" and exited[0] is not None and exited[1] is None:
            return exited
        if all(e is not None for e in exited):
            return exited
        time.sleep(0.05)
    return exited


def _read_log(path: Path) -> List[Dict[str, Any]]:
    out = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


_WARNING = re.compile(r"warn|would trap|timed out", re.IGNORECASE)
# Python's warnings module repeats the call site; import-time deprecations are no fault.
_NOISE = re.compile(r"^\s*warnings\.warn\(|DeprecationWarning|FutureWarning|is deprecated")


def _collect(job: Path, procs, exited, spec) -> Dict[str, Any]:
    ranks = []
    for rank, p in enumerate(procs):
        records = _read_log(job / f"rank{rank}.faults")
        result_file = job / f"rank{rank}.json"
        result = json.loads(result_file.read_text()) if result_file.exists() else {}
        output = (
            (job / f"rank{rank}.log").read_text(errors="replace")
            if (job / f"rank{rank}.log").exists()
            else ""
        )
        markers = {m["what"]: m["t"] for m in records if m.get("kind") == "marker"}
        done = markers.get("done")
        killed = exited[rank] is None
        entries = [e for e in records if "op" in e]
        teardown = _between(records, "teardown_start", "teardown_end")
        ranks.append(
            {
                **result,
                "rc": None if killed else p.returncode,
                "killed": killed,
                "exit_s": None if killed or done is None else exited[rank] - done,
                "collectives": entries,
                "teardown_collectives": teardown,
                "warnings": _warnings(output, records),
                "device_barrier_timeouts": [
                    m for m in records if m.get("kind") == "device_barrier_timeout"
                ],
                "output_tail": output[-1500:],
                "teardown_started": "teardown_start" in markers,
            }
        )
    return {"ranks": ranks}


def _between(records, start: str, end: str) -> List[Dict[str, Any]]:
    """The collectives entered between markers ``start`` and ``end`` (every such span)."""
    out, inside = [], False
    for rec in records:
        if rec.get("kind") == "marker" and rec.get("what") in (start, end):
            inside = rec["what"] == start
        elif inside and "op" in rec:
            out.append(rec)
    return out


def _warnings(output: str, records) -> List[str]:
    lines = [
        line.strip()[:200]
        for line in output.splitlines()
        if _WARNING.search(line) and not _NOISE.search(line)
    ]
    lines += [f"[logger] {m['text'][:200]}" for m in records if m.get("kind") == "warning"]
    seen: Dict[str, None] = {}
    for line in lines:
        seen.setdefault(line, None)
    return list(seen)


# -- the pass rule ---------------------------------------------------------------------------


def banned(entry: Dict[str, Any]) -> Optional[str]:
    """Why a collective entry breaks the pass rule, or None."""
    from moe_release.runtime.measure.faults import BANNED_CONTEXTS, LIFECYCLE

    ctx = entry.get("context") or []
    hit = [c for c in ctx if c in BANNED_CONTEXTS]
    if hit:
        return hit[0]
    if "atexit" in ctx and entry.get("exception_pending"):
        return "atexit after an exception"
    if entry["op"] in LIFECYCLE and ("autograd" in ctx or "thread" in ctx):
        return "inside a backward"
    return None


def unmatched(cell: Dict[str, Any], lifecycle_only: bool = True) -> List[Dict[str, Any]]:
    """Collectives not every member rank of their group entered as often (on a GPU: a rank
    waiting alone). ``lifecycle_only``: barriers and the buffers' device-side collectives."""
    from moe_release.runtime.measure.faults import LIFECYCLE

    counts: Dict[tuple, Dict[int, int]] = {}
    for rank, r in enumerate(cell["ranks"]):
        for e in r["collectives"]:
            if e["ranks"] is None or len(e["ranks"]) < 2:
                continue
            if lifecycle_only and e["op"] not in LIFECYCLE:
                continue
            key = (tuple(e["ranks"]), e["op"])
            counts.setdefault(key, {m: 0 for m in e["ranks"]})
            counts[key][rank] = counts[key].get(rank, 0) + 1
    return [
        {"ranks": list(k[0]), "op": k[1], "per_rank": v}
        for k, v in sorted(counts.items())
        if len(set(v.values())) > 1
    ]


def summary(cell: Dict[str, Any]) -> Dict[str, Any]:
    """The figures of a cell the pass rule and the table read (also the golden values)."""
    ranks = cell["ranks"]
    s = cell["scenario"]
    expect_exit_code = 1 if s in ("b", "f", "g-exc") else 0
    flat = None
    if s in ("d", "e", "h") and all(len(r.get("bytes") or []) == CYCLES + 1 for r in ranks):
        flat = [
            (r["bytes"][CYCLES] - r["bytes"][1])
            - (r["kernel_leaks"][CYCLES] - r["kernel_leaks"][1])
            for r in ranks
        ]
    exits = []
    for i, r in enumerate(ranks):
        if s == "c2" and i == 1:
            exits.append(None)  # killed by design
            continue
        exits.append(r["exit_s"] if not r["killed"] else float("inf"))
    teardown = [max(r.get("teardown_s") or [0.0]) if r.get("teardown_s") else None for r in ranks]
    if s in ("c1", "c2") and ranks[0].get("teardown_started") and not ranks[0].get("teardown_s"):
        teardown[0] = float("inf")  # killed inside its teardown: its exit is not measured
        exits[0] = None
    return {
        "scenario_s": [r.get("scenario_s") for r in ranks],
        "teardown_s": teardown,
        "teardown_waits": [
            sum(1 for e in r["teardown_collectives"] if e["op"] in _lifecycle()) for r in ranks
        ],
        "exit_s": exits,
        "rc": [r["rc"] for r in ranks],
        "expect_rc": expect_exit_code,
        "bytes": [r.get("bytes") for r in ranks],
        "growth": flat,
        "buffers_alive": [r.get("buffers_alive") for r in ranks],
        "leaked_bytes": [r.get("leaked_bytes") for r in ranks],
        "banned": sorted(
            {f"{e['op']} ({banned(e)})" for r in ranks for e in r["collectives"] if banned(e)}
        ),  # fmt: skip
        "unmatched": [f"{u['op']} on {u['ranks']}: {u['per_rank']}" for u in unmatched(cell)],
        "device_barrier_timeouts": sum(len(r["device_barrier_timeouts"]) for r in ranks),
        "collectives": [len(r["collectives"]) for r in ranks],
        "warnings": sorted({w for r in ranks for w in r["warnings"]}),
        "threads_left": sorted({t for r in ranks for t in r.get("threads_left") or []}),
        "dispatcher_bytes": [r.get("dispatcher_bytes") for r in ranks],
        "release_api": ranks[0].get("release_api"),
        "unfinished": [
            _last_error(r["output_tail"])
            for r in ranks
            if "scenario_s" not in r and not r["killed"]
        ],
        "buffers_made": ranks[0].get("buffers_made"),
    }


def _last_error(output: str) -> str:
    """The last line of a rank's traceback (its exception), or of its output."""
    lines = [line for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "Exception" in line or "Fault" in line:
            return line.strip()[-300:]
    return (lines[-1].strip() if lines else "no output")[-300:]


def _lifecycle():
    from moe_release.runtime.measure.faults import LIFECYCLE

    return LIFECYCLE


def _num(x) -> float:
    return -1.0 if x is None else float(x)


def violations(scenario: str, s: Dict[str, Any], base: Optional[Dict[str, Any]]) -> List[str]:
    """The pass rule for one cell's :func:`summary` ``s`` (``base``: the unpatched base's
    summary of the same cell, or None): each broken rule with its figure."""
    bound = BOUNDS[scenario]
    out = [f"a rank failed before its last point: {e}" for e in s.get("unfinished") or ()]
    for rank, t in enumerate(s["scenario_s"]):
        if t is not None and t > bound:
            out.append(f"rank {rank} ran {t:.1f} s, over the {bound:.0f} s bound")
    for rank, t in enumerate(s["teardown_s"]):
        if t is not None and t > bound:
            out.append(f"rank {rank}'s teardown took {_secs(t)} (bound {bound:.0f} s)")
    if base is not None and max(s["teardown_waits"]) > max(base["teardown_waits"]):
        out.append(
            f"destroy_model_parallel() entered {max(s['teardown_waits'])} peer waits "
            f"(the base's teardown: {max(base['teardown_waits'])})"
        )
    for rank, (t, rc) in enumerate(zip(s["exit_s"], s["rc"])):
        if t is None:
            continue
        if t > EXIT_BOUND:
            out.append(
                f"rank {rank} exited {_secs(t)} after its last point (bound {EXIT_BOUND:.0f} s)"
            )
        elif rc != s["expect_rc"]:
            out.append(f"rank {rank} exited with {rc} (expected {s['expect_rc']})")
    if s["growth"] is not None and any(abs(g) > BYTES_JITTER for g in s["growth"]):
        out.append(f"device bytes grew from cycle 1 to {CYCLES}: {s['growth']} B")
    if s["banned"]:
        out.append(f"collectives from a banned context: {s['banned']}")
    if s["device_barrier_timeouts"]:
        out.append(f"{s['device_barrier_timeouts']} device barrier(s) timed out (a GPU traps)")
    if len(s["unmatched"]) > len(base["unmatched"] if base else []):
        out.append(f"collectives entered by one rank alone: {s['unmatched']}")
    if scenario == "d":
        alive = [sum((a or {}).values()) for a in s["buffers_alive"]]
        if max(alive) > 1:
            out.append(f"after 5 aborts {alive} buffers alive per rank (the current step's: 1)")
    if scenario == "i" and base is not None:
        mine, theirs = (
            max(map(_num, s["dispatcher_bytes"])),
            max(map(_num, base["dispatcher_bytes"])),
        )
        if mine > theirs + BYTES_JITTER:
            out.append(f"the dispatcher holds {mine:,.0f} B after the offload (base {theirs:,.0f})")
    if base is not None:
        known = None not in base["leaked_bytes"]  # None: the base's rank failed first
        if known and sum(map(_num, s["leaked_bytes"])) > sum(map(_num, base["leaked_bytes"])):
            out.append(f"leaked {s['leaked_bytes']} B (base {base['leaked_bytes']})")
        if len(s["threads_left"]) > len(base["threads_left"]):
            out.append(f"threads left: {s['threads_left']} (base {base['threads_left']})")
    return out


def _secs(t: float) -> str:
    return "past the deadline (killed)" if t == float("inf") else f"{t:.2f} s"


# -- the table -------------------------------------------------------------------------------


def cell_text(scenario: str, s: Dict[str, Any], base: Optional[Dict[str, Any]]) -> str:
    """One table cell: the verdict and the figures that decide it."""
    bad = violations(scenario, s, base)
    figures = []
    if s["teardown_s"] and any(t is not None for t in s["teardown_s"]):
        figures.append("teardown " + "/".join(_short(t) for t in s["teardown_s"]))
    if any(t is not None for t in s["exit_s"]):
        figures.append("exit " + "/".join(_short(t) for t in s["exit_s"]))
    if s["growth"] is not None:
        figures.append("growth " + "/".join(f"{g:+,}" for g in s["growth"]) + " B")
    if scenario == "i":
        figures.append("held " + "/".join(f"{_num(b):,.0f}" for b in s["dispatcher_bytes"]) + " B")
    if scenario == "h" and not s["release_api"]:
        figures.append("no release API")
    alive = [sum((a or {}).values()) for a in s["buffers_alive"]]
    figures.append(f"alive {'/'.join(map(str, alive))}")
    if s["banned"]:
        figures.append("banned: " + ", ".join(s["banned"]))
    if s["unmatched"]:
        figures.append(f"alone: {len(s['unmatched'])}")
    verdict = "FAIL" if bad else "pass"
    return f"**{verdict}** " + "; ".join(figures)


def _short(t) -> str:
    if t is None:
        return "-"
    return "killed" if t == float("inf") else f"{t:.2f}s"


def markdown(rows: Dict[str, Dict[str, Dict[str, Any]]], base_row: str) -> str:
    """The matrix as markdown: a table per backend, a row per tree, a column per scenario."""
    lines = []
    for backend in BACKENDS:
        scenarios = [s for s in SCENARIOS if applies(s, backend)]
        present = [t for t in rows if any(f"{s}/{backend}" in rows[t] for s in scenarios)]
        if not present:
            continue
        lines += ["", f"### {backend}", "", "| tree | " + " | ".join(scenarios) + " |"]
        lines.append("|---" * (len(scenarios) + 1) + "|")
        for tree in present:
            cells = []
            for s in scenarios:
                summ = rows[tree].get(f"{s}/{backend}")
                base = rows.get(base_row, {}).get(f"{s}/{backend}") if tree != base_row else None
                cells.append("n/a" if summ is None else cell_text(s, summ, base))
            lines.append(f"| {tree} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # a spawned rank (MOE_RELEASE_FORK=0)
    from moe_release.runtime.ranks import zygote

    zygote._prepare({"emulate_deep_ep": True, "force_emulation": False, "placement": True})
    rank_entry(sys.argv[1])
