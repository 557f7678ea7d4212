"""paged_attention: every rule of the contract, Triton kernel against the float64 reference.

Runs on CPU under TRITON_INTERPRET=1 (small shapes) and on a GPU when there is one.
Inputs are fresh random each run; caches are poisoned with NaN wherever the kernel must not read;
outputs are poisoned with NaN before each call, so an unwritten element fails.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import random

import numpy as np
import pytest
import torch

import triton_kernels
from minengine.ops import reference
from minengine.ops.testing import make_paged_batch, relative_error
from triton_kernels.contract import check_paged_attention, check_paged_attention_values

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# ||out - ref|| / ||ref|| against float64; bf16/fp16 carry the rounding of P before the PV matmul.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# A mixed batch: decodes, a fresh prompt, chunks over a cached prefix, and an empty entry.
MIXED_Q = [1, 7, 0, 1, 12, 3]
MIXED_KV = [9, 7, 4, 23, 30, 3]


def run_and_check(batch, dtype, kernels=None, **kwargs) -> torch.Tensor:
    attention = kernels.paged_attention if kernels is not None else triton_kernels.paged_attention
    out = torch.full_like(batch.q, float("nan"))
    res = attention(*batch.args(), out=out, **kwargs)
    assert res is out
    ref = reference.paged_attention(*batch.to_float64(), softmax_scale=kwargs.get("softmax_scale"))
    assert not out.isnan().any(), "output has unwritten (NaN) elements"
    err = relative_error(out, ref)
    assert err < TOL[dtype], f"relative error {err:.2e} >= {TOL[dtype]:.0e}"
    return out


def batch_for(q_lens, kv_lens, dtype, device, hq=4, hkv=2, d=64, page=5, **kw):
    return make_paged_batch(
        q_lens, kv_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page, dtype=dtype, device=device, **kw
    )


@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_batch_one_launch(dtype, page_size, device, kernels):
    run_and_check(batch_for(MIXED_Q, MIXED_KV, dtype, device, page=page_size), dtype, kernels=kernels)


@pytest.mark.parametrize("head_dim", [32, 64, 80, 128, 256])
def test_head_dims(head_dim, device, kernels):
    run_and_check(batch_for([1, 5], [6, 11], torch.float16, device, d=head_dim), torch.float16, kernels=kernels)


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (8, 2), (10, 2), (16, 1)])
def test_gqa_ratios(hq, hkv, device, kernels):
    run_and_check(
        batch_for([1, 4, 1], [12, 4, 20], torch.float16, device, hq=hq, hkv=hkv), torch.float16, kernels=kernels
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_fresh_prompts_only(dtype, device, kernels):
    run_and_check(batch_for([6, 17], [6, 17], dtype, device), dtype, kernels=kernels)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decodes_only(dtype, device, kernels):
    run_and_check(batch_for([1] * 5, [1, 5, 16, 33, 2], dtype, device, page=16), dtype, kernels=kernels)


@pytest.mark.parametrize("num_splits", [1, 2, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_kv(num_splits, dtype, device, kernels):
    """Flash-decoding path: long decodes (and a chunk) split num_splits ways, then merged."""
    batch = batch_for([1, 1, 9], [70, 3, 40], dtype, device, page=16)
    run_and_check(batch, dtype, num_splits=num_splits, kernels=kernels)


def test_split_kv_is_chosen_for_few_long_decodes(device):
    from triton_kernels.attention import pick_num_splits

    assert pick_num_splits(num_tokens=2, num_seqs=2, block_q=4, num_kv_heads=1, device=device) > 1
    assert pick_num_splits(num_tokens=4096, num_seqs=8, block_q=32, num_kv_heads=8, device=device) == 1


@pytest.mark.parametrize("kv_views", [True, False])
def test_cache_layouts(kv_views, device, kernels):
    batch = batch_for(MIXED_Q, MIXED_KV, torch.float16, device, kv_views=kv_views)
    assert batch.k_cache.is_contiguous() is not kv_views
    run_and_check(batch, torch.float16, kernels=kernels)


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("layout", ["head-major", "slot-major"])
def test_caches_past_2_pow_31_elements_in_any_layout(layout, num_splits, device, kernels):
    """Caches of [pages, page, Hkv, D] viewed from head-major storage [Hkv, pages, page, D] (the
    last head starts past element 2**31, its stride fits in 32 bits) or from slot-major storage
    [page, pages, Hkv, D] (the last slot of a page starts past 2**31): every offset is 64-bit.
    About 10 GB of address space of which only the first pages are touched (on CPU the rest stays
    uncommitted)."""
    hkv, page, d, t = (3, 16, 32, 5) if layout == "head-major" else (1, 16, 32, 5)
    if layout == "head-major":
        pages = 2**30 // (page * d) + 1  # head stride 2**30 + 512: head 2 starts past 2**31
        shape, order = (2, hkv, pages, page, d), (1, 2, 0, 3)
    else:
        pages = 2**31 // ((page - 1) * hkv * d) + 2  # slot 15 of a page starts past 2**31
        shape, order = (2, page, pages, hkv, d), (1, 0, 2, 3)
    try:
        storage = torch.empty(shape, dtype=torch.float16, device=device)
    except (RuntimeError, MemoryError) as e:  # an allocator that commits what it reserves
        pytest.skip(f"could not reserve {math.prod(shape) * 2 / 1e9:.1f} GB of address space: {e}")
    k_cache, v_cache = (storage[i].permute(*order) for i in range(2))
    assert max((hkv - 1) * k_cache.stride(2), (page - 1) * k_cache.stride(1)) > 2**31
    for cache in (k_cache, v_cache):  # the pages the batch reads
        cache[:2] = torch.randn(2, page, hkv, d, dtype=torch.float16, device=device)
    q = torch.randn(t, 2 * hkv, d, dtype=torch.float16, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    meta = (torch.tensor([[1, 0]], **i32), torch.tensor([page + t], **i32), torch.tensor([0, t], **i32), t)
    out = torch.full_like(q, float("nan"))
    kernels.paged_attention(q, k_cache, v_cache, *meta, out=out, num_splits=num_splits)
    small = (c[:2].double().contiguous() for c in (k_cache, v_cache))
    ref = reference.paged_attention(q.double(), *small, *meta)
    assert relative_error(out, ref) < TOL[torch.float16]
    k, v = (torch.randn(page, hkv, d, dtype=torch.float16, device=device) for _ in range(2))
    kernels.store_kv(k, v, k_cache, v_cache, torch.arange(page, device=device) + 2 * page)  # all of page 2
    assert torch.equal(k_cache[2], k) and torch.equal(v_cache[2], v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q_as_view_of_a_merged_projection(dtype, device, kernels):
    """The engine's q is the first heads of a merged q/k/v projection's rows: a view whose rows
    are strided past its heads. The k/v columns after it are NaN, so reading past q's heads fails."""
    batch = batch_for(MIXED_Q, MIXED_KV, dtype, device)
    t, hq, d = batch.q.shape
    qkv = torch.full((t, (hq + 2 * 2) * d), float("nan"), dtype=dtype, device=device)
    q = qkv[:, : hq * d].view(t, hq, d)
    q.copy_(batch.q)
    assert not q.is_contiguous()
    batch.q = q
    run_and_check(batch, dtype, kernels=kernels)


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [0.37, -0.37, 0.0, -0.0, 1e-46, -1e-300])
def test_softmax_scale(scale, dtype, num_splits, device, kernels):
    """Any finite scale: the Triton kernel takes row maxima of unscaled scores, which needs a
    positive scale, so it negates q for a negative one and zeroes it for one whose float32
    scale * log2(e) is 0 (a uniform average, as the float64 reference's)."""
    batch = batch_for([3, 1, 12], [8, 9, 14], dtype, device)
    run_and_check(batch, dtype, softmax_scale=scale, num_splits=num_splits, kernels=kernels)


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("page", [5, 16])
def test_k_and_v_caches_with_different_strides(page, num_splits, device, kernels):
    """K and V views of storages of different shapes: V's rows are padded past D and its pages
    are strided differently, so no offset of K's may be reused for V."""
    batch = batch_for(MIXED_Q, MIXED_KV, torch.float16, device, page=page)
    pages, size, hkv, d = batch.v_cache.shape
    padded = torch.full((pages, size + 1, hkv, d + 16), float("nan"), dtype=torch.float16, device=device)
    v_cache = padded[:, :size, :, :d]
    v_cache.copy_(batch.v_cache)
    assert v_cache.stride() != batch.k_cache.stride()
    batch.v_cache = v_cache
    run_and_check(batch, torch.float16, num_splits=num_splits, kernels=kernels)


