"""`moe_release.py matrix`: the compatibility matrix from the pins and the recorded runs."""

import pytest

from moe_release.commands.matrix import (
    BEGIN,
    END,
    column,
    junit_outcomes,
    record_run,
    table,
    update_file,
)
from moe_release.common import UserError

# What tests/helpers/trees.py writes for a test marked `backport` (a release test).
RELEASE = '<properties><property name="moe_release_test" value="backport"/></properties>'
CASES = {
    ("transformer.moe.test_dispatcher_state_release",
     "test_nothing_of_the_forward_outlives_backward[flex-hybridep-ep2-x]"): RELEASE,
    ("transformer.moe.test_dispatcher_state_release",
     "test_nothing_of_the_forward_outlives_backward[alltoall-dropless-ep2-x]"):
        RELEASE + '<failure message="boom"/>',
    ("transformer.moe.test_dispatcher_state_release",
     "test_nothing_of_the_forward_outlives_backward[flex-deepep-ep2-x]"): RELEASE + '<skipped/>',
    ("a2a_overlap.test_stream_care", "test_one"): RELEASE,
    ("transformer.moe.test_cpu_guards", "test_guard"): RELEASE,
    # Not marked `backport`: in no column, though its node id would put it under "other".
    ("transformer.moe.test_moe_layer", "test_not_a_release_test"): "",
}  # fmt: skip


def _junit(path):
    body = "".join(
        f'<testcase classname="tests.unit_tests.{c}" name="{n}" time="1">{inner}</testcase>'
        for (c, n), inner in CASES.items()
    )
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite>{body}</testsuite></testsuites>')


def test_columns_by_node_id():
    assert column("a2a_overlap/test_stream_care.py::test_x") == "A2A-overlap"
    assert column("transformer/moe/test_x.py::t[flex-hybridep-ep2-a]") == "flex-hybridep"
    assert column("transformer/moe/test_x.py::t[flex-deepep-ep2-a]") == "flex-deepep"
    assert column("transformer/moe/test_x.py::t[flex-deepepv2-ep2-a]") == "flex-deepepv2"
    assert column("transformer/moe/test_x.py::t[flex-ncclep-ep2-a]") == "flex-ncclep"
    assert column("transformer/moe/test_x.py::t[allgather-ep2]") == "allgather"
    assert column("transformer/moe/test_x.py::test_hybridep_buffer_rebinds[new-ep2]") == (
        "flex-hybridep"
    )
    assert column("transformer/moe/test_cpu_guards.py::test_x") == "other"


def test_record_and_table(tmp_path, repo):
    _junit(tmp_path / "r.xml")
    outcomes = junit_outcomes(tmp_path / "r.xml")
    assert outcomes["a2a_overlap/test_stream_care.py::test_one"] == "passed"
    record_run("0.18.2", tmp_path / "r.xml", 42, 1, root=repo)
    text = table(root=repo)
    (row,) = [line for line in text.splitlines() if line.startswith("| `0.18.2`")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    # 0.18.2 has neither DeepEP v2 nor NCCL EP: their columns are n/a, not failures (the record
    # reads the backends from the base's tree; none is materialized here, so none is known).
    assert cells[2:10] == ["✓ 1/1", "✗ 0/1 (1 skipped)", "n/a (no deepepv2)", "n/a (no ncclep)",
                           "✗ 0/1 (1 failed)", "—", "✓ 1/1", "✓ 1/1"]  # fmt: skip
    assert cells[10].endswith(", 42 s")
    assert "| `0.17.1` |" in text and text.count("not run |") >= 1
    assert "| `main-d98e8a6` | Megatron-LM `main` `d98e8a64ddf3` (0.20.0) |" in text
    # A change to the series makes the record stale.
    series = repo / "patches" / "backports" / "core_r0.18.0" / "series"
    lines = series.read_text().splitlines(True)
    names = [line for line in lines if not line.startswith("#")]
    series.write_text("".join([line for line in lines if line.startswith("#")] + names[:-1]))
    (repo / "patches/backports/core_r0.18.0" / names[-1].strip()).unlink()
    assert "(stale: the series changed since)" in table(root=repo)


def test_update_rewrites_only_the_marked_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{BEGIN}\nold\n{END}\nrest\n")
    assert update_file(readme, "| new |\n")
    assert readme.read_text() == f"intro\n{BEGIN}\n| new |\n{END}\nrest\n"
    assert not update_file(readme, "| new |\n")
    (tmp_path / "plain.md").write_text("no markers\n")
    with pytest.raises(UserError, match="has no '<!-- moe-release matrix -->'"):
        update_file(tmp_path / "plain.md", "x")
