# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The report at seed 000's shape (``run-report --production-shape``,
``moe_release.report.production_section``): its table at a tiny shape (both ranks, base and patched,
the planner beside, the seed attributed, what the mode does not see), the patched tree holding less
between calls, and the measured attributes against the planner's terms; the seed's shape
itself behind ``slow``."""

import functools

import pytest

from moe_release.report import production_section as ps


@functools.cache
def _collect(base_tree: str, patched_tree: str, seed_shape: bool):
    shape, tokens = (
        (ps.SEED_SHAPE, ps.SEED_TOKENS) if seed_shape else (ps.TINY_SHAPE, ps.TINY_TOKENS)
    )
    return ps.collect({"base": base_tree, "patched": patched_tree}, shape, tokens)


def _check_relations(data):
    layers = data["shape"]["layers"]
    for row in data["ranks"]:
        base, patched = row["base"], row["patched"]
        assert base["tokens"] == patched["tokens"] == row["tokens"]
        assert len(base["held"]) == len(base["peaks"]) == 2
        assert patched["held"][-1] < base["held"][-1]
        assert patched["params"] == base["params"] and patched["buffers"] == base["buffers"]
        assert len(base["per_layer"]) == len(patched["per_layer"]) == layers
        assert all(p < b for p, b in zip(patched["per_layer"], base["per_layer"]))
        assert patched["peaks"][-1] <= base["peaks"][-1]
        # Dropping every layer's state leaves both trees holding the same.
        assert base["after_drop"] == patched["after_drop"]
        # What is alive at each call's peak, by origin, sums to the peak; at the warm peak the
        # patched tree holds nothing an earlier call made but the communication buffers.
        for kind in (base, patched):
            for peak, origins in zip(kind["peaks"], kind["peak_origins"]):
                assert sum(origins.values()) == peak
        earlier = [k for k in patched["peak_origins"][-1] if k.startswith("an earlier call")]
        assert earlier == ["an earlier call | megatron/core/transformer/moe/fused_a2a.py:"
                           "init_hybrid_ep_buffer"], earlier  # fmt: skip
        split = ps.peak_split(row)
        assert sum(b - p for _, b, p in split) == base["peaks"][-1] - patched["peaks"][-1]


def test_tiny_report_table(base_tree, patched_tree):
    data = _collect(base_tree, patched_tree, False)
    text = ps.render(data, ps.forty_layer_point(data))
    for rank, n in enumerate(ps.TINY_TOKENS):
        assert f"rank {rank} ({n:,} tokens)" in text
    for label in ("memory held between calls", "planner: dispatcher state",
                  "per layer, freed by dispatch", "warm peak", "term by term",
                  "by what made the bytes alive at each peak",
                  "Seed 000 has 8 MoE layers: not compared with this 2-layer run",
                  "40-MoE-layer point (per-layer scaling", ps.NOT_SEEN):  # fmt: skip
        assert label in text
    # At the seed's depth the seed's figures are printed beside; at 40 layers the point is the
    # run itself.
    eight = dict(data, shape=dict(data["shape"], layers=8))
    assert ps.SEED["source"] in ps.render(eight)
    forty = dict(data, shape=dict(data["shape"], layers=40))
    assert ps.forty_layer_point(forty)["text"] == "40-MoE-layer point: this run (above)."
    _check_relations(data)


def test_measured_attributes_match_the_planner_terms(base_tree, patched_tree):
    """Every attribute the base dispatcher keeps is priced by the planner to the byte, except
    the ones the planner names no term for (each printed as "not priced")."""
    data = _collect(base_tree, patched_tree, False)
    for row in data["ranks"]:
        for attr, measured, priced, names in ps.term_table(row):
            if names:
                assert measured == priced, (row["rank"], attr, measured, priced)
        assert ps.explained(row, data["shape"])[-1] == ("not explained", 0)
        # The emulation sizes its buffer from deep_ep's source, the planner from its own terms.
        assert row["base"]["buffers"] == row["planner_base"]["buffer"]


def test_the_warm_peak_difference_is_whole_layers_of_planner_terms(base_tree, patched_tree):
    """Each origin of the warm peak's base - patched difference is whole layers of the
    planner's terms for that site; a planner term one byte off no longer fits."""
    import copy

    data = _collect(base_tree, patched_tree, False)
    for row in data["ranks"]:
        split = ps.peak_split(row)
        assert split, row["rank"]
        for what, b, p in split:
            assert ps.peak_terms(row, data["shape"], what, b - p).startswith("= "), what
        wrong = copy.deepcopy(row)
        wrong["planner_base"]["terms"] = [
            (name, n + 1 if name.startswith("routing_map") else n)
            for name, n in row["planner_base"]["terms"]
        ]
        router = next(r for r in split if "topk_routing" in r[0])
        assert ps.peak_terms(wrong, data["shape"], router[0], router[1] - router[2]).startswith(
            "not a whole number"
        )


@pytest.mark.slow
def test_seed_shape_report(base_tree, patched_tree):
    """Seed 000's shape: 8 MoE layers, hidden 2048, 256 experts, top-8, 89,600 and 105,153
    tokens per rank (minutes per job on 2 cores)."""
    data = _collect(base_tree, patched_tree, True)
    print(ps.render(data, ps.forty_layer_point(data)))
    _check_relations(data)
