"""The ``cuda`` backend: the CUDA C++ kernels of ``minengine._C`` behind the kernel contracts.

Arguments are checked with the contracts' shared checks (``triton_kernels.contract``), then the
kernels get raw pointers, sizes, strides, dtype codes and the current CUDA stream as integers.
``gather_input_ids`` also accepts ``prefill_ids`` in pinned host memory: the kernel reads it over
unified addressing, fusing the host-to-device copy into the gather.

``paged_attention`` runs the tensor-core kernel (mma.sync, fp16/bf16, aligned K/V rows) with
split-KV for few long sequences, else the CUDA-core kernel; ``impl`` forces one ("mma", "simt").
``impl="wgmma"`` runs the tensor-core kernel with its prefill tiles on Hopper's warpgroup MMA
(an sm_90 GPU and a build with 9.0a, head_dim <= 128); nothing picks it unless asked, or unless the
device's tuning table measured it faster (backend ``cuda-wgmma`` of ``tuning.py``).
``impl="wgmma-tma"`` runs those tiles with their K/V stages loaded by TMA (tensor maps of the
caches, completion on mbarriers) where whole chunks of pages allow: page_size 8, 16, 32, 64 or a
multiple of 64, and 128-byte aligned cache bases and strides (elsewhere it runs ``"wgmma"``);
backend ``cuda-wgmma-tma``. ``impl="wgmma-pipe"`` runs those TMA tiles pipelined as FlashAttention-3
does within a warpgroup (each stage's softmax while the previous stage's P V runs; two blocks an
SM at head dim 128 instead of three), with the same fallback; backend ``cuda-wgmma-pipe``.
``impl="wgmma-2wg"`` runs those pipelined TMA tiles with two warpgroups a block: 128-row prefill
tiles whose rows share each K/V stage, so every key crosses from L2 to shared memory half as often
as with 64-row tiles (one block an SM), with the same fallback; backend ``cuda-wgmma-2wg``.

After ``use_emulator()``, CPU tensors run through ``cuda_emulator`` (the same sources compiled for
the CPU with a warp-level emulator): that is how the contract tests cover these kernels without
a GPU.
"""

from __future__ import annotations

import contextlib

import torch

from triton_kernels.contract import (
    BLOCK_ORDERS,
    check_block_order,
    check_gather_input_ids,
    check_gather_input_ids_values,
    check_num_splits,
    check_paged_attention,
    check_paged_attention_values,
    check_store_kv,
    check_store_kv_values,
    softmax_scale_or_default,
)

try:
    from minengine import _C
except ImportError as exc:  # built only where nvcc was found
    _C = None
    _IMPORT_ERROR = exc

_DTYPES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
_INDEX = {torch.int32: 0, torch.int64: 1}
IMPLS = {"auto": 0, "simt": 1, "mma": 2, "wgmma": 3, "wgmma-tma": 4, "wgmma-pipe": 5, "wgmma-2wg": 6}
WGMMA_IMPLS = ("wgmma", "wgmma-tma", "wgmma-pipe", "wgmma-2wg")  # the Hopper prefill tiles (sm_90, head_dim <= 128)
TMA_IMPLS = ("wgmma-tma", "wgmma-pipe", "wgmma-2wg")  # those loading K/V by TMA where the caches allow

_emulator = None  # the cuda_emulator module once use_emulator() was called


def available() -> bool:
    return _C is not None and torch.cuda.is_available()


def use_emulator(enabled: bool = True) -> None:
    """Run calls on CPU tensors through the CPU-emulated kernels (tests; builds them on first use)."""
    global _emulator
    if enabled:
        from minengine.ops import cuda_emulator

        cuda_emulator._library()
        _emulator = cuda_emulator
    else:
        _emulator = None


