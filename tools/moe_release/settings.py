# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The tooling's settings: every environment variable the tooling reads for itself, in one
place, one accessor per variable.

Each accessor reads the process environment when it is called (nothing is cached at import),
so a test's ``monkeypatch.setenv`` and a parent that sets a variable before it spawns ranks
both keep working. A value that cannot be read as its type raises :class:`SettingError`, which
names the variable. Defaults are those the readers had before they moved here.

=======================================  =================================  =====================
variable                                 accessor                           type (default)
=======================================  =================================  =====================
``MOE_RELEASE_TREE``                     :func:`tree`                       path (unset)
``MOE_RELEASE_BASE_TREE``                :func:`base_tree`                  path (unset)
``MOE_RELEASE_MEGATRON_LM``              :func:`megatron_lm`                path (unset)
``MOE_RELEASE_BASES``                    :func:`bases`                      names ([])
``MOE_RELEASE_CACHE``                    :func:`cache_dir`                  path (XDG cache)
``MOE_RELEASE_FORK``                     :func:`fork`                       flag, "0" off (on)
``MOE_RELEASE_PLACEMENT``                :func:`placement`                  flag, "0" off (on)
``MOE_RELEASE_PLACEMENT_TRACE``          :func:`placement_trace`            flag, "1" on (off)
``MOE_RELEASE_DEVICE_BARRIER_TIMEOUT``   :func:`device_barrier_timeout`     seconds (30)
``MOE_RELEASE_RANKS_PER_NODE``           :func:`ranks_per_node`             ranks (unset: one node)
``DEEP_EP_SRC``                          :func:`deep_ep_src`                path (unset)
``MOE_RELEASE_FAULT_GLOO_TIMEOUT``       :func:`fault_gloo_timeout`         seconds (caller's)
``MOE_RELEASE_REPLACEMENT``              :func:`fault_replacement`          flag, "1" on (off)
``MOE_RELEASE_FAULT_LOG``                :func:`fault_log`                  path (unset)
``MOE_RELEASE_LIVE_BYTES_CHECK``         :func:`live_bytes_check`           flag, non-empty (off)
``MOE_RELEASE_PRODUCTION_SHAPE_CHAINS``  :func:`production_shape_chains`    flag, non-empty (off)
``UPSTREAM_CPU_CHECKOUT``                :func:`upstream_cpu_checkout`      path (cwd)
``UPSTREAM_CPU_PLACEMENT``               :func:`upstream_cpu_placement`     flag, "0" off (on)
``UPSTREAM_CPU_STREAM_ORDER``            :func:`upstream_cpu_stream_order`  flag, "0" off (on)
``UPSTREAM_CPU_PG_TIMEOUT``              :func:`upstream_cpu_pg_timeout`    seconds (180)
``UPSTREAM_CPU_DEEP_EP``                 :func:`upstream_cpu_deep_ep`       word ("")
``UPSTREAM_CPU_TE``                      :func:`upstream_cpu_te`            word ("")
``UPSTREAM_CPU_FP32_GEMM``               :func:`upstream_cpu_fp32_gemm`     flag, "1" on (off)
``UPSTREAM_CPU_REPORT_DIR``              :func:`upstream_cpu_report_dir`    path (unset)
``CXX``                                  :func:`cxx`                        command (unset)
deep_ep's tuning variables               :func:`deep_ep_variable`           raw text (unset)
=======================================  =================================  =====================

deep_ep's tuning variables (:data:`DEEP_EP_VARIABLES`) are deep_ep's, not the tooling's: the
emulations and the planner read them as deep_ep does (``atoi``, ``int()``), so
:func:`deep_ep_variable` hands back the raw text and the reader parses it.

What stays outside this module, on purpose (``tests/tooling/test_settings.py`` allows it):

* **Writing** a child's environment: copying ``os.environ`` into a rank's or a subprocess's
  environment (``dict(os.environ)``, the ``GIT_*``-free copies of ``moe_release.series.git``,
  ``moe_release.series.source`` and ``moe_release.commands.apply``), extending ``PATH`` /
  ``PYTHONPATH`` for a child, ``os.environ[...] = ...`` for what a spawned rank inherits, and the
  zygote replacing a child's environment wholesale. These set the environment, they do not read a
  setting.
* **torch's launch protocol**: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
  ``MASTER_ADDR``, ``MASTER_PORT`` are read in rank processes exactly as torch's ``env://``
  rendezvous reads them; they are torch's variables, set per rank by the launcher.
* ``MOE_RELEASE_RANK_ENTRY`` is read by the zygote from the job's environment *dict* it was
  sent, not from its own process environment.
* :func:`override` sets a variable for a block (the production-shape runs turn the placement
  rules off for the ranks they spawn) and puts the old value back.

Standard library only; the lowest layer of the tooling (every package may import it).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator, Optional


class SettingError(ValueError):
    """A variable is unset where it is required, or its value cannot be read as its type."""


def _get(name: str) -> Optional[str]:
    return os.environ.get(name)


def _float(name: str, default: float) -> float:
    raw = _get(name)
    if raw is None:
        return float(default)
    try:
        return float(raw)
    except ValueError:
        raise SettingError(f"{name}={raw[:40]!r}: expected a number of seconds") from None


def _required(name: str, value: Optional[str], required: bool) -> Optional[str]:
    if required and value is None:
        raise SettingError(f"{name} is not set (eval \"$(python scripts/moe_release.py trees)\")")
    return value


# --- trees and sources ------------------------------------------------------------------------


def tree(required: bool = False) -> Optional[str]:
    """``MOE_RELEASE_TREE``: the patched tree (base + series + overlay modules), as
    ``moe_release.py trees`` prints it. None when unset (an error when ``required``)."""
    return _required("MOE_RELEASE_TREE", _get("MOE_RELEASE_TREE"), required)


def base_tree(required: bool = False) -> Optional[str]:
    """``MOE_RELEASE_BASE_TREE``: the pristine base plus the overlay modules. None when unset
    (an error when ``required``)."""
    return _required("MOE_RELEASE_BASE_TREE", _get("MOE_RELEASE_BASE_TREE"), required)


MEGATRON_LM = "MOE_RELEASE_MEGATRON_LM"


def megatron_lm() -> Optional[str]:
    """``MOE_RELEASE_MEGATRON_LM``: a Megatron-LM clone (or mirror) that commit bases are read
    from. The raw value, None when unset (callers strip it)."""
    return _get(MEGATRON_LM)


BASES = "MOE_RELEASE_BASES"


def bases() -> list[str]:
    """``MOE_RELEASE_BASES``: the bases ``trees --list`` selects, names separated by spaces or
    commas, or ``all``; [] when unset (the default selection)."""
    return (_get(BASES) or "").replace(",", " ").split()


def cache_dir() -> Path:
    """``MOE_RELEASE_CACHE``: where verified sdists are kept; default
    ``$XDG_CACHE_HOME/moe-release`` (``XDG_CACHE_HOME`` default ``~/.cache``)."""
    env = _get("MOE_RELEASE_CACHE")
    if env:
        return Path(env)
    xdg = _get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "moe-release"


# --- the CPU runtime --------------------------------------------------------------------------


def fork() -> bool:
    """``MOE_RELEASE_FORK``: ranks fork from a warm zygote (default); ``0`` spawns each rank
    fresh."""
    return _get("MOE_RELEASE_FORK") != "0"


def placement() -> bool:
    """``MOE_RELEASE_PLACEMENT``: CPU ranks run under the CUDA placement rules (default); ``0``
    turns them off."""
    return _get("MOE_RELEASE_PLACEMENT") != "0"


def placement_trace() -> bool:
    """``MOE_RELEASE_PLACEMENT_TRACE``: ``1`` puts the whole stack in a placement error
    (default: the first frame outside the rules)."""
    return _get("MOE_RELEASE_PLACEMENT_TRACE") == "1"


def device_barrier_timeout() -> float:
    """``MOE_RELEASE_DEVICE_BARRIER_TIMEOUT``: seconds an emulated device-side barrier waits
    for its peers before it "traps" (default 30)."""
    return _float("MOE_RELEASE_DEVICE_BARRIER_TIMEOUT", 30.0)


RANKS_PER_NODE = "MOE_RELEASE_RANKS_PER_NODE"


def ranks_per_node() -> Optional[int]:
    """``MOE_RELEASE_RANKS_PER_NODE``: the ranks of one emulated node (NVLink domain) in the
    CPU runtime, a positive integer; ranks ``n * R .. n * R + R - 1`` are node ``n``, as a
    launcher fills real nodes. Unset: every rank of the job on one node (the runtime's
    default)."""
    value = _get(RANKS_PER_NODE)
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise SettingError(f"{RANKS_PER_NODE}={value!r}: not a positive integer")
    return n


def deep_ep_src() -> Optional[str]:
    """``DEEP_EP_SRC``: a deep_ep git repository to read (the planner's cited lines) or to
    carry to a lent GPU (``scripts/device-check kernels prepare``); unset: none."""
    return _get("DEEP_EP_SRC")


def fault_gloo_timeout(default: float) -> float:
    """``MOE_RELEASE_FAULT_GLOO_TIMEOUT``: seconds a fault scenario's gloo groups wait in a
    collective (default: the scenario's own, ``fault_scenarios.GLOO_TIMEOUT``)."""
    return _float("MOE_RELEASE_FAULT_GLOO_TIMEOUT", default)


def fault_replacement() -> bool:
    """``MOE_RELEASE_REPLACEMENT``: ``1`` in a fault-matrix rank that replaced a peer's process
    (scenario j: the rank re-executed itself as a fresh process)."""
    return _get("MOE_RELEASE_REPLACEMENT") == "1"


def fault_log() -> Optional[str]:
    """``MOE_RELEASE_FAULT_LOG``: the file the collective log appends to (unset: none)."""
    return _get("MOE_RELEASE_FAULT_LOG")


def live_bytes_check() -> bool:
    """``MOE_RELEASE_LIVE_BYTES_CHECK``: any non-empty value checks the production-shape live
    byte count against the allocator at every step (slow; default off)."""
    return bool(_get("MOE_RELEASE_LIVE_BYTES_CHECK"))


def production_shape_chains() -> bool:
    """``MOE_RELEASE_PRODUCTION_SHAPE_CHAINS``: any non-empty value allows retention chains of
    more than six links in the production-shape mode (default off)."""
    return bool(_get("MOE_RELEASE_PRODUCTION_SHAPE_CHAINS"))


def cxx() -> Optional[str]:
    """``CXX``: the C++ compiler for the allocator-counting extension (unset: Python's
    configured compiler, else ``g++``)."""
    return _get("CXX")


DEEP_EP_VARIABLES = (
    "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN",
    "NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API",
    "NUM_OF_TOKENS_PER_CHUNK_COMBINE_API",
    "NUM_OF_TOKENS_PER_CHUNK_PREPROCESSING_API",
    "EP_REUSE_NCCL_COMM",  # DeepEP v2: reuse the group's NCCL communicator (comm.py)
)


def deep_ep_variable(name: str) -> Optional[str]:
    """One of deep_ep's tuning variables (:data:`DEEP_EP_VARIABLES`), raw (None: unset): the
    emulations and the planner parse it as deep_ep does."""
    if name not in DEEP_EP_VARIABLES:
        raise SettingError(f"{name}: not one of deep_ep's variables {DEEP_EP_VARIABLES}")
    return _get(name)


# --- the upstream tests on CPU ranks ----------------------------------------------------------


def upstream_cpu_checkout() -> str:
    """``UPSTREAM_CPU_CHECKOUT``: the Megatron-LM checkout whose tests run (default: the
    working directory)."""
    value = _get("UPSTREAM_CPU_CHECKOUT")
    return os.getcwd() if value is None else value


def upstream_cpu_placement() -> bool:
    """``UPSTREAM_CPU_PLACEMENT``: the placement rules (default); ``0``: the plugin's own
    CUDA-to-host mode."""
    return _get("UPSTREAM_CPU_PLACEMENT") != "0"


def upstream_cpu_stream_order() -> bool:
    """``UPSTREAM_CPU_STREAM_ORDER``: the host streams keep CUDA's stream order (default);
    ``0`` runs every stream's work at once."""
    return _get("UPSTREAM_CPU_STREAM_ORDER") != "0"


def upstream_cpu_pg_timeout() -> float:
    """``UPSTREAM_CPU_PG_TIMEOUT``: the cap, in seconds, on a process group's timeout
    (default 180)."""
    return _float("UPSTREAM_CPU_PG_TIMEOUT", 180.0)


def upstream_cpu_deep_ep() -> str:
    """``UPSTREAM_CPU_DEEP_EP``: ``emulation`` installs the deep_ep stand-ins (default "")."""
    return _get("UPSTREAM_CPU_DEEP_EP") or ""


def upstream_cpu_te() -> str:
    """``UPSTREAM_CPU_TE``: ``local`` gives the tests local layer specs for Transformer Engine
    (default "")."""
    return _get("UPSTREAM_CPU_TE") or ""


def upstream_cpu_fp32_gemm() -> bool:
    """``UPSTREAM_CPU_FP32_GEMM``: ``1`` runs low-precision matmuls in fp32 (default off)."""
    return _get("UPSTREAM_CPU_FP32_GEMM") == "1"


def upstream_cpu_report_dir() -> Optional[str]:
    """``UPSTREAM_CPU_REPORT_DIR``: where each rank appends its test outcomes (unset or empty:
    not recorded)."""
    return _get("UPSTREAM_CPU_REPORT_DIR") or None


# --- setting a variable for a block -----------------------------------------------------------


@contextlib.contextmanager
def override(name: str, value: str) -> Iterator[None]:
    """Set ``name`` to ``value`` in this process's environment (and so in every process it
    spawns) for the block; put back the old value, or unset it, afterwards."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved
