"""The one place the engine calls kernels.

A backend is a ``KernelSet`` of the three contract functions (see ``triton_kernels``):

- ``torch``: the pure-torch references in ``reference.py`` (CPU engine runs, test oracles);
- ``triton``: ``triton_kernels`` (CUDA, or CPU under ``TRITON_INTERPRET=1``);
- ``cuda``: the CUDA C++ kernels of ``minengine._C`` (GPU; built when nvcc is found);
- ``flashinfer``: FlashInfer's paged attention behind our contract, planned once per forward
  step from the runner's host copy of the metadata, outside the graph for CUDA-graph decode
  steps (GPU, optional import);
- ``auto``: on CUDA, ``triton``, ``cuda``, ``cuda-wgmma`` (the cuda kernel with Hopper wgmma
  prefill tiles), ``cuda-wgmma-tma`` (those tiles loading K/V by TMA), ``cuda-wgmma-pipe`` (the TMA
  tiles pipelined) or ``cuda-wgmma-2wg`` (those with two warpgroups, 128-row tiles) chosen per call
  shape from the device's committed
  tuning table (``tuning.py``; backend name ``tuned``), or ``triton`` where the device has none
  (or ``minengine._C`` is not built); ``torch`` otherwise.

The engine resolves its backend once (``get_kernels(name, device)``) and calls the functions
directly; the module-level wrappers below resolve per call, for scripts and tests.

The decoder's elementwise layers (RMSNorm with the residual add, rotary embedding, SiLU-and-mul)
have their own choice, ``--layer-kernels``: ``triton`` (``triton_kernels.layers``, one launch
each) or ``torch`` (the modules' own torch code, several kernels each); ``auto`` is triton on
CUDA. It reaches the model as ``KernelSet.layers`` (None: torch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class HostMetadata:
    """A step's attention metadata as the host built it: what ``seq_lens`` and ``cu_seqlens_q`` hold
    on the device. A backend that plans on the host (flashinfer) reads these instead of copying the
    device tensors back (a sync)."""

    seq_lens: list[int]
    cu_seqlens_q: list[int]


class LayerKernels(NamedTuple):
    """The decoder's fused elementwise layers (contracts in ``triton_kernels/layers.py``)."""

    rms_norm: Callable[..., torch.Tensor]  # (x, weight, eps, residual=None) -> out; residual += x in place
    rotary: Callable[..., None]  # (positions, q, k, cos, sin[, q_weight, k_weight, eps]): in place
    silu_and_mul: Callable[..., torch.Tensor]  # (gate, up) -> silu(gate) * up


LAYER_KERNEL_NAMES = ("auto", "torch", "triton")


def get_layer_kernels(name: str, device: torch.device | str) -> LayerKernels | None:
    """The layer kernels ``name`` stands for on ``device`` (None: the modules' torch code)."""
    if name not in LAYER_KERNEL_NAMES:
        raise ValueError(f"unknown layer kernels {name!r}; allowed: {', '.join(LAYER_KERNEL_NAMES)}")
    if name == "torch" or (name == "auto" and torch.device(device).type != "cuda"):
        return None
    from triton_kernels import layers

    return LayerKernels(layers.rms_norm, layers.rotary, layers.silu_and_mul)


class KernelSet(NamedTuple):
    paged_attention: Callable[..., torch.Tensor]
    store_kv: Callable[..., None]
    gather_input_ids: Callable[..., torch.Tensor]
    # stage(block_tables, seq_lens, cu_seqlens_q, host): the runner hands over the host copy of the
    # metadata tensors the next paged_attention calls pass (None: the backend needs none)
    stage: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, HostMetadata], None] | None = None
    # graph_bucket(bucket, static_block_tables, metadata or None): a context around a CUDA-graph
    # capture (None) or replay of a padded decode bucket in which the backend plans outside the
    # graph (None: it plans nothing; see cuda_graph.py)
    graph_bucket: Callable[[int, torch.Tensor, tuple | None], AbstractContextManager] | None = None
    layers: LayerKernels | None = None  # the decoder's elementwise layers (None: torch; see above)


def _torch_kernels() -> KernelSet:
    from minengine.ops import reference

    return KernelSet(reference.paged_attention, reference.store_kv, reference.gather_input_ids)


def _triton_kernels() -> KernelSet:
    import triton_kernels

    return KernelSet(triton_kernels.paged_attention, triton_kernels.store_kv, triton_kernels.gather_input_ids)


def _cuda_kernels() -> KernelSet:
    from minengine.ops import cuda

    return KernelSet(cuda.paged_attention, cuda.store_kv, cuda.gather_input_ids)


