"""The decoder's elementwise layers, each one launch: RMSNorm (with the residual add fused in),
rotary embedding of q and k (with Qwen3's per-head q/k RMSNorm fused in), and SiLU-and-multiply.

Left to torch, a Llama layer runs about 30 small elementwise kernels besides its matmuls and
attention (an RMSNorm alone is eight); under a CUDA graph each still costs a few microseconds of
GPU time, so a decode step of a 32-layer model spends milliseconds on them. These three replace
them all. Every kernel computes in float32 and rounds where the torch code rounds (the residual
sum, the normalised activations, the silu), so its outputs match the torch layers' to rounding.

Contracts::

    rms_norm(x, weight, eps, residual=None) -> out
        x         [rows, n]   float32 / float16 / bfloat16, last dim contiguous
        weight    [n]         x's dtype, contiguous
        residual  [rows, n]   x's dtype, last dim contiguous; when given it becomes x + residual
                              (in place) and the norm is of that sum
        out       [rows, n]   new, x's dtype: weight * (s * rsqrt(mean(s^2) + eps)), s = x (+ residual)

    rotary(positions, q, k, cos, sin) -> None   (q and k rotated in place)
        positions  int64 [T], contiguous; values in [0, cos.shape[0])
        q, k       [T, Hq, D], [T, Hk, D]   one dtype, last dim contiguous, D even
        cos, sin   float32 [max_positions, D] contiguous; the first D / 2 columns are read (the
                   Llama tables repeat them): x1, x2 = halves of a head, c, s = cos, sin at its position:
                   (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), c and s rounded to q's dtype first

    rotary(positions, q, k, cos, sin, q_weight, k_weight, eps) -> None   (Qwen3's q/k norms fused)
        q_weight, k_weight  [D] q's dtype, contiguous (both or neither): each head of q (k) is first
                   RMS-normalised over D and scaled by q_weight (k_weight), as rms_norm rounds, then rotated

    silu_and_mul(gate, up) -> out
        gate, up  [rows, n]   one dtype, last dim contiguous
        out       [rows, n]   new: silu(gate) * up
"""

from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from triton_kernels._common import FP_FUSION, check_runnable, debug_checks

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_NORM_WIDTH = 65536  # one program holds a whole row


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    n,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the stream keeps the rounded sum
        tl.store(res_ptr + row * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
    y = (xf * rstd).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    out = (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, out, mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    qw_ptr,
    kw_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    eps,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_ok = offs_d < HALF
    dtype = q_ptr.dtype.element_ty
    c = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_ok, other=0.0).to(dtype).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * stride_cos + offs_d, mask=d_ok, other=0.0).to(dtype).to(tl.float32)[None, :]
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    q_ptrs = q_ptr + token * stride_qt + offs_h * stride_qh + offs_d[None, :]
    _rotate_heads(q_ptrs, (offs_h < HQ) & d_ok[None, :], c, s, qw_ptr + offs_d, d_ok, eps, HALF, HAS_NORM)
    k_ptrs = k_ptr + token * stride_kt + offs_h * stride_kh + offs_d[None, :]
    _rotate_heads(k_ptrs, (offs_h < HK) & d_ok[None, :], c, s, kw_ptr + offs_d, d_ok, eps, HALF, HAS_NORM)


