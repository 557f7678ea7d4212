"""The CUDA C++ kernels of ``csrc/``, compiled for the CPU and run by a warp-level emulator.

``csrc/emulate.h`` turns every launch into a loop over the grid in which each thread of a block is
a fiber, with ``__syncthreads``, warp shuffles, ``mma.sync`` (m16n8k16, PTX fragment layouts) and
``cp.async`` (copies land only when the thread waits for them) emulated. The same sources that
nvcc builds into ``minengine._C`` are compiled here with the host C++ compiler, so the contract
tests exercise the CUDA kernels' indexing, masking, tiling, split-KV and merge logic on a machine
without a GPU. It says nothing about speed, and blocks run one after another, so races between
blocks are out of its reach. Tests only: slow (a fiber switch per barrier).

The module mirrors ``minengine._C``: ``paged_attention``, ``attention_impl``, ``store_kv`` and
``gather_input_ids`` take the same keyword arguments, with host pointers. ``fast_div`` runs the
kernels' page divider (``FastDiv``) for its exhaustive-range test.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SOURCES = ("paged_attention.cu", "store_kv.cu", "gather_input_ids.cu", "emulate_capi.cpp")
HEADERS = ("common.cuh", "kernels.h", "emulate.h")

_P, _I64, _F64, _INT = ctypes.c_size_t, ctypes.c_int64, ctypes.c_double, ctypes.c_int


def _struct(name: str, fields: list[tuple[type, str]]) -> type[ctypes.Structure]:
    """A ctypes mirror of one of kernels.h's argument structs (same order, same C types)."""
    return type(name, (ctypes.Structure,), {"_fields_": [(n, t) for t, fields_of in fields for n in fields_of.split()]})


PagedAttentionArgs = _struct(
    "PagedAttentionArgs",
    [
        (_P, "q k_cache v_cache out block_tables seq_lens cu_seqlens_q part_acc part_ml"),
        (_I64, "num_tokens num_seqs num_q_heads num_kv_heads head_dim page_size num_pages max_seqlen_q num_splits"),
        (_I64, "sq_t sq_h sk_p sk_s sk_h sv_p sv_s sv_h so_t so_h sbt"),
        (_F64, "softmax_scale"),
        (_INT, "dtype impl block_order"),
        (_P, "stream"),
    ],
)
StoreKVArgs = _struct(
    "StoreKVArgs",
    [
        (_P, "k v k_cache v_cache slot_mapping"),
        (_I64, "num_tokens num_heads head_dim page_size sk_t sk_h sv_t sv_h skc_p skc_s skc_h svc_p svc_s svc_h"),
        (_INT, "dtype"),
        (_P, "stream"),
    ],
)
GatherArgs = _struct(
    "GatherArgs",
    [
        (_P, "prefill_ids token_buffer decode_indices out"),
        (_I64, "num_prefill num_decode sp sb si so"),
        (_INT, "id_dtype index_dtype"),
        (_P, "stream"),
    ],
)