def _flashinfer_kernels() -> KernelSet:
    """FlashInfer's attention (one workspace and plan per forward step, from the staged host
    metadata); our store and gather."""
    import triton_kernels
    from minengine.ops import flashinfer_ref

    if not flashinfer_ref.available():
        raise RuntimeError("the flashinfer backend needs flashinfer-python and a CUDA GPU")
    backend = flashinfer_ref.FlashInferBackend()
    return KernelSet(
        backend, triton_kernels.store_kv, triton_kernels.gather_input_ids, backend.stage, backend.graph_bucket
    )


def _tuning_table(device: torch.device) -> dict[str, str] | None:
    from minengine.ops import cuda, tuning

    if not cuda.available():
        return None
    return tuning.load_table(torch.cuda.get_device_name(device))


def attention_of(name: str) -> Callable[..., torch.Tensor]:
    """The paged attention of one of our kernels by backend name: ``triton``, ``cuda`` (its auto
    impl) or ``cuda-<impl>`` (the cuda kernel with that impl forced: ``minengine.ops.cuda.IMPLS``)."""
    from minengine.ops import cuda

    if name == "triton":
        return _triton_kernels().paged_attention
    if name == "cuda":
        return cuda.paged_attention
    impl = name.removeprefix("cuda-")
    if not name.startswith("cuda-") or impl not in cuda.IMPLS or impl == "auto":
        allowed = ["triton", "cuda", *(f"cuda-{i}" for i in cuda.IMPLS if i != "auto")]
        raise ValueError(f"unknown backend {name!r}; allowed: {', '.join(allowed)}")
    return functools.partial(cuda.paged_attention, impl=impl)


def attention_kernels(
    name: str, device: torch.device | str, dtype: torch.dtype | str | None = None, head_dim: int | None = None
) -> tuple[str, ...]:
    """Our attention kernels (as ``attention_of`` names them) that the backend ``name`` runs on
    ``device``: ``triton``; ``cuda``; ``auto`` on CUDA: triton, or triton (the calls its table does not
    list) and the table's backends (with ``dtype`` and ``head_dim`` both given, those of its entries
    for that model's calls only); none for ``torch`` and ``flashinfer``."""
    backend = resolve_backend(name, device)
    if backend == "tuned":
        from minengine.ops import tuning

        table = _tuning_table(torch.device(device)) or {}
        if dtype is not None and head_dim is not None:
            keys = [tuning.table_key(kind, dtype, head_dim) for kind in tuning.KINDS]
            table = {key: table[key] for key in keys if key in table}
        return tuple(b for b in tuning.CHOICES if b == "triton" or b in table.values())
    return (backend,) if backend in ("triton", "cuda") else ()


def _tuned_kernels(device: torch.device) -> KernelSet:
    """Attention from triton, cuda or one of the cuda-wgmma* backends per call shape (the device's
    table); triton's store and gather."""
    from minengine.ops import tuning

    triton = _triton_kernels()
    choices = {name: attention_of(name) for name in tuning.CHOICES}
    attention = tuning.tuned_attention(_tuning_table(device), choices)
    return KernelSet(attention, triton.store_kv, triton.gather_input_ids)


_BACKENDS: dict[str, Callable[[], KernelSet]] = {
    "torch": _torch_kernels,
    "triton": _triton_kernels,
    "cuda": _cuda_kernels,
    "flashinfer": _flashinfer_kernels,
}
BACKEND_NAMES = ("auto", *_BACKENDS)


def resolve_backend(name: str, device: torch.device | str) -> str:
    """The backend ``name`` stands for on ``device``; ``auto``: ``tuned`` on a CUDA device with a
    tuning table, else ``triton`` on CUDA and ``torch`` elsewhere."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; allowed: {', '.join(BACKEND_NAMES)}")
    device = torch.device(device)
    if name == "auto":
        if device.type != "cuda":
            return "torch"
        return "tuned" if _tuning_table(device) else "triton"
    return name


def get_kernels(name: str = "auto", device: torch.device | str = "cpu") -> KernelSet:
    backend = resolve_backend(name, device)
    if backend == "tuned":
        return _tuned_kernels(torch.device(device))
    return _BACKENDS[backend]()


def paged_attention(q: torch.Tensor, *args, backend: str = "auto", **kwargs) -> torch.Tensor:
    return get_kernels(backend, q.device).paged_attention(q, *args, **kwargs)


def store_kv(k: torch.Tensor, *args, backend: str = "auto", **kwargs) -> None:
    return get_kernels(backend, k.device).store_kv(k, *args, **kwargs)


def gather_input_ids(prefill_ids: torch.Tensor, *args, backend: str = "auto", **kwargs) -> torch.Tensor:
    return get_kernels(backend, prefill_ids.device).gather_input_ids(prefill_ids, *args, **kwargs)


__all__ = [
    "BACKEND_NAMES",
    "HostMetadata",
    "KernelSet",
    "LAYER_KERNEL_NAMES",
    "LayerKernels",
    "gather_input_ids",
    "get_kernels",
    "get_layer_kernels",
    "paged_attention",
    "resolve_backend",
    "store_kv",
]
