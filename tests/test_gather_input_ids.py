"""gather_input_ids: out[:P] = prefill_ids, out[P:] = token_buffer[decode_indices], one launch."""

from __future__ import annotations

import pytest
import torch

import triton_kernels
from minengine.ops import reference


def make_case(num_prefill, num_decode, dtype, index_dtype, device, buffer_size=40):
    hi = torch.iinfo(dtype).max if dtype == torch.int32 else 2**40
    prefill = torch.randint(0, hi, (num_prefill,), dtype=dtype, device=device)
    buffer = torch.randint(0, hi, (buffer_size,), dtype=dtype, device=device)
    indices = torch.randint(0, buffer_size, (num_decode,), dtype=index_dtype, device=device)
    return prefill, buffer, indices


@pytest.mark.parametrize(("num_prefill", "num_decode"), [(0, 0), (5, 0), (0, 7), (300, 9), (3, 200)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_gather(num_prefill, num_decode, dtype, index_dtype, device, kernels):
    prefill, buffer, indices = make_case(num_prefill, num_decode, dtype, index_dtype, device)
    out = torch.full((num_prefill + num_decode,), -7, dtype=dtype, device=device)  # poison
    assert kernels.gather_input_ids(prefill, buffer, indices, out=out) is out
    expected = torch.cat([prefill, buffer[indices.long()]])
    assert torch.equal(out, expected)
    assert torch.equal(reference.gather_input_ids(prefill, buffer, indices), expected)
    assert torch.equal(kernels.gather_input_ids(prefill, buffer, indices), expected)


def test_gather_strided_inputs(device, kernels):
    prefill, buffer, indices = make_case(6, 5, torch.int64, torch.int64, device)
    wide = torch.stack([buffer, -buffer], 1)  # token_buffer as a strided column
    out = kernels.gather_input_ids(prefill[::2], wide[:, 0], indices[::2])
    assert torch.equal(out, torch.cat([prefill[::2], buffer[indices[::2]]]))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(token_buffer=lambda a: a["token_buffer"].int()), "token_buffer.dtype"),
        (dict(decode_indices=lambda a: a["decode_indices"].float()), "decode_indices.dtype"),
        (dict(prefill_ids=lambda a: a["prefill_ids"].view(2, 2)), "must be 1-D"),
        (dict(out=lambda a: torch.empty(3, dtype=torch.int64, device=a["prefill_ids"].device)), "out has shape"),
    ],
)
def test_gather_bad_arguments(change, message, device):
    prefill, buffer, indices = make_case(4, 2, torch.int64, torch.int32, device)
    args = dict(prefill_ids=prefill, token_buffer=buffer, decode_indices=indices, out=None)
    args.update({name: fn(args) for name, fn in change.items()})
    for impl in (triton_kernels.gather_input_ids, reference.gather_input_ids):
        with pytest.raises(ValueError, match=message):
            impl(**args)


def test_gather_debug_checks(device, monkeypatch):
    prefill, buffer, indices = make_case(4, 2, torch.int64, torch.int32, device)
    monkeypatch.setenv("MINENGINE_KERNEL_DEBUG", "1")
    with pytest.raises(ValueError, match="decode_indices span"):
        triton_kernels.gather_input_ids(prefill, buffer, indices + 100)


@pytest.mark.gpu
def test_cuda_gather_reads_prefill_ids_from_pinned_host_memory():
    """The fused H2D: prefill ids stay in pinned host memory, and the kernel reads them there."""
    from minengine.ops import cuda

    if not cuda.available():
        pytest.skip("needs minengine._C and a CUDA GPU")
    prefill = torch.randint(0, 1000, (300,), dtype=torch.int64).pin_memory()
    buffer = torch.randint(0, 1000, (64,), dtype=torch.int64, device="cuda")
    indices = torch.randperm(64, device="cuda")[:20]
    out = cuda.gather_input_ids(prefill, buffer, indices)
    assert prefill.device.type == "cpu" and out.device.type == "cuda"
    assert torch.equal(out.cpu(), torch.cat([prefill, buffer[indices].cpu()]))
    # The kernel reads the host memory when it runs, not when it is queued: with the stream held by
    # a long sleep, a host write made after the call still reaches the output (a copy staged at
    # call time would give the old ids).
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU clock cycles ahead of the gather
    late = cuda.gather_input_ids(prefill, buffer, indices)
    prefill.fill_(7)
    torch.cuda.synchronize()
    assert torch.equal(late[:300].cpu(), torch.full((300,), 7))
    with pytest.raises(ValueError, match="pinned memory"):
        cuda.gather_input_ids(torch.zeros(3, dtype=torch.int64), buffer, indices)
