"""The release code is one implementation on every branch (drift.py).

Every function, method and class attribute the primary series adds to megatron-core must be
the same code (AST with docstrings) at the end of every backport series and upstream variant,
unless the patch it belongs to names it for that series, with the reason, in its not-carried
table (``[[patch.<name>.not-carried]]`` in patches/topics.toml).
"""

import pytest

from moe_release import settings
from moe_release.common import UserError
from moe_release.series import drift
from moe_release.series.pins import load_pins
from moe_release.series.repo import read_series
from moe_release.series.source import read_base_files
from moe_release.series.topics import load_topics

TD = "megatron/core/transformer/moe/token_dispatcher.py"

BASE_TD = b'''
class _DispatchManager:
    def setup_metadata(self):
        pass
'''

PATCHED_TD = b'''
class _DispatchManager:
    # a comment the branch may word differently
    _TRANSIENT_FORWARD_ATTRS = ("token_probs", "handle")

    def reset_transient_forward_state(self) -> None:
        """Release the per-forward state."""
        for attr in self._TRANSIENT_FORWARD_ATTRS:
            setattr(self, attr, None)

    def setup_metadata(self):
        pass
'''


def test_release_code_is_what_the_primary_adds():
    release = drift.release_code({TD: BASE_TD}, {TD: PATCHED_TD})
    assert sorted(release) == [
        f"{TD}::_DispatchManager._TRANSIENT_FORWARD_ATTRS",
        f"{TD}::_DispatchManager.reset_transient_forward_state",
    ]


def test_drift_is_reported_and_comments_are_not():
    release = drift.release_code({TD: BASE_TD}, {TD: PATCHED_TD})
    same = PATCHED_TD.replace(b"a comment the branch may word differently", b"other words")
    assert drift.drift(release, {TD: BASE_TD}, {TD: same}, "patches/backports/x") == []
    other = PATCHED_TD.replace(b'"handle")', b'"handle", "routing_map")')
    assert drift.drift(release, {TD: BASE_TD}, {TD: other}, "patches/backports/x") == [
        f"patches/backports/x: {TD}::_DispatchManager._TRANSIENT_FORWARD_ATTRS differs from "
        "the primary series' code"
    ]
    doc = PATCHED_TD.replace(b"Release the per-forward state.", b"Used by one path only.")
    (line,) = drift.drift(release, {TD: BASE_TD}, {TD: doc}, "patches/backports/x")
    assert "reset_transient_forward_state differs" in line
    assert drift.drift(release, {TD: BASE_TD}, {}, "patches/backports/x") == [
        f"patches/backports/x: {TD}::_DispatchManager._TRANSIENT_FORWARD_ATTRS is missing (the "
        "primary series adds it)",
        f"patches/backports/x: {TD}::_DispatchManager.reset_transient_forward_state is missing "
        "(the primary series adds it)",
    ]


def test_a_moved_module_is_found_by_name():
    """dev keeps TransformerLayerNode in another module: the definition is matched by name."""
    release = drift.release_code({TD: BASE_TD}, {TD: PATCHED_TD})
    moved = "megatron/core/transformer/moe/other.py"
    assert drift.drift(release, {}, {moved: PATCHED_TD}, "patches/upstream/dev") == []


def test_every_series_ends_with_the_primary_release_code():
    """Against the real pinned bases: every backport series, and main/dev where a Megatron-LM
    checkout is configured ($MOE_RELEASE_MEGATRON_LM)."""
    try:
        compared, problems = drift.compare_all()
    except UserError as exc:  # a base that cannot be read is a failure, not a skip
        pytest.fail(str(exc))
    assert {"0.18.2", "0.18.0", "0.17.1", "0.17.0", "0.16.1"} <= set(compared), compared
    if settings.megatron_lm():
        assert {"main-d98e8a6", "dev-d48bd6b"} <= set(compared), compared
    assert problems == [], "\n".join(problems)


def test_each_not_carried_definition_is_one_its_patch_changes():
    """A not-carried entry sits with the patch whose code it is: every definition a patch's
    table names is one that patch adds or changes in the primary series."""
    pins = load_pins()
    primary = pins.get(None)
    files = read_base_files(primary)
    series = read_series(primary)
    touched = drift.apply_series(files, series)
    changes: dict[str, set] = {}
    for i, (name, _) in enumerate(series):
        base = {p: files.get(p) for p in touched}
        after = drift.python_defs({**base, **drift.apply_series(files, series[: i + 1])})
        prev = drift.python_defs({**base, **drift.apply_series(files, series[:i])})
        for key in set(after) | set(prev):
            if after.get(key) != prev.get(key):
                changes.setdefault(key, set()).add(name)
    entries = load_topics().not_carried
    assert entries
    for (sdir, key), (patch, _) in entries.items():
        assert patch in changes.get(key, set()), (sdir, key, patch, changes.get(key))


def test_a_series_without_its_not_carried_entries_drifts(monkeypatch):
    """The tables are what lets a branch leave code out: without core_r0.16.0's entries, its
    series is reported for the NCCL EP release it does not carry."""
    kept = {k: v for k, v in drift.not_carried().items() if "core_r0.16.0" not in k[0]}
    monkeypatch.setattr(drift, "not_carried", lambda root=None: kept)
    _, problems = drift.compare_all()
    assert problems and all(p.startswith("patches/backports/core_r0.16.0: ") for p in problems)
    assert any("nccl_ep_release_context is missing" in p for p in problems), problems
