# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""HybridEP memory accounting (the overlay's ``hybridep_memory`` module and
``scripts/hybridep_memory.py``): the documented worked examples, growth decisions, bad input,
and, on CPU gloo ranks, a real megatron-core HybridEP dispatch + combine through the deep_ep
emulation whose allocations equal the per-call prediction."""

import json
import subprocess
import sys

import pytest
import torch

from cpu_runtime.launcher import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "hybridep_memory.py"
sys.path.insert(0, str(SCRIPT.parent))
import hybridep_memory as cli  # noqa: E402

acc = cli.load_accounting()


def _cfg(**kw):
    base = dict(hidden=2048, num_experts=256, topk=8, ep=2, tokens_per_rank=1000)
    base.update(kw)
    return acc.HybridEPMemoryConfig(**base)


def test_buffer_worked_example():
    """Seed 001 / DeepEP hybrid-ep: T=1000 -> 1024 rows, group 2, H=2048, E=256."""
    assert acc.buffer_rows(1000) == 1024
    b = acc.buffer_bytes(_cfg())
    assert b["total"] == 11_141_120
    assert b == {
        "tokens": 2048 * 2 * 2048,
        "probs": 2048 * 4 * 256,
        "routing_map": 2048 * 256,
        "scaling_factors": 2048 * 4 * 16,
        "total": 11_141_120,
    }


@pytest.mark.parametrize(
    "tokens,chunk,rows", [(1, 64, 512), (512, 64, 512), (513, 64, 576), (513, 128, 640)]
)
def test_rows_minimum_and_chunk(monkeypatch, tokens, chunk, rows):
    monkeypatch.setenv("NUM_OF_TOKENS_PER_CHUNK_COMBINE_API", str(chunk))
    assert acc.buffer_rows(tokens) == rows


def test_etp_widens_group_and_expert_columns():
    plain, etp = acc.buffer_bytes(_cfg()), acc.buffer_bytes(_cfg(etp=2))
    # Twice the rows (group ETPxEP = 4) and twice the expert columns.
    assert etp["tokens"] == 2 * plain["tokens"] and etp["probs"] == 4 * plain["probs"]


def test_growth_decisions():
    cfg = _cfg()
    first = acc.growth_bytes(cfg, None)
    assert first["grows"] and first["growth_bytes"] == 11_141_120
    assert acc.growth_bytes(cfg, 1024) == dict(
        acc.growth_bytes(cfg, 1024), grows=False, growth_bytes=0
    )
    assert acc.growth_bytes(cfg, 2048)["growth_bytes"] == 0  # a larger held buffer suffices
    grow = acc.growth_bytes(cfg, 512)
    old = acc.buffer_bytes(cfg, 512)["total"]
    assert grow["grows"] and grow["growth_bytes"] == 11_141_120  # the new buffer's full size
    assert grow["transient_peak_holding_old"] == old + 11_141_120
    assert grow["transient_peak_dropping_old"] == 11_141_120


def test_working_set_and_recompute_floor():
    w = acc.expert_working_set(_cfg(imbalance=1.35))
    assert w["balanced_rows"] == 8000 and w["rows"] == 10800 and w["worst_rows"] == 16000
    # Seed 003's fixture: P=7168, H=128, against 8,192 B once the large graph is gone.
    assert acc.recompute_combine_floor(7168, 128) == 1_835_008
    assert acc.recompute_combine_floor(32, 128) == 8192


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(hidden=0), "hidden must be a positive integer"),
        (dict(ep=3), "ETP x EP = 1 x 3 must divide the 256 experts"),
        (dict(topk=300), "topk 300 exceeds"),
        (dict(nodes=2), "only intranode"),
        (dict(imbalance=0.0), "imbalance must be positive"),
    ],
)
def test_bad_config(kw, message):
    with pytest.raises(ValueError, match=message):
        _cfg(**kw)


def _run(*args):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60
    )


def test_command_table_and_json():
    args = ["--hidden", "2048", "--experts", "256", "--topk", "8", "--ep", "2"]
    args += ["--tokens-per-rank", "1000"]
    done = _run(*args)
    assert done.returncode == 0 and "11,141,120" in done.stdout, done.stderr
    data = json.loads(_run(*args, "--json").stdout)
    assert data["buffer_rows"] == 1024 and data["buffer_bytes"] == 11_141_120


OK = ["--hidden", "8", "--experts", "8", "--topk", "2", "--tokens-per-rank", "4"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--hidden", "-1", "--experts", "8", "--topk", "2", "--tokens-per-rank", "4"],
         "hidden must be a positive integer"),
        (OK[:2] + ["--experts", "6", "--ep", "4"] + OK[4:], "must divide the 6 experts"),
        (OK + ["--held-rows", "0"], "held-rows must be positive"),
        (OK + ["--frobnicate"], "unrecognized arguments: --frobnicate"),
        (OK[:6] + ["--tokens-per-rank", "many"], "invalid int value: 'many'"),
    ],
)  # fmt: skip
def test_command_bad_input(args, message):
    """One line on stderr naming what is wrong, exit status 2, nothing on stdout."""
    done = _run(*args)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr


def rank_per_call(tokens: int, hidden: int):
    """Rank side: a balanced HybridEP dispatch + combine (every token to one local expert on
    each rank) through megatron-core's fused_a2a and the emulation; what they allocated."""
    import torch.distributed as dist

    from cpu_runtime.moe_harness import init_megatron
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import fused_a2a

    world = dist.get_world_size()
    init_megatron(ep=world)
    group = parallel_state.get_expert_model_parallel_group()
    local = 2
    experts = local * world
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    routing = torch.zeros(tokens, experts, dtype=torch.bool)
    for t in range(tokens):  # token t -> local expert t % local on every rank (top-k = world)
        routing[t, [r * local + t % local for r in range(world)]] = True
    probs = routing.float() / world
    out, dprobs, _, tpe, handle = fused_a2a.hybrid_ep_dispatch(
        x, routing, probs, group, local, num_permuted_tokens=None, pad_multiple=None
    )
    combined = fused_a2a.hybrid_ep_combine(out, handle, None, None)
    from cpu_runtime.compat import held_comm_buffers

    (buffer,) = held_comm_buffers(fused_a2a)
    return {
        "dispatch_tokens": out.untyped_storage().nbytes(),
        "dispatch_probs": dprobs.untyped_storage().nbytes(),
        "tokens_per_expert": tpe.to(torch.int64).untyped_storage().nbytes(),
        "combine_output": combined.untyped_storage().nbytes(),
        "buffer": buffer.memory.nbytes,
        "topk": world,
        "experts": experts,
    }


