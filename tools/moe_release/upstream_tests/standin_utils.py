# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Stand-in for upstream Megatron-LM's ``tests/unit_tests/test_utilities.py`` (``Utils``).

The PyPI sdist our trees come from has no ``tests/``, so :mod:`moe_release.upstream_tests.per_patch`
runs our upstream-layout tests (``patches/upstream/tests/...``) in a scratch checkout built around a
materialized tree, with this file copied in as ``tests/unit_tests/test_utilities.py``. It has the
part of upstream's ``Utils`` those tests use, with upstream's behaviour: the process group is
initialized once per process from torchrun's environment with backend "nccl" (the harness plugin
turns it into gloo), and ``initialize_model_parallel``/``destroy_model_parallel`` wrap
megatron-core's. Upstream's own file (and its ``megatron.training`` imports) is what runs against a
real Megatron-LM checkout.
"""

import os
from datetime import timedelta

import megatron.core.parallel_state as ps
import torch


class Utils:
    """Upstream's ``Utils``: model-parallel setup and teardown for one test."""

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    inited = False

    @staticmethod
    def initialize_distributed() -> None:
        """Initialize the default process group once per process (from torchrun's env)."""
        if not torch.distributed.is_initialized() and Utils.rank >= 0:
            torch.cuda.set_device(Utils.rank % torch.cuda.device_count())
            torch.distributed.init_process_group(
                backend="nccl",
                world_size=Utils.world_size,
                rank=Utils.rank,
                timeout=timedelta(minutes=1),
            )
            torch.distributed.barrier()
        Utils.inited = True

    @staticmethod
    def initialize_model_parallel(
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_model_parallel_size=None,
        **kwargs,
    ) -> None:
        """Tear down any previous state, then initialize megatron-core's parallel state."""
        ps.destroy_model_parallel()
        Utils.initialize_distributed()
        ps.initialize_model_parallel(
            tensor_model_parallel_size,
            pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size,
            **kwargs,
        )
        Utils.inited = True

    @staticmethod
    def destroy_model_parallel() -> None:
        """Synchronize the ranks, then destroy megatron-core's parallel state."""
        if not Utils.inited:
            return
        torch.cuda.synchronize()
        torch.distributed.barrier()
        ps.destroy_model_parallel()
        Utils.inited = False
