# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""docs/using.md's "In a colocated RL loop", run as written: its code blocks are read from the
document and executed on the ranks, with only what the document says is the user's
(``num_steps``, ``train_step()``, ``rollout()``, ``init_model_parallel()``, ``training_ranks``)
supplied here, so the document and these tests cannot drift apart.

On every flex backend the tree has: megatron-core's real MoELayer on 2 CPU gloo ranks (the
kernels emulated, their buffers allocated through the counted allocator), the loop and the
shutdown, then a second lifetime aborted and restarted by the restart block. Each call's
guarantee is checked where the document states it: the sequence of calls, what each release
returns and frees, that the rollout fits where the buffers were, that the next step re-creates
them, that the restart frees the old lifetime's buffers. Then which group to pass (3 ranks, one
rollout-only) and what a rank that skips the call does to its peers.
"""

import re

import pytest

from moe_release import backends
from moe_release.report import colocated_section
from tests.helpers import REPO_ROOT

THIS = "tests.unit_tests.transformer.moe.test_colocated_loop_doc"
DOC = REPO_ROOT / "docs" / "using.md"
HEADING = "## In a colocated RL loop"
BACKENDS = [
    pytest.param(b, marks=[pytest.mark.flex_backend(b)] if b in backends.ONLY_SOME_TREES else [])
    for b in backends.NAMES
]
NUM_STEPS = 2
# The calls the loop block makes, in order, as the spies below name them: per iteration the
# release over the MoE layers' group ("tp_ep"), empty_cache, rollout, a training step; then the
# shutdown's release and teardown (which takes the buffers out of use: the no-argument form).
LOOP_CALLS = ["release tp_ep", "empty_cache", "rollout", "train_step"] * NUM_STEPS + [
    "release tp_ep",
    "destroy_model_parallel",
    "out of use",
]
RESTART_CALLS = ["destroy_model_parallel", "out of use", "init_model_parallel", "release world"]


def doc_blocks() -> list:
    """The python code blocks of the section, in order: the loop and shutdown, the restart, the
    group for rollout-only ranks."""
    text = DOC.read_text(encoding="utf-8")
    assert text.count(HEADING + "\n") == 1, f"{DOC.name}: no single {HEADING!r} section"
    section = text.split(HEADING + "\n", 1)[1]
    section = re.split(r"^## ", section, flags=re.M)[0]
    return re.findall(r"^```python\n(.*?)^```$", section, flags=re.M | re.S)


def _spy(calls: list, releases: list):
    """Log the calls the blocks make (the release, with what it did and the bytes it returned to
    the counted allocator; the teardown; empty_cache) and let each run."""
    import gc

    import torch
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.measure import cpu_memory
    from moe_release.runtime.megatron.fault_scenarios import buffers_alive

    release, destroy, empty_cache = (
        fused_a2a.reset_fused_a2a_buffers,
        parallel_state.destroy_model_parallel,
        torch.cuda.empty_cache,
    )

    def spy_release(**kwargs):
        if not kwargs.get("collective"):
            calls.append("out of use")
            return release(**kwargs)
        group = kwargs.get("group")
        ep = parallel_state.get_expert_tensor_and_model_parallel_group(check_initialized=False)
        name = "world" if group is dist.group.WORLD else "tp_ep" if group is ep else "other"
        calls.append(f"release {name}")
        gc.collect()
        before = cpu_memory.settled()
        out = release(**kwargs)
        gc.collect()
        releases.append(
            {
                "freed": dict(out.freed),
                "bytes_freed": dict(out.bytes_freed or {}),
                "leaked": list(out.leaked),
                "left": list(out.left),
                "before": before,
                "drop": before - cpu_memory.settled(),
                "alive_after": buffers_alive(),
            }
        )
        return out

    def spy_destroy():
        calls.append("destroy_model_parallel")
        destroy()

    def spy_empty_cache():
        calls.append("empty_cache")
        empty_cache()

    fused_a2a.reset_fused_a2a_buffers = spy_release
    parallel_state.destroy_model_parallel = spy_destroy
    torch.cuda.empty_cache = spy_empty_cache


def rank_documented_loop(backend: str, loop: str, restart: str) -> dict:
    """Rank side: the loop block (``NUM_STEPS`` steps, then the shutdown), then a second
    lifetime: a step, the abort (every group parallel_state made destroyed), the restart block, a
    step and a release over the restarted group."""
    import gc

    import torch
    import torch.distributed as dist

    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.measure import cpu_memory
    from moe_release.runtime.megatron import moe_harness
    from moe_release.runtime.megatron.fault_scenarios import abort_groups, buffers_alive

    cpu_memory.install()
    ep = dist.get_world_size()
    calls, releases, steps, rollouts = [], [], [], []
    state = {"seed": 3}

    def init_model_parallel():
        calls.append("init_model_parallel")
        moe_harness.init_megatron(ep=ep)
        config = moe_harness.moe_config(backend, ep, **moe_harness.model_kwargs(backend))
        state["layer"] = moe_harness.build_moe_layer(config)
        state["layer"].train()

    def train_step():
        calls.append("train_step")
        moe_harness.train_step(state["layer"], colocated_section.TOKENS, state["seed"])
        state["seed"] += 1
        gc.collect()
        steps.append(buffers_alive())

    def rollout():
        calls.append("rollout")
        freed = releases[-1]["drop"]
        cpu_memory.reset_peak_memory_stats()
        tensors = torch.ones(max(freed, 0), dtype=torch.uint8)  # the engine's allocations
        rollouts.append(cpu_memory.max_memory_allocated() - releases[-1]["before"])
        del tensors

    _spy(calls, releases)
    init_model_parallel()
    del calls[:]
    # One program: the restart block goes on in the loop block's names (its imports).
    names = {"num_steps": NUM_STEPS, "train_step": train_step, "rollout": rollout}
    exec(loop, names)
    out = {"loop": list(calls), "loop_releases": list(releases), "loop_steps": list(steps)}
    out["rollouts"] = rollouts
    out["alive_after_shutdown"] = buffers_alive()

    init_model_parallel()
    train_step()
    out["alive_before_abort"] = buffers_alive()
    abort_groups()
    del calls[:], releases[:], steps[:]
    names["init_model_parallel"] = init_model_parallel
    exec(restart, names)
    out.update(restart=list(calls), restart_releases=list(releases))
    train_step()
    out["alive_after_restart_step"] = steps[-1]
    again = fused_a2a.reset_fused_a2a_buffers(collective=True, group=names["train_group"])
    out["freed_over_new_group"] = dict(again.freed)
    fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_documented_loop_runs_as_written(dist_job, patched_tree, backend):
    """The loop frees nothing the first time (nothing held yet), then each step's buffers
    before the next rollout, every byte of them back on the device before empty_cache() runs;
    the rollout fits where they were; each step re-creates them; the shutdown frees the last
    step's and leaves nothing allocated. After an abort, the restart block frees the old
    lifetime's buffers over the world (NCCL EP: the teardown already finalized its context), the
    next step allocates one set, and the group the block fetches again frees it."""
    loop, restart, _ = doc_blocks()
    results = dist_job(
        f"{THIS}:rank_documented_loop", colocated_section.EP, patched_tree, backend=backend,
        loop=loop, restart=restart,
    )  # fmt: skip
    for rank, r in enumerate(results):
        assert r["loop"] == LOOP_CALLS, (rank, r["loop"])
        first, *later = r["loop_releases"]
        assert first["freed"] == {} and first["drop"] == 0, (rank, first)
        for rel in later:  # each iteration's after the first, and the shutdown's
            assert rel["freed"] == {backend: 1}, (rank, rel)
            assert rel["leaked"] == [] and rel["left"] == [] and rel["alive_after"] == {}, rel
            assert rel["drop"] > 0 and rel["bytes_freed"][backend] == rel["drop"], (rank, rel)
        assert all(sum(alive.values()) == 1 for alive in r["loop_steps"]), r["loop_steps"]
        assert all(over <= 0 for over in r["rollouts"]), (rank, r["rollouts"])
        assert r["alive_after_shutdown"] == {}, (rank, r["alive_after_shutdown"])

        assert sum(r["alive_before_abort"].values()) == 1, r["alive_before_abort"]
        assert r["restart"] == RESTART_CALLS, (rank, r["restart"])
        (rel,) = r["restart_releases"]
        old = {} if backend == "ncclep" else {backend: 1}
        assert rel["freed"] == old and rel["alive_after"] == {}, (rank, rel)
        assert rel["leaked"] == [] and rel["left"] == [], (rank, rel)
        assert sum(r["alive_after_restart_step"].values()) == 1, r["alive_after_restart_step"]
        assert r["freed_over_new_group"] == {backend: 1}, (rank, r["freed_over_new_group"])


def rank_rollout_only_rank(group_block: str) -> dict:
    """Rank side, 3 ranks: ranks 0 and 1 train (a DeepEP buffer on their EP group), rank 2 only
    rolls out. A group without a peer first (each training rank alone), then the document's
    block with ``training_ranks = [0, 1]``."""
    import time

    import torch
    import torch.distributed as dist

    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.measure import cpu_memory
    from moe_release.runtime.megatron.fault_scenarios import buffers_alive

    cpu_memory.install()
    rank, training_ranks = dist.get_rank(), [0, 1]
    ep_group = dist.new_group(training_ranks)
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())]
    out = {}
    if rank in training_ranks:
        fused_a2a.get_buffer(ep_group, hidden_bytes=32)
        wrong = fused_a2a.reset_fused_a2a_buffers(collective=True, group=alone[rank])
        out["wrong_group"] = {"freed": wrong.freed, "left": wrong.left, "alive": buffers_alive()}
    start = time.monotonic()
    # The loop block's imports, and the ranks the document leaves to the user.
    names = {"training_ranks": training_ranks, "fused_a2a": fused_a2a, "torch": torch}
    exec(group_block, names)
    out["elapsed"] = time.monotonic() - start
    out["release"] = names["release"].freed if "release" in names else None
    out["alive"] = buffers_alive()
    dist.barrier()  # no rank exits (rank 0 serves the store) while another still makes groups
    return out


def test_rollout_only_ranks_stay_out_of_the_release(dist_job, patched_tree):
    """Which group: with a group lacking a peer the buffer is left, named in ``left``, and stays
    allocated; with the document's group of the training ranks (made on every rank, the
    rollout-only one too) the training ranks free it and the rollout-only rank never waits."""
    *_, group_block = doc_blocks()
    outs = dist_job(f"{THIS}:rank_rollout_only_rank", 3, patched_tree, group_block=group_block)
    for rank, out in enumerate(outs[:2]):
        wrong = out["wrong_group"]
        peer = 1 - rank
        assert wrong["freed"] == {} and wrong["alive"] == {"Buffer": 1}, (rank, wrong)
        assert wrong["left"] == [("deepep", [0, 1], f"peer rank(s) [{peer}] are not in group")]
        assert out["release"] == {"deepep": 1} and out["alive"] == {}, (rank, out)
    assert outs[2]["release"] is None and outs[2]["alive"] == {}, outs[2]
    assert outs[2]["elapsed"] < 5.0, outs[2]


def rank_skipped_release(timeout_s: float) -> dict:
    """Rank side: a HybridEP step; rank 1 skips the release that rank 0 makes over a group with
    a ``timeout_s`` collective timeout; then both make it over that group, then over a new one."""
    import datetime
    import time

    import torch.distributed as dist

    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.measure import cpu_memory
    from moe_release.runtime.megatron import moe_harness
    from moe_release.runtime.megatron.fault_scenarios import buffers_alive

    def release(group) -> dict:
        try:
            return {"freed": fused_a2a.reset_fused_a2a_buffers(collective=True, group=group).freed}
        except RuntimeError as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            out.setdefault("alive", []).append(buffers_alive())

    cpu_memory.install()
    ranks = list(range(dist.get_world_size()))
    moe_harness.init_megatron(ep=len(ranks))
    layer = moe_harness.build_moe_layer(moe_harness.moe_config("hybridep", len(ranks)))
    moe_harness.train_step(layer, colocated_section.TOKENS, 3)
    group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s))
    out: dict = {}
    if dist.get_rank() == 0:
        start = time.monotonic()
        out["skipped"] = release(group)
        out["waited"] = time.monotonic() - start
    dist.barrier()  # rank 1 went on, here to a collective on another group
    out["same_group"] = release(group)
    out["new_group"] = release(dist.new_group(ranks))
    return out


def test_a_rank_that_skips_the_release_leaves_its_peers_waiting(dist_job, patched_tree):
    """Rank 0 waits in the exchange for rank 1, which skipped the call, until the group's
    timeout, then raises, having freed nothing. That group is then unusable (gloo closed its
    connections): made by both ranks over it the release raises on both and frees nothing; over
    a new group it frees the buffer on both."""
    r0, r1 = dist_job(f"{THIS}:rank_skipped_release", 2, patched_tree, timeout_s=2.0)
    assert "Timed out" in r0["skipped"]["error"] and r0["waited"] >= 1.9, r0
    for rank, r in enumerate((r0, r1)):
        assert "error" in r["same_group"], (rank, r)
        *before, after = r["alive"]
        assert before == [{"HybridEPBuffer": 1}] * len(before), (rank, r)
        assert r["new_group"] == {"freed": {"hybridep": 1}} and after == {}, (rank, r)


def test_the_sections_blocks_are_the_ones_these_tests_run():
    """The section has the three blocks the tests execute, each making the calls its test
    expects of it, and no other block: a block added, dropped or reordered fails here."""
    blocks = doc_blocks()
    assert len(blocks) == 3, blocks
    called = r"(reset_fused_a2a_buffers|destroy_model_parallel|empty_cache|rollout|train_step|"
    called += r"init_model_parallel|new_group)\("
    calls = [re.findall(called, re.sub(r"#.*", "", b)) for b in blocks]
    assert calls[0] == [
        "reset_fused_a2a_buffers", "empty_cache", "rollout", "train_step",
        "reset_fused_a2a_buffers", "destroy_model_parallel",
    ], calls[0]  # fmt: skip
    assert calls[1] == ["destroy_model_parallel", "init_model_parallel", "reset_fused_a2a_buffers"]
    assert calls[2] == ["new_group", "reset_fused_a2a_buffers"], calls[2]
    for block in blocks:
        for call in re.findall(r"reset_fused_a2a_buffers\(([^)]*)\)", block):
            assert "collective=True" in call and "group=" in call, call