def test_out_allocated_when_omitted(device, kernels):
    batch = batch_for([2, 1], [5, 6], torch.float16, device)
    out = kernels.paged_attention(*batch.args())
    ref = reference.paged_attention(*batch.to_float64())
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    assert relative_error(out, ref) < TOL[torch.float16]


@pytest.mark.parametrize("num_splits", [1, 4])
def test_padding_rows_are_zeroed(num_splits, device, kernels):
    """Rows past cu_seqlens_q[-1] (e.g. a padded graph batch) are written, as zeros."""
    batch = batch_for([1, 3], [7, 3], torch.float32, device, num_tokens=9)
    out = run_and_check(batch, torch.float32, num_splits=num_splits, kernels=kernels)
    assert torch.equal(out[4:], torch.zeros_like(out[4:]))


def test_empty_batches(device, kernels):
    batch = batch_for([0, 0], [4, 5], torch.float16, device)
    assert kernels.paged_attention(*batch.args()).shape == (0, 4, 64)
    none = batch_for([], [], torch.float16, device)
    assert kernels.paged_attention(*none.args()).shape == (0, 4, 64)


def test_random_batches(device, kernels):
    """Fresh random batch compositions, shapes and dtypes each run."""
    rng = random.Random()
    for _ in range(4):
        dtype = rng.choice(DTYPES)
        n = rng.randint(1, 4)
        kv = [rng.randint(1, 40) for _ in range(n)]
        q = [rng.choice([0, 1, rng.randint(0, s)]) for s in kv]
        hkv = rng.choice([1, 2])
        hq = hkv * rng.choice([1, 3, 4])
        batch = batch_for(q, kv, dtype, device, hq=hq, hkv=hkv, d=rng.choice([32, 48, 64]), page=rng.randint(1, 9))
        run_and_check(batch, dtype, num_splits=rng.choice([None, 1, 2]), kernels=kernels)


