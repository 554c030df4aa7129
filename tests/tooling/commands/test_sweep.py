"""`moe_release.py sweep`: apply --dry-run on every first-parent commit of main and dev, each
row checked against apply, on the synthetic Megatron-shaped repository
(tests/helpers/megatron_repo.py) and on the real mirror where it is at hand."""

from pathlib import Path

import pytest

from moe_release import settings
from moe_release.commands import cli
from moe_release.commands.apply import open_checkout, run_apply
from moe_release.commands.sweep import SETTLED, summary_lines, sweep
from moe_release.series.source import CHECKOUT_ENV
from tests.helpers.megatron_repo import P_RELEASE, TD, sweep_codes


def test_sweep_agrees_with_apply_on_every_commit(mlm):
    """Each first-parent commit of main and dev since February: the series and the verdicts
    the sweep reports are apply --dry-run's at that commit; c1 and dev's d0 conflict (main
    changed the line above the release hunk since), grouped under that hunk."""
    m, c, repo = mlm
    rows, facts = sweep(open_checkout(m), root=repo)
    main = [c[k] for k in (1, 2, 3, 4, "B", 5, 6)]
    assert [r.commit for r in rows if r.line == "main"] == main
    assert [r.commit for r in rows if r.line == "dev"] == [c[1], c["d0"], c["d1"], c["D"]]
    for r in rows:
        _, result, _ = run_apply(m, r.commit, dry_run=True, root=repo)
        assert (r.series, r.codes) == (result.choice.base.name, sweep_codes(result)), r
    bad = {r.commit: r for r in rows if not r.whole}
    assert set(bad) == {c[1], c["d0"]}
    assert bad[c[1]].conflict.startswith(f"{P_RELEASE}: {TD} (@@ ")
    text = "\n".join(summary_lines(rows, facts))
    assert "main: 7 commits (2026-03-02 .. 2026-07-10): 6 (85.7%) take the whole series" in text
    assert f"1 x {P_RELEASE}: {TD}" in text
    assert facts["merges"] <= len(rows)


def test_sweep_command(mlm, capsys, tmp_path, monkeypatch):
    """The command: a row per commit, the summary, --write's page; exit 1 while a commit
    conflicts; bad input is one line and exit 2, nothing written."""
    m, c, repo = mlm
    monkeypatch.setattr("moe_release.commands.sweep.REPO_ROOT", repo)
    page = tmp_path / "sweep.md"
    assert cli.main(["sweep", str(m), "--write", str(page)]) == 1
    out = capsys.readouterr().out
    assert f"main 2026-03-02 {c[1][:12]} main-{c['B'][:7]}" in out
    assert "main: 7 commits" in out and "dev: 4 commits" in out
    assert page.read_text().startswith("# `apply` on every first-parent commit of main and dev")
    assert f"| 2026-03-02 | `{c[1][:12]}` |" in page.read_text()
    for argv, message in (
        (["sweep", str(tmp_path / "nothing")], "not a git checkout"),
        (["sweep", str(m), "--since", "March"], "--since March: not a date"),
        (["sweep", str(m), "--every", "0"], "--every 0: must be 1 or more"),
    ):
        out_page = tmp_path / "not-written.md"
        assert cli.main([*argv, "--write", str(out_page)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("moe_release.py sweep: error:") and message in err, err
        assert len(err.splitlines()) == 1 and not out_page.exists()


@pytest.mark.needs_env(CHECKOUT_ENV)
def test_on_the_mirror_the_sweep_is_applys_verdict():
    """On the real mirror, main 2026-07-22 .. 07-24 (81770cb015ea, where the release patch's
    new method sits beside 0.19.2 code the commit lacks: settled), NeMo-RL's pin 14346b65
    (the import block of fused_a2a.py) and 2d7060f44fc9 (NCCL EP landed; the nearest series,
    0.18.0, conflicts and 0.19.2's is taken): every commit whole, each row apply's own
    verdict."""
    mirror = Path(settings.megatron_lm())
    co = open_checkout(mirror)
    rows, _ = sweep(co, ("main",), "2026-07-22", "2026-07-24")
    rows += [r for r in sweep(co, ("main",), "2026-08-12", "2026-08-12")[0]
             if r.commit.startswith("14346b65")]  # fmt: skip
    # Where the nearest series conflicts: a farther one, whole (NCCL EP's window on main).
    rows += [r for r in sweep(co, ("main",), "2026-07-08", "2026-07-08")[0]
             if r.commit.startswith("2d7060f44fc9")]  # fmt: skip
    assert any(r.commit.startswith("81770cb015ea") and SETTLED in r.codes for r in rows)
    assert any(r.commit.startswith("14346b65") for r in rows)
    assert [r.series for r in rows if r.farther] == ["0.19.2"]
    for r in rows:
        _, result, _ = run_apply(mirror, r.commit, dry_run=True)
        assert (r.series, r.codes) == (result.choice.base.name, sweep_codes(result)), r
        assert r.whole, r
