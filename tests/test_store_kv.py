"""store_kv: the Triton kernel writes exactly the mapped slots, skips padding, touches nothing else."""

from __future__ import annotations

import pytest
import torch

import triton_kernels
from minengine.ops import reference


def make_case(dtype, page_size, device, num_tokens=11, hkv=2, d=64, num_pages=6, kv_views=True, pad=3):
    if kv_views:
        kv = torch.randn(num_pages, 2, page_size, hkv, d, device=device).to(dtype)
        k_cache, v_cache = kv[:, 0], kv[:, 1]
    else:
        k_cache = torch.randn(num_pages, page_size, hkv, d, device=device).to(dtype)
        v_cache = torch.randn(num_pages, page_size, hkv, d, device=device).to(dtype)
    capacity = num_pages * page_size
    n_real = min(num_tokens - pad, capacity)
    slots = torch.randperm(capacity)[:n_real]
    slots = torch.cat([slots, torch.full((num_tokens - n_real,), -1)])[torch.randperm(num_tokens)]
    k = torch.randn(num_tokens, hkv, d, device=device).to(dtype)
    v = torch.randn(num_tokens, hkv, d, device=device).to(dtype)
    return k, v, k_cache, v_cache, slots.to(device)


@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_kv_matches_reference_exactly(dtype, page_size, device, kernels):
    k, v, k_cache, v_cache, slots = make_case(dtype, page_size, device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.store_kv(k, v, k_ref, v_ref, slots)
    kernels.store_kv(k, v, k_cache, v_cache, slots)
    # bit-exact everywhere: written slots hold k/v, every other slot is unchanged
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("head_dim", [32, 80, 256])
def test_store_kv_head_dims_and_separate_caches(head_dim, device, kernels):
    k, v, k_cache, v_cache, slots = make_case(torch.float16, 5, device, d=head_dim, hkv=3, kv_views=False)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    kernels.store_kv(k, v, k_cache, v_cache, slots)
    page_size = k_cache.shape[1]
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(k_cache[s // page_size, s % page_size], k[i])
            assert torch.equal(v_cache[s // page_size, s % page_size], v[i])
            before_k[s // page_size, s % page_size] = k[i]
            before_v[s // page_size, s % page_size] = v[i]
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)


def test_store_kv_from_views_of_a_merged_projection(device, kernels):
    """k and v as the engine passes them: views into one q/k/v projection output (rows strided)."""
    k, v, k_cache, v_cache, slots = make_case(torch.bfloat16, 5, device)
    t, hkv, d = k.shape
    qkv = torch.randn(t, (3 + 2) * hkv * d, device=device).to(torch.bfloat16)
    k_view = qkv[:, 3 * hkv * d : 4 * hkv * d].view(t, hkv, d)
    v_view = qkv[:, 4 * hkv * d :].view(t, hkv, d)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.store_kv(k_view.contiguous(), v_view.contiguous(), k_ref, v_ref, slots)
    kernels.store_kv(k_view, v_view, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "shift"), [(torch.bfloat16, 64, 1), (torch.float16, 36, 0), (torch.float32, 6, 0)]
)
def test_store_kv_rows_that_16_byte_pieces_cannot_copy(dtype, head_dim, shift, device, kernels):
    """The CUDA kernel copies 16-byte pieces where every row start is 16-byte aligned; here k and v
    start one element into their buffer, or the head dim is no multiple of 16 bytes: values
    one by one, the same result."""
    k, v, k_cache, v_cache, slots = make_case(dtype, 5, device, d=head_dim, hkv=3)
    t, hkv, d = k.shape
    buffer = torch.randn(2, t * hkv * d + shift, device=device).to(dtype)
    k_view, v_view = (buffer[i, shift:].view(t, hkv, d) for i in range(2))
    k_view.copy_(k), v_view.copy_(v)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.store_kv(k, v, k_ref, v_ref, slots)
    kernels.store_kv(k_view, v_view, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_store_kv_head_dim_inside_wider_rows_and_odd_row_strides(device, kernels):
    """Every stride a multiple of 16 bytes but the head dim (36 of 40-value rows), or the head dim
    fine but the token stride odd (rows of a wider buffer): each needs the value-by-value copy."""
    t, hkv, page, pages = 7, 3, 5, 4
    slots = torch.randperm(page * pages)[:t].to(device)
    wide = torch.randn(2, pages, page, hkv, 40, device=device).to(torch.float16)
    k_cache, v_cache = wide[0, ..., :36], wide[1, ..., :36]
    kv = torch.randn(2, t, hkv, 40, device=device).to(torch.float16)
    cases = [(kv[0, ..., :36], kv[1, ..., :36], k_cache, v_cache)]
    rows = [torch.randn(t, hkv * 64 + 1, device=device).to(torch.bfloat16) for _ in range(2)]  # aligned starts
    k2, v2 = (r[:, : hkv * 64].view(t, hkv, 64) for r in rows)  # token stride hkv * 64 + 1
    caches = torch.randn(2, pages, page, hkv, 64, device=device).to(torch.bfloat16)
    cases.append((k2, v2, caches[0], caches[1]))
    for k, v, kc, vc in cases:
        k_ref, v_ref = kc.clone(), vc.clone()
        reference.store_kv(k.contiguous(), v.contiguous(), k_ref, v_ref, slots)
        kernels.store_kv(k, v, kc, vc, slots)
        assert torch.equal(kc, k_ref) and torch.equal(vc, v_ref)


def test_store_kv_all_padding_and_empty(device, kernels):
    k, v, k_cache, v_cache, slots = make_case(torch.float16, 4, device)
    before = k_cache.clone()
    kernels.store_kv(k, v, k_cache, v_cache, torch.full_like(slots, -1))
    kernels.store_kv(k[:0], v[:0], k_cache, v_cache, slots[:0])
    assert torch.equal(k_cache, before)


def test_store_kv_refuses_empty_heads():
    """Hkv or D of 0 crashed inside Triton (an arange of 0); now a ValueError as any bad shape."""
    for shape in ((4, 0, 8), (4, 2, 0)):
        k = torch.zeros(shape)
        cache = torch.zeros(3, 4, *shape[1:])
        for impl in (triton_kernels.store_kv, reference.store_kv):
            with pytest.raises(ValueError, match=r"k's \[Hkv, D\] is .*; allowed: each >= 1"):
                impl(k, k, cache, cache.clone(), torch.arange(4))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(slot_mapping=lambda a: a["slot_mapping"].int()), "slot_mapping.dtype"),
        (dict(k=lambda a: a["k"].float()), "k.dtype"),
        (dict(v=lambda a: a["v"][:, :1]), "v has shape"),
        (dict(k=lambda a: a["k"][..., :32], v=lambda a: a["v"][..., :32]), "must match the cache"),
        (dict(slot_mapping=lambda a: a["slot_mapping"][:3]), "slot_mapping has shape"),
        (dict(slot_mapping=lambda a: a["slot_mapping"].repeat_interleave(2)[::2]), "slot_mapping must be contiguous"),
    ],
)
def test_store_kv_bad_arguments(change, message, device):
    k, v, k_cache, v_cache, slots = make_case(torch.float16, 4, device)
    args = dict(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    args.update({name: fn(args) for name, fn in change.items()})
    for impl in (triton_kernels.store_kv, reference.store_kv):
        with pytest.raises(ValueError, match=message):
            impl(**args)


def test_store_kv_debug_checks(device, monkeypatch):
    k, v, k_cache, v_cache, slots = make_case(torch.float16, 4, device)
    monkeypatch.setenv("MINENGINE_KERNEL_DEBUG", "1")
    with pytest.raises(ValueError, match="allowed: < num_pages"):
        triton_kernels.store_kv(k, v, k_cache, v_cache, slots * 0 + 10**6)
    with pytest.raises(ValueError, match="one slot twice"):
        triton_kernels.store_kv(k, v, k_cache, v_cache, slots * 0)
