"""Import blocks merged as sets (``moe_release.series.imports``), with upstream's isort settings
(Megatron-LM's ``[tool.isort]`` table) and ``git merge-file`` for the rest of the file."""

import pytest

from moe_release.series import imports
from moe_release.series.merge import MARK_OURS, merge_file

PYPROJECT = b"""[tool.isort]
profile = "black"
line_length = 100
py_version = 312
known_first_party = ["megatron"]
known_third_party = ["transformer_engine"]
sections = ["FUTURE", "STDLIB", "THIRDPARTY", "FIRSTPARTY", "LOCALFOLDER"]
default_section = "THIRDPARTY"
extend_skip = ["setup.py"]
"""
HEAD = b"# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.\n\n"
BODY = b"\n\ndef f():\n    return Optional, internal_api\n"


@pytest.fixture
def style():
    style = imports.isort_style(PYPROJECT)
    assert style is not None, "isort is missing: requirements-dev.txt pins upstream's 5.13.2"
    return style


def _merge(ours: bytes, base: bytes, theirs: bytes, style):
    return imports.merge_imports(ours, base, theirs, merge_file, style)


def test_the_nemo_rl_pin_conflict_is_a_set(style):
    """NeMo-RL's pin (main 14346b65): REF lacks ``import inspect``, which the series' base has
    above the ``import weakref`` the patch adds. git merge-file conflicts; as sets, weakref is
    added and inspect, which nothing in the file uses, is not brought back."""
    base = (
        HEAD + b"import inspect\nfrom typing import Optional\n\nfrom megatron.core.utils "
        b"import internal_api\n" + BODY
    )
    theirs = base.replace(b"import inspect\n", b"import inspect\nimport weakref\n")
    ours = base.replace(b"import inspect\n", b"")
    assert merge_file(ours, base, theirs)[1] == 1
    merged, left = _merge(ours, base, theirs, style)
    assert left == 0
    assert (
        merged == HEAD + b"import weakref\nfrom typing import Optional\n\nfrom megatron.core."
        b"utils import internal_api\n" + BODY
    )
    # The body uses inspect: it is kept (REF predates what needs it, the series' code does).
    used = BODY + b"\n\ndef g():\n    return inspect.signature(g)\n"
    merged, left = _merge(ours[: -len(BODY)] + used, base[: -len(BODY)] + used,
                          theirs[: -len(BODY)] + used, style)  # fmt: skip
    assert left == 0 and b"import inspect\nimport weakref\n" in merged


def test_both_sides_add_and_the_patch_drops_what_nothing_uses(style):
    """REF adds ``os`` and a first-party import; the patch adds ``sys`` and drops ``re``,
    which the merged file does not use: isort's order, sections and combined from-imports."""
    base = (
        HEAD + b"import re\nfrom typing import Optional\n\nfrom megatron.core.utils import "
        b"internal_api\n" + BODY
    )
    ours = base.replace(b"import re\n", b"import os\nimport re\n").replace(
        b"from megatron.core.utils",
        b"from megatron.core import parallel_state\nfrom megatron.core.utils",
    )
    theirs = base.replace(b"import re\n", b"import sys\n")
    merged, left = _merge(ours, base, theirs, style)
    assert left == 0
    assert (
        merged
        == HEAD
        + (
            b"import os\nimport sys\nfrom typing import Optional\n\n"
            b"from megatron.core import parallel_state\n"
            b"from megatron.core.utils import internal_api\n"
        )
        + BODY
    )


def test_what_a_person_must_decide_is_refused(style):
    """None (the conflict stays): a comment in the block, a conflict outside it, a REF block
    isort would rewrite, a file that does not parse, no isort settings."""
    base = HEAD + b"import inspect\nfrom typing import Optional\n" + BODY
    theirs = base.replace(b"import inspect\n", b"import inspect\nimport weakref\n")
    ours = base.replace(b"import inspect\n", b"")
    commented = [x.replace(b"from typing", b"# typing\nfrom typing") for x in (ours, base, theirs)]
    assert _merge(*commented, style) is None
    body_conflict = (ours.replace(b"return Optional", b"return 1"), base,
                     theirs.replace(b"return Optional", b"return 2"))  # fmt: skip
    merged, left = _merge(*body_conflict, style)
    assert left == 1 and MARK_OURS in merged and b"import weakref\n" in merged
    unsorted = (ours.replace(b"from typing import Optional\n", b"from typing import Optional\n"
                             b"import abc\n"), base, theirs)  # fmt: skip
    assert _merge(*unsorted, style) is None
    assert _merge(ours + b"def (:\n", base, theirs, style) is None
    assert imports.isort_style(b"[tool.black]\nline-length = 100\n") is None
    assert imports.isort_style(None) is None


def test_no_isort_no_mechanical_merge(monkeypatch):
    """Without isort installed the block is not merged (the conflict stays for a person)."""
    import builtins

    real = builtins.__import__

    def no_isort(name, *args, **kwargs):
        if name == "isort":
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_isort)
    assert imports.isort_style(PYPROJECT) is None


def test_a_side_by_side_settle_that_drops_a_needed_import_is_refused(style):
    """Megatron-Bridge's pin (main 2a75ac12): REF predates the ``import inspect`` the series'
    base has, and the patch adds imports around it while its code calls ``inspect`` at module
    level. Side by side, REF's side of the block wins and the file raises NameError on import;
    ``settle_file`` refuses that and merges the block as a set, keeping inspect."""
    from moe_release.series.merge import settle_file

    body = BODY + b"\n\ndef g():\n    return inspect.signature(g)\n"
    base = HEAD + b"import inspect\nimport weakref\nfrom typing import Optional\n" + body
    theirs = base.replace(b"import inspect\n", b"import collections\nimport inspect\nimport os\n")
    ours = base.replace(b"import inspect\n", b"")
    data, n = merge_file(ours, base, theirs)
    assert n == 1
    assert imports.lost_imports(theirs, ours + b"\n") == ["inspect"]
    merged, left, how = settle_file(ours, base, theirs, data, n, style)
    assert left == 0 and how.startswith("import block merged as a set"), how
    assert b"import collections\nimport inspect\nimport os\nimport weakref\n" in merged
    assert imports.lost_imports(theirs, merged) == []
    # A function's own import binds nothing at module level: still a use that needs the block.
    local = b"def h():\n    import inspect\n\n    return inspect\n"
    assert imports.lost_imports(b"import inspect\n" + local, local) == ["inspect"]
