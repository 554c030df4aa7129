# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The factory-placement check that stands in, on the host, for running on CUDA tensors."""

import importlib.util

import torch

from tests.unit_tests.device_placement import FactoryPlacement

SOURCE = '''
import torch


def follows(x):
    return torch.zeros(3, device=x.device), torch.arange(2, device=x.device), x.new_zeros(2)


def strays(x):
    return torch.zeros(3), torch.tensor([1, 2], dtype=torch.long)
'''


def _module(tmp_path):
    path = tmp_path / "placed.py"
    path.write_text(SOURCE)
    spec = importlib.util.spec_from_file_location("placed", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


def test_records_factories_without_a_device(tmp_path):
    module, path = _module(tmp_path)
    mode = FactoryPlacement([str(path)])
    with mode:
        module.follows(torch.ones(1))
        module.strays(torch.ones(1))
    assert mode.calls == 4
    assert mode.missing == [("placed.py", 10, "zeros"), ("placed.py", 10, "tensor")]


def test_ignores_code_outside_the_watched_files(tmp_path):
    module, path = _module(tmp_path)
    mode = FactoryPlacement([str(tmp_path / "other.py")])
    with mode:
        module.strays(torch.ones(1))
        torch.zeros(2)
    assert mode.calls == 0 and mode.missing == []