@triton.jit
def _rotate_heads(first_half_ptrs, mask, c, s, w_ptrs, d_ok, eps, HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    """Rotate a token's heads in place: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s); with HAS_NORM each
    head is first RMS-normalised and scaled by the weight at ``w_ptrs`` (rounded as RMSNorm rounds)."""
    dtype = first_half_ptrs.dtype.element_ty
    x1 = tl.load(first_half_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first_half_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        w1 = tl.load(w_ptrs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptrs + HALF, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        x1 = (w1 * (x1 * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(first_half_ptrs, (x1 * c - x2 * s).to(dtype), mask=mask)
    tl.store(first_half_ptrs + HALF, (x2 * c + x1 * s).to(dtype), mask=mask)


@triton.jit
def _silu_and_mul_kernel(gate_ptr, up_ptr, out_ptr, stride_g, stride_u, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + row * stride_g + offs, mask=mask, other=0.0)
    u = tl.load(up_ptr + row * stride_u + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # rounded, as torch's silu output
    tl.store(out_ptr + row * stride_o + offs, (silu.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; allowed: float32, float16, bfloat16")
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {tuple(t.stride())}")


def _check_eps(eps: object) -> None:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ValueError(f"eps is {eps!r}; allowed: a number >= 0")


def norm_warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 8192 else 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    _check_float("x", x)
    _check_float("weight", weight)
    if x.dim() != 2:
        raise ValueError(f"x must be [rows, n], got shape {tuple(x.shape)}")
    rows, n = x.shape
    if weight.shape != (n,) or not weight.is_contiguous() or weight.dtype != x.dtype:
        raise ValueError(
            f"weight must be contiguous [{n}] (x's last dim) of x's dtype {x.dtype}, got {tuple(weight.shape)} "
            f"{weight.dtype}"
        )
    if not 1 <= n <= MAX_NORM_WIDTH:
        raise ValueError(f"x's last dim is {n}; allowed: 1..{MAX_NORM_WIDTH}")
    _check_eps(eps)
    if residual is not None:
        _check_float("residual", residual)
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual must match x ({tuple(x.shape)}, {x.dtype}), got {tuple(residual.shape)}, {residual.dtype}"
            )
    check_runnable(x, weight, *([] if residual is None else [residual]))
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if rows == 0:
        return out
    block = triton.next_power_of_2(n)
    res = x if residual is None else residual
    _rms_norm_kernel[(rows,)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), n, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=norm_warps(block), **FP_FUSION,
    )  # fmt: skip
    return out


def rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> None:
    _check_float("q", q)
    _check_float("k", k)
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must be [T, Hq, D] and [T, Hk, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    t, hq, d = q.shape
    if d % 2 or d == 0:
        raise ValueError(f"head dim is {d}; allowed: an even number >= 2")
    if min(hq, k.shape[1]) < 1:
        raise ValueError(f"q and k have {hq} and {k.shape[1]} heads; allowed: >= 1 each")
    if positions.dtype != torch.int64 or positions.shape != (t,) or not positions.is_contiguous():
        raise ValueError(f"positions must be contiguous int64 [{t}], got {positions.dtype} {tuple(positions.shape)}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dtype != torch.float32 or table.dim() != 2 or table.shape[1] < d or not table.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 [max_positions, >= {d}], got {table.dtype} "
                             f"{tuple(table.shape)}")  # fmt: skip
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    norm = q_weight is not None or k_weight is not None
    if norm:
        for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
            if w is None or w.shape != (d,) or w.dtype != q.dtype or not w.is_contiguous():
                got = "None" if w is None else f"{tuple(w.shape)} {w.dtype}"
                raise ValueError(f"{name} must be contiguous [{d}] (the head dim) of q's dtype {q.dtype}, got {got}")
        _check_eps(eps)
    check_runnable(positions, q, k, cos, sin, *((q_weight, k_weight) if norm else ()))
    if t == 0:
        return
    if debug_checks() and not bool(((positions >= 0) & (positions < cos.shape[0])).all()):
        bad = positions[(positions < 0) | (positions >= cos.shape[0])][0].item()
        raise ValueError(f"position {bad} is outside the rotary tables [0, {cos.shape[0]})")
    half = d // 2
    _rotary_kernel[(t,)](
        positions, q, k, cos, sin, q_weight if norm else q, k_weight if norm else k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), float(eps),
        HQ=hq, HK=k.shape[1], HALF=half, BLOCK_H=triton.next_power_of_2(max(hq, k.shape[1])),
        BLOCK_HALF=triton.next_power_of_2(half), HAS_NORM=norm, num_warps=4, **FP_FUSION,
    )  # fmt: skip


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    _check_float("gate", gate)
    _check_float("up", up)
    if gate.dim() != 2 or gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"gate and up must be [rows, n] of one shape and dtype, got {tuple(gate.shape)} {gate.dtype} "
            f"and {tuple(up.shape)} {up.dtype}"
        )
    check_runnable(gate, up)
    rows, n = gate.shape
    out = torch.empty((rows, n), dtype=gate.dtype, device=gate.device)
    if rows == 0 or n == 0:
        return out
    block = min(triton.next_power_of_2(n), 1024)
    _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](
        gate, up, out, gate.stride(0), up.stride(0), out.stride(0), n, BLOCK=block, num_warps=4, **FP_FUSION
    )
    return out
