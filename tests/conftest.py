"""Test set-up: Triton's interpreter on CPU-only machines, GPU tests skipped without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

# Must happen before anything imports triton_kernels: @triton.jit reads it at decoration time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")
