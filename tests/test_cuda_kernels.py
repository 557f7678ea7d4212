"""The CUDA C++ attention kernels beyond the shared contract tests: both kernels (tensor cores and
CUDA cores), which one ``auto`` picks, prefill and decode tiles in one launch, split-KV, wide GQA
groups, Hopper's wgmma prefill tiles (K/V by cp.async, or by TMA; pipelined), and random batches.

On a GPU these run the real kernels of ``minengine._C``; without one, the same sources compiled
for the CPU and run by the warp-level emulator (``minengine/ops/cuda_emulator.py``).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from conftest import HAS_CUDA, use_cuda_emulator
from test_paged_attention import run_and_check

from minengine import ops
from minengine.ops import cuda
from minengine.ops.cuda import TMA_IMPLS
from minengine.ops.testing import aligned_rows, make_paged_batch


@pytest.fixture
def dev():
    """The device the cuda backend runs on here: the GPU, or the CPU through the emulator."""
    if HAS_CUDA:
        if not cuda.available():
            pytest.skip("minengine._C is not built")
        yield torch.device("cuda")
        return
    use_cuda_emulator()
    yield torch.device("cpu")
    cuda.use_emulator(False)


def needs_wgmma(dev):
    """The wgmma prefill tiles run on an sm_90 GPU (H100, H200) with a 9.0a build, and in the emulator."""
    if dev.type == "cuda":
        if torch.cuda.get_device_capability(dev) != (9, 0):
            pytest.skip("wgmma needs an sm_90 GPU")
        try:
            cuda.paged_attention(*batch_for([20], [20], torch.bfloat16, dev).args(), impl="wgmma")
        except ValueError as exc:
            if "needs a build with 9.0a" not in str(exc):
                raise
            pytest.skip(str(exc))


def check(batch, dtype, **kwargs):
    """The contract tests' check (NaN-poisoned output, float64 reference) on the cuda backend."""
    return run_and_check(batch, dtype, kernels=ops.get_kernels("cuda", batch.q.device), **kwargs)


def batch_for(q_lens, kv_lens, dtype, device, hq=8, hkv=2, d=64, page=16, **kw):
    return make_paged_batch(
        q_lens, kv_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page, dtype=dtype, device=device, **kw
    )


