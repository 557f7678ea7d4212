"""Kernel demo: one mixed batch (prefill chunks + decodes) through one paged-attention launch.

    python -m minengine.demo

On a GPU it runs the compiled Triton kernels; on a CPU-only machine, Triton's interpreter.
It checks each sequence against the float64 reference and prints a table. The full benchmark
is ``python benchmarks/bench_attention.py`` (GPU).
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.page_size < 1:
        parser.error(f"--page-size is {args.page_size}; allowed: any integer >= 1")
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton_kernels is imported
    import triton_kernels
    from minengine.ops import reference
    from minengine.ops.testing import make_paged_batch, relative_error

    device = torch.device("cuda" if cuda else "cpu")
    scale = 1 if cuda else 16
    q_lens = [2048 // scale, 1, 1, 512 // scale, 1, 0]
    seq_lens = [2048 // scale, 700 // scale, 4096 // scale, 8192 // scale, 33, 12]
    kinds = ["fresh prompt", "decode", "decode", "chunk over prefix", "decode", "idle (q_len 0)"]
    gen = torch.Generator().manual_seed(args.seed)
    batch = make_paged_batch(
        q_lens,
        seq_lens,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=128,
        page_size=args.page_size,
        dtype=getattr(torch, args.dtype),
        device=device,
        generator=gen,
    )
    out = torch.full_like(batch.q, float("nan"))
    t0 = time.perf_counter()
    triton_kernels.paged_attention(*batch.args(), out=out)
    if cuda:
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    ref = reference.paged_attention(*batch.to_float64())

    mode = "GPU (" + torch.cuda.get_device_name() + ")" if cuda else "CPU, Triton interpreter"
    print(
        f"paged_attention, one launch, {mode}: {len(q_lens)} sequences, {out.shape[0]} query tokens, "
        f"{args.dtype}, Hq=8 Hkv=2 D=128, page size {args.page_size}, {ms:.1f} ms"
        + (" (first call: includes compilation)" if cuda else "")
    )
    print(f"{'seq':>3}  {'kind':<18} {'q_len':>6} {'seq_len':>7}  rel. error vs float64")
    cu = batch.cu_seqlens_q.tolist()
    worst = 0.0
    for b, kind in enumerate(kinds):
        rows = slice(cu[b], cu[b + 1])
        err = relative_error(out[rows], ref[rows]) if q_lens[b] else 0.0
        worst = max(worst, err)
        print(
            f"{b:>3}  {kind:<18} {q_lens[b]:>6} {seq_lens[b]:>7}  {err:.1e}"
            if q_lens[b]
            else f"{b:>3}  {kind:<18} {q_lens[b]:>6} {seq_lens[b]:>7}  (no rows)"
        )
    ok = worst < (2e-5 if args.dtype == "float32" else 1.6e-2) and not out.isnan().any()
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
