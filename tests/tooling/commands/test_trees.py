"""`moe_release.py trees`: the base and patched trees the tests and the report use, made once
per label, stale ones removed."""

from moe_release.series.trees import MANIFEST_PATH, PACKAGE_INFO, ensure_trees, load_tree


def test_trees_are_made_once_per_label_and_stale_ones_removed(repo):
    stale = repo / ".build" / "trees" / "0.19.2+moerelease.0.stale"
    stale.mkdir(parents=True)
    other_base = repo / ".build" / "trees" / "0.18.2+moerelease.3.other"
    other_base.mkdir(parents=True)
    base, patched = ensure_trees(root=repo)
    assert not stale.exists()
    # Another base's trees are not this base's stale ones.
    assert other_base.exists()
    assert base.name == "base-" + load_tree(series=False, root=repo).version
    assert patched.name == load_tree(root=repo).version
    assert (patched / MANIFEST_PATH).exists() and (base / MANIFEST_PATH).exists()
    info = patched / PACKAGE_INFO
    before = info.stat().st_mtime_ns
    assert ensure_trees(root=repo) == (base, patched)
    assert info.stat().st_mtime_ns == before
    # The base tree carries the new modules but none of the series.
    dispatcher = "megatron/core/transformer/moe/token_dispatcher.py"
    assert (base / dispatcher).read_bytes() != (patched / dispatcher).read_bytes()
