"""`scripts/fault_matrix.py --out`: one generated block per base, the hand-written text kept."""

import json

from moe_release.commands import fault_matrix
from tests.helpers import REPO_ROOT

GOLDEN = REPO_ROOT / "tests/unit_tests/transformer/moe/golden_values/fault_matrix_base.json"


def _fault_matrix():
    return fault_matrix


def test_each_base_keeps_its_own_block(tmp_path):
    """Rendering a second base appends its block; rendering the first again replaces only its
    own block; the text around the blocks stays."""
    fm = _fault_matrix()
    row = json.loads(GOLDEN.read_text())["bases"]["0.19.2"]
    results = tmp_path / "r.json"
    results.write_text(json.dumps({"base": row}))
    doc = tmp_path / "doc.md"
    doc.write_text("# intro\n\n" + "\n".join(fm.markers("0.19.2")) + "\n\n## after\n")
    argv = ["--from-json", str(results), "--out", str(doc)]
    assert fm.main(argv + ["--base", "0.19.2"]) == 0
    assert fm.main(argv + ["--base", "main-d98e8a6"]) == 0
    first = doc.read_text()
    assert first.startswith("# intro\n") and "\n## after\n" in first
    for base in ("0.19.2", "main-d98e8a6"):
        begin, end = fm.markers(base)
        assert first.count(begin) == 1 and first.count(end) == 1
        block = first[first.index(begin) : first.index(end)]
        assert "| base |" in block and "### hybridep" in block
    assert first.index(fm.markers("0.19.2")[1]) < first.index("## after")
    assert fm.main(argv + ["--base", "0.19.2"]) == 0
    assert doc.read_text() == first
