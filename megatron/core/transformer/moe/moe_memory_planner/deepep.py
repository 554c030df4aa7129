# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""DeepEP's normal-mode buffer (``Buffer``): its NVLink and RDMA sizes from the dispatch and
combine configs of each deep_ep source (``DEEP_EP_COMMIT``, ``DEEP_EP_MAIN_COMMIT``) and the
lines that allocate and refuse them."""

from dataclasses import dataclass
from typing import Dict, List, Tuple

from .sources import DEEP_EP_COMMIT, DEEP_EP_MAIN_COMMIT
from .terms import FP32, HOST, INT32, INT64, OUTSIDE, Term, _up, total

DEEPEP_WORKSPACE = 32 * 1024 * 1024  # NUM_WORKSPACE_BYTES: csrc/kernels/configs.cuh:5
DEEPEP_NVL_META = 8 * 4 + 8 * 8 + 8 * 8  # barrier signals and pointers: csrc/deep_ep.cpp:171-184
NUM_MAX_NVL_PEERS = 8  # csrc/kernels/configs.cuh:3
SOURCE_META_BYTES = 8  # internode::get_source_meta_bytes: csrc/kernels/internode.cu:40-42
MAX_TOPK = 128  # kNumMaxTopK, kNumMaxScales: csrc/config.hpp:54-55
DEFAULT_DEEPEP_SMS = 20  # megatron: moe_flex_dispatcher_num_sms or 20 (token_dispatcher.py)

# Buffer.get_dispatch_config / get_combine_config: (nvl_send, nvl_recv, rdma_send, rdma_recv)
# per group size (deep_ep/buffer.py:240-251 and 268-279 at DEEP_EP_COMMIT); any other size is
# refused there.
DEEPEP_DISPATCH_CONFIGS = {
    2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
    24: (8, 288, 32, 128), 32: (32, 288, 32, 128), 64: (20, 288, 28, 128),
    128: (20, 560, 32, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128),
}  # fmt: skip
DEEPEP_COMBINE_CONFIGS = {
    2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
    24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 64: (1, 288, 20, 128),
    128: (1, 560, 12, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128),
}  # fmt: skip
# The same at DEEP_EP_MAIN_COMMIT (deep_ep/buffers/legacy.py:246-257 and 276-287).
DEEPEP_MAIN_DISPATCH_CONFIGS = {
    2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
    24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
    96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128),
    160: (28, 720, 12, 128),
}  # fmt: skip
DEEPEP_MAIN_COMBINE_CONFIGS = {
    2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
    24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
    96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128),
}  # fmt: skip


@dataclass(frozen=True)
class DeepEPSource:
    """Where one deep_ep source sizes and refuses DeepEP's normal-mode buffer: its configs
    and the lines that hold them, the SM-count check, the size hints, the buffer's
    allocations."""

    name: str
    commit: str
    dispatch: Dict[int, tuple]
    combine: Dict[int, tuple]
    configs_at: str  # get_dispatch_config's table and refusal
    even_sms_at: str  # Buffer.set_num_sms: assert new_num_sms % 2 == 0
    nvl_hint_at: str
    rdma_hint_at: str
    nvl_alloc_at: str
    workspace_at: str
    counters_at: str
    rdma_counter_at: str
    destroy_at: str
    rdma_alloc_at: str
    # (intranode, internode): the checks a dispatch or combine of megatron's makes
    local_experts_at: Tuple[str, str]  # local experts <= NUM_MAX_LOCAL_EXPERTS (1024)
    topk_at: Tuple[str, str]  # num_topk <= 32, a device assert in the dispatch kernel
    hidden_at: Tuple[str, str]  # hidden x element size a multiple of 16 (int4)


DEEPEP_SOURCE = {
    "hybrid-ep": DeepEPSource(
        "hybrid-ep", DEEP_EP_COMMIT, DEEPEP_DISPATCH_CONFIGS, DEEPEP_COMBINE_CONFIGS,
        "deep_ep/buffer.py:252", "deep_ep/buffer.py:160", "csrc/config.hpp:51-73",
        "csrc/config.hpp:75-103", "csrc/deep_ep.cpp:145-147,171-184", "csrc/deep_ep.cpp:186-188",
        "csrc/deep_ep.cpp:191-200", "csrc/deep_ep.cpp:202-206", "deep_ep.cpp:299-304",
        "csrc/deep_ep.cpp:341-356",
        ("csrc/deep_ep.cpp:474", "csrc/deep_ep.cpp:869"),
        ("csrc/kernels/intranode.cu:187", "csrc/kernels/internode.cu:408"),
        ("csrc/deep_ep.cpp:717", "csrc/deep_ep.cpp:1111"),
    ),
    "main": DeepEPSource(
        "main", DEEP_EP_MAIN_COMMIT, DEEPEP_MAIN_DISPATCH_CONFIGS, DEEPEP_MAIN_COMBINE_CONFIGS,
        "deep_ep/buffers/legacy.py:259", "deep_ep/buffers/legacy.py:162",
        "csrc/legacy/config.hpp:53-73", "csrc/legacy/config.hpp:75-99",
        "csrc/legacy/buffer.hpp:101-103,132-137", "csrc/legacy/buffer.hpp:149-150",
        "csrc/legacy/buffer.hpp:153-161", "csrc/legacy/buffer.hpp:164-168",
        "buffer.hpp:326-331", "csrc/legacy/buffer.hpp:268",
        ("csrc/legacy/buffer.hpp:469", "csrc/legacy/buffer.hpp:949"),
        ("csrc/kernels/legacy/intranode.cu:251", "csrc/kernels/legacy/internode.cu:519"),
        ("csrc/legacy/buffer.hpp:458", "csrc/legacy/buffer.hpp:930"),
    ),
}  # fmt: skip


def deepep_nvl_bytes(
    hidden_bytes: int, group_size: int, num_sms: int, recv: int, nvl_peers: int = NUM_MAX_NVL_PEERS
) -> int:
    """``Config::get_nvl_buffer_size_hint`` (``csrc/config.hpp:51-73``), with NVSHMEM.
    ``nvl_peers``: the ranks of a DeepEP node (the kernel's ``NUM_MAX_NVL_PEERS``; fewer on the
    CPU runtime's scaled-down nodes, ``MOE_RELEASE_RANKS_PER_NODE``)."""
    rdma_ranks = max(group_size // nvl_peers, 1)
    nvl_ranks = min(group_size, nvl_peers)
    c = num_sms // 2
    b = c * nvl_ranks * (2 * rdma_ranks + 3) * INT32
    b += c * nvl_ranks * recv * (hidden_bytes + SOURCE_META_BYTES)
    b += c * nvl_ranks * recv * MAX_TOPK * (INT64 + FP32 + FP32)
    return _up(b, 128)


def deepep_rdma_bytes(
    hidden_bytes: int,
    group_size: int,
    num_sms: int,
    send: int,
    recv: int,
    nvl_peers: int = NUM_MAX_NVL_PEERS,
):
    """``Config::get_rdma_buffer_size_hint`` (``csrc/config.hpp:75-103``): 0 on one node (up
    to ``nvl_peers`` ranks, 8 on a GPU); ``recv`` is first rounded up to a multiple of ``send``
    (``config.hpp:45``). The counters' ``NUM_MAX_NVL_PEERS`` is the compile-time 8 always."""
    if group_size <= nvl_peers:
        return 0
    recv = _up(recv, send)
    c, rr = num_sms // 2, group_size // nvl_peers
    b = c * rr * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * INT32
    b += c * rr * recv * (hidden_bytes + SOURCE_META_BYTES) * 2
    b += c * rr * recv * MAX_TOPK * (INT64 + FP32 + FP32) * 2
    b += c * rr * recv * 16 * 2  # sizeof(int4)
    return _up(b, 128)


def deepep_buffer_terms(
    hidden_bytes: int,
    group_size: int,
    num_sms: int = DEFAULT_DEEPEP_SMS,
    source: str = "hybrid-ep",
    nvl_peers: int = NUM_MAX_NVL_PEERS,
) -> List[Term]:
    """One rank's ``deep_ep.Buffer`` as megatron-core's ``get_buffer`` builds it: the byte
    hints are the maximum over the dispatch and combine configs for the group
    (``fused_a2a.py`` ``get_buffer``), so the size does not depend on the token count.
    ``hidden_bytes`` is ``H x max(element size, 2)`` (``fused_a2a.py`` ``get_hidden_bytes``).
    ``source`` is the deep_ep read (:data:`DEEPEP_SOURCE`): ``hybrid-ep`` (``DEEP_EP_COMMIT``)
    or ``main`` (``DEEP_EP_MAIN_COMMIT``), whose configs differ. ``nvl_peers``: the ranks of a
    DeepEP node (:func:`deepep_nvl_bytes`). A group size the source has no config for is a
    ValueError citing the line that refuses it."""
    src = DEEPEP_SOURCE[source]
    if group_size not in src.dispatch:
        raise ValueError(
            f"DeepEP has no config for {group_size} ranks ({src.configs_at} accepts "
            f"{sorted(src.dispatch)})"
        )
    configs = (src.dispatch[group_size], src.combine[group_size])
    nvl = max(deepep_nvl_bytes(hidden_bytes, group_size, num_sms, c[1], nvl_peers)
              for c in configs)  # fmt: skip
    rdma = max(deepep_rdma_bytes(hidden_bytes, group_size, num_sms, c[2], c[3], nvl_peers)
               for c in configs)  # fmt: skip
    t = [
        Term("NVLink buffer (num_nvl_bytes)", nvl, OUTSIDE, src.nvl_hint_at,
             f"one cudaMalloc shared over CUDA IPC ({src.nvl_alloc_at})"),
        Term("NVLink barrier signals and pointers", DEEPEP_NVL_META, OUTSIDE, src.nvl_alloc_at),
        Term("workspace", DEEPEP_WORKSPACE, OUTSIDE, src.workspace_at),
        Term("receive counters (token, per local expert)", 8 + 4 * 1024, HOST,
             src.counters_at, f"freed by destroy() ({src.destroy_at})"),
        Term("RDMA receive counter", 4, HOST, src.rdma_counter_at,
             f"destroy() does not free it ({src.destroy_at})", released=False),
    ]  # fmt: skip
    if rdma:
        t.append(Term("RDMA buffer (num_rdma_bytes)", rdma, OUTSIDE, src.rdma_hint_at,
                      f"NVSHMEM symmetric heap ({src.rdma_alloc_at}); NVSHMEM's own "
                      "memory is not modelled"))  # fmt: skip
    return t


def deepep_emulated_bytes(hidden_bytes: int, group_size: int, num_sms: int) -> int:
    """Device bytes of :func:`deepep_buffer_terms` (what the CPU emulation allocates)."""
    return total(deepep_buffer_terms(hidden_bytes, group_size, num_sms), OUTSIDE)
