"""Run the kernels a few times on the representative mixed batch (for ncu / compute-sanitizer).

python profiles/mixed_batch.py --backend triton|cuda|cuda-wgmma|cuda-wgmma-tma|cuda-wgmma-pipe|cuda-wgmma-2wg [--small]

cuda-wgmma: the cuda kernel with its prefill tiles on Hopper's wgmma (an sm_90 GPU); cuda-wgmma-tma:
those tiles with their K/V loaded by TMA; cuda-wgmma-pipe: the TMA tiles pipelined; cuda-wgmma-2wg:
those with two warpgroups a block (128-row tiles).
"""

from __future__ import annotations

import argparse

import torch

from minengine import ops
from minengine.ops.testing import make_paged_batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--backend",
        default="triton",
        choices=["triton", "cuda", "cuda-wgmma", "cuda-wgmma-tma", "cuda-wgmma-pipe", "cuda-wgmma-2wg"],
    )
    p.add_argument("--small", action="store_true", help="a small batch (for compute-sanitizer, which is slow)")
    p.add_argument("--iters", type=int, default=4)
    args = p.parse_args()
    kernels = ops.get_kernels(args.backend.split("-")[0], "cuda")
    attention = ops.attention_of(args.backend)
    if args.small:
        q_lens, kv_lens = [37] + [1] * 7, [90] + [70] * 7
    else:
        q_lens, kv_lens = [2048] + [1] * 63, [10240] + [4096] * 63
    batch = make_paged_batch(
        q_lens, kv_lens, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16, device="cuda"
    )
    k = torch.randn(batch.q.shape[0], 8, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(batch.q.shape[0], device="cuda")
    for _ in range(args.iters):
        attention(*batch.args())
        kernels.store_kv(k, k, batch.k_cache, batch.v_cache, slots)
        kernels.gather_input_ids(slots[:10], slots, slots[:5])
    torch.cuda.synchronize()
    print("ok")


if __name__ == "__main__":
    main()
