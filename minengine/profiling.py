"""Named ranges around the parts of an engine step: NVTX (for Nsight) on CUDA, and
``torch.profiler.record_function`` (for torch-profiler traces) everywhere."""

from __future__ import annotations

import contextlib
import functools

import torch


@functools.cache
def _nvtx() -> bool:
    return torch.cuda.is_available()


@contextlib.contextmanager
def step_range(name: str):
    if _nvtx():
        torch.cuda.nvtx.range_push(name)
    try:
        with torch.profiler.record_function(name):
            yield
    finally:
        if _nvtx():
            torch.cuda.nvtx.range_pop()
