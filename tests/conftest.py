"""Shared test helpers: markers, skips, and what several test files need once."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)
