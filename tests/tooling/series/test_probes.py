"""The probes (what a merged series must leave in REF's files) and ``merge_right``, which takes
a probe's patch from another series where the chosen one merges cleanly but wrong.

The probes are worked on small hand-written files, then checked against every stored series
on its own base: each series' result passes every probe, and each base fails the probes whose
fix its series carries (so a probe that could not fail is caught). ``merge_right`` is run on the
0.17.0 base taken as REF for the 0.16.1 series (the release of ``layer_state.dispatched_probs``
gone, as on main after #3164): the series merges cleanly there and leaves the probs held, and
the 0.17.0 series' patch puts the release back."""

from pathlib import Path

import pytest

from moe_release import settings
from moe_release.commands.apply import run_apply
from moe_release.commands.sweep import BORROWED, sweep
from moe_release.common import UserError
from moe_release.series import applying, probes
from moe_release.series.applying import CONFLICT, Records, merge_right, merge_series
from moe_release.series.merge import series_states
from moe_release.series.nearest import open_checkout
from moe_release.series.patches import parse_series
from moe_release.series.pins import load_pins
from moe_release.series.repo import read_series
from moe_release.series.source import CHECKOUT_ENV, read_base_files
from moe_release.series.topics import load_topics
from tests.helpers import REPO_ROOT

PINS = load_pins()
SDIST_BASES = [name for name, b in PINS.bases.items() if not b.is_commit]


def _files(**texts: str) -> dict:
    return {p: None for p in probes.PATHS} | {
        getattr(probes, k): v.encode() for k, v in texts.items()
    }


# ----------------------------------------------------------------------------- hand-worked


def test_triton_imported_directly_fails_and_guarded_passes():
    bare = "import torch\nimport triton\nimport triton.language as tl\n"
    guarded = "import torch\ntry:\n    import triton\nexcept ImportError:\n    triton = None\n"
    msg = probes.triton_guard(_files(PAGED_STASH=bare))
    assert msg == f"{probes.PAGED_STASH}:2 imports triton outside a try"
    assert probes.triton_guard(_files(PAGED_STASH=guarded)) is None
    assert probes.triton_guard(_files()) is None  # no paged stash: nothing to promise


def test_triton_imported_through_the_ops_module_fails():
    stash = "import torch\nfrom megatron.core.transformer.moe.ops.paged_stash import K\n"
    ops = "import triton\nimport triton.language as tl\nK = 1\n"
    msg = probes.triton_guard(_files(PAGED_STASH=stash, OPS_PAGED_STASH=ops))
    assert msg == (
        f"{probes.PAGED_STASH}:2 imports megatron.core.transformer.moe.ops."
        f"paged_stash outside a try, and {probes.OPS_PAGED_STASH} imports triton"
    )
    guarded = "import torch\ntry:\n    from megatron.core.transformer.moe.ops.paged_stash " \
              "import K\nexcept ImportError:\n    K = None\n"  # fmt: skip
    assert probes.triton_guard(_files(PAGED_STASH=guarded, OPS_PAGED_STASH=ops)) is None
    # an ops module that needs no Triton at import is no reason to guard
    assert probes.triton_guard(_files(PAGED_STASH=stash, OPS_PAGED_STASH="K = 1\n")) is None


def test_te_general_gemm_bound_only_by_the_te_import_fails():
    only_te = ("try:\n    from megatron.core.extensions.transformer_engine import "
               "te_general_gemm\nexcept ImportError:\n    pass\n\n\ndef f():\n"
               "    return te_general_gemm()\n")  # fmt: skip
    both = only_te.replace("    pass\n", "    te_general_gemm = None\n")
    assert probes.te_general_gemm_bound(_files(MOE_UTILS=only_te)) == (
        f"{probes.MOE_UTILS} binds te_general_gemm only where Transformer Engine imports"
    )
    assert probes.te_general_gemm_bound(_files(MOE_UTILS=both)) is None
    unused = only_te.replace("    return te_general_gemm()\n", "    return 1\n")
    assert probes.te_general_gemm_bound(_files(MOE_UTILS=unused)) is None