def _lib(t: torch.Tensor):
    """The kernel module for tensors on t's device: _C for CUDA, the emulator for CPU (if enabled)."""
    if t.device.type == "cpu" and _emulator is not None:
        return _emulator
    if _C is None:
        raise RuntimeError(
            f"the cuda backend needs minengine._C, which is not built ({_IMPORT_ERROR}); "
            "reinstall with nvcc available (MINENGINE_BUILD_CUDA=1)"
        )
    if t.device.type != "cuda":
        raise ValueError(f"the cuda backend needs CUDA tensors; got one on {t.device}")
    return _C


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def _on(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


# Pinned host tensors a launched gather still reads, with the event that says it is done: the
# kernel reads host memory directly, so nothing else keeps the allocator from reusing it.
_host_reads: list[tuple[torch.Tensor, torch.cuda.Event]] = []


def _keep_alive(tensor: torch.Tensor, device: torch.device) -> None:
    while _host_reads and _host_reads[0][1].query():
        _host_reads.pop(0)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    _host_reads.append((tensor, done))


def _debug() -> bool:
    from triton_kernels._common import debug_checks

    return debug_checks()


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    impl: str = "auto",
    block_order: str = "heavy-first",
) -> torch.Tensor:
    """``num_splits`` (a power of two up to 16) splits KV on the tensor-core kernel; the CUDA-core
    kernel (fp32, unaligned caches) has no split path and ignores it. ``block_order`` (the
    tensor-core kernel; ``BLOCK_ORDERS``) is the order its blocks start in, not what they compute."""
    from triton_kernels.attention import pick_num_splits

    num_splits = check_num_splits(num_splits)
    if out is None:
        out = torch.empty_like(q)
    dims, args = _attention_call(
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, softmax_scale, out, impl
    )
    args["block_order"] = BLOCK_ORDERS.index(check_block_order(block_order))
    lib = _lib(q)
    if _debug():
        check_paged_attention_values(dims, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q)
    if dims.num_tokens == 0:
        return out
    with _on(q.device):
        # Split workspaces for the tensor-core kernel; were the caches unaligned after all, the
        # CUDA-core kernel runs and ignores them (asking the dispatcher first would cost a call).
        if impl != "simt" and q.dtype != torch.float32:
            if num_splits is None:
                # a prefill tile's rows: 128 for wgmma-2wg (on its fallback to wgmma's 64-row tiles, for
                # caches TMA cannot load, this may pick up to twice the splits: same output, no
                # dispatcher call per launch)
                tile_rows = 128 if impl == "wgmma-2wg" else 64
                block_q = max(1, tile_rows // (dims.num_q_heads // dims.num_kv_heads))
                num_splits = pick_num_splits(dims.num_tokens, dims.num_seqs, block_q, dims.num_kv_heads, q.device)
            if num_splits > 1:
                rows = (num_splits, dims.num_tokens, dims.num_q_heads)
                part_acc = torch.empty((*rows, dims.head_dim), dtype=torch.float32, device=q.device)
                part_ml = torch.empty((*rows, 2), dtype=torch.float32, device=q.device)
                args.update(num_splits=num_splits, part_acc=part_acc.data_ptr(), part_ml=part_ml.data_ptr())
        if lib is _emulator:  # its cp.async checks every read against the caches' memory
            args["readable"] = (k_cache, v_cache)
        lib.paged_attention(**args)
    return out


def chosen_kernel(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    impl: str = "auto",
) -> str:
    """The kernel ``paged_attention`` runs for these inputs: "mma" (tensor cores), "wgmma" (tensor
    cores, Hopper prefill tiles; only when asked for), "wgmma-tma" (those tiles with TMA loads),
    "wgmma-pipe" (the TMA tiles pipelined), "wgmma-2wg" (those with two warpgroups a block) or
    "simt". A kernel asked for that cannot take the inputs raises the ValueError ``paged_attention``
    would (for a batch with tokens: an empty one returns before any kernel is chosen)."""
    _, args = _attention_call(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, None, q, impl)
    with _on(q.device):  # (wgmma's check reads the current device's compute capability)
        code = _lib(q).attention_impl(**args)
    return next(name for name, value in IMPLS.items() if value == code)


def _attention_call(
    q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, softmax_scale, out, impl
) -> tuple:
    """Checked arguments -> (dims, the keyword arguments of _C.paged_attention without split-KV);
    ``out`` only lends its pointer and strides."""
    dims = check_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, out)
    if impl not in IMPLS:
        raise ValueError(f"impl is {impl!r}; allowed: {', '.join(IMPLS)}")
    return dims, dict(
        q=q.data_ptr(),
        k_cache=k_cache.data_ptr(),
        v_cache=v_cache.data_ptr(),
        out=out.data_ptr(),
        block_tables=block_tables.data_ptr(),
        seq_lens=seq_lens.data_ptr(),
        cu_seqlens_q=cu_seqlens_q.data_ptr(),
        num_tokens=dims.num_tokens,
        num_seqs=dims.num_seqs,
        num_q_heads=dims.num_q_heads,
        num_kv_heads=dims.num_kv_heads,
        head_dim=dims.head_dim,
        page_size=dims.page_size,
        num_pages=k_cache.shape[0],
        sq_t=q.stride(0),
        sq_h=q.stride(1),
        sk_p=k_cache.stride(0),
        sk_s=k_cache.stride(1),
        sk_h=k_cache.stride(2),
        sv_p=v_cache.stride(0),
        sv_s=v_cache.stride(1),
        sv_h=v_cache.stride(2),
        so_t=out.stride(0),
        so_h=out.stride(1),
        sbt=block_tables.stride(0),
        softmax_scale=softmax_scale_or_default(softmax_scale, dims.head_dim),
        dtype=_DTYPES[q.dtype],
        stream=_stream(q.device),
        max_seqlen_q=int(max_seqlen_q),
        impl=IMPLS[impl],
        block_order=0,
        num_splits=1,
        part_acc=0,
        part_ml=0,
    )


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    check_store_kv(k, v, k_cache, v_cache, slot_mapping)
    lib = _lib(k)
    if _debug():
        check_store_kv_values(k_cache, slot_mapping)
    with _on(k.device):
        _launch_store_kv(lib, k, v, k_cache, v_cache, slot_mapping)


