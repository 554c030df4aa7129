# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""What code outside megatron-core reads and assigns in ``fused_a2a`` keeps its meaning.

Each rank function below makes the calls a downstream project makes, as its public source makes
them, on megatron-core's real MoELayer (flex dispatcher, EP=2 on CPU gloo ranks, the deep_ep
emulation):

* OpenPipe ART 0.5.23 (pinned to megatron-core 0.17.0): ``_ensure_hybridep_capacity``
  (``art/megatron/train.py:1320``) reads ``fused_a2a._hybrid_ep_buffer`` and its
  ``configurer.buffer_config.max_num_of_tokens_per_rank``, then ``reset_hybrid_ep_buffer()`` and
  ``init_hybrid_ep_buffer(group=get_expert_tensor_and_model_parallel_group(), ...)`` with a
  larger capacity; ``_set_hybridep_token_count`` (``art/megatron/training/
  pipeline_schedule.py:79``) raises ``RuntimeError("HybridEP buffer is not initialized")``
  when ``_hybrid_ep_buffer`` is None and otherwise uses that buffer (also
  ``art/trainer_rank/_impl.py:4971,4998``, ``art/trainer_rank/_memory.py:710``, which read its
  identity to see a re-allocation).
* Test fixtures that save ``fused_a2a._buffer`` and ``fused_a2a._hybrid_ep_buffer`` (on dev
  also ``_elastic_buffer``, DeepEP v2's), set them, and restore them (NeMo Automodel's fused_a2a
  tests, ``_restore_buffers``; Megatron-LM's own ``test_hybridep_rebuilds_buffer_for_new_group``
  sets ``_hybrid_ep_buffer`` and ``_buffer`` to None with ``monkeypatch.setattr``): None means
  the next dispatch makes a buffer, a restored buffer is the one the next dispatch uses.

* OpenPipe ART's own release of the dispatcher caches on top of the series' (a second release:
  harmless, bitwise the same steps).

The unpatched base passes all of it (its single module global); so must every series.
"""

import inspect

import pytest
import torch
import torch.distributed as dist

THIS = "tests.unit_tests.transformer.moe.test_downstream_calls"
TOKENS, HIDDEN = 16, 16
# Per backend: the module global downstream code saves and restores, and the kernel class.
GLOBALS = {
    "hybridep": ("_hybrid_ep_buffer", "HybridEPBuffer"),
    "deepep": ("_buffer", "Buffer"),
    "deepepv2": ("_elastic_buffer", "ElasticBuffer"),
}


def _setup(backend: str):
    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.megatron.moe_harness import (
        build_moe_layer,
        init_megatron,
        model_kwargs,
        moe_config,
    )

    init_megatron(ep=dist.get_world_size())
    kwargs = dict(dict(hidden=HIDDEN), **model_kwargs(backend))  # DeepEP v2: bf16, hidden 256
    layer = build_moe_layer(moe_config(backend, dist.get_world_size(), **kwargs))
    layer.train()
    return fused_a2a, layer


def _step(layer, tokens: int = TOKENS, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    x = torch.randn(tokens, 1, layer.config.hidden_size, generator=gen)
    x = x.to(layer.config.params_dtype).requires_grad_()
    y, _ = layer(x)
    y.float().sum().backward()
    return y.detach()


def _track(fused_a2a, monkeypatch_name: str):
    """Record every buffer the class ``monkeypatch_name`` constructs and each one a dispatch
    runs on (a subclass put where fused_a2a looks the class up, as Megatron-LM's own test
    ``test_hybridep_rebuilds_buffer_for_new_group`` does)."""
    base = getattr(fused_a2a, monkeypatch_name)
    made, used = [], []
    method = "dispatch_with_permute" if monkeypatch_name == "HybridEPBuffer" else "dispatch"

    class Tracked(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    def dispatch(self, *args, **kwargs):
        used.append(self)
        return getattr(base, method)(self, *args, **kwargs)

    setattr(Tracked, method, dispatch)
    setattr(fused_a2a, monkeypatch_name, Tracked)
    return made, used


def _art_set_hybridep_token_count(fused_a2a):
    """ART's ``_set_hybridep_token_count`` (pipeline_schedule.py:79), up to the buffer call."""
    buffer = fused_a2a._hybrid_ep_buffer
    if buffer is None:
        raise RuntimeError("HybridEP buffer is not initialized")
    return buffer


