# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""The 1F1B A2A-overlap schedule releases a microbatch's state once it has been used.

Two microbatches of a small MoE GPTModel (local spec, bf16, EP 4) run through
``TransformerModelChunkSchedulePlan.run`` as the combined-1F1B schedule runs them: microbatch
0's forward, microbatch 1's forward overlapped with microbatch 0's backward, then microbatch 1's
backward. The tests keep their own references to each plan's layer nodes, layer states, chunk
state and pre/post-process nodes (so nothing is freed by the plans dropping them) and check:

* once a layer node's backward is done it holds none of the tensors ``detach`` saved for it
  (``before_detached``, ``detached``), and the dispatch's non-detached probs are freed, while
  the other microbatch's forward state is intact;
* after the expert forward, the layer state no longer holds the dispatched probs or HybridEP's
  tokens per expert;
* once a chunk's backward is done its chunk state holds no tensor and neither its pre- nor its
  post-process node references it (also after a second ``release_state``);
* outputs and gradients are bitwise those of the same two microbatches run one after the
  other without the overlap.
"""

import gc
import weakref

import pytest
import torch

from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.pipeline_parallel.utils import set_streams
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import float16_to_fp32
from megatron.core.transformer.moe import fused_a2a
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils

NUM_LAYERS = 2
NUM_EXPERTS = 8
EP_SIZE = 4
SEQ_LEN = 16
MICRO_BATCH = 2
VOCAB_SIZE = 128
NUM_MICROBATCHES = 2

# A layer plan's schedule nodes; the first is "attn" on branches that name it so.
LAYER_NODE_NAMES = ("pre_dispatch_computation", "attn", "moe_dispatch", "mlp", "moe_combine")
# What TransformerLayerNode.detach() keeps for the node's backward.
DETACH_ATTRS = ("before_detached", "detached")
# What the dispatch and expert nodes hand over on the layer state, last read by the experts.
LAYER_STATE_ATTRS = ("dispatched_probs", "tokens_per_expert")

DISPATCHERS = [
    pytest.param("alltoall", None, id="alltoall"),
    pytest.param(
        "flex",
        "deepep",
        id="flex-deepep",
        marks=pytest.mark.skipif(not fused_a2a.HAVE_DEEP_EP, reason="DeepEP is not installed"),
    ),
    pytest.param(
        "flex",
        "hybridep",
        id="flex-hybridep",
        marks=pytest.mark.skipif(not fused_a2a.HAVE_HYBRIDEP, reason="HybridEP is not installed"),
    ),
]


def _holds_tensor(value) -> bool:
    if torch.is_tensor(value):
        return True
    if isinstance(value, (tuple, list)):
        return any(_holds_tensor(v) for v in value)
    return False


def build_model(dispatcher_type, flex_backend, overlap):
    """A small MoE GPTModel on megatron-core's local (non-TE) modules, in bf16."""
    torch.manual_seed(123)
    model_parallel_cuda_manual_seed(123)
    kwargs = dict(moe_token_dispatcher_type=dispatcher_type)
    if flex_backend is not None:
        kwargs["moe_flex_dispatcher_backend"] = flex_backend
    config = TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        moe_ffn_hidden_size=128,
        num_moe_experts=NUM_EXPERTS,
        moe_router_topk=2,
        moe_router_dtype="fp32",
        moe_grouped_gemm=False,
        expert_model_parallel_size=EP_SIZE,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        deterministic_mode=True,
        overlap_moe_expert_parallel_comm=overlap,
        **kwargs,
    )
    spec = get_gpt_layer_local_spec(num_experts=NUM_EXPERTS, moe_grouped_gemm=False)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB_SIZE,
        max_sequence_length=SEQ_LEN,
        # Untied: the overlap runs the output layer's and the embedding's backward separately,
        # which would add a tied weight's two gradients to .grad in another order.
        share_embeddings_and_output_weights=False,
    )
    # As Float16Module does for a bf16 run: every parameter in bf16 (the local norms too).
    return model.cuda().bfloat16()