@pytest.mark.parametrize("hkv", [1, 2, 3, 4, 8])
def test_block_orders_give_the_same_output(hkv, device, kernels):
    """The order blocks start in changes no output bit: heavy-first (the default) and in-order on a
    batch of chunks, a fresh prompt, decodes, an empty entry and padding rows, split and not."""
    rng = random.Random()
    dtype = rng.choice([torch.float16, torch.bfloat16])
    q, kv = [37, 1, 0, 20, 1], [60, 9, 4, 20, 33]
    batch = batch_for(q, kv, dtype, device, hq=hkv * rng.choice([1, 2, 3]), hkv=hkv, d=32, page=16, num_tokens=62)
    for num_splits in (1, 2):
        outs = [
            run_and_check(batch, dtype, kernels=kernels, num_splits=num_splits, block_order=order)
            for order in ("heavy-first", "in-order")
        ]
        assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("order", ["", "heavy_first", None, 0])
def test_bad_block_order_raises(order, device, kernels):
    for batch in batch_for([3], [5], torch.float16, device), batch_for([0], [5], torch.float16, device):
        with pytest.raises(ValueError, match=r"block_order is .*; allowed: heavy-first, in-order"):
            kernels.paged_attention(*batch.args(), block_order=order)


def block_order_properties(order: list[tuple[int, int, int]], heavy_first: bool, num_kv_heads: int) -> None:
    """Checks a launch order, (KV head, sequence, first query row of the block) per block that does
    work: each block once, sequences in batch order within a KV head; heavy-first, a (head,
    sequence)'s blocks last first, with 4 KV heads interleaved where 4 divide num_kv_heads (else 2
    where 2 do) all along; in-order, first first, one KV head after another."""
    assert len(set(order)) == len(order), "a block launched twice"
    rows = collections.defaultdict(list)
    for head, seq, row in order:
        rows[head, seq].append(row)
    for (head, seq), seen in rows.items():
        assert seen == sorted(seen, reverse=heavy_first), (head, seq, seen)
    group = next(g for g in (4, 2, 1) if num_kv_heads % g == 0) if heavy_first else 1
    heads = [h for h, _, _ in order]
    assert all(h % group == i % group for i, h in enumerate(heads)), heads  # interleaved, in step
    assert [h // group for h in heads] == sorted(h // group for h in heads), heads
    for head in range(num_kv_heads):  # each head's blocks: sequences in batch order
        seqs = [b for h, b, _ in order if h == head]
        assert seqs == sorted(seqs), (head, seqs)


@pytest.mark.parametrize("hkv", [1, 2, 3, 4, 8])
def test_triton_block_order(hkv, monkeypatch):
    """The Triton kernel's programs in launch order: the order of their linear ids (axis 0 fastest),
    which the GPU starts them in (the interpreter runs axis 0 outermost: sorted here)."""
    from triton.runtime import interpreter

    from triton_kernels import attention

    if not os.environ.get("TRITON_INTERPRET"):
        pytest.skip("reads the launch order through the interpreter")
    for block_order in ("heavy-first", "in-order"):
        calls = []
        real = attention._attend_block

        def spy(*args, calls=calls, real=real):
            (x, y, z), (nx, ny, _) = interpreter.interpreter_builder.grid_idx, interpreter.interpreter_builder.grid_dim
            calls.append((x + nx * (y + ny * z), int(args[11]), int(args[7]), int(args[8])))  # kv_head, seq, tok0
            return real(*args)

        monkeypatch.setattr(attention, "_attend_block", spy)
        q_lens, kv_lens = [37, 1, 0, 20, 1], [60, 9, 4, 20, 33]
        batch = batch_for(q_lens, kv_lens, torch.float16, "cpu", hq=2 * hkv, hkv=hkv, d=32, num_tokens=59 + 19)
        triton_kernels.paged_attention(*batch.args(), block_order=block_order)
        monkeypatch.undo()
        order = [call[1:] for call in sorted(calls)]
        block_q = attention.pick_config(37, 2, 32, torch.float16, True).tokens(2)[0]
        ends = [*batch.cu_seqlens_q.tolist(), 59 + 19]  # the padding range: sequence 5, rows 59 to 77
        expected = {(h, b, t) for h in range(hkv) for b in range(6) for t in range(ends[b], ends[b + 1], block_q)}
        assert set(order) == expected
        block_order_properties(order, block_order == "heavy-first", hkv)


def test_triton_matches_torch_backend(device):
    """The torch backend (engine on CPU) and the kernel agree in the working dtype too."""
    batch = batch_for(MIXED_Q, MIXED_KV, torch.float32, device)
    torch.testing.assert_close(
        triton_kernels.paged_attention(*batch.args()), reference.paged_attention(*batch.args()), rtol=1e-5, atol=1e-5
    )


# --- argument checks -----------------------------------------------------------------------


def _bad(device, **change):
    batch = batch_for([2, 1], [4, 6], torch.float16, device)
    args = dict(
        zip(
            ["q", "k_cache", "v_cache", "block_tables", "seq_lens", "cu_seqlens_q", "max_seqlen_q"],
            batch.args(),
            strict=True,
        )
    )
    args.update(change)
    return args


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: dict(q=a["q"][..., :40]), "head dim"),
        (lambda a: dict(q=a["q"].float()), "must equal q.dtype"),
        (lambda a: dict(q=a["q"][:, :3]), "multiple of Hkv"),
        (lambda a: dict(q=a["q"][:, :0]), "Hq=0 must be a positive multiple"),
        (lambda a: dict(block_tables=a["block_tables"].long()), "block_tables.dtype"),
        (lambda a: dict(seq_lens=a["seq_lens"][:1]), "seq_lens has shape"),
        (lambda a: dict(cu_seqlens_q=a["cu_seqlens_q"].long()), "cu_seqlens_q.dtype"),
        (lambda a: dict(max_seqlen_q=-1), "max_seqlen_q"),
        (lambda a: dict(v_cache=a["v_cache"][:, :2]), "v_cache has shape"),
        (lambda a: dict(q=a["q"].transpose(1, 2).contiguous().transpose(1, 2)), "contiguous"),
    ],
)
def test_bad_arguments_raise(change, message, device, kernels):
    args = _bad(device)
    args.update(change(args))
    with pytest.raises(ValueError, match=message):
        kernels.paged_attention(**args)
    with pytest.raises(ValueError, match=message):
        reference.paged_attention(**args)