def test_layer_state_stored_and_never_dropped_fails():
    held = ("def f(node, p, t):\n    node.layer_state.dispatched_probs = node.detach(p)\n"
            "    node.layer_state.tokens_per_expert = t\n"
            "    node.layer_state.residual = p\n")  # fmt: skip
    msg = probes.layer_state_released(_files(CALLABLES=held))
    assert msg == (
        f"{probes.CALLABLES} stores layer_state.dispatched_probs (line 2), "
        "tokens_per_expert (line 3) and never drops it"
    )  # residual: not ours
    dropped = held + ("    node.layer_state.dispatched_probs = None\n"
                      "    node.layer_state.tokens_per_expert = None\n")  # fmt: skip
    assert probes.layer_state_released(_files(CALLABLES=dropped)) is None


def test_a_replaced_elastic_buffer_must_be_kept_and_destroyed_explicitly():
    upstream = ("def get_elastic_buffer(group):\n    global _elastic_buffer\n"
                "    if _elastic_buffer is None or grow:\n"
                "        _elastic_buffer = ElasticBuffer(group, num_bytes=n)\n"
                "    return _elastic_buffer\n")  # fmt: skip
    assert probes.elastic_buffer_kept(_files(FUSED_A2A=upstream)) == (
        f"{probes.FUSED_A2A}:4 builds ElasticBuffer without explicitly_destroy=True (destroyed "
        "from a finalizer)")  # fmt: skip
    explicit = upstream.replace("num_bytes=n)", "num_bytes=n, explicitly_destroy=True)")
    assert probes.elastic_buffer_kept(_files(FUSED_A2A=explicit)) == (
        f"{probes.FUSED_A2A}:4 rebinds _elastic_buffer and drops the buffer it replaces, which a "
        "pending backward may still use")  # fmt: skip
    kept = explicit.replace("        _elastic_buffer = ElasticBuffer",
                            "        _replaced.append(_elastic_buffer)\n"
                            "        _elastic_buffer = ElasticBuffer")  # fmt: skip
    assert probes.elastic_buffer_kept(_files(FUSED_A2A=kept)) is None
    assert probes.elastic_buffer_kept(_files(FUSED_A2A="_buffer = None\n")) is None  # no v2


def test_a_file_that_does_not_parse_is_left_to_the_merge():
    assert probes.failures(_files(CALLABLES="<<<<<<< REF\nx = (\n")) == []


def test_a_dispatcher_that_never_resets_after_combine_fails():
    cls = "class MoEAlltoAllTokenDispatcher(MoETokenDispatcher):\n"
    reset = "    def reset_transient_forward_state(self):\n        self.probs = None\n"
    called = "    def token_unpermutation(self, x):\n" \
             "        self._maybe_reset_transient_forward_state()\n        return x\n"  # fmt: skip
    only_reset = _files(TOKEN_DISPATCHER=cls + reset)  # a reset nothing calls after combine
    assert [(p.name, m) for p, m in probes.failures(only_reset)] == [
        ("alltoall", f"{probes.TOKEN_DISPATCHER}:1 MoEAlltoAllTokenDispatcher never calls "
                     "_maybe_reset_transient_forward_state() after combine")
    ]  # fmt: skip
    assert probes.failures(_files(TOKEN_DISPATCHER=cls + reset + called)) == []
    assert probes.failures(_files(TOKEN_DISPATCHER="class Other:\n    pass\n")) == []


def test_a_schedule_node_that_keeps_before_detached_fails():
    node = ("class TransformerLayerNode(ScheduleNode):\n    def detach(self, t):\n"
            "        self.before_detached = self.before_detached + (t,)\n")  # fmt: skip
    release = "    def _release_state(self):\n        self.before_detached = tuple()\n"
    for where in ("CALLABLES", "COMMON_UTILS"):  # before and after #4798 moved the node
        kept = probes.failures(_files(**{where: node}))
        assert [p.name for p, _ in kept] == ["schedule-node"]
        assert "TransformerLayerNode keeps before_detached after its backward" in kept[0][1]
        assert probes.failures(_files(**{where: node + release})) == []