def test_per_call_prediction_matches_emulated_dispatch(dist_job, patched_tree):
    tokens, hidden = 24, 16
    for rank, got in enumerate(
        dist_job(f"{__name__}:rank_per_call", 2, patched_tree, tokens=tokens, hidden=hidden)
    ):
        cfg = acc.HybridEPMemoryConfig(
            hidden=hidden, num_experts=got["experts"], topk=got["topk"], ep=2,
            tokens_per_rank=tokens,
        )  # fmt: skip
        predicted = acc.per_call_bytes(cfg)
        measured = {k: got[k] for k in predicted}
        assert measured == predicted, f"rank {rank}"
        # The emulation's buffer is sized independently from the same documented rule.
        assert got["buffer"] == acc.buffer_bytes(cfg)["total"], f"rank {rank}"


def rank_recompute_extent(tokens: list, hidden: int):
    """Rank side: a bf16 MoELayer with HybridEP padding uneven inputs to the group's extent and
    the MoE layer recomputed in backward; the bytes of every combine output (forward and
    recompute), taken inside megatron-core before it crops them to the rank's tokens."""
    import torch.distributed as dist

    from cpu_runtime import moe_harness
    from cpu_runtime.moe_harness import init_megatron
    from megatron.core.transformer.moe import token_dispatcher

    init_megatron(ep=dist.get_world_size())
    config = moe_harness.moe_config(
        "hybridep", dist.get_world_size(), hidden=hidden, recompute=True,
        dtype=torch.bfloat16, moe_hybridep_pad_uneven_dispatch_inputs=True,
    )  # fmt: skip
    layer = moe_harness.build_moe_layer(config)
    sizes = []
    combine = token_dispatcher.hybrid_ep_combine

    def recorded(*args, **kwargs):
        out = combine(*args, **kwargs)
        sizes.append((tuple(out.shape), out.untyped_storage().nbytes()))
        return out

    token_dispatcher.hybrid_ep_combine = recorded
    n = tokens[dist.get_rank()]
    x = torch.randn(n, 1, hidden, dtype=torch.bfloat16, requires_grad=True)
    out, _ = layer(x)
    out.float().sum().backward()
    token_dispatcher.hybrid_ep_combine = combine
    return {
        "combine": sizes,
        "out_rows": out.shape[0],
        "recompute": bool(layer.moe_layer_recompute),
    }


def test_recompute_combine_output_at_the_communication_extent(dist_job, patched_tree):
    """Both the forward's and the checkpoint recompute's combine allocate a fresh BF16 [P, H]
    output at the padded communication extent P (the group's max tokens rounded to 64), before
    megatron-core crops it to the rank's own tokens: the recompute floor's allocation."""
    tokens, hidden = [24, 40], 16
    extent = 64
    for rank, got in enumerate(
        dist_job(f"{__name__}:rank_recompute_extent", 2, patched_tree, tokens=tokens, hidden=hidden)
    ):
        assert got["recompute"] and got["out_rows"] == tokens[rank]
        assert len(got["combine"]) == 2, got  # forward, then the recompute in backward
        for shape, nbytes in got["combine"]:
            assert shape == (extent, hidden)
            assert nbytes == acc.recompute_combine_floor(extent, hidden), f"rank {rank}"


def test_measured_retained_bytes_reads_the_probe(patched_tree):
    """The measured side of the comparison: what a dispatcher object references, through the
    retained-state probe (here a stand-in dispatcher holding a probs tensor and a handle)."""

    class Dispatcher:
        pass

    d = Dispatcher()
    d.probs = torch.zeros(12, 8)  # 384 bytes
    d.handle = (torch.zeros(4, dtype=torch.int64), torch.zeros(3, dtype=torch.bool))  # 32 + 3
    assert acc.measured_retained_bytes(d) == 384 + 32 + 3
    d.probs = d.handle = None
    assert acc.measured_retained_bytes(d) == 0
