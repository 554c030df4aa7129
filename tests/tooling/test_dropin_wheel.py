"""The drop-in wheel: `pip install .` replaces upstream megatron-core 0.19.2 in a real venv.

The venv is a hard-linked copy of the one running the tests (it already holds torch), so no
multi-GB install is repeated; pip only ever replaces files in the copy, never writes into them.
"""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from moe_release.series.pins import load_pins
from moe_release.series.trees import load_tree
from tests.helpers import REPO_ROOT

pytestmark = pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs to run in a venv")


def pip(python: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True, text=True, cwd="/",
    )  # fmt: skip


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    """A copy of the test venv without any megatron-core, holding upstream 0.19.2 instead."""
    dest = tmp_path / "venv"
    subprocess.run(["cp", "-al", sys.prefix, str(dest)], check=True)
    python = dest / "bin" / "python"
    pip(python, "uninstall", "--yes", "megatron-core")
    ok(pip(python, "install", "--no-deps", "--only-binary", ":all:", "megatron-core==0.19.2"))
    return python


def test_pip_install_replaces_upstream_and_verify_tells_them_apart(venv):
    version = load_tree().version
    ok(pip(venv, "install", str(REPO_ROOT)))
    installed = json.loads(ok(pip(venv, "list", "--format=json")))
    listed = [p for p in installed if p["name"] == "megatron-core"]
    assert listed == [{"name": "megatron-core", "version": version}]
    ok(pip(venv, "check"))
    show = ok(pip(venv, "show", "megatron-core"))
    assert f"Version: {version}\n" in show and show.count("+") == 1
    # Dependents pinning the upstream release accept the overlay.
    for spec in ("megatron-core==0.19.2", "megatron-core>=0.19", "megatron-core~=0.19.0"):
        assert Requirement(spec).specifier.contains(version), spec
    # The imported package reports the label exactly once, also without NO_VCS_VERSION.
    probe = (
        "import warnings; warnings.simplefilter('ignore'); import megatron.core as m; "
        "print(m.__version__); print(m.__file__)"
    )
    out = subprocess.run(
        [str(venv), "-c", probe], capture_output=True, text=True, cwd="/", env={"PATH": "/usr/bin"}
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got_version, got_file = out.stdout.strip().splitlines()[-2:]
    assert got_version == version and got_file.startswith(str(venv.parent.parent))
    # The memory planner's API, imported from the installed package, prices a configuration.
    _installed_planner_prices_seed_000(venv)
    # verify: OK for the overlay ...
    script = str(REPO_ROOT / "scripts" / "moe_release.py")
    result = subprocess.run(
        [sys.executable, script, "verify", "--python", str(venv)], capture_output=True, text=True
    )
    assert result.returncode == 0 and result.stdout.startswith(f"OK: megatron-core {version}")
    # ... and MISMATCH once something like `pip install -U` silently put upstream back.
    ok(pip(venv, "install", "--no-deps", "--force-reinstall", "--only-binary", ":all:",
           "megatron-core==0.19.2"))  # fmt: skip
    result = subprocess.run(
        [sys.executable, script, "verify", "--python", str(venv)], capture_output=True, text=True
    )
    assert result.returncode == 1 and result.stdout.startswith("MISMATCH:")
    assert "installed distribution is megatron-core 0.19.2, expected" in result.stdout
    assert "megatron/core/transformer/moe/paged_stash.py: differs from the series" in result.stdout


# Seed 000's MoE layer as TransformerConfig's fields: H=2048, 256 experts top-8, 8 layers,
# EP2, HybridEP, the MoE layer recomputed, bf16; 105,153 tokens on the rank.
SEED_000 = dict(
    num_layers=8, hidden_size=2048, num_attention_heads=16, num_moe_experts=256,
    moe_router_topk=8, expert_model_parallel_size=2, moe_token_dispatcher_type="flex",
    moe_flex_dispatcher_backend="hybridep", recompute_granularity="selective",
    recompute_modules=["moe"], bf16=True,
)  # fmt: skip
PRICE_SEED_000 = """
import json, sys, warnings
warnings.simplefilter("ignore")
import torch
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.moe.moe_memory_planner import estimate
config = TransformerConfig(**json.loads(sys.argv[1]), params_dtype=torch.bfloat16)
installed, base = estimate(config, 105153), estimate(config, 105153, releases=False)
print(json.dumps(dict(
    file=sys.modules[estimate.__module__].__file__, releases=installed.releases,
    buffer_bytes=installed.buffer_bytes, state=installed.dispatcher_state_bytes,
    terms={t.name: t.nbytes for t in installed.buffers}, base_state=base.dispatcher_state_bytes,
)))
"""


def _installed_planner_prices_seed_000(python: Path) -> None:
    """``estimate`` from the wheel's megatron-core, on a real TransformerConfig: the buffer terms
    worked by hand from deep_ep's source (test_moe_memory_planner.py's seed-000 test), no
    dispatcher state (the installed tree releases it), and, priced as a tree that keeps it,
    the repository's base column for the same configuration."""
    from moe_release.plan.compare import plan
    from moe_release.plan.pricing import planner

    done = subprocess.run(
        [str(python), "-c", PRICE_SEED_000, json.dumps(SEED_000)], capture_output=True, text=True,
        cwd="/", env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["file"].startswith(str(python.parent.parent)), got["file"]
    assert got["releases"] is True and got["state"] == 0
    n = 105216 * 2  # rows: 105,153 tokens rounded up to the 64-token combine chunk, x 2 ranks
    assert got["terms"]["combine tokens (N x H, 16-bit)"] == n * 2048 * 2
    assert got["terms"]["combine probs (N x E_nvl, fp32)"] == n * 256 * 4
    assert got["buffer_bytes"] == 1_144_889_280
    fields = {k: v for k, v in SEED_000.items() if k != "num_attention_heads"}
    report = plan(planner.MoEMemoryConfig(**fields, tokens_per_rank=105153))["totals"]
    assert got["buffer_bytes"] == report["buffers_outside_allocator"]
    assert got["base_state"] == report["retained_between_calls_base"] == 9_079_448_320


def _backport_bases() -> list:
    # The sdist bases (a commit base's wheel: test_source.py, on a synthetic Megatron-LM).
    pins = load_pins()
    return [
        pytest.param(v, marks=[] if i == 0 else [pytest.mark.slow])
        for i, v in enumerate(
            v
            for v, b in pins.bases.items()
            if v != pins.primary and not b.is_commit and (b.series_dir() / "series").exists()
        )
    ]


@pytest.mark.parametrize("version", _backport_bases())
def test_wheel_for_a_backport_base(tmp_path, version):
    """MOE_RELEASE_BASE=<base> builds that base's drop-in wheel: its backport series applied."""
    tree = load_tree(version)
    env = dict(os.environ, MOE_RELEASE_BASE=version)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(tmp_path), str(REPO_ROOT)],
        capture_output=True, text=True, env=env, cwd="/",
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (wheel,) = tmp_path.glob("megatron_core-*.whl")
    assert wheel.name.startswith(f"megatron_core-{tree.version}-")
    # A dependent pinned to the exact release (ART: `megatron-core==0.17.0`) accepts it.
    assert Requirement(f"megatron-core=={version}").specifier.contains(tree.version)
    with zipfile.ZipFile(wheel) as zf:
        # Every file the backport series patched is in the wheel as the series wrote it.
        for rel in tree.touched:
            if rel.startswith("megatron/"):
                assert zf.read(rel) == tree.files[rel], rel