def _launch_store_kv(lib, k, v, k_cache, v_cache, slot_mapping) -> None:
    lib.store_kv(
        k=k.data_ptr(),
        v=v.data_ptr(),
        k_cache=k_cache.data_ptr(),
        v_cache=v_cache.data_ptr(),
        slot_mapping=slot_mapping.data_ptr(),
        num_tokens=k.shape[0],
        num_heads=k.shape[1],
        head_dim=k.shape[2],
        page_size=k_cache.shape[1],
        sk_t=k.stride(0),
        sk_h=k.stride(1),
        sv_t=v.stride(0),
        sv_h=v.stride(1),
        skc_p=k_cache.stride(0),
        skc_s=k_cache.stride(1),
        skc_h=k_cache.stride(2),
        svc_p=v_cache.stride(0),
        svc_s=v_cache.stride(1),
        svc_h=v_cache.stride(2),
        dtype=_DTYPES[k.dtype],
        stream=_stream(k.device),
    )


def gather_input_ids(
    prefill_ids: torch.Tensor,
    token_buffer: torch.Tensor,
    decode_indices: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    total = check_gather_input_ids(prefill_ids, token_buffer, decode_indices, out, host_prefill_ok=True)
    lib = _lib(token_buffer)
    if _debug():
        check_gather_input_ids_values(token_buffer, decode_indices)
    if out is None:
        out = torch.empty(total, dtype=prefill_ids.dtype, device=token_buffer.device)
    with _on(token_buffer.device):
        _launch_gather(lib, prefill_ids, token_buffer, decode_indices, out)
        if token_buffer.device.type == "cuda" and prefill_ids.device.type == "cpu" and prefill_ids.numel():
            _keep_alive(prefill_ids, token_buffer.device)
    return out


def _launch_gather(lib, prefill_ids, token_buffer, decode_indices, out) -> None:
    lib.gather_input_ids(
        prefill_ids=prefill_ids.data_ptr(),
        token_buffer=token_buffer.data_ptr(),
        decode_indices=decode_indices.data_ptr(),
        out=out.data_ptr(),
        num_prefill=prefill_ids.numel(),
        num_decode=decode_indices.numel(),
        sp=prefill_ids.stride(0),
        sb=token_buffer.stride(0),
        si=decode_indices.stride(0),
        so=out.stride(0),
        id_dtype=_INDEX[prefill_ids.dtype],
        index_dtype=_INDEX[decode_indices.dtype],
        stream=_stream(token_buffer.device),
    )