def build_microbatches():
    """Seeded microbatches, different on every rank."""
    generator = torch.Generator().manual_seed(1234 + torch.distributed.get_rank())
    mask = torch.triu(torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool), diagonal=1)
    position_ids = torch.arange(SEQ_LEN, dtype=torch.int64).repeat(MICRO_BATCH, 1)
    device = torch.cuda.current_device()
    batches = []
    for _ in range(NUM_MICROBATCHES):
        tokens = torch.randint(0, VOCAB_SIZE, (MICRO_BATCH, SEQ_LEN + 1), generator=generator)
        batches.append(
            {
                "input_ids": tokens[:, :-1].contiguous().to(device),
                "labels": tokens[:, 1:].contiguous().to(device),
                "position_ids": position_ids.to(device),
                "attention_mask": mask[None, None].to(device),
            }
        )
    return batches


class PlanWatch:
    """References to what a model-chunk schedule plan's backward should leave empty.

    Taken before the plan runs: the plan pops its layer plans and drops its nodes during the
    backward, and these references keep the objects (not what they hold) alive to look at.
    """

    def __init__(self, plan):
        self.plan = plan
        self.chunk_state = plan.state
        self.pre_process = plan.pre_process
        self.post_process = plan.post_process
        self.layer_states = []
        self.nodes = {}
        for i in range(plan.num_layers()):
            layer = plan.get_layer(i)
            self.layer_states.append(layer.layer_state)
            for name in LAYER_NODE_NAMES:
                node = getattr(layer, name, None)
                if node is not None and hasattr(node, "before_detached"):
                    self.nodes[f"layer {i} {name}"] = node
        assert self.nodes, "the schedule plan has no transformer layer nodes"
        self.dispatched_probs = []

    def after_forward(self):
        """Weak references to the dispatched probs each dispatch node kept before detaching
        them: they carry the dispatch's autograd graph. (The detached probs are also on the
        layer state, which this watch keeps alive.)"""
        for where, node in self.nodes.items():
            if where.endswith("moe_dispatch") and node.before_detached:
                self.dispatched_probs.append((where, weakref.ref(node.before_detached[-1])))

    def nodes_holding_detached(self):
        """``layer i node.attr`` for every node attribute saved by detach still holding a
        tensor."""
        return [
            f"{where}.{attr}"
            for where, node in self.nodes.items()
            for attr in DETACH_ATTRS
            if _holds_tensor(getattr(node, attr, None))
        ]

    def alive_dispatched_probs(self):
        """The dispatched probs (by dispatch node) that are still alive."""
        gc.collect()
        return [
            f"{where} dispatched_probs" for where, ref in self.dispatched_probs if ref() is not None
        ]

    def layer_states_holding(self):
        """``layer i layer_state.attr`` for the probs and token counts still on a layer
        state."""
        return [
            f"layer {i} layer_state.{attr}"
            for i, state in enumerate(self.layer_states)
            for attr in LAYER_STATE_ATTRS
            if _holds_tensor(getattr(state, attr, None))
        ]

    def chunk_state_holding(self):
        """The chunk state's fields still holding a tensor."""
        return sorted(
            f"chunk_state.{name}"
            for name, value in vars(self.chunk_state).items()
            if _holds_tensor(value)
        )

    def nodes_holding_chunk_state(self):
        """The pre/post-process nodes still referencing the chunk state."""
        nodes = {"pre_process": self.pre_process, "post_process": self.post_process}
        return [
            name
            for name, node in nodes.items()
            if node is not None and getattr(node, "chunk_state", None) is not None
        ]


