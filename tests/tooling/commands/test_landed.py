"""`moe_release.py landed`: which patches of the series a newer checkout already contains."""

from pathlib import Path

import pytest

from moe_release.commands import cli
from moe_release.commands.landed import landed_states
from moe_release.common import UserError
from moe_release.series.patches import parse_patch
from moe_release.series.repo import read_series
from moe_release.series.trees import build_tree


def _checkout(tmp_path: Path, base, base_files, patches) -> Path:
    """A checkout holding the series' files as they are after ``patches``."""
    tree = build_tree(base, base_files, patches, [], stamp=False)
    root = tmp_path / "checkout"
    paths = {fp.path for name, data in read_series(base) for fp in parse_patch(data, name).files}
    for rel in paths:
        if rel in tree.files:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(tree.files[rel])
    (root / "megatron" / "core").mkdir(parents=True, exist_ok=True)
    return root


def _verdicts(root: Path, base) -> list[str]:
    patches = [parse_patch(data, name) for name, data in read_series(base)]
    return [s.verdict for s in landed_states(root, patches)]


@pytest.mark.parametrize("landed", [0, 4, None], ids=["none", "first-four", "all"])
def test_landed_prefix_is_reported(tmp_path, base, base_files, landed):
    series = read_series(base)
    n = len(series) if landed is None else landed
    root = _checkout(tmp_path, base, base_files, series[:n])
    verdicts = _verdicts(root, base)
    assert verdicts == ["landed"] * n + ["not landed (applies)"] * (len(series) - n)


def test_landed_when_a_later_patch_rewrote_earlier_lines(tmp_path, base, base_files):
    """Patch 5 rewrites lines patches 2-4 added; on the fully patched tree all still count as
    landed (landed patches are peeled from the end first)."""
    series = read_series(base)
    root = _checkout(tmp_path, base, base_files, series)
    assert set(_verdicts(root, base)) == {"landed"}


def test_changed_context_is_a_conflict(tmp_path, base, base_files):
    series = read_series(base)
    root = _checkout(tmp_path, base, base_files, [])
    target = root / "megatron/core/parallel_state.py"
    text = target.read_text()
    assert '    """Set the groups to none."""\n' in text
    target.write_text(text.replace('    """Set the groups to none."""\n', '    """Reworded."""\n'))
    names = [name for name, _ in series]
    verdicts = dict(zip(names, _verdicts(root, base)))
    touched = [
        name
        for name, data in series
        if any(fp.path.endswith("parallel_state.py") for fp in parse_patch(data, name).files)
    ]
    assert touched and all(verdicts[n] == "conflicts" for n in touched)
    # A later patch that builds on a conflicting one's lines (the DeepEP destroy patch on the
    # teardown patch's reset) cannot apply either; every other patch still does.
    files = {name: {fp.path for fp in parse_patch(data, name).files} for name, data in series}
    order = [name for name, _ in series]
    dependent = {
        n
        for n in names
        if n not in touched
        and any(order.index(t) < order.index(n) and files[t] & files[n] for t in touched)
    }
    assert all(verdicts[n] in ("conflicts", "not landed (applies)") for n in dependent)
    assert all(
        v == "not landed (applies)"
        for n, v in verdicts.items()
        if n not in touched and n not in dependent
    )


def test_not_a_checkout(tmp_path, capsys):
    with pytest.raises(UserError, match="not a checkout"):
        landed_states(tmp_path, [])
    assert cli.main(["landed", str(tmp_path)]) == 2
    assert "not a checkout (no megatron/core in it)" in capsys.readouterr().err


def test_landed_for_an_upstream_target(tmp_path, base, base_files, capsys):
    """--target checks the series `upstream TARGET` exports (core_r0.19.0: the primary one)."""
    root = _checkout(tmp_path, base, base_files, read_series(base))
    assert cli.main(["landed", "--target", "core_r0.19.0", str(root)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("upstream core_r0.19.0 series against")
    assert f"{len(read_series(base))} of {len(read_series(base))} landed" in out