def test_nccl_ep_without_its_release_fails():
    boot = "def ensure_nccl_ep_bootstrapped(group):\n    pass\n"
    release = ("def reset_fused_a2a_buffers(*, collective=False, group=None):\n"
               "    nccl_ep_release_context()\n")  # fmt: skip
    defined = "def nccl_ep_release_context():\n    pass\n"
    left = probes.failures(_files(FUSED_A2A=boot + release))  # called, never defined
    assert [p.name for p, _ in left] == ["nccl-ep"]
    assert left[0][0].patch == "ncclep-context.patch"
    assert probes.failures(_files(FUSED_A2A=boot + release, TOKEN_DISPATCHER=defined)) == []
    old_release = "def reset_fused_a2a_buffers():\n    pass\n"  # no explicit release at all
    assert {p.name for p, _ in probes.failures(_files(FUSED_A2A=boot + old_release))} == {"nccl-ep"}
    done, left = probes.releases(_files(FUSED_A2A=boot + release, TOKEN_DISPATCHER=defined))
    assert (done, left) == (["NCCL EP's context"], [])
    assert probes.releases_line(_files(FUSED_A2A=boot + old_release)) == (
        "releases nothing; leaves unreleased: NCCL EP's context: "
        f"{probes.FUSED_A2A} bootstraps NCCL EP and the release never runs "
        "nccl_ep_release_context()"
    )
    nothing = "has none of the backends and paths the series releases"
    assert probes.releases_line(_files()) == nothing


# ----------------------------------------------------------------------------- stored series


def _result(name: str) -> tuple[dict, dict]:
    """The base's files and the series' result on them (the probes' paths)."""
    base = PINS.get(name)
    files = read_base_files(base)
    done = dict(files)
    for _, _, after in series_states(files, read_series(base)):
        done.update(after)
    pick = lambda fs: {p: fs.get(p) for p in probes.PATHS}  # noqa: E731
    return pick(files), pick(done)


# What each base lacks that its series fixes (read off the release tests that fail unpatched:
# test_cpu_guards and the A2A-overlap retention tests), besides the releases every base lacks.
RELEASES = {"flex", "alltoall", "allgather", "schedule-node", "chunk-state", "hybridep", "deepep"}
BASE_FAILS = {
    "0.16.1": RELEASES | {"te_general_gemm"},
    "0.17.0": RELEASES | {"layer-state"},
    "0.17.1": RELEASES | {"layer-state"},
    "0.18.0": RELEASES | {"triton", "layer-state"},
    "0.18.2": RELEASES | {"triton", "layer-state"},
    "0.19.2": RELEASES | {"triton", "layer-state", "nccl-ep"},
}


def test_each_probe_is_kept_by_one_patch_of_its_topic():
    """patches/topics.toml names, per patch, the probes whose promise it keeps: every probe is
    listed by exactly one patch of the series, of the probe's topic, and no patch lists a probe
    that does not exist (a renamed probe or patch fails here, not in apply)."""
    topics = load_topics()
    series = parse_series((REPO_ROOT / "patches" / "series").read_text())
    assert sorted(topics.probes) == sorted(p.id for p in probes.PROBES)
    for probe in probes.PROBES:
        assert probe.patch in series, probe.id
        assert topics.of_patch[probe.patch] == probe.topic, probe.id


def test_a_probe_listed_twice_is_one_line_naming_both(tmp_path):
    (tmp_path / "patches").mkdir()
    text = (REPO_ROOT / "patches" / "topics.toml").read_text()
    (tmp_path / "patches" / "topics.toml").write_text(
        text.replace('probes = ["dispatcher-state/alltoall"]', 'probes = ["dispatcher-state/flex"]')
    )
    twice = r"probes: 'dispatcher-state/flex' is also flex-dispatcher-state.patch's"
    with pytest.raises(UserError, match=r"patch.alltoall-dispatcher-state." + twice):
        load_topics(tmp_path)


