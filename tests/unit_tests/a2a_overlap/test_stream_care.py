# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The dispatchers' combine-time release records what it drops on the current stream.

Under the 1F1B A2A overlap combine (and with it the release) runs on the communication stream,
while much of what it drops was made on the compute stream. Every dispatcher's
``reset_transient_forward_state`` must record each device tensor it drops (also inside a tuple
such as a dispatch handle) on the current stream before dropping it. A host has no device
tensors, so a tensor subclass that reports ``is_cuda`` stands in for one and logs
``record_stream``; the stream is the CPU runtime's stand-in. The checks run in one fresh
interpreter on the patched tree (megatron-core imported once, a fresh record log per check),
and each fails on the unpatched base (which has no release).
"""

import json
import subprocess
import sys
import textwrap

import pytest

from moe_release.runtime.ranks.launcher import TOOLS
from tests.helpers import REPO_ROOT

pytestmark = pytest.mark.backport  # release tests: run against every pinned base

SETUP = """
import torch
from moe_release.runtime.cuda.compat import install_dtoh_stream_cpu_shim
from moe_release.runtime.cuda.host_streams import HOST_STREAMS, HostStream
from megatron.core.transformer.moe import token_dispatcher as td

install_dtoh_stream_cpu_shim()  # the module's torch.cuda.current_stream: the host stand-in
recorded = []

class DeviceTensor(torch.Tensor):
    @property
    def is_cuda(self):
        return True

    def record_stream(self, stream):
        recorded.append((id(self), stream.name))

def device_tensor():
    return torch.zeros(2).as_subclass(DeviceTensor)

def check(obj, attrs):
    tensors = {}
    for attr in attrs:
        t = device_tensor()
        tensors[attr] = t
        setattr(obj, attr, (t, None) if attr == "handle" else t)
    host = torch.zeros(2)  # a host tensor is dropped without a record
    with HOST_STREAMS.stream(HostStream(name="comm")):
        obj.reset_transient_forward_state()
    for attr, t in tensors.items():
        assert getattr(obj, attr) is None, attr
        assert (id(t), "comm") in recorded, f"{type(obj).__name__}.{attr} not recorded"
    assert len(recorded) == len(tensors), recorded

def set_per_forward(cls, attrs):
    # The attributes of ``attrs`` this base's class sets (older branches lack some).
    import inspect
    source = inspect.getsource(cls)
    return [a for a in attrs if f"self.{a} =" in source or f"self.{a}:" in source]
"""

CASES = {
    "allgather": """
        d = object.__new__(td.MoEAllGatherTokenDispatcher)
        check(d, ["routing_map", "local_map", "local_probs",
                  "reversed_local_input_permutation_mapping"])
        """,
    "alltoall": """
        d = object.__new__(td.MoEAlltoAllTokenDispatcher)
        d.valid_cudagraph_attrs = None  # no captured preprocess: everything is dropped
        check(d, ["probs", "routing_map", "reversed_local_input_permutation_mapping",
                  "tokens_per_expert", "num_out_tokens", "input_splits", "output_splits",
                  "output_splits_tp", "num_global_tokens_per_local_expert"])
        """,
    "hybridep": """
        m = object.__new__(td._HybridEPManager)
        m.drop_and_pad = False
        check(m, set_per_forward(td._HybridEPManager, [
            "routing_map", "token_probs", "dispatched_probs", "handle", "_original_num_tokens",
            "_padded_num_tokens", "tokens_per_expert", "num_permuted_tokens"]))
        """,
    "deepep": """
        m = object.__new__(td._DeepepManager)
        check(m, set_per_forward(td._DeepepManager, [
            "token_probs", "token_indices", "handle", "tokens_per_expert", "dispatched_indices",
            "dispatched_probs", "dispatched_routing_map", "reversed_mapping_for_combine",
            "pad_offsets"]))
        """,
}


def _run(tree: str, code: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": f"{tree}:{TOOLS}", "CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=str(REPO_ROOT), capture_output=True,
        text=True, timeout=240,
    )  # fmt: skip


def _all_cases_program() -> str:
    """One interpreter runs every case (importing megatron-core once), each in a fresh ``recorded``
    log; prints one JSON line: case -> "ok" or its traceback."""
    out = [textwrap.dedent(SETUP), "import json, traceback", "results = {}"]
    for name in sorted(CASES):
        body = textwrap.indent(textwrap.dedent(CASES[name]).strip("\n"), "    ")
        out.append(
            f"recorded.clear()\ntry:\n{body}\n    results[{name!r}] = 'ok'\n"
            f"except BaseException:\n    results[{name!r}] = traceback.format_exc()"
        )
    out.append("print('RESULTS ' + json.dumps(results))")
    return "\n".join(out)


_RESULTS: dict = {}


def _results(tree: str) -> dict:
    if tree not in _RESULTS:
        done = _run(tree, _all_cases_program())
        line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULTS ")]
        assert done.returncode == 0 and line, done.stderr[-3000:]
        _RESULTS[tree] = json.loads(line[-1][len("RESULTS ") :])
    return _RESULTS[tree]


@pytest.mark.parametrize("case", sorted(CASES))
def test_release_records_dropped_tensors_on_current_stream(patched_tree, case):
    result = _results(patched_tree)[case]
    assert result == "ok", result[-3000:]
