"""Build the patched megatron-core wheel: the pinned sdist + patches/series + our new modules.

The wheel is named megatron-core and versioned `<base>+moerelease.<n>.<hash>`, so dependents
asking for `megatron-core==0.19.2` or `>=0.19` accept it. Its metadata (dependencies, extras,
classifiers, URLs) is read at build time from the pinned sdist's own pyproject.toml. Set
MOE_RELEASE_BASE to build another pinned base (see patches/pins.toml); a Megatron-LM commit base
also needs MOE_RELEASE_MEGATRON_LM, the clone or `git archive` its files are read from.
"""

import os
import shutil
import sys
import tomllib
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension
from setuptools import find_namespace_packages, setup

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))

from moe_release.common import UserError  # noqa: E402
from moe_release.series.trees import Tree, load_tree, write_tree_atomic  # noqa: E402


def _materialized_tree() -> tuple[Tree, str]:
    """Materialize (once per label) under build/ and return it with its path relative to ROOT."""
    try:
        tree = load_tree(os.environ.get("MOE_RELEASE_BASE") or None)
    except UserError as exc:
        sys.exit(f"moe-release setup.py: error: {exc}")
    # Written afresh on every build: a tree left by an earlier build may predate a tooling change.
    rel = f"build/moe-release/{tree.version}"
    shutil.rmtree(ROOT / rel, ignore_errors=True)
    write_tree_atomic(tree.files, ROOT / rel)
    return tree, rel


def _upstream_metadata(tree: Tree) -> dict:
    """setup() keywords from the sdist's [project] table, version replaced by the overlay's."""
    project = tomllib.loads(tree.files["pyproject.toml"].decode())["project"]
    author = project.get("authors", [{}])[0]
    maintainer = project.get("maintainers", [{}])[0]
    meta = dict(
        name=project["name"],
        version=tree.version,
        description=project.get("description"),
        long_description=tree.files["README.md"].decode(),
        long_description_content_type="text/markdown",
        python_requires=project.get("requires-python"),
        install_requires=project.get("dependencies", []),
        extras_require=project.get("optional-dependencies", {}),
        author=author.get("name"),
        author_email=author.get("email"),
        maintainer=maintainer.get("name"),
        maintainer_email=maintainer.get("email"),
        license=project.get("license", {}).get("text"),
        keywords=project.get("keywords"),
        classifiers=project.get("classifiers"),
        project_urls=project.get("urls"),
    )
    return {k: v for k, v in meta.items() if v is not None}


HELPERS_CPP = "megatron/core/datasets/helpers.cpp"
tree, tree_dir = _materialized_tree()
setup(
    **_upstream_metadata(tree),
    package_dir={"": tree_dir},
    packages=find_namespace_packages(
        where=tree_dir,
        include=["megatron.core", "megatron.core.*", "megatron.training", "megatron.training.*"],
    ),
    package_data={"": ["*"]},
    exclude_package_data={"": ["*.pyc", "__pycache__"]},
    ext_modules=[
        # As upstream's setup.py: the dataset index helper, optional (skipped if it fails).
        Pybind11Extension(
            "megatron.core.datasets.helpers_cpp",
            sources=[f"{tree_dir}/{HELPERS_CPP}"],
            language="c++",
            extra_compile_args=["-O3", "-Wall", "-std=c++17"],
            optional=True,
        )
    ]
    if HELPERS_CPP in tree.files
    else [],
    zip_safe=False,
)
