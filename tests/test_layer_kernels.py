"""The decoder's fused elementwise layers (``triton_kernels/layers.py``): RMSNorm with the residual
add, rotary embedding in place, SiLU-and-mul. Each against a float64 reference and the torch
modules' own code, on strided views, with every contract check; then the engine with them."""

from __future__ import annotations

import pytest
import torch

from minengine import LLM, SamplingParams
from minengine.config import EngineConfig
from minengine.models.layers import MLP, RMSNorm, RotaryEmbedding
from minengine.ops import get_layer_kernels
from triton_kernels import layers as fused
from triton_kernels._common import interpreting

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ULP = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}  # relative rounding unit


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, ulps: float = 4, scale=None) -> None:
    """Within ``ulps`` roundings of ``scale`` (default: the wanted values) everywhere."""
    err = (got.double() - want.double()).abs()
    bound = ulps * ULP[dtype] * ((want.double().abs() if scale is None else scale) + 1e-2)
    assert bool((err <= bound).all()), f"worst error {err.max().item():.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(0, 16), (1, 1), (7, 128), (5, 300)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, rows, width, with_residual, device):
    eps = 1e-5
    base = torch.randn(rows, width + 8, device=device).to(dtype)
    x = base[:, :width]  # rows strided past their width
    weight = (1 + 0.1 * torch.randn(width, device=device)).to(dtype)
    residual = torch.randn(rows, width, device=device).to(dtype) if with_residual else None
    module = RMSNorm(width, eps).to(device=device, dtype=dtype)
    module.weight.data.copy_(weight)
    want_stream = (x + residual) if with_residual else x.clone()
    torch_out = module(x, None if residual is None else residual.clone())
    s = want_stream.double()
    want = weight.double() * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)).to(dtype).double()
    before = base.clone()
    out = fused.rms_norm(x, weight, eps, residual)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    close(out, want, dtype)
    close(out, torch_out, dtype)
    if with_residual and dtype is torch.bfloat16 and interpreting():
        close(residual, want_stream, dtype, ulps=1)  # the interpreter truncates float32 -> bfloat16
    elif with_residual:  # the stream is the rounded sum, exactly as torch's add
        assert torch.equal(residual, want_stream)
    assert torch.equal(base, before)  # x is read only


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, head_dim", [((4, 2), 32), ((5, 1), 80), ((3, 3), 16)])
def test_rotary_in_place(dtype, heads, head_dim, device):
    hq, hk = heads
    t, max_pos = 9, 64
    rope = RotaryEmbedding(head_dim, max_pos, 10000.0, None).to(device)
    # q, k as views of one projection output, v after them (untouched)
    qkv = torch.randn(t, (hq + 2 * hk) * head_dim, device=device).to(dtype)
    q = qkv[:, : hq * head_dim].view(t, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hk) * head_dim].view(t, hk, head_dim)
    positions = torch.randint(0, max_pos, (t,), device=device)
    positions[0], positions[-1] = 0, max_pos - 1
    want_q, want_k = rope(positions, q.clone(), k.clone())  # the torch code
    half = head_dim // 2
    c = rope.cos[positions, :half].to(dtype).double()[:, None]
    s = rope.sin[positions, :half].to(dtype).double()[:, None]

    def ref(x):
        x1, x2 = x[..., :half].double(), x[..., half:].double()
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    def size(x):  # the rounding scale of a rotated pair: its terms, not its (maybe cancelled) sum
        pair = x[..., :half].double().abs() + x[..., half:].double().abs()
        return torch.cat([pair, pair], -1)

    exact_q, exact_k, scale_q, scale_k = ref(q), ref(k), size(q), size(k)
    v_before = qkv[:, (hq + hk) * head_dim :].clone()
    fused.rotary(positions, q, k, rope.cos, rope.sin)
    close(q, exact_q, dtype, scale=scale_q)
    close(k, exact_k, dtype, scale=scale_k)
    close(q, want_q, dtype, scale=scale_q)  # torch rounds each product; the kernel rounds once
    close(k, want_k, dtype, scale=scale_k)
    assert torch.equal(qkv[:, (hq + hk) * head_dim :], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, head_dim", [((4, 2), 32), ((5, 1), 80), ((2, 2), 128)])
def test_rotary_with_qk_norms(dtype, heads, head_dim, device):
    """Qwen3's per-head q/k RMSNorms fused into the rotary launch, on views of one projection
    output: against float64 (norm, rounded as RMSNorm rounds, then the rotation) and the modules."""
    hq, hk = heads
    t, max_pos, eps = 7, 32, 1e-6
    rope = RotaryEmbedding(head_dim, max_pos, 1e6, None).to(device)
    norms = tuple(RMSNorm(head_dim, eps).to(device=device, dtype=dtype) for _ in range(2))
    for norm in norms:
        norm.weight.data.copy_(1 + 0.2 * torch.randn(head_dim, device=device))
    qkv = (3 * torch.randn(t, (hq + 2 * hk) * head_dim, device=device)).to(dtype)
    q = qkv[:, : hq * head_dim].view(t, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hk) * head_dim].view(t, hk, head_dim)
    positions = torch.randint(0, max_pos, (t,), device=device)
    want_q, want_k = rope(positions, q.clone(), k.clone(), None, norms)  # the torch code
    half = head_dim // 2
    c = rope.cos[positions, :half].to(dtype).double()[:, None]
    s = rope.sin[positions, :half].to(dtype).double()[:, None]

    def ref(x, weight):  # exact but for the two roundings RMSNorm makes; and each term's size
        xd = x.double()
        y = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)).to(dtype).double()
        y = (weight.double() * y).to(dtype).double()
        y1, y2 = y[..., :half], y[..., half:]
        pair = y1.abs() + y2.abs()
        return torch.cat([y1 * c - y2 * s, y2 * c + y1 * s], -1), torch.cat([pair, pair], -1)

    (exact_q, scale_q), (exact_k, scale_k) = ref(q, norms[0].weight), ref(k, norms[1].weight)
    v_before = qkv[:, (hq + hk) * head_dim :].clone()
    kernels = get_layer_kernels("triton", device)
    out_q, out_k = rope(positions, q, k, kernels, norms)
    assert out_q is q and out_k is k  # in place, on the views
    ulps = 4
    close(q, exact_q, dtype, ulps=ulps, scale=scale_q)
    close(k, exact_k, dtype, ulps=ulps, scale=scale_k)
    close(q, want_q, dtype, ulps=ulps, scale=scale_q)
    close(k, want_k, dtype, ulps=ulps, scale=scale_k)
    assert torch.equal(qkv[:, (hq + hk) * head_dim :], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(0, 8), (3, 7), (4, 1500)])
