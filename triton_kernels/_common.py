"""Helpers shared by the Triton launchers: interpreter detection, device facts, debug checks."""

from __future__ import annotations

import functools
import os
import re

import numpy
import torch
import triton

_TRUE = ("1", "true", "on", "yes")

# Every launch asks for a * b + c fused into one FMA. Triton fuses by default up to 3.9, which
# warns that 3.10's default is off; the kernels were designed and measured with fusion (the
# online softmax's scale-and-subtract is one FFMA per score), so an upgrade must not change them.
FP_FUSION = {"enable_fp_fusion": True}


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs, "runtime"):
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in _TRUE


def _major_minor(version: str) -> tuple[int, int]:
    numbers = [int(x) for x in re.findall(r"\d+", version)[:2]] + [0, 0]
    return numbers[0], numbers[1]


@functools.cache
def interpreter_problem() -> str:
    """Why Triton's interpreter cannot run the attention kernel here, or "" when it can.

    Triton before 3.7 turns a loop bound computed in the kernel into a Python int with
    ``int(array)`` on a one-element array, which NumPy 2.4 turned from a deprecation into an error.
    """
    if _major_minor(triton.__version__) < (3, 7) and _major_minor(numpy.__version__) >= (2, 4):
        return (
            f"Triton {triton.__version__}'s interpreter cannot run the attention kernel with NumPy "
            f"{numpy.__version__} (its loop bounds need NumPy < 2.4): install numpy<2.4 or triton>=3.7 "
            "for CPU runs, or use the torch backend"
        )
    return ""


def debug_checks() -> bool:
    """Value checks that need a host sync run only when ``MINENGINE_KERNEL_DEBUG=1``, and never
    while a CUDA graph is being captured (a sync there would break the capture)."""
    if os.environ.get("MINENGINE_KERNEL_DEBUG", "0").lower() not in _TRUE:
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a small fixed number when interpreting."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def max_shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may use on a CUDA device (the limit Triton checks a
    launch against: 227 KB on sm_90, 163 KB on sm_80, 99 KB on sm_86 / sm_89); unbounded otherwise."""
    if device.type != "cuda":
        return 1 << 30
    index = device.index if device.index is not None else torch.cuda.current_device()
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


def check_runnable(*tensors: torch.Tensor) -> None:
    """Triton kernels run on CUDA tensors, or on CPU tensors under the interpreter."""
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device, got {t.device} and {device}")
    if device.type == "cuda" or (device.type == "cpu" and interpreting()):
        return
    raise RuntimeError(
        f"the triton backend cannot run on {device} tensors: use CUDA tensors, or set "
        "TRITON_INTERPRET=1 before importing triton_kernels, or use the torch backend"
    )