def run_overlapped(model, batches, checkpoints):
    """Run the microbatches through the 1F1B A2A-overlap schedule plan, as combined 1F1B
    without pipelining does: ``checkpoints(phase, watches)`` is called after microbatch 0's
    forward ("forward 0"), after microbatch 1's forward overlapped with microbatch 0's
    backward ("overlapped"), and after microbatch 1's backward ("backward 1")."""
    plans = [model.build_schedule_plan(**batch) for batch in batches]
    watches = [PlanWatch(plan) for plan in plans]
    outputs = [TransformerModelChunkSchedulePlan.run(plans[0], None)]
    watches[0].after_forward()
    checkpoints("forward 0", watches)
    outputs.append(
        TransformerModelChunkSchedulePlan.run(
            plans[1], plans[0], b_grad=torch.ones_like(outputs[0])
        )
    )
    watches[1].after_forward()
    checkpoints("overlapped", watches)
    TransformerModelChunkSchedulePlan.run(None, plans[1], b_grad=torch.ones_like(outputs[1]))
    torch.cuda.synchronize()
    checkpoints("backward 1", watches)
    return outputs, watches


def _rank():
    return torch.distributed.get_rank()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Requires CUDA")
class TestA2AOverlapScheduleStateRelease:
    """State release of the 1F1B A2A-overlap schedule nodes, layer states and chunk state."""

    def setup_method(self, method):
        Utils.initialize_model_parallel(
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            expert_model_parallel_size=EP_SIZE,
        )
        set_streams()

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize("dispatcher_type,flex_backend", DISPATCHERS)
    def test_layer_nodes_drop_detached_tensors_after_backward(self, dispatcher_type, flex_backend):
        """A layer node's ``before_detached``/``detached`` go when its backward is done, not
        when the layer plan drops the node; the other microbatch's are left alone."""
        model = build_model(dispatcher_type, flex_backend, overlap=True)
        seen = {}

        def checkpoints(phase, watches):
            if phase == "forward 0":
                held = watches[0].nodes_holding_detached()
                assert any(
                    "moe_dispatch.before_detached" in h for h in held
                ), f"[rank {_rank()}] the dispatch node kept nothing in forward: {held}"
            elif phase == "overlapped":
                seen["mb0"] = watches[0].nodes_holding_detached()
                seen["mb0 alive"] = watches[0].alive_dispatched_probs()
                seen["mb1"] = watches[1].nodes_holding_detached()
            else:
                seen["mb1 after"] = watches[1].nodes_holding_detached()
                seen["mb1 alive"] = watches[1].alive_dispatched_probs()

        run_overlapped(model, build_microbatches(), checkpoints)

        held = seen["mb0"]
        assert (
            not held
        ), f"[rank {_rank()}] after microbatch 0's backward its layer nodes still hold {held}"
        alive = seen["mb0 alive"]
        assert not alive, f"[rank {_rank()}] after microbatch 0's backward still alive: {alive}"
        # Microbatch 1's forward ran in between; its backward still needs what it saved.
        kept = seen["mb1"]
        for name in DETACH_ATTRS:
            assert any(f"moe_dispatch.{name}" in k for k in kept), (
                f"[rank {_rank()}] microbatch 0's backward cleared microbatch 1's "
                f"moe_dispatch.{name}: it holds only {kept}"
            )
        held = seen["mb1 after"]
        assert (
            not held
        ), f"[rank {_rank()}] after microbatch 1's backward its layer nodes still hold {held}"
        alive = seen["mb1 alive"]
        assert not alive, f"[rank {_rank()}] after microbatch 1's backward still alive: {alive}"

    @pytest.mark.parametrize("dispatcher_type,flex_backend", DISPATCHERS)
    def test_layer_state_drops_probs_and_token_counts_after_expert_forward(
        self, dispatcher_type, flex_backend
    ):
        """The layer state's dispatched probs and tokens per expert go once the expert
        forward has read them, before the layer's backward."""
        model = build_model(dispatcher_type, flex_backend, overlap=True)
        seen = {}

        def checkpoints(phase, watches):
            if phase == "forward 0":
                seen["mb0"] = watches[0].layer_states_holding()
            elif phase == "overlapped":
                seen["mb1"] = watches[1].layer_states_holding()

        run_overlapped(model, build_microbatches(), checkpoints)

        for mb in ("mb0", "mb1"):
            held = seen[mb]
            assert not held, (
                f"[rank {_rank()}] after microbatch {mb[-1]}'s forward, before its backward, "
                f"the layer states still hold {held}"
            )

    @pytest.mark.parametrize("dispatcher_type,flex_backend", DISPATCHERS)
    def test_chunk_state_released_after_backward(self, dispatcher_type, flex_backend):
        """Once a chunk's backward is done its chunk state holds no tensor and the pre- and
        post-process nodes no longer reference it; release_state may run again."""
        model = build_model(dispatcher_type, flex_backend, overlap=True)
        seen = {}

        def checkpoints(phase, watches):
            if phase == "forward 0":
                seen["forward"] = watches[0].chunk_state_holding()
            elif phase == "overlapped":
                seen["mb0"] = watches[0].chunk_state_holding()
                seen["mb0 nodes"] = watches[0].nodes_holding_chunk_state()
                seen["mb1"] = watches[1].chunk_state_holding()

        _, watches = run_overlapped(model, build_microbatches(), checkpoints)

        assert "chunk_state.decoder_input" in seen["forward"], (
            f"[rank {_rank()}] the chunk state held no decoder input after the forward: "
            f"{seen['forward']}"
        )
        # Microbatch 0's backward leaves microbatch 1's chunk state (its own) alone.
        assert "chunk_state.decoder_input" in seen["mb1"], (
            f"[rank {_rank()}] microbatch 0's backward cleared microbatch 1's chunk state: "
            f"it holds only {seen['mb1']}"
        )
        for mb, watch in enumerate(watches):
            if mb == 0:
                held, nodes = seen["mb0"], seen["mb0 nodes"]
            else:
                held, nodes = watch.chunk_state_holding(), watch.nodes_holding_chunk_state()
            held = held + [f"{node}.chunk_state" for node in nodes]
            assert not held, (
                f"[rank {_rank()}] after microbatch {mb}'s backward its chunk state and "
                f"pre/post-process nodes still hold {held}"
            )
            watch.plan.release_state()
            held = watch.chunk_state_holding() + watch.nodes_holding_chunk_state()
            assert not held, f"[rank {_rank()}] a second release_state left {held}"

    @pytest.mark.parametrize("dispatcher_type,flex_backend", DISPATCHERS)
    def test_overlap_matches_sequential_run(self, dispatcher_type, flex_backend):
        """What the schedule releases early is not needed later: outputs and gradients are
        bitwise those of the microbatches run one after the other without the overlap."""
        batches = build_microbatches()

        reference = build_model(dispatcher_type, flex_backend, overlap=False)
        ref_outputs = []
        for batch in batches:
            output = float16_to_fp32(reference(**batch))
            output.backward(torch.ones_like(output))
            ref_outputs.append(output.detach())
        ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
        assert ref_grads, f"[rank {_rank()}] the reference run produced no gradients"

        model = build_model(dispatcher_type, flex_backend, overlap=True)
        outputs, _ = run_overlapped(model, batches, lambda phase, watches: None)
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

        for i, (out, ref) in enumerate(zip(outputs, ref_outputs)):
            assert torch.equal(
                out.detach(), ref
            ), f"[rank {_rank()}] microbatch {i}'s output differs from the reference"
        assert grads.keys() == ref_grads.keys(), (
            f"[rank {_rank()}] gradients of {sorted(grads.keys() ^ ref_grads.keys())} differ "
            f"in presence from the reference"
        )
        differ = [n for n in ref_grads if not torch.equal(grads[n], ref_grads[n])]
        assert not differ, f"[rank {_rank()}] gradients differ from the reference: {differ}"
