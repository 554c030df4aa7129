# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The pricing: the overlay package ``megatron/core/transformer/moe/moe_memory_planner/``
(standard library only), loaded once by file path, so the command runs without a materialized
tree or an installed megatron-core."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from moe_release.common import REPO_ROOT

PACKAGE = REPO_ROOT / "megatron/core/transformer/moe/moe_memory_planner"
NAME = "moe_memory_planner"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        NAME, PACKAGE / "__init__.py", submodule_search_locations=[str(PACKAGE)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = module  # its modules import each other relatively, through this name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[NAME]
        raise
    return module


planner = _load()


def load_planner() -> ModuleType:
    """The pricing package (the overlay's ``moe_memory_planner``, loaded by path once)."""
    return planner


def source_files() -> list[Path]:
    """The pricing's modules, for the tests that read what it cites."""
    return sorted(PACKAGE.glob("*.py"))