def test_float64_only_in_the_reference(device):
    args = _bad(device)
    args.update(q=args["q"].double(), k_cache=args["k_cache"].double(), v_cache=args["v_cache"].double())
    with pytest.raises(ValueError, match="q.dtype is torch.float64"):
        triton_kernels.paged_attention(**args)
    assert reference.paged_attention(**args).dtype == torch.float64


def test_bad_out_raises(device):
    args = _bad(device)
    with pytest.raises(ValueError, match="out has shape"):
        triton_kernels.paged_attention(**args, out=args["q"][:1])
    with pytest.raises(ValueError, match="out.dtype"):
        triton_kernels.paged_attention(**args, out=args["q"].float())


@pytest.mark.parametrize("num_splits", [0, 3, 32, 2.0, "2", True])
def test_bad_num_splits_raises(num_splits, device):
    with pytest.raises(ValueError, match="num_splits is .*; allowed: a power of two from 1 to 16"):
        triton_kernels.paged_attention(**_bad(device), num_splits=num_splits)


def test_any_integer_num_splits_and_scale_run(device):
    """A numpy integer is an integer (it ran into the kernel unconverted and failed there)."""
    args = _bad(device)
    want = triton_kernels.paged_attention(**args, num_splits=2, softmax_scale=0.25)
    got = triton_kernels.paged_attention(**args, num_splits=np.int64(2), softmax_scale=np.float32(0.25))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), True, "0.1", 1e39, -2.4e38])