@pytest.mark.parametrize("name", SDIST_BASES)
def test_every_stored_series_passes_and_its_base_fails(name):
    base, result = _result(name)
    assert probes.failures(result) == []
    assert {p.name for p, _ in probes.failures(base)} == BASE_FAILS[name]
    done, left = probes.releases(result)
    assert left == [] and "the flex dispatcher's state" in done
    assert ("NCCL EP's context" in done) == (name == "0.19.2")  # NCCL EP from 0.19
    # A base releases none of them, but 0.16.1 its layer state (main dropped that in #3164).
    assert probes.releases(base)[0] == (
        ["the A2A overlap's layer state"] if name == "0.16.1" else []
    )


def _ref_017_with_016_series():
    """REF: the 0.17.0 base, whose fine_grained_callables.py no longer releases
    `layer_state.dispatched_probs` (main dropped the line in #3164, after core_r0.16.0 left),
    with the 0.16.1 series, which carries no layer-state patch (its base releases the probs)."""
    files17 = read_base_files(PINS.get("0.17.0"))
    s16 = series_states(read_base_files(PINS.get("0.16.1")), read_series(PINS.get("0.16.1")))
    at_ref = {p: files17.get(p) for p in probes.PATHS}
    paths = {fp.path for p, _, _ in s16 for fp in p.files}
    ref = {**{p: files17.get(p) for p in paths}, **at_ref}
    return s16, ref, at_ref


def test_merge_right_borrows_the_layer_state_patch_where_the_release_is_gone():
    """The 0.16.1 series merges cleanly on it and fails the probe; merge_right takes 0.17.0's
    patch, puts it in the primary series' place, and the probe passes."""
    s16, ref, at_ref = _ref_017_with_016_series()
    line = b"        node.layer_state.dispatched_probs = None\n"
    assert at_ref[probes.CALLABLES].count(line) == 0

    def merge(states):
        return merge_series(states, ref, Records(), probe_files=at_ref)

    plain = merge(s16)
    assert all(not s.outcome.conflicts for s in plain)  # a clean merge, every patch
    failed = [s.outcome for s in plain if s.outcome.probe]
    assert [o.verdict for o in failed] == [CONFLICT]
    assert failed[0].probe_patch == "overlap-layer-state.patch"
    assert "dispatched_probs" in failed[0].probe and "merged cleanly" in failed[0].note

    b17 = PINS.get("0.17.0")
    s17 = series_states(read_base_files(b17), read_series(b17))
    states, steps = merge_right(s16, [("0.17.0", s17)], merge, list(load_topics().of_patch))
    assert all(s.outcome.verdict != CONFLICT for s in steps)
    borrowed = [s.outcome for s in steps if s.outcome.borrowed]
    assert [(o.patch, o.borrowed) for o in borrowed] == [("overlap-layer-state.patch", "0.17.0")]
    assert "from the 0.17.0 series; without it, a2a-overlap/layer-state" in borrowed[0].note
    # In the primary order: after "drop a schedule node's detached tensors", before the chunk.
    names = [p.name for p, _, _ in states]
    i = names.index(borrowed[0].patch)
    assert "overlap-node-detached" in names[i - 1] and "chunk-state" in names[i + 1]
    final = dict(at_ref)
    for s in steps:
        final.update(s.changed)
    assert final[probes.CALLABLES].count(line) == 1 and probes.failures(final) == []


def test_merge_right_gives_up_where_no_series_has_a_right_patch():
    s16, ref, at_ref = _ref_017_with_016_series()
    states, steps = merge_right(
        s16, [("0.16.1", s16)],
        lambda st: merge_series(st, ref, Records(), probe_files=at_ref),
        list(load_topics().of_patch),
    )  # fmt: skip
    assert states is s16 and any(s.outcome.probe for s in steps)