def test_silu_and_mul(dtype, rows, width, device):
    gate_up = torch.randn(rows, 2 * width, device=device).to(dtype)
    gate, up = gate_up[:, :width], gate_up[:, width:]  # views with the row stride of both
    out = fused.silu_and_mul(gate, up)
    g = gate.double()
    want = (g * torch.sigmoid(g)).to(dtype).double() * up.double()
    close(out, want, dtype)
    close(out, torch.nn.functional.silu(gate) * up, dtype, ulps=2)


def test_contract_checks_name_the_value_and_what_is_allowed(device):
    x = torch.randn(3, 8, device=device)
    w = torch.ones(8, device=device)
    cases = [
        (lambda: fused.rms_norm(x.int(), w, 1e-5), r"x has dtype torch.int32; allowed: float32, float16, bfloat16"),
        (lambda: fused.rms_norm(x, w.half(), 1e-5), r"weight must be contiguous \[8\] .* of x's dtype"),
        (lambda: fused.rms_norm(x[:, ::2], w[:4], 1e-5), r"x must have a contiguous last dim"),
        (lambda: fused.rms_norm(x, w, -1.0), r"eps is -1.0; allowed: a number >= 0"),
        (lambda: fused.rms_norm(x, w, None), r"eps is None; allowed: a number >= 0"),
        (lambda: fused.rms_norm(x, w, 1e-5, x[:2]), r"residual must match x \(\(3, 8\)"),
        (lambda: fused.rms_norm(x[None], w, 1e-5), r"x must be \[rows, n\], got shape \(1, 3, 8\)"),
        (lambda: fused.silu_and_mul(x, x[:, :4]), r"gate and up must be \[rows, n\] of one shape"),
    ]
    q = torch.randn(2, 4, 6, device=device)
    cos = torch.ones(10, 6, device=device)
    pos = torch.zeros(2, dtype=torch.int64, device=device)
    cases += [
        (lambda: fused.rotary(pos, q[..., :5], q[:, :2, :5], cos, cos), r"head dim is 5; allowed: an even number"),
        (lambda: fused.rotary(pos, q[..., :0], q[:, :2, :0], cos, cos), r"head dim is 0; allowed: an even number >= 2"),
        (lambda: fused.rotary(pos, q, q[:, :0], cos, cos), r"q and k have 4 and 0 heads; allowed: >= 1 each"),
        (lambda: fused.rotary(pos.int(), q, q[:, :2], cos, cos), r"positions must be contiguous int64 \[2\]"),
        (lambda: fused.rotary(pos, q, q[:, :2].half(), cos, cos), r"q and k must share a dtype"),
        (lambda: fused.rotary(pos, q, q[:, :2], cos[:, :4], cos[:, :4]), r"cos must be contiguous float32"),
        (lambda: fused.rotary(pos, q, q[:1], cos, cos), r"q and k must be \[T, Hq, D\] and \[T, Hk, D\]"),
        (lambda: fused.rotary(pos, q, q[:, :2], cos, cos, w[:6]), r"k_weight must be contiguous \[6\] .* got None"),
        (lambda: fused.rotary(pos, q, q[:, :2], cos, cos, w, w[:6]), r"q_weight must be contiguous \[6\] .* \(8,\)"),
        (lambda: fused.rotary(pos, q, q[:, :2], cos, cos, w[:6], w[:6].half()), r"k_weight .* torch.float16"),
        (lambda: fused.rotary(pos, q, q[:, :2], cos, cos, w[:6], w[:6], -1.0), r"eps is -1.0; allowed: a number >= 0"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    with pytest.raises(ValueError, match=r"unknown layer kernels 'fast'; allowed: auto, torch, triton"):
        get_layer_kernels("fast", device)
    with pytest.raises(ValueError, match=r"layer_kernels is 'fast'; allowed: auto, torch, triton"):
        EngineConfig(layer_kernels="fast")


def test_modules_dispatch_to_the_layer_kernels(device):
    """The modules with ``layers`` run the fused kernels, one call per use, and agree with their torch code."""
    kernels = get_layer_kernels("triton", device)
    calls = []
    counted = type(kernels)(
        *(lambda *a, f=f, n=n: calls.append(n) or f(*a) for n, f in zip(kernels._fields, kernels, strict=True))
    )
    mlp = MLP(16, 24).to(device)
    x = torch.randn(5, 16, device=device)
    close(mlp(x, counted), mlp(x), torch.float32, ulps=16)
    norm = RMSNorm(16, 1e-6).to(device)
    stream = torch.randn(5, 16, device=device)
    ours, theirs = stream.clone(), stream.clone()
    close(norm(x, ours, counted), norm(x, theirs), torch.float32, ulps=16)
    assert torch.equal(ours, theirs)  # both streams hold x + stream
    rope = RotaryEmbedding(8, 16, 10000.0, None).to(device)
    qk_norms = (RMSNorm(8, 1e-6).to(device), RMSNorm(8, 1e-6).to(device))
    q, k, positions = torch.randn(5, 4, 8, device=device), torch.randn(5, 2, 8, device=device), torch.arange(5)
    want = rope(positions.to(device), q, k, None, qk_norms)
    for got, ref in zip(rope(positions.to(device), q.clone(), k.clone(), counted, qk_norms), want, strict=True):
        close(got, ref, torch.float32, ulps=16)
    assert calls == ["silu_and_mul", "rms_norm", "rotary"]  # the q/k norms ride in the rotary launch
    assert get_layer_kernels("auto", "cpu") is None and get_layer_kernels("torch", device) is None


PROMPTS = ["the fused layers", "one launch each: norm, rotary, silu and mul", "x"]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("arch", ["tiny", "qwen3"])
def test_engine_with_triton_layer_kernels_matches_torch_layers(arch, tmp_path):
    """Greedy tokens (float32 on CPU) with the fused layers equal the torch layers' (qwen3: q/k norms too)."""
    from checkpoints import build_checkpoint

    model = "tiny" if arch == "tiny" else str(build_checkpoint(tmp_path / arch, arch))
    config = dict(device="cpu", dtype="float32", page_size=4, chunked_prefill_size=16)
    want = [o.token_ids for o in LLM(model, layer_kernels="torch", **config).generate(PROMPTS, PARAMS)]
    llm = LLM(model, layer_kernels="triton", **config)
    assert llm.engine.runner.kernels.layers is not None
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == want


def first_step_logits(model: str, device: str, dtype: str, layer_kernels: str) -> torch.Tensor:
    """The logits of the engine's first (prefill) step over ``PROMPTS``."""
    llm = LLM(model, device=device, dtype=dtype, layer_kernels=layer_kernels, disable_cuda_graph=True)
    assert (llm.engine.runner.kernels.layers is not None) == (layer_kernels != "torch")
    runner, seen = llm.engine.runner, []
    real = runner.model.forward
    runner.model.forward = lambda *a: seen.append(real(*a)) or seen[-1]
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    llm.shutdown()
    return seen[0]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("arch", ["tiny", "qwen3"])
def test_layer_kernels_on_gpu_are_as_accurate_as_the_torch_layers(dtype, arch, tmp_path):
    """On CUDA ``auto`` picks the fused layers. Against float32 logits of a prefill step, the fused
    layers' half-precision logits are about as close as the torch layers' (greedy tokens may flip
    on near-ties, so logits are compared). qwen3: its q/k norms run inside the rotary launch.
    (Under the interpreter bf16 is truncated, not rounded, so this is a GPU test.)"""
    from checkpoints import build_checkpoint

    from minengine.ops.testing import relative_error

    model = "tiny" if arch == "tiny" else str(build_checkpoint(tmp_path / arch, arch))
    want = first_step_logits(model, "cuda", "float32", "torch")
    fused_err = relative_error(first_step_logits(model, "cuda", dtype, "auto"), want)
    torch_err = relative_error(first_step_logits(model, "cuda", dtype, "torch"), want)
    assert fused_err <= 1.3 * torch_err + 1e-3, (fused_err, torch_err)