def test_bad_softmax_scale_raises(scale, device, kernels):
    """NaN or inf made every output NaN without an error. The kernels take |scale| * log2(e) as a
    float32, so a scale for which that is inf is refused too, by every backend alike."""
    for run in (kernels.paged_attention, reference.paged_attention):
        with pytest.raises(ValueError, match=r"softmax_scale is .*; allowed: a finite number"):
            run(**_bad(device), softmax_scale=scale)


def test_a_bool_max_seqlen_q_raises(device):
    with pytest.raises(ValueError, match="max_seqlen_q must be a host int >= 0; got True"):
        triton_kernels.paged_attention(**_bad(device, max_seqlen_q=True))


def test_a_device_mismatch_names_every_device():
    """The odd one out may be q itself: the message lists them all, not 'k_cache is on cpu'."""
    args = _bad("cpu")
    args["q"] = args["q"].to("meta")
    with pytest.raises(ValueError, match="the tensors must be on one device; got q on meta, k_cache on cpu"):
        triton_kernels.paged_attention(**args)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: dict(cu_seqlens_q=a["cu_seqlens_q"] + 1), r"cu_seqlens_q\[0\]"),
        (
            lambda a: dict(cu_seqlens_q=torch.tensor([0, 2, 1], dtype=torch.int32, device=a["q"].device)),
            "non-decreasing",
        ),
        (lambda a: dict(max_seqlen_q=1), "exceeds max_seqlen_q"),
        (lambda a: dict(seq_lens=a["seq_lens"] * 0 + 1), "seq_lens"),
        (lambda a: dict(seq_lens=a["seq_lens"] + 1000), "max_pages_per_seq"),
        (lambda a: dict(block_tables=a["block_tables"] * 0 + 999), "page ids"),
    ],
)
def test_debug_value_checks(change, message, device, monkeypatch):
    """With MINENGINE_KERNEL_DEBUG=1 the launcher checks the values (host sync) too."""
    args = _bad(device)
    args.update(change(args))
    dims = check_paged_attention(**args, out=None)
    with pytest.raises(ValueError, match=message):
        check_paged_attention_values(
            dims, args["block_tables"], args["seq_lens"], args["cu_seqlens_q"], args["max_seqlen_q"]
        )
    monkeypatch.setenv("MINENGINE_KERNEL_DEBUG", "1")
    with pytest.raises(ValueError, match=message):
        triton_kernels.paged_attention(**args)


