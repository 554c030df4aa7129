# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The counting CPU allocator is itself tested against known allocations (its oracle: sizes the
test allocates and frees, on the main thread and on others)."""

import subprocess
import sys
import textwrap

from moe_release.runtime.measure import cpu_memory
from moe_release.runtime.ranks.launcher import TOOLS

SCRIPT = textwrap.dedent(
    """
    import threading, torch
    from moe_release.runtime.measure import cpu_memory as m
    torch.set_num_threads(1)
    before = torch.empty(10_000, dtype=torch.uint8)  # allocated before install: never counted
    m.install(); m.install()
    assert m.installed()
    assert m.memory_allocated() == 0, m.memory_allocated()
    a = torch.empty(1_000_000, dtype=torch.uint8)
    b = torch.empty(250, dtype=torch.float32)
    assert m.memory_allocated() == 1_001_000, m.memory_allocated()
    del before  # freeing an uncounted block changes nothing
    assert m.memory_allocated() == 1_001_000
    # Freed on another thread (as gloo and autograd workers do): still subtracted.
    box = [a]
    del a
    t = threading.Thread(target=box.clear); t.start(); t.join()
    assert m.memory_allocated() == 1_000, m.memory_allocated()
    # Allocated on another thread, freed here.
    t = threading.Thread(target=lambda: box.append(torch.empty(4096, dtype=torch.uint8)))
    t.start(); t.join()
    assert m.memory_allocated() == 5_096
    box.clear()
    m.reset_peak_memory_stats()
    assert m.max_memory_allocated() == 1_000
    m.start_recording()
    x = torch.ones(1000, 1000)  # 4 MB
    y = x.clone()               # 8 MB live
    del x, y
    times, values = m.stop_recording()
    assert values == [1_000 + 4_000_000, 1_000 + 8_000_000, 1_000 + 4_000_000, 1_000], values
    assert times == sorted(times)
    assert m.max_memory_allocated() == 8_001_000
    assert m.memory_allocated() == 1_000
    # raw_allocate/raw_deallocate paths (used e.g. by storage resizes) stay consistent.
    s = torch.empty(0, dtype=torch.uint8)
    s.resize_(777)
    assert m.memory_allocated() == 1_777, m.memory_allocated()
    s.untyped_storage().resize_(0)
    assert m.memory_allocated() == 1_000, m.memory_allocated()
    del b
    assert m.memory_allocated() == 0
    print("ok", m.allocations())
    """
)


def test_counting_allocator_matches_known_allocations():
    cpu_memory.build()
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=str(TOOLS), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok ")


def test_counter_refuses_to_count_when_broken(tmp_path):
    """A deliberately broken counter (frees not subtracted) fails the same checks."""
    source = cpu_memory.SOURCE.read_text()
    broken = source.replace("g_current.fetch_sub(", "g_current.fetch_add(0 * ")
    assert broken != source
    lib_dir = tmp_path / "broken"
    lib_dir.mkdir()
    (lib_dir / cpu_memory.SOURCE.name).write_text(broken)
    script = (
        "import moe_release.runtime.measure.cpu_memory as m, pathlib\n"
        f"m.SOURCE = pathlib.Path({str(lib_dir / cpu_memory.SOURCE.name)!r})\n"
        f"m._library_path = lambda: pathlib.Path({str(lib_dir / 'lib.so')!r})\n" + SCRIPT
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=str(TOOLS), capture_output=True, text=True
    )
    assert result.returncode != 0 and "AssertionError" in result.stderr