def cuda_include() -> Path | None:
    """The CUDA headers (``cuda_fp16.h`` and friends give the host-side half and bfloat16 types)."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        homes.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    for home in homes:
        if home and (Path(home) / "include" / "cuda_fp16.h").exists():
            return Path(home) / "include"
    return None


def unavailable_reason() -> str | None:
    """Why the emulator cannot be built here, or None."""
    if not all((CSRC / name).exists() for name in SOURCES + HEADERS):
        return f"csrc/ sources not found at {CSRC} (the emulator needs a source checkout)"
    if cuda_include() is None:
        return "no CUDA headers (cuda_fp16.h) found: set CUDA_HOME"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (set CXX)"
    return None


@functools.cache
def _library() -> ctypes.CDLL:
    reason = unavailable_reason()
    if reason:
        raise RuntimeError(f"the CUDA kernel emulator cannot be built: {reason}")
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update((CSRC / name).read_bytes())
    default = Path(tempfile.gettempdir()) / f"minengine-emu-{os.getuid()}"
    cache = Path(os.environ.get("MINENGINE_EMULATOR_CACHE", default))
    cache.mkdir(parents=True, exist_ok=True)
    lib = cache / f"libminengine_emu_{digest.hexdigest()[:16]}.so"
    if not lib.exists():
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        cu = [str(CSRC / n) for n in SOURCES if n.endswith(".cu")]
        cpp = [str(CSRC / n) for n in SOURCES if n.endswith(".cpp")]
        cmd = [os.environ.get("CXX", "c++"), "-std=c++17", "-O2", "-fPIC", "-shared", "-fno-strict-aliasing"]
        cmd += ["-DMINENGINE_EMULATE", f"-I{CSRC}", f"-I{cuda_include()}", "-x", "c++", *cu, "-x", "none", *cpp]
        cmd += ["-o", str(tmp)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building the CUDA kernel emulator failed:\n{' '.join(cmd)}\n{done.stderr[-4000:]}")
        tmp.replace(lib)  # atomic: a concurrent build just wins or loses the rename
    dll = ctypes.CDLL(str(lib))
    for fn, struct in (
        ("me_paged_attention", PagedAttentionArgs),
        ("me_attention_impl", PagedAttentionArgs),
        ("me_store_kv", StoreKVArgs),
        ("me_gather_input_ids", GatherArgs),
    ):
        getattr(dll, fn).argtypes = [ctypes.POINTER(struct), ctypes.c_char_p, ctypes.c_int]
        getattr(dll, fn).restype = ctypes.c_int
    dll.me_attention_block_order.argtypes = [
        ctypes.POINTER(PagedAttentionArgs),
        ctypes.c_void_p,
        _I64,
        ctypes.c_char_p,
        ctypes.c_int,
    ]
    dll.me_attention_block_order.restype = _I64
    dll.me_fast_div.argtypes = [_I64, ctypes.c_void_p, ctypes.c_void_p, _I64, ctypes.c_char_p, ctypes.c_int]
    dll.me_fast_div.restype = ctypes.c_int
    dll.me_set_readable.argtypes = [ctypes.c_void_p, ctypes.c_int]
    dll.me_set_readable.restype = None
    dll.me_set_cp_async_landing.argtypes = [ctypes.c_int]
    dll.me_set_cp_async_landing.restype = None
    return dll


@contextlib.contextmanager
def cp_async_land_at_issue():
    """Inside: ``cp.async`` copies land when issued, not at the wait that covers them. A refill
    issued before every warp has read the buffer (a missing barrier) then corrupts the warps that
    run after it; the default (latest) landing catches the opposite race, a read before the barrier
    that follows the wait."""
    _library().me_set_cp_async_landing(1)
    try:
        yield
    finally:
        _library().me_set_cp_async_landing(0)


def _call(fn: str, struct: type[ctypes.Structure], kwargs: dict) -> int:
    missing = {name for name, _ in struct._fields_} - kwargs.keys()
    extra = kwargs.keys() - {name for name, _ in struct._fields_}
    if missing or extra:
        raise TypeError(f"{fn}: missing arguments {sorted(missing)}, unexpected {sorted(extra)}")
    args = struct(**kwargs)
    error = ctypes.create_string_buffer(1024)
    rc = getattr(_library(), fn)(ctypes.byref(args), error, len(error))
    if rc < 0 or (rc != 0 and fn != "me_attention_impl"):
        raise ValueError(error.value.decode(errors="replace"))
    return rc


def paged_attention(readable: tuple = (), **kwargs) -> None:
    """``readable``: the tensors (the K/V caches) whose memory the kernel's cp.async may read; a
    copy from anywhere else fails, as does one that reads a NaN (a slot past seq_len, in tests)."""
    ranges = np.array([(t.data_ptr(), t.data_ptr() + _extent(t)) for t in readable], dtype=np.uint64)
    _library().me_set_readable(ranges.ctypes.data, len(ranges))
    try:
        _call("me_paged_attention", PagedAttentionArgs, kwargs)
    finally:
        _library().me_set_readable(None, 0)


def _extent(t) -> int:
    """Bytes from t's first element to the end of its last (any strides >= 0)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))) * t.element_size()


def attention_impl(**kwargs) -> int:
    return _call("me_attention_impl", PagedAttentionArgs, kwargs)


def attention_block_order(**kwargs) -> np.ndarray:
    """The tensor-core kernel's blocks of split 0 in launch order (grid x fastest), a row each:
    (KV head, sequence, tile). Sequence -1 does nothing, sequence num_seqs zeroes the padding rows,
    tile -1 is a decode tile; a prefill tile past its sequence's rows returns at once."""
    args = PagedAttentionArgs(**kwargs)
    error = ctypes.create_string_buffer(1024)
    fn = _library().me_attention_block_order
    n = fn(ctypes.byref(args), None, 0, error, len(error))
    if n < 0:
        raise ValueError(error.value.decode(errors="replace"))
    order = np.empty((n // 3, 3), dtype=np.int32)
    fn(ctypes.byref(args), order.ctypes.data, n, error, len(error))
    return order


def store_kv(**kwargs) -> None:
    _call("me_store_kv", StoreKVArgs, kwargs)


def gather_input_ids(**kwargs) -> None:
    _call("me_gather_input_ids", GatherArgs, kwargs)


def fast_div(divisor: int, n: np.ndarray) -> np.ndarray:
    """n // divisor through the kernels' FastDiv (page lookups), for its test; n: int32, >= 0."""
    n = np.ascontiguousarray(n, dtype=np.int32)
    q = np.empty_like(n)
    error = ctypes.create_string_buffer(1024)
    if _library().me_fast_div(divisor, n.ctypes.data, q.ctypes.data, n.size, error, len(error)):
        raise ValueError(error.value.decode(errors="replace"))
    return q
