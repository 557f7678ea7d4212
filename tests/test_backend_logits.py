"""Every attention backend inside the model, teacher-forced over two mixed steps against transformers'
float32 logits: step 1 holds a prefill chunk and a whole prompt, step 2 the chunk's continuation
over its cached prefix and a decode, with the pages of both sequences scattered over the pool.
The kernels' own contract tests check them alone; this checks what the model feeds them (strided
per-layer caches, store_kv before attention, one plan per step for flashinfer, made from the
host metadata staged as the runner stages it) and every row's
logits, not just greedy tokens.

On CPU: the torch and Triton (interpreted) backends in float32, and the CUDA kernels through the
emulator in fp16 (tensor-core and wgmma tiles, the latter also with TMA loads on 8-slot pages,
and pipelined, with one warpgroup a block or two). On a GPU (``gpu``): triton, cuda and the four
cuda-wgmma* backends (sm_90), flashinfer (when
installed) and auto in fp16: the model in fp16 is within about 3e-3 of float32 here, in bf16
within 2.5e-2, too close to any tolerance that would still catch a kernel bug (the kernel tests
cover bf16).
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
from checkpoints import build_checkpoint
from conftest import HAS_CUDA

from minengine import LLM
from minengine.memory import KVPool
from minengine.models import ForwardBatch
from minengine.ops import HostMetadata, KernelSet, get_kernels
from minengine.ops.testing import aligned_rows, relative_error

PAGE = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("llama64"), "llama", hidden_size=256)  # head dim 64


@pytest.fixture(scope="module")
def sequences(checkpoint):
    """Two token sequences and transformers' float32 logits at every position of each."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    rng = random.Random()
    seqs = [[rng.randrange(4, hf.config.vocab_size) for _ in range(n)] for n in (24, 40)]
    with torch.inference_mode():
        return seqs, [hf(torch.tensor([s])).logits[0] for s in seqs]