def test_first_whole_takes_a_farther_series_only_whole_and_carrying_every_patch():
    """REF: the 0.19.2 base (NCCL EP). The 0.18.0 series conflicts there and has no NCCL EP
    release; 0.18.2's conflicts too; 0.16.1's would leave out the layer-state patch 0.18.0
    carries; 0.19.2's own series is whole and releases every backend and path REF has."""
    f19 = read_base_files(PINS.get("0.19.2"))
    states = {n: series_states(read_base_files(PINS.get(n)), read_series(PINS.get(n)))
              for n in ("0.18.0", "0.18.2", "0.16.1", "0.19.2")}  # fmt: skip
    paths = {fp.path for st in states.values() for p, _, _ in st for fp in p.files}
    at_ref = {p: f19.get(p) for p in paths | set(probes.PATHS)}
    tried = []

    def merge(name):
        def run():
            tried.append(name)
            return states[name], merge_series(states[name], at_ref, Records(), probe_files=at_ref)

        return name, run

    nearest = merge("0.18.0")[1]()[1]
    assert any(s.outcome.verdict == CONFLICT for s in nearest)
    assert not applying.carries_all(states["0.16.1"], states["0.18.0"])
    farther = ("0.18.2", "0.16.1", "0.19.2")
    got = applying.first_whole(states["0.18.0"], [merge(n) for n in farther])
    assert got is not None and got[0] == "0.19.2" and tried == ["0.18.0", *farther]
    final = dict(at_ref)
    for step in got[2]:
        final.update(step.changed)
    assert probes.releases(final)[1] == [] and "NCCL EP's context" in probes.releases(final)[0]
    # None whole and carrying every patch: the nearest stays, for a person.
    assert applying.first_whole(states["0.18.0"], [merge("0.18.2"), merge("0.16.1")]) is None


# ----------------------------------------------------------------------------- on the mirror


# The three commits whose clean merge failed a release test patched (run-tests --checkout),
# the probe each fails with the nearest series alone, and the series its patch now comes from.
WRONG_BUT_CLEAN = {
    "4beb8caae7ee": ("0.16.1", ["layer-state"], ["0.17.0"]),
    "55638bc44339": ("0.18.0", ["triton"], ["dev-d48bd6b"]),
    "f47ad9143e18": ("0.17.0", ["te_general_gemm"], ["0.16.1"]),
    # dev 2026-07-20 has DeepEP v2, which the 0.18.0 series does not know; and the moved stash.
    "c8239f9a503a": ("0.18.0", ["triton", "deepep-v2"], ["dev-d48bd6b", "dev-d48bd6b"]),
}


PROBE_TOPIC = {p.name: p.topic for p in probes.PROBES}


@pytest.mark.needs_env(CHECKOUT_ENV)
@pytest.mark.parametrize("commit", sorted(WRONG_BUT_CLEAN))
def test_on_the_mirror_a_clean_wrong_merge_takes_a_patch_from_another_series(commit):
    series, probes_failed, lenders = WRONG_BUT_CLEAN[commit]
    mirror = Path(settings.megatron_lm())
    _, result, _ = run_apply(mirror, commit, dry_run=True)
    assert result.ok and result.choice.base.name == series
    lent = [o for o in result.outcomes if o.borrowed]
    assert [o.borrowed for o in lent] == lenders
    for o, probe in zip(lent, probes_failed):
        assert f"without it, {PROBE_TOPIC[probe]}/{probe}: " in o.note  # the nearest alone
    rows, _ = sweep(open_checkout(mirror), ("main", "dev"), *[result_date(mirror, commit)] * 2)
    row = next(r for r in rows if r.commit.startswith(commit))
    assert row.series == series and BORROWED in row.codes and row.whole


@pytest.mark.needs_env(CHECKOUT_ENV)
def test_on_the_mirror_the_nccl_ep_window_takes_a_series_that_releases_it():
    """main 2026-07-08 .. 07-15: NCCL EP landed (#5129), the nearest series (0.18.0) has no
    release for it and conflicts; apply takes 0.19.2's, whole, with the schedule node's release
    from 0.18.0 (the node is still in fine_grained_callables.py there), and says so."""
    mirror = Path(settings.megatron_lm())
    _, result, _ = run_apply(mirror, "1aa880d0ea1d", dry_run=True)
    assert result.ok and result.choice.base.name == "0.19.2"
    assert "the nearest, 0.18.0, conflicts in" in result.choice.why
    assert [(o.borrowed, o.patch) for o in result.outcomes if o.borrowed] == [
        ("0.18.0", "overlap-node-detached.patch")
    ]
    assert result.releases.endswith("NCCL EP's context; leaves unreleased: none")


def result_date(mirror: Path, commit: str) -> str:
    return open_checkout(mirror).date(commit).isoformat()
