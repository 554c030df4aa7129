"""`moe_release.py verify`: an installed megatron-core against the series it was built from,
and what the install releases."""

import json

from moe_release.commands.verify import verify_installed
from moe_release.series.pins import load_pins
from moe_release.series.source import read_base_files
from moe_release.series.trees import MANIFEST_PATH, materialize


def test_verify_detects_replaced_files(tmp_path, repo):
    site = tmp_path / "site"
    tree = materialize(site, root=repo)
    core = site / "megatron" / "core"
    assert verify_installed(core, tree.version, tree) == []
    assert verify_installed(core, "0.19.2", tree) == [
        f"installed distribution is megatron-core 0.19.2, expected {tree.version}"
    ]
    dispatcher = core / "transformer/moe/token_dispatcher.py"
    dispatcher.write_text(dispatcher.read_text() + "# changed\n")
    assert verify_installed(core, tree.version, tree) == [
        "megatron/core/transformer/moe/token_dispatcher.py: differs from the series"
    ]


def test_verify_says_what_the_install_releases(tmp_path, repo):
    """verify's last line: what the installed megatron-core releases, of the backends and paths
    it has (probes.releases_line), and what it leaves unreleased: none for the series; the
    base's fused_a2a.py put back leaves every communication buffer unreleased."""
    from moe_release.series.probes import installed_releases

    site = tmp_path / "site"
    materialize(site, root=repo)
    core = site / "megatron" / "core"
    line = installed_releases(core)
    assert line.startswith("releases the flex dispatcher's state") and "NCCL EP's context" in line
    assert line.endswith("leaves unreleased: none")
    fused = "megatron/core/transformer/moe/fused_a2a.py"
    (site / fused).write_bytes(read_base_files(load_pins().get(None))[fused])
    left = installed_releases(core).split("leaves unreleased: ")[1].split("; ")
    assert [item.split(":")[0] for item in left] == [
        "HybridEP's buffers", "DeepEP's buffers", "NCCL EP's context"
    ]  # fmt: skip


def test_verify_reads_the_base_from_the_installed_manifest(tmp_path, repo):
    """After `MOE_RELEASE_BASE=0.17.0 pip install .`, a plain verify checks the install against
    0.17.0's series, read from the manifest the wheel carries (not the primary's)."""
    from moe_release.commands.verify import _installed_pin

    site = tmp_path / "site"
    tree = materialize(site, "0.17.0", root=repo)
    manifest = json.loads((site / MANIFEST_PATH).read_text())
    assert _installed_pin(manifest) == "0.17.0"
    assert verify_installed(site / "megatron" / "core", tree.version, tree) == []
    assert _installed_pin(None) is None and _installed_pin({"base": {"sha256": "0" * 64}}) is None
