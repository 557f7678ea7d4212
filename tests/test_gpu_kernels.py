"""GPU-only kernel tests: large grids, caches past 2**31 elements, split-KV at scale, FlashInfer.

Marked ``gpu``: skipped without CUDA. (Every CPU test in this folder also runs on the GPU, with
the compiled kernels, when CUDA is present.)
"""

from __future__ import annotations

import random

import pytest
import torch

import triton_kernels
from minengine.ops import flashinfer_ref, reference
from minengine.ops.testing import make_paged_batch, relative_error
from triton_kernels.attention import pick_num_splits

pytestmark = pytest.mark.gpu
BF16_TOL = 1.6e-2


def check(batch, kernels, tol=BF16_TOL, **kwargs):
    out = torch.full_like(batch.q, float("nan"))
    kernels.paged_attention(*batch.args(), out=out, **kwargs)
    torch.cuda.synchronize()
    ref = reference.paged_attention(*batch.to_float64())
    assert not out.isnan().any()
    err = relative_error(out, ref)
    assert err < tol, err
    return out


def llama_batch(q_lens, kv_lens, **kw):
    kw = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16, device="cuda") | kw
    return make_paged_batch(q_lens, kv_lens, **kw)


def test_large_mixed_grid(kernels):
    """256 decodes + chunks over long prefixes + a fresh 16k prompt, thousands of pages."""
    rng = random.Random()
    kv = [rng.randint(1, 4096) for _ in range(256)] + [16384, 9000, 3000]
    q = [1] * 256 + [16384, 2048, 777]
    order = list(range(len(kv)))
    rng.shuffle(order)
    batch = llama_batch([q[i] for i in order], [kv[i] for i in order])
    assert batch.k_cache.shape[0] > 2000
    check(batch, kernels=kernels)


@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_large_page_sizes(page_size, kernels):
    check(llama_batch([1] * 64 + [1000], [3000] * 64 + [5000], page_size=page_size), kernels=kernels)


def test_cache_past_2_pow_31_elements(kernels):
    """Pages used by the batch sit past element 2**31 of the cache (64-bit offsets)."""
    per_page = 16 * 8 * 128
    first = 2**31 // per_page + 10
    batch = llama_batch([1, 300, 1], [700, 900, 65], first_page=first)
    assert batch.k_cache.shape[0] * per_page > 2**31
    check(batch, kernels=kernels)
    k = torch.randn(4, 8, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([first * 16 + 3, -1, (batch.k_cache.shape[0] - 1) * 16 + 15, first * 16 + 40], device="cuda")
    kernels.store_kv(k, -k, batch.k_cache, batch.v_cache, slots)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(batch.k_cache[s // 16, s % 16], k[i])
            assert torch.equal(batch.v_cache[s // 16, s % 16], -k[i])


def test_split_kv_long_decodes(kernels):
    batch = llama_batch([1] * 4, [16384, 12000, 30, 16000])
    assert pick_num_splits(4, 4, 4, 8, torch.device("cuda")) > 1
    check(batch, kernels=kernels)
    for splits in (1, 2, 16):
        check(batch, num_splits=splits, kernels=kernels)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes_at_scale(dtype, kernels):
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    check(llama_batch([1] * 32 + [512], [2000] * 32 + [3000], dtype=dtype), tol=tol, kernels=kernels)


def test_gather_input_ids_large(kernels):
    prefill = torch.randint(0, 150000, (8192,), device="cuda")
    buffer = torch.randint(0, 150000, (1024,), device="cuda")
    idx = torch.randperm(1024, device="cuda")[:256]
    out = kernels.gather_input_ids(prefill, buffer, idx)
    assert torch.equal(out, torch.cat([prefill, buffer[idx]]))


@pytest.mark.skipif(not flashinfer_ref.available(), reason="flashinfer is not installed")
@pytest.mark.parametrize("decode_only", [True, False])
def test_agrees_with_flashinfer(decode_only):
    q = [1] * 63 + ([] if decode_only else [2048])
    kv = [4096] * 63 + ([] if decode_only else [10240])
    batch = llama_batch(q, kv, poison=False)
    ours = triton_kernels.paged_attention(*batch.args())  # the Triton kernel against FlashInfer
    theirs = flashinfer_ref.FlashInferPagedAttention(*batch.args()[:6]).run()
    assert relative_error(ours, theirs.to(ours.dtype)) < BF16_TOL


@pytest.mark.skipif(not flashinfer_ref.available(), reason="flashinfer is not installed")
@pytest.mark.parametrize("decode_only", [True, False])
def test_flashinfer_replans_behind_a_busy_stream(decode_only):
    """Overlap scheduling plans step N + 1 while step N (its plan's copies included) is still queued
    on the device. Plans from staged host metadata never sync, so two batches planned and run behind
    a long sleep kernel would share FlashInfer's pinned plan buffer; each must still get its own
    result (the backend waits for the previous plan's copies before it plans again)."""
    from minengine.ops import HostMetadata

    rng = random.Random()
    batches = []
    for _ in range(2):
        n = rng.randint(4, 40)
        q = [1] * n if decode_only else [rng.choice([1, 1, 7, 300]) for _ in range(n)]
        batches.append(llama_batch(q, [x + rng.randint(0, 6000) for x in q], poison=False))
    hosts = [HostMetadata(b.seq_lens_host, b.cu_seqlens_q.tolist()) for b in batches]  # before: .tolist() syncs
    backend = flashinfer_ref.FlashInferBackend()
    for b in batches:  # create the wrappers and compile outside the timed part
        backend(*b.args())
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # about 0.1 s of device time ahead of everything below
    outs = []
    for b, host in zip(batches, hosts, strict=True):
        backend.stage(b.block_tables, b.seq_lens, b.cu_seqlens_q, host)
        outs.append(backend(*b.args()))
    torch.cuda.synchronize()
    assert backend.host_plans == 2
    for b, out in zip(batches, outs, strict=True):
        assert relative_error(out, reference.paged_attention(*b.to_float64())) < BF16_TOL