def _art_ensure_hybridep_capacity(fused_a2a, config, token_capacity: int):
    """ART's ``_ensure_hybridep_capacity`` (train.py:1320-1351), with the provider's fields
    read from the layer's config. ART passes ``seq_len=`` (0.17's name); 0.18 renamed it
    ``num_tokens``, so the base's own name is used."""
    from megatron.core import parallel_state as ps

    current = fused_a2a._hybrid_ep_buffer
    if (
        current is not None
        and current.configurer.buffer_config.max_num_of_tokens_per_rank >= token_capacity
    ):
        return False
    params = inspect.signature(fused_a2a.init_hybrid_ep_buffer).parameters
    tokens_kw = "seq_len" if "seq_len" in params else "num_tokens"
    sms = config.moe_hybridep_num_sms or 16  # ART's provider always sets it; 0.19 defaults None
    fused_a2a.reset_hybrid_ep_buffer()
    fused_a2a.init_hybrid_ep_buffer(
        group=ps.get_expert_tensor_and_model_parallel_group(),
        hidden_dim=int(config.hidden_size),
        num_local_experts=config.num_moe_experts // ps.get_expert_model_parallel_world_size(),
        num_sms_dispatch_api=int(sms),
        num_sms_combine_api=int(sms),
        fp8_dispatch=False,
        **{tokens_kw: token_capacity},
    )
    return True


def rank_art_hybridep_capacity():
    """ART's capacity code around two training steps."""
    fused_a2a, layer = _setup("hybridep")
    made, used = _track(fused_a2a, "HybridEPBuffer")
    out = {}
    try:
        _art_set_hybridep_token_count(fused_a2a)
        out["before"] = "no error"
    except RuntimeError as exc:
        out["before"] = str(exc)
    _step(layer)
    buffer = _art_set_hybridep_token_count(fused_a2a)
    out["after_step_is_used"] = buffer is used[-1]
    out["capacity"] = buffer.configurer.buffer_config.max_num_of_tokens_per_rank
    config = layer.config
    out["grown_again"] = _art_ensure_hybridep_capacity(fused_a2a, config, out["capacity"])
    out["grown"] = _art_ensure_hybridep_capacity(fused_a2a, config, 4 * out["capacity"])
    grown = fused_a2a._hybrid_ep_buffer
    out["grown_capacity"] = grown.configurer.buffer_config.max_num_of_tokens_per_rank
    _step(layer, seed=1)
    out["next_step_uses_grown"] = used[-1] is grown
    out["buffers_made"] = len(made)
    out["still_the_alias"] = fused_a2a._hybrid_ep_buffer is grown
    fused_a2a.reset_hybrid_ep_buffer()
    out["after_reset"] = fused_a2a._hybrid_ep_buffer is None
    return out


def rank_fixture_save_restore(backend: str):
    """A fixture's save, set to None, restore, around dispatches."""
    fused_a2a, layer = _setup(backend)
    name, cls = GLOBALS[backend]
    made, used = _track(fused_a2a, cls)
    out = {"initial_none": getattr(fused_a2a, name) is None}
    _step(layer)
    saved = getattr(fused_a2a, name)
    out["saved_is_used"] = saved is used[-1]
    setattr(fused_a2a, name, None)
    _step(layer, seed=1)
    out["none_makes_new"] = used[-1] is not saved and len(made) == 2
    out["new_is_alias"] = getattr(fused_a2a, name) is used[-1]
    setattr(fused_a2a, name, saved)
    _step(layer, seed=2)
    out["restored_is_used"] = used[-1] is saved
    out["buffers_made"] = len(made)
    return out


@pytest.mark.backport
@pytest.mark.guard
def test_art_hybridep_capacity_calls(dist_job, patched_tree):
    """ART's reads and re-initialization of ``fused_a2a._hybrid_ep_buffer``: the RuntimeError
    ART expects before a buffer exists, the buffer the dispatch used after one, a larger buffer
    ART makes is the one the next step dispatches on, ``reset_hybrid_ep_buffer()`` empties it."""
    for rank, out in enumerate(dist_job(f"{THIS}:rank_art_hybridep_capacity", 2, patched_tree)):
        assert out["before"] == "HybridEP buffer is not initialized", (rank, out)
        assert out["after_step_is_used"], (rank, out)
        assert out["capacity"] >= TOKENS, (rank, out)
        assert not out["grown_again"], (rank, out)  # large enough already: ART keeps it
        assert out["grown"] and out["grown_capacity"] >= 4 * out["capacity"], (rank, out)
        assert out["next_step_uses_grown"] and out["still_the_alias"], (rank, out)
        assert out["buffers_made"] == 2, (rank, out)
        assert out["after_reset"], (rank, out)