def tma_ready(batch, impl):
    """For the TMA impls: the batch with its caches 128-byte aligned and in rows of 64-element
    multiples (NaN padding), as TMA takes them (CPU tensors are only 64-byte aligned), checked to
    run with TMA; other impls: the batch as it is."""
    if impl not in TMA_IMPLS:
        return batch
    width = -(-batch.q.shape[-1] // 64) * 64
    batch = dataclasses.replace(
        batch, k_cache=aligned_rows(batch.k_cache, width), v_cache=aligned_rows(batch.v_cache, width)
    )
    assert cuda.chosen_kernel(*batch.args(), impl=impl) == impl
    return batch


@pytest.mark.parametrize("impl", ["mma", "simt"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_both_kernels(impl, dtype, dev):
    batch = batch_for([1, 7, 0, 1, 12, 3], [9, 7, 4, 23, 30, 3], dtype, dev, page=5)
    check(batch, dtype, impl=impl)


def test_auto_picks_tensor_cores_when_they_apply(dev):
    aligned = batch_for([1, 9], [20, 9], torch.bfloat16, dev)
    assert cuda.chosen_kernel(*aligned.args()) == "mma"
    assert cuda.chosen_kernel(*aligned.args(), impl="simt") == "simt"
    fp32 = batch_for([1, 9], [20, 9], torch.float32, dev)
    assert cuda.chosen_kernel(*fp32.args()) == "simt"
    # K rows 2 bytes off a 16-byte boundary: cp.async cannot move them; the CUDA-core kernel can.
    k = aligned.k_cache.contiguous()
    storage = torch.empty(k.numel() + 8, dtype=k.dtype, device=k.device)
    shifted_k = storage[1 : 1 + k.numel()].view(k.shape)
    shifted_k.copy_(k)
    shifted = dataclasses.replace(aligned, k_cache=shifted_k)
    assert cuda.chosen_kernel(*shifted.args()) == "simt"
    check(shifted, torch.bfloat16)
    check(shifted, torch.bfloat16, num_splits=4)  # workspaces allocated, the CUDA-core kernel ignores them
    with pytest.raises(ValueError, match="needs 16-byte aligned K/V rows"):  # forced: an error, not a fault
        cuda.paged_attention(*shifted.args(), impl="mma")
    # chosen_kernel names the kernel that would run: a forced one that refuses the inputs raises as
    # paged_attention does, rather than naming a kernel that never runs
    for batch, impl, why in [
        (shifted, "mma", "needs 16-byte aligned K/V rows"),
        (shifted, "wgmma", "needs 16-byte aligned K/V rows"),
        (fp32, "mma", "takes fp16 or bf16, not fp32"),
        (batch_for([1, 9], [20, 9], torch.bfloat16, dev, d=256), "wgmma", "head_dim up to 128, not 256"),
    ]:
        with pytest.raises(ValueError, match=why):
            cuda.chosen_kernel(*batch.args(), impl=impl)
        with pytest.raises(ValueError, match=why):
            cuda.paged_attention(*batch.args(), impl=impl)


@pytest.mark.parametrize("num_splits", [1, 2, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_and_decode_tiles_in_one_launch(num_splits, dtype, dev):
    """Chunks over a prefix and fresh prompts (64-row tiles) next to decodes and a 2-token chunk
    (16-row tiles), an empty entry and padding rows, with and without split-KV."""
    q_lens = [1, 70, 1, 0, 2, 33, 1]
    kv_lens = [100, 90, 5, 7, 40, 33, 64]
    batch = batch_for(q_lens, kv_lens, dtype, dev, num_tokens=sum(q_lens) + 5)
    out = check(batch, dtype, num_splits=num_splits)
    assert torch.equal(out[sum(q_lens) :], torch.zeros_like(out[sum(q_lens) :]))


@pytest.mark.parametrize(("impl", "tile"), [("auto", 64), ("wgmma-2wg", 128)])
@pytest.mark.parametrize("hkv", [1, 2, 3, 4, 8, 12])
def test_block_order(hkv, impl, tile, dev):
    """The tensor-core kernel's blocks in launch order (grid x fastest), as its own block_work maps
    them (the emulator's attention_block_order): every prefill tile (64 rows; 128 for the
    two-warpgroup kernel), decode tile and padding block once per KV head; heavy-first, a sequence's
    tiles last first with KV heads interleaved; in-order, as before. Padding tokens make blocks past
    the last sequence, which must do nothing."""
    from test_paged_attention import block_order_properties

    from minengine.ops import cuda_emulator

    if dev.type == "cuda":
        pytest.skip("reads the order through the emulator's block_work")
    # sequence 7: 64 tokens x group 2 are 2 tiles of 64 rows, on 3 blocks here (the spare one returns
    # at once); 128 tokens, 2 tiles of 128 rows
    q_lens = [1, 70, 1, 0, 2, 33, 130, tile]
    kv_lens = [100, 90, 5, 7, 40, 33, 200, tile]
    group = 2
    batch = batch_for(q_lens, kv_lens, torch.bfloat16, dev, hq=group * hkv, hkv=hkv, num_tokens=sum(q_lens) + 40)
    batch = tma_ready(batch, impl)
    rows = [q * group for q in q_lens]
    prefill = {(b, t) for b, n in enumerate(rows) if n > 16 for t in range(-(-n // tile))}
    decode = {(b, -1) for b, n in enumerate(rows) if n <= 16}
    for block_order in (0, 1):
        _, args = cuda._attention_call(*batch.args(), None, batch.q, impl)
        order = [tuple(b) for b in cuda_emulator.attention_block_order(**args | {"block_order": block_order}).tolist()]
        padding = [b for b in order if b[1] == len(q_lens)]
        tiles = [b for b in order if 0 <= b[1] < len(q_lens) and (b[2] < 0 or b[2] * tile < rows[b[1]])]
        assert sorted(padding) == [(h, len(q_lens), 0) for h in range(hkv)]
        assert sorted(tiles) == sorted((h, *w) for h in range(hkv) for w in prefill | decode)
        block_order_properties([(h, b, t * tile) for h, b, t in tiles if t >= 0], block_order == 0, hkv)
        if block_order == 0:  # a sequence with spare blocks: the spare one first, then its tiles last first
            assert [t for h, b, t in order if (h, b) == (0, 7)] == [2, 1, 0]
    with pytest.raises(ValueError, match=r"block_order 7; allowed: 0 \(heavy-first\), 1 \(in-order\)"):
        cuda_emulator.attention_block_order(**args | {"block_order": 7})


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_every_tile_shape_over_several_stages(head_dim, dev):
    """Each head-dim instantiation, prefill and decode tiles alike, walks several K/V stages
    (the single-buffered ones refill between stages)."""
    check(batch_for([1, 1, 40], [200, 129, 240], torch.bfloat16, dev, d=head_dim), torch.bfloat16, num_splits=1)


@pytest.mark.skipif(HAS_CUDA, reason="the emulator's copy timing; a GPU has its own")
@pytest.mark.parametrize(
    ("impl", "head_dim"),
    [
        ("mma", 64),
        ("mma", 256),
        ("wgmma", 64),
        ("wgmma", 128),
        ("wgmma-tma", 128),
        ("wgmma-pipe", 64),
        ("wgmma-pipe", 128),
        ("wgmma-2wg", 64),
        ("wgmma-2wg", 128),
    ],
)
def test_stages_are_refilled_only_after_every_warp_read_them(impl, head_dim, dev):
    """With copies landing at issue (as early as the GPU may land them) and one warp at a time
    running ahead, a refill issued before the barrier that ends the reads of its buffer gives the
    warps that read later the next stage's keys: a write-after-read race the default (latest
    landing, warps in lockstep) cannot show. Deleting the mma tile's trailing barrier fails every
    case here. The wgmma tile's cannot be checked this way: the emulator runs each wgmma as one
    collective of the whole warpgroup, so its reads end together (TMA loads land at issue too). What
    it does check there is the buffer count: the pipelined tile with two stage buffers instead of
    three refills the one its last P V still reads, and fails."""
    from minengine.ops import cuda_emulator

    batch = tma_ready(batch_for([1, 1, 40], [200, 129, 240], torch.bfloat16, dev, d=head_dim), impl)
    with cuda_emulator.cp_async_land_at_issue():
        check(batch, torch.bfloat16, num_splits=1, impl=impl)


@pytest.mark.parametrize(("hq", "hkv", "q_lens"), [(32, 1, [1, 3, 1]), (128, 1, [1, 2]), (10, 2, [4, 1, 20])])
def test_wide_and_odd_groups(hq, hkv, q_lens, dev):
    """A token's query heads spanning tiles (group 32, 128) and a group that does not divide 16."""
    check(batch_for(q_lens, [q + 30 for q in q_lens], torch.float16, dev, hq=hq, hkv=hkv), torch.float16)


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_wgmma_prefill_tiles(head_dim, dtype, dev):
    """Hopper's prefill tiles (wgmma, 128B-swizzled K/V stages, zero-padded head dims) over several
    stages, next to decode tiles, an empty entry and padding rows, with and without split-KV."""
    needs_wgmma(dev)
    q_lens = [70, 1, 0, 9, 1]
    kv_lens = [200, 150, 3, 140, 1]
    batch = batch_for(q_lens, kv_lens, dtype, dev, d=head_dim, num_tokens=sum(q_lens) + 3)
    assert cuda.chosen_kernel(*batch.args(), impl="wgmma") == "wgmma"
    for splits in (1, 2):
        out = check(batch, dtype, num_splits=splits, impl="wgmma")
        assert torch.equal(out[sum(q_lens) :], torch.zeros_like(out[sum(q_lens) :]))


@pytest.mark.parametrize("impl", ["mma", "wgmma", "wgmma-pipe", "wgmma-2wg"])
@pytest.mark.parametrize("scale", [0.37, -0.2, 0.0])
def test_softmax_scales_on_tensor_cores(impl, scale, dev):
    """The tensor-core tiles take the max of the raw scores and fold the scale into each weight's
    exponent, so a negative scale must flip Q's signs and a zero one (uniform weights over the keys
    a row sees) must not turn a masked key's -inf * 0 into NaN: prefill and decode tiles, masked
    and unmasked stages."""
    if impl.startswith("wgmma"):
        needs_wgmma(dev)
    batch = batch_for([70, 1, 3], [200, 150, 9], torch.bfloat16, dev, num_tokens=76)
    check(tma_ready(batch, impl), torch.bfloat16, impl=impl, softmax_scale=scale)


@pytest.mark.parametrize("impl", ["mma", "wgmma", "wgmma-tma", "wgmma-pipe", "wgmma-2wg"])
def test_unmasked_stages_end_where_the_first_row_stops_seeing(impl, dev):
    """Stages that every row of a tile sees whole skip the causal mask. Each sequence here puts a
    tile's first token one key before, at, or one key after the end of a 64-key wgmma prefill
    stage or a 16-key decode warp slice (the 64-row mma.sync tile masks every stage), so a bound
    one key too generous fails. One too strict only masks a stage that needs none: no output
    shows it. The last three do it for the second tile of 128 rows (32 tokens in, wgmma-2wg)."""
    if impl.startswith("wgmma"):
        needs_wgmma(dev)
    ctx = [62, 63, 64, 46, 47, 48, 30, 31, 32, 14, 15, 16, 94, 95, 96]
    q_lens = [20, 20, 20, 20, 20, 20, 3, 3, 3, 1, 1, 1, 40, 40, 40]  # group 4: 16 tokens per 64-row tile
    batch = batch_for(q_lens, [c + q for c, q in zip(ctx, q_lens, strict=True)], torch.bfloat16, dev)
    check(tma_ready(batch, impl), torch.bfloat16, impl=impl)


@pytest.mark.parametrize("impl", ["mma", "wgmma", "wgmma-pipe", "wgmma-2wg"])
def test_a_late_dominant_key_rescales_its_rows(impl, dev):
    """A key 40 times longer than the rest, in a late stage, raises its rows' max far past
    anything before it: fp16 P overflows unless acc and l are rescaled to the new max (prefill and
    decode tiles; the pipelined tile rescales O only after the previous stage's P V is in)."""
    if impl.startswith("wgmma"):
        needs_wgmma(dev)
    batch = tma_ready(batch_for([70, 1], [200, 150], torch.float16, dev), impl)
    for seq, key in ((0, 150), (1, 100)):
        page = int(batch.block_tables[seq, key // 16])
        batch.k_cache[page, key % 16] *= 40
    check(batch, torch.float16, impl=impl)


@pytest.mark.parametrize("page", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("head_dim", [32, 96, 128])
@pytest.mark.parametrize("impl", TMA_IMPLS)
def test_wgmma_tiles_load_whole_chunks_of_pages_by_tma(impl, page, head_dim, dev):
    """impls "wgmma-tma" and "wgmma-pipe": the prefill tiles' K/V come by TMA in chunks of min(page, 64) slots
    (several pages a 64-key stage, or 64-slot parts of a page). Head dims 32 and 96 sit in rows of
    64 and 128 elements (TMA takes 128-byte aligned bases and strides) whose padding holds NaN: the tensor map
    must zero-fill the dims past head_dim without reading them. Sequences end one slot before, at
    and one slot after a chunk's end: the chunk holding seq_len must go by cp.async (a TMA load of
    it would read the NaN past seq_len, which the emulator fails), as must chunks past a tile's
    keys; with split-KV too, beside decode tiles."""
    needs_wgmma(dev)
    rows = min(page, 64)
    end = -(-130 // rows) * rows  # a chunk end past the 20-token chunks' first tile
    q_lens = [20, 20, 20, 1, 7]
    kv_lens = [end - 1, end, end + 1, end - 1, end + 1]
    batch = batch_for(q_lens, kv_lens, torch.bfloat16, dev, d=head_dim, page=page, num_tokens=sum(q_lens) + 2)
    batch = tma_ready(batch, impl)
    for splits in (1, 2):
        check(batch, torch.bfloat16, num_splits=splits, impl=impl)


@pytest.mark.parametrize(("page", "head_dim"), [(1, 64), (3, 64), (24, 64), (48, 64), (96, 64), (16, 96)])
def test_wgmma_tma_runs_the_cp_async_tiles_where_tma_does_not_apply(page, head_dim, dev):
    """Page sizes that do not split a 64-key stage into whole chunks of at least 8 slots, and
    strides that are not 128-byte multiples (head dim 96 in unpadded rows: 192-byte head stride),
    run the wgmma kernel with cp.async (what ``chosen_kernel`` says), rightly, for either TMA impl."""
    needs_wgmma(dev)
    batch = batch_for([40, 1], [130, 70], torch.float16, dev, page=page, d=head_dim)
    for impl in TMA_IMPLS:
        assert cuda.chosen_kernel(*batch.args(), impl=impl) == "wgmma"
        check(batch, torch.float16, impl=impl)


@pytest.mark.parametrize("impl", ["wgmma-pipe", "wgmma-2wg"])
@pytest.mark.parametrize("page", [16, 128])
def test_wgmma_pipe_cycles_its_three_stage_buffers(page, impl, dev):
    """The pipelined tiles over 5 to 8 stages: each of their three buffers is filled twice or more (the
    mbarrier phase flips), each stage's P V is issued a stage late (the last one after the loop),
    with a dominant key in a late stage so O's deferred rescale matters; with the copies landing as
    late and as early as the GPU may land them. The 70-token chunk is 280 rows (group 4): for the
    two-warpgroup tile, two 128-row tiles and one whose first warpgroup holds 24 rows and whose
    second holds none."""
    from minengine.ops import cuda_emulator

    needs_wgmma(dev)
    batch = tma_ready(batch_for([70, 1, 20], [460, 300, 400], torch.float16, dev, d=128, page=page), impl)
    for seq, key in ((0, 390), (2, 330)):
        block = int(batch.block_tables[seq, key // page])
        batch.k_cache[block, key % page] *= 30
    for splits in (1, 2):
        check(batch, torch.float16, num_splits=splits, impl=impl)
    if dev.type == "cpu":
        with cuda_emulator.cp_async_land_at_issue():
            check(batch, torch.float16, impl=impl)


def test_wgmma_refuses_what_it_cannot_run(dev):
    batch = batch_for([20], [20], torch.bfloat16, dev, d=256)
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev) != (9, 0):
        with pytest.raises(ValueError, match="needs an sm_90 GPU|needs a build with 9.0a"):
            cuda.paged_attention(*batch_for([20], [20], torch.bfloat16, dev).args(), impl="wgmma")
    with pytest.raises(ValueError, match="the wgmma kernel takes head_dim up to 128, not 256"):
        cuda.paged_attention(*batch.args(), impl="wgmma")
    with pytest.raises(ValueError, match="tensor-core kernel takes fp16 or bf16"):
        cuda.paged_attention(*batch_for([20], [20], torch.float32, dev).args(), impl="wgmma")
    for impl in TMA_IMPLS:
        with pytest.raises(ValueError, match="the wgmma kernel takes head_dim up to 128, not 256"):
            cuda.chosen_kernel(*batch.args(), impl=impl)


@pytest.mark.skipif(HAS_CUDA, reason="the emulator's own checks")
def test_emulator_fails_a_copy_past_seq_len_or_outside_the_caches(dev):
    """How the tests see a read past seq_len that the kernel would mask away: every such slot
    holds a NaN, and the emulator's cp.async fails a copy of one (or of anything outside the
    caches). K loads that run on to the end of the last page pass every other test in this file,
    and fail 29 of them with this check."""
    from minengine.ops import cuda_emulator

    batch = batch_for([1, 3], [20, 9], torch.bfloat16, dev)
    check(batch, torch.bfloat16, impl="mma")
    page = int(batch.block_tables[1, 0])
    batch.k_cache[page, 2, 1, 5] = float("nan")  # a live key: what the check sees is the kernel's reads
    with pytest.raises(ValueError, match="cp.async reads a NaN"):
        cuda.paged_attention(*batch.args(), impl="mma")
    batch.k_cache[page, 2, 1, 5] = 0.0
    out = torch.empty_like(batch.q)  # alive while the kernel writes through its pointer
    _, args = cuda._attention_call(*batch.args(), None, out, "mma")
    with pytest.raises(ValueError, match="outside the memory declared readable"):
        cuda_emulator.paged_attention(readable=(torch.empty(64),), **args)
    cuda_emulator.paged_attention(readable=(batch.k_cache, batch.v_cache), **args)
    assert not out.isnan().any()


@pytest.mark.parametrize("impl", ["mma", "wgmma", "wgmma-tma", "wgmma-pipe", "wgmma-2wg"])
def test_random_batches(impl, dev):
    if impl.startswith("wgmma"):
        needs_wgmma(dev)
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    for _ in range(10 if impl == "mma" else 6):
        q_lens = [rng.choice([0, 1, 1, 2, 5, 17, 40, 70]) for _ in range(rng.randint(0, 5))]
        kv_lens = [q + rng.choice([0, 1, 3, 20, 90]) for q in q_lens]
        hkv, group = rng.choice([1, 2, 3]), rng.choice([1, 2, 4, 5, 8, 16])
        dims = [32, 48, 64, 96, 128, 160, 256] if impl == "mma" else [32, 48, 64, 96, 128]
        d, page = rng.choice(dims), rng.choice([8, 16, 32, 128] if impl in TMA_IMPLS else [1, 3, 16, 64])
        dtype = rng.choice([torch.float16, torch.bfloat16])
        splits = rng.choice([None, 1, 2, 4, 16])
        case = dict(q_lens=q_lens, kv_lens=kv_lens, hkv=hkv, group=group, d=d, page=page, dtype=dtype, splits=splits)
        batch = batch_for(
            q_lens, kv_lens, dtype, dev, hq=hkv * group, hkv=hkv, d=d, page=page, num_tokens=sum(q_lens) + 2
        )
        batch = tma_ready(batch, impl)
        try:
            check(batch, dtype, num_splits=splits, impl=impl)
        except (AssertionError, ValueError) as exc:  # ValueError: the emulator's checks
            raise AssertionError(f"seed {seed}, case {case}: {exc}") from exc


def test_bad_arguments_name_the_value(dev):
    batch = batch_for([1], [4], torch.float16, dev)
    with pytest.raises(ValueError, match=r"impl is 'fast'; allowed: auto, simt, mma, wgmma"):
        cuda.paged_attention(*batch.args(), impl="fast")
    with pytest.raises(ValueError, match="num_splits is 3; allowed: a power of two from 1 to 16"):
        cuda.paged_attention(*batch.args(), num_splits=3)
    fp32 = batch_for([1], [4], torch.float32, dev)
    with pytest.raises(ValueError, match="tensor-core kernel takes fp16 or bf16"):
        cuda.paged_attention(*fp32.args(), impl="mma")


def test_fast_div_matches_integer_division():
    """The kernels find a key's page with a multiply-high instead of a division (FastDiv): exact for
    every divisor from 1 to 2^31 - 1 and every key from 0 to 2^31 - 1, including the values next to
    multiples of the divisor and the top of the range."""
    import numpy as np

    from minengine.ops import cuda_emulator

    reason = cuda_emulator.unavailable_reason()
    if reason:
        pytest.skip(f"the CUDA kernel emulator cannot be built: {reason}")
    rng = np.random.default_rng()
    top = 2**31 - 1
    divisors = list(range(1, 300)) + [2**k + e for k in range(9, 31) for e in (-1, 0, 1)] + [top]
    divisors += rng.integers(1, top, size=200, endpoint=True).tolist()
    for d in divisors:
        multiples = np.array([d * m for m in (1, 2, 3, top // d - 1, top // d) if 0 < d * m <= top], dtype=np.int64)
        n = np.concatenate(
            [
                np.arange(0, min(d * 3, 4096), dtype=np.int64),
                multiples - 1,
                multiples,
                np.minimum(multiples + 1, top),
                np.array([top, top - 1, top - d + 1]),
                rng.integers(0, top, size=2000, endpoint=True),
            ]
        )
        n = n[(n >= 0) & (n <= top)]
        q = cuda_emulator.fast_div(d, n.astype(np.int32))
        expected = n // d
        bad = np.flatnonzero(q != expected)
        assert bad.size == 0, f"divisor {d}: n {n[bad[0]]} gave {q[bad[0]]}, expected {expected[bad[0]]}"
    for d in (0, -3, 2**31):
        with pytest.raises(ValueError, match=rf"divisor {d}; allowed: 1 to 2147483647"):
            cuda_emulator.fast_div(d, np.zeros(1, dtype=np.int32))