def test_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    import triton_kernels._common as common

    monkeypatch.setattr(common, "interpreting", lambda: False)
    batch = batch_for([1], [3], torch.float16, "cpu")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        triton_kernels.paged_attention(*batch.args())


@pytest.mark.parametrize(
    ("triton_version", "numpy_version", "broken"),
    [("3.6.0", "2.4.6", True), ("3.6.0", "2.3.5", False), ("3.7.1", "2.4.6", False), ("3.10.0", "3.0.0", False)],
)
def test_interpreter_with_numpy_it_cannot_run_is_a_clear_error(monkeypatch, triton_version, numpy_version, broken):
    """Triton < 3.7's interpreter fails on NumPy >= 2.4 deep inside the kernel; we say why first."""
    import numpy
    import triton

    import triton_kernels._common as common
    from triton_kernels import attention

    monkeypatch.setattr(triton, "__version__", triton_version)
    monkeypatch.setattr(numpy, "__version__", numpy_version)
    common.interpreter_problem.cache_clear()
    monkeypatch.setattr(attention, "interpreting", lambda: True)
    monkeypatch.setattr(common, "interpreting", lambda: True)  # on a GPU, TRITON_INTERPRET is unset
    try:
        assert bool(common.interpreter_problem()) is broken
        if broken:
            batch = batch_for([1], [3], torch.float32, "cpu")
            with pytest.raises(RuntimeError, match=rf"Triton {triton_version}.*NumPy {numpy_version}.*numpy<2\.4"):
                triton_kernels.paged_attention(*batch.args())
    finally:
        common.interpreter_problem.cache_clear()


@pytest.mark.parametrize("max_seqlen_q", [1, 2048])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_tile_configs(max_seqlen_q, dtype, device, monkeypatch):
    """The tile shapes picked for a GPU (decode and prefill rows) compute the same function.

    On CPU the interpreter normally runs small tiles; here it runs the GPU ones, so the block
    mapping with BLOCK_M = 128 / BLOCK_Q = 32 is executed, not only compiled.
    """
    from triton_kernels import attention

    real = attention.pick_config
    gpu = real(max_seqlen_q, 4, 64, dtype, interpret=False)
    monkeypatch.setattr(attention, "pick_config", lambda *a, **k: gpu)
    batch = batch_for([1, 40, 1, 70], [50, 40, 3, 90], dtype, device, hq=8, hkv=2, page=16)
    run_and_check(batch, dtype)
    run_and_check(batch, dtype, num_splits=2)