@pytest.mark.backport
@pytest.mark.guard
@pytest.mark.parametrize(
    "backend",
    ["hybridep", "deepep", pytest.param("deepepv2", marks=pytest.mark.flex_backend("deepepv2"))],
)
def test_fixture_save_and_restore(dist_job, patched_tree, backend):
    """Save, set None, restore the module global: None makes the next dispatch allocate a
    buffer (the global names it), the restored buffer is the one the next dispatch uses."""
    outs = dist_job(f"{THIS}:rank_fixture_save_restore", 2, patched_tree, backend=backend)
    for rank, out in enumerate(outs):
        assert out == {
            "initial_none": True,
            "saved_is_used": True,
            "none_makes_new": True,
            "new_is_alias": True,
            "restored_is_used": True,
            "buffers_made": 2,
        }, (rank, out)


def _art_dispatcher_cache_release(dispatcher) -> None:
    """OpenPipe ART's own release of the dispatcher caches, installed per dispatcher as
    ``_configure_moe_dispatcher_caches`` installs it (``src/art/trainer_rank/_impl.py``, with
    ``_moe_dispatch_preprocess``, ``_moe_combine_postprocess``, ``_release_hybridep_state`` and
    ``_hybridep_combine_postprocess``): the all-to-all's ``probs`` cut to an empty tensor after
    dispatch_preprocess and its routing map and reversed permutation mapping dropped after
    combine_postprocess; the HybridEP manager's routing map, token probs and dispatched probs
    dropped after combine_postprocess."""
    from megatron.core.transformer.moe.token_dispatcher import (
        MoEAlltoAllTokenDispatcher,
        MoEFlexTokenDispatcher,
        _HybridEPManager,
    )

    cls = type(dispatcher)

    def dispatch_preprocess(hidden_states, routing_map, probs):
        result = cls.dispatch_preprocess(dispatcher, hidden_states, routing_map, probs)
        dispatcher.probs = probs.new_empty(0)
        return result

    def combine_postprocess(hidden_states):
        result = cls.combine_postprocess(dispatcher, hidden_states)
        dispatcher.routing_map = None
        dispatcher.reversed_local_input_permutation_mapping = None
        return result

    def hybridep_combine_postprocess(hidden_states):
        result = cls.combine_postprocess(dispatcher, hidden_states)
        manager = dispatcher._comm_manager
        manager.routing_map = manager.token_probs = manager.dispatched_probs = None
        return result

    if cls is MoEFlexTokenDispatcher and type(dispatcher._comm_manager) is _HybridEPManager:
        dispatcher.combine_postprocess = hybridep_combine_postprocess
    elif cls is MoEAlltoAllTokenDispatcher:
        dispatcher.dispatch_preprocess = dispatch_preprocess
        dispatcher.combine_postprocess = combine_postprocess
    else:
        raise AssertionError(f"ART wraps no {cls.__name__}")


def rank_art_release_on_top(dispatcher: str, art: bool, recompute: bool):
    """Two training steps of one MoELayer (EP=2), with or without ART's own release on top."""
    from moe_release.runtime.megatron.moe_harness import build_moe_layer, init_megatron, moe_config

    init_megatron(ep=dist.get_world_size())
    extra = {} if dispatcher == "flex" else {"moe_token_dispatcher_type": dispatcher}
    torch.manual_seed(7)
    config = moe_config(
        "hybridep", dist.get_world_size(), hidden=HIDDEN, recompute=recompute, **extra
    )
    layer = build_moe_layer(config)
    layer.train()
    if art:
        _art_dispatcher_cache_release(layer.token_dispatcher)
    steps = []
    for seed in (3, 4):
        out = _step(layer, seed=seed)
        grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
        layer.zero_grad(set_to_none=True)
        steps.append({"out": out, "grads": grads})
    return steps


@pytest.mark.parametrize("recompute", [False, True], ids=["eager", "recompute"])
@pytest.mark.parametrize("dispatcher", ["alltoall", "flex"])
def test_art_release_on_top_is_a_harmless_second_release(
    dist_job, patched_tree, dispatcher, recompute
):
    """ART releases the dispatcher caches itself; on a series that already released them its
    release finds them dropped, and two steps (forward, backward, the layer recomputed or not)
    are bitwise those without it."""
    kw = dict(dispatcher=dispatcher, recompute=recompute)
    plain = dist_job(f"{THIS}:rank_art_release_on_top", 2, patched_tree, art=False, **kw)
    art = dist_job(f"{THIS}:rank_art_release_on_top", 2, patched_tree, art=True, **kw)
    for rank, (p, a) in enumerate(zip(plain, art)):
        for step, (ps, as_) in enumerate(zip(p, a)):
            assert torch.equal(ps["out"], as_["out"]), (rank, step)
            assert ps["grads"].keys() == as_["grads"].keys() and ps["grads"], (rank, step)
            for name in ps["grads"]:
                assert torch.equal(ps["grads"][name], as_["grads"][name]), (rank, step, name)