def teacher_forced(model, kernels: KernelSet, seqs, dtype, device, page: int = PAGE) -> list[torch.Tensor]:
    """Logits of every position of seqs[0] (23-token prompt, then a decode) and seqs[1] (a
    17-token chunk, then 23 more over the cached 17), over two mixed steps."""
    cfg = model.config
    pool = KVPool(cfg.num_layers, 32, page, cfg.num_kv_heads, cfg.head_dim, dtype, device)
    if page >= 8:  # TMA loads (cuda-wgmma-tma, -pipe) take 128-byte aligned caches; CPU tensors are 64-byte aligned
        pool.kv = aligned_rows(pool.kv)
        pool.layers = [(pool.kv[i, :, 0], pool.kv[i, :, 1]) for i in range(cfg.num_layers)]
    free = random.sample(range(32), 32)
    pages = [free[:8], free[8:18]]  # scattered pages, enough for 24 and 40 tokens
    steps = [[(1, 0, 17), (0, 0, 23)], [(1, 17, 40), (0, 23, 24)]]  # (seq, start, end): chunks first
    out = [[], []]
    for step in steps:
        ids, pos, slots, lens, cu = [], [], [], [], [0]
        for s, start, end in step:
            ids += seqs[s][start:end]
            pos += range(start, end)
            slots += [pages[s][p // page] * page + p % page for p in range(start, end)]
            lens.append(end)
            cu.append(cu[-1] + end - start)
        table = torch.zeros(len(step), 10, dtype=torch.int32)
        for row, (s, _, _) in enumerate(step):
            table[row, : len(pages[s])] = torch.tensor(pages[s])
        t = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
        fb = ForwardBatch(
            input_ids=t(ids, torch.int64), positions=t(pos, torch.int64), slot_mapping=t(slots, torch.int64),
            block_tables=table.to(device), seq_lens=t(lens, torch.int32), cu_seqlens_q=t(cu, torch.int32),
            max_seqlen_q=max(end - start for _, start, end in step), logits_indices=t(range(len(ids)), torch.int64),
        )  # fmt: skip
        if kernels.stage is not None:  # as the runner does
            kernels.stage(fb.block_tables, fb.seq_lens, fb.cu_seqlens_q, HostMetadata(lens, cu))
        logits = model(fb, pool.layers, kernels)
        for (s, _, _), lo, hi in zip(step, cu, cu[1:], strict=False):
            out[s].append(logits[lo:hi].float().cpu())
    return [torch.cat(o) for o in out]


def check_backend(checkpoint, sequences, kernels, dtype, device, tol, page=PAGE):
    seqs, want = sequences
    llm = LLM(
        str(checkpoint), device=device, dtype=dtype, attention_backend="torch", disable_cuda_graph=True,
        max_total_tokens=64,
    )  # fmt: skip
    try:
        got = teacher_forced(llm.engine.model, kernels, seqs, getattr(torch, dtype), torch.device(device), page)
    finally:
        llm.shutdown()
    for s in range(2):
        assert got[s].shape == want[s].shape
        err = relative_error(got[s], want[s].cpu())
        assert err < tol, f"sequence {s}: logits relative error {err:.2e} (tolerance {tol:.0e})"


@pytest.mark.skipif(HAS_CUDA, reason="the GPU test below runs the backends there")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backend_logits_cpu(backend, checkpoint, sequences):
    check_backend(checkpoint, sequences, get_kernels(backend, "cpu"), "float32", "cpu", 1e-4)


@pytest.mark.skipif(HAS_CUDA, reason="the GPU test below runs the real kernels")
@pytest.mark.parametrize("impl", ["mma", "wgmma", "wgmma-tma", "wgmma-pipe", "wgmma-2wg"])
def test_cuda_emulated_logits(impl, checkpoint, sequences):
    """The CUDA tensor-core kernel (and its wgmma prefill tiles, K/V by cp.async or TMA, or by TMA
    and pipelined, with one warpgroup a block or two) in fp16 through the emulator; TMA takes pages
    of 8 slots or more."""
    from conftest import use_cuda_emulator

    from minengine.ops import cuda

    use_cuda_emulator()
    try:
        base = get_kernels("cuda", "cpu")

        def attention(*args):  # the kernel asked for is the one that runs
            assert cuda.chosen_kernel(*args, impl=impl) == impl
            return cuda.paged_attention(*args, impl=impl)

        kernels = base._replace(paged_attention=attention)
        page = 8 if impl in cuda.TMA_IMPLS else PAGE
        check_backend(checkpoint, sequences, kernels, "float16", "cpu", 2e-2, page=page)
    finally:
        cuda.use_emulator(False)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "backend",
    ["triton", "cuda", "cuda-wgmma", "cuda-wgmma-tma", "cuda-wgmma-pipe", "cuda-wgmma-2wg", "flashinfer", "auto"],
)
def test_backend_logits_gpu(backend, checkpoint, sequences):
    from minengine.ops import cuda, flashinfer_ref

    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    if backend.startswith("cuda") and not cuda.available():
        pytest.skip("minengine._C is not built")
    if backend.startswith("cuda-wgmma") and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma needs an sm_90 GPU")
    if backend == "flashinfer" and not flashinfer_ref.available():
        pytest.skip("flashinfer is not installed")
    if backend.startswith("cuda-wgmma"):
        base = get_kernels("cuda", "cuda")
        impl = backend.removeprefix("cuda-")
        kernels = base._replace(paged_attention=functools.partial(cuda.paged_attention, impl=impl))
    else:
        kernels = get_kernels(backend, "cuda")
    page = 8 if backend.removeprefix("cuda-") in cuda.TMA_IMPLS else PAGE
    check_backend(checkpoint, sequences, kernels, "float16", "cuda", 2e-2, page=page)
    if backend == "flashinfer":  # one plan per step, each from the staged host metadata
        assert kernels.paged_attention.plans == kernels.paged_attention.host_plans == 2