@pytest.mark.parametrize(
    ("block_m", "tile_n", "small_m", "hq", "d"),
    [(128, 64, 16, 8, 64), (64, 16, 16, 8, 64), (64, 16, 16, 6, 80), (32, 16, 32, 4, 48)],
)
@pytest.mark.parametrize("num_splits", [1, 2])
def test_tile_mapping(block_m, tile_n, small_m, hq, d, num_splits, device):
    """Every path of the kernel's block and tile mapping, with tile shapes the GPU would run.

    Blocks of at most SMALL_M // GROUP tokens (decodes, a chunk's short tail: 35 = 32 + 3 and
    37 = 32 + 5 with BLOCK_Q 32) take the small block, the others the big one; KV tiles at or
    below a block's first position run unmasked, the rest masked. Sequence lengths put the
    diagonal on, just before and just after tile edges; d 80 and 48 leave BLOCK_D past HEAD_DIM
    (the unmasked loads still mask columns: the decode at 48 ends a full tile mid-page, so an
    unmasked row would run into the poisoned slot after it), and 6/2 heads leave padding rows.
    """
    from triton_kernels import attention

    cfg = attention.AttentionConfig(block_m, tile_n, num_warps=4, num_stages=2, small_m=small_m)
    q_lens = [1, 35, 0, 1, 70, 37, 1, 4, 1]
    kv_lens = [130, 100, 4, 17, 70, 64, 63, 65, 48]
    page = 16 if d == 64 else 5
    for dtype in (torch.float32, torch.bfloat16):
        # 3 padding tokens past the last sequence: their block may take the small branch too
        batch = batch_for(q_lens, kv_lens, dtype, device, hq=hq, hkv=2, d=d, page=page, num_tokens=sum(q_lens) + 3)
        with block_table_reads(batch.block_tables) as reads:
            out = run_and_check(batch, dtype, num_splits=num_splits, config=cfg)
        assert torch.equal(out[sum(q_lens) :], torch.zeros_like(out[sum(q_lens) :]))
        if reads is not None:  # under the interpreter: no entry past a sequence's last page is read
            assert reads, "the spy saw no block-table read"
            for row, col in reads:
                assert col < -(-kv_lens[row] // page), f"sequence {row} read block-table column {col}"


@contextlib.contextmanager
def block_table_reads(block_tables: torch.Tensor):
    """Under Triton's interpreter, the (row, column) of every block-table entry a kernel loads
    (unmasked lanes only); None on a GPU."""
    if block_tables.device.type != "cpu":
        yield None
        return
    from triton.runtime import interpreter

    base, size = block_tables.data_ptr(), block_tables.numel() * block_tables.element_size()
    seen: set[tuple[int, int]] = set()
    real = interpreter.InterpreterBuilder.create_masked_load

    def spy(self, ptrs, mask, *args, **kwargs):
        addrs = np.asarray(ptrs.data, dtype=np.int64)
        hit = np.broadcast_to(np.asarray(mask.data, dtype=bool), addrs.shape) & (addrs >= base) & (addrs < base + size)
        for index in (addrs[hit] - base) // block_tables.element_size():
            seen.add(divmod(int(index), block_tables.stride(0)))
        return real(self, ptrs, mask, *args, **kwargs)

    interpreter.InterpreterBuilder.create_masked_load = spy
    try:
        yield seen
    finally:
        interpreter.InterpreterBuilder.create_masked_load = real


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(block_m=8), r"config\.block_m is 8; allowed: a power of two in \[16, 256\]"),
        (dict(block_m=48), r"config\.block_m is 48;"),
        (dict(block_m=512, small_m=16), r"config\.block_m is 512;"),
        (dict(block_m=16, small_m=32), r"config\.small_m is 32; allowed: a power of two in \[16, block_m 16\]"),
        (dict(small_m=8), r"config\.small_m is 8;"),
        (dict(tile_n=8), r"config\.tile_n is 8; allowed: a power of two in \[16, 256\]"),
        (dict(tile_n=48), r"config\.tile_n is 48;"),
        (dict(num_warps=3), r"config\.num_warps is 3; allowed: 1, 2, 4, 8 or 16"),
        (dict(num_stages=0), r"config\.num_stages is 0; allowed: an integer in \[1, 8\]"),
        (dict(num_stages=2.0), r"config\.num_stages is 2\.0; allowed: an integer"),
        (dict(num_warps=True), r"config\.num_warps is True; allowed: an integer"),
    ],
)
def test_bad_config_raises(change, message, device):
    from triton_kernels import attention

    cfg = attention.AttentionConfig(block_m=32, tile_n=16, num_warps=1, num_stages=1, small_m=16)._replace(**change)
    batch = batch_for([2, 1], [4, 6], torch.float16, device)
    with pytest.raises(ValueError, match=message):
        triton_kernels.paged_attention(*batch.args(), config=cfg)
    # a group of 32 query heads per KV head needs 32-row blocks
    wide_group = batch_for([1], [4], torch.float16, device, hq=32, hkv=1)
    small = attention.AttentionConfig(block_m=32, tile_n=16, num_warps=1, num_stages=1, small_m=16)
    with pytest.raises(ValueError, match=r"config\.small_m is 16; allowed: a power of two in \[32, block_m 32\]"):
        triton_kernels.paged_attention(*wide_group.args(), config=small)


