# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The peak attribution (runtime.measure.peak_tensors) against allocations whose sizes, makers and
lifetimes the test chooses (its oracle), in a fresh interpreter with the counting allocator:
the blocks alive at the peak, the op and phase that made each, the bytes freed of blocks older
than the recording, and the difference of two runs whose only change is when a tensor dies."""

import subprocess
import sys
import textwrap

from moe_release.runtime.ranks.launcher import TOOLS

SCRIPT = textwrap.dedent(
    """
    import torch
    from moe_release.runtime.measure import cpu_memory as m, peak_tensors as pt

    torch.set_num_threads(1)
    m.install()

    def run(free_early, moments=()):
        old = torch.empty(3_000, dtype=torch.uint8)  # made before the recording
        m.start_recording()
        start = m.memory_allocated()
        log = pt.OpLog()
        with log:
            log.phase = "forward"
            a = torch.ones(1_000, dtype=torch.float32)        # 4,000 B
            b = torch.zeros(500, dtype=torch.bfloat16)        # 1,000 B
            log.phase = "backward"
            if free_early:
                del a
            del old                                           # -3,000 B, older block
            c = torch.full((2_000,), 1.0)                     # 8,000 B: the peak
            log.phase = "after"
            del c
        values, ptrs, deltas = m.stop_recording(events=True)[1:]
        return pt.summarize(log, values, ptrs, deltas, start, moments=moments)

    late, early = run(False), run(True)
    assert late["peak_bytes"] == 4_000 + 1_000 - 3_000 + 8_000, late["peak_bytes"]
    assert early["peak_bytes"] == 1_000 - 3_000 + 8_000, early["peak_bytes"]
    assert late["peak_phase"] == early["peak_phase"] == "backward"
    at = late["at"]["backward"]
    assert at["freed_older"] == 3_000
    made = {(r["phase"], r["op"], r["shape"], r["dtype"]): (r["count"], r["bytes"])
            for r in at["rows"]}
    assert made == {
        ("forward", "aten.ones", (1000,), "torch.float32"): (1, 4_000),
        ("forward", "aten.zeros", (500,), "torch.bfloat16"): (1, 1_000),
        ("backward", "aten.full", (2000,), "torch.float32"): (1, 8_000),
    }, made
    assert sum(r["bytes"] for r in at["rows"]) - at["freed_older"] == late["peak_bytes"]
    diff = pt.difference(late["at"]["backward"]["rows"], early["at"]["backward"]["rows"])
    assert [(r["op"], r["difference"]) for r in diff] == [("aten.ones", 4_000)], diff
    lines = pt.explain(late, early)
    assert "difference 4,000 B = 4,000 B alive in one and not the other" in lines[2], lines
    assert "+4,000  forward | aten.ones (1000,) float32" in lines[3], lines
    # The base's peak moment in the other run, as the report passes it: the highest point of
    # the same op (the backward's aten.full), though that run freed a block more before it.
    moment = pt.peak_moments(late)[0]
    assert moment[:2] == ["backward", 0], moment
    aligned = run(True, moments=[moment])["at_moments"]["backward"]
    assert aligned["bytes"] == early["peak_bytes"], aligned
    lines = pt.explain(late, run(True, moments=pt.peak_moments(late)))
    assert "at the base's peak (backward, the same op in both)" in lines[2], lines
    assert "difference 4,000 B" in lines[2], lines
    print("ok")
    """
)


def test_peak_attribution_names_what_was_alive():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=str(TOOLS), capture_output=True, text=True, timeout=99
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
