"""minengine.ops: backend resolution and dispatch."""

from __future__ import annotations

import pytest
import torch

from minengine import ops
from minengine.ops import reference
from minengine.ops.testing import make_paged_batch


def test_auto_resolves_by_device():
    assert ops.resolve_backend("auto", "cpu") == "torch"
    assert ops.resolve_backend("auto", "cuda") == "triton"
    assert ops.resolve_backend("triton", "cpu") == "triton"


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="'tvm'.*auto, torch, triton"):
        ops.get_kernels("tvm", "cpu")


def test_attention_of_names_each_of_our_kernels():
    import triton_kernels
    from minengine.ops import cuda, tuning

    assert ops.attention_of("triton") is triton_kernels.paged_attention
    assert ops.attention_of("cuda") is cuda.paged_attention
    for name in (*tuning.CHOICES[2:], "cuda-simt", "cuda-mma"):
        call = ops.attention_of(name)
        assert call.func is cuda.paged_attention and call.keywords == {"impl": name.removeprefix("cuda-")}
    for bad in ("cuda-auto", "cuda-nope", "flashinfer", "wgmma"):
        with pytest.raises(ValueError, match=f"unknown backend '{bad}'; allowed: triton, cuda, cuda-simt, cuda-mma"):
            ops.attention_of(bad)


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_backends_agree(backend, device):
    batch = make_paged_batch(
        [2, 1], [6, 9], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=4, dtype=torch.float32, device=device
    )
    out = ops.paged_attention(*batch.args(), backend=backend)
    torch.testing.assert_close(out, reference.paged_attention(*batch.args()), rtol=1e-5, atol=1e-5)
    ids = ops.gather_input_ids(
        torch.arange(3, device=device),
        torch.arange(10, 20, device=device),
        torch.tensor([4, 0], device=device),
        backend=backend,
    )
    assert ids.tolist() == [0, 1, 2, 14, 10]
    kernels = ops.get_kernels(backend, device)
    k = torch.randn(2, 2, 32, device=device)
    kernels.store_kv(k, k, batch.k_cache, batch.v_cache, torch.tensor([0, -1], device=device))
    assert torch.equal(batch.k_cache[0, 0], k[0])