def test_configs_pass_the_checks(device):
    """pick_config's shapes (not checked per call) are ones check_config accepts, and a config of
    NumPy integers runs as plain ints."""
    from triton_kernels import attention

    for interpret in (False, True):
        for dtype in DTYPES:
            for group in (1, 3, 4, 8, 16, 32):
                for head_dim in (32, 64, 128, 192, 256):
                    for max_seqlen_q in (1, 3, 2048):
                        for shared in (101376, 232448):  # sm_89, sm_90
                            cfg = attention.pick_config(max_seqlen_q, group, head_dim, dtype, interpret, shared)
                            assert attention.check_config(cfg, group) == cfg
    # a wide prefill tile runs 3 stages only where they fit (tests/test_compile_targets.py: sizes)
    assert attention.pick_config(2048, 4, 256, torch.bfloat16, False, 232448).num_stages == 3
    assert attention.pick_config(2048, 4, 256, torch.bfloat16, False, 101376).num_stages == 2
    assert attention.pick_config(2048, 4, 128, torch.bfloat16, False, 101376).num_stages == 3
    assert attention.pick_config(2048, 4, 128, torch.bfloat16, False, 65536).num_stages == 2
    numpy_cfg = attention.AttentionConfig(*(np.int64(v) for v in (32, 16, 1, 1, 16)))
    assert all(type(v) is int for v in attention.check_config(numpy_cfg, 4))
    run_and_check(batch_for([3, 1], [9, 6], torch.float32, device), torch.float32, config=numpy_cfg)


@pytest.mark.parametrize(("num_splits", "launches"), [(1, 1), (4, 2)])
def test_mixed_batch_is_one_launch(num_splits, launches, device, monkeypatch):
    """Prefill chunks and decodes share one kernel launch; split-KV adds exactly one merge launch."""
    from triton_kernels import attention

    calls = []
    for name in ("_paged_attention_kernel", "_merge_splits_kernel"):
        kernel = getattr(attention, name)

        class Counted:
            def __getitem__(self, grid, kernel=kernel, name=name):
                calls.append(name)
                return kernel[grid]

        monkeypatch.setattr(attention, name, Counted())
    run_and_check(batch_for(MIXED_Q, MIXED_KV, torch.float16, device), torch.float16, num_splits=num_splits)
    assert len(calls) == launches, calls
