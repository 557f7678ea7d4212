"""Registers, spills, shared memory and matrix instructions of each attention tile config.

Compiles for a GPU target on any machine (no GPU needed; see triton_kernels/aot.py):

    python profiles/compile_report.py                 # sm_90 and sm_80, the configs the launcher picks
    python profiles/compile_report.py --arch 90 --head-dims 128 --dtypes bf16

HGMMA in the mma column is Hopper's wgmma, HMMA is mma.sync; fp32 runs exact dots on FMA units.
"""

from __future__ import annotations

import argparse

import torch

from triton_kernels.aot import compile_attention, resources

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
KINDS = (("decode", 1, 1), ("split", 1, 4), ("prefill", 2048, 1))  # (name, max_seqlen_q, num_splits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp16", "fp32"], choices=list(DTYPES))
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--groups", type=int, nargs="+", default=[4])
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args()
    header = ("arch", "dtype", "D", "grp", "kind", "BM", "TN", "warps", "regs", "spill", "smem", "mma")
    print(" ".join(f"{h:>6}" for h in header))
    for arch in args.arch:
        for dt in args.dtypes:
            for d in args.head_dims:
                for group in args.groups:
                    for kind, max_q, splits in KINDS:
                        cfg, compiled = compile_attention(arch, DTYPES[dt], d, group, args.page_size, splits, max_q)
                        r = resources(compiled)
                        row = (
                            arch,
                            dt,
                            d,
                            group,
                            kind,
                            cfg.block_m,
                            cfg.tile_n,
                            cfg.num_warps,
                            r["regs"],
                            r["spill_bytes"],
                            r["shared_bytes"],
                            r["mma"],
                        )
                        print(" ".join(f"{v:>6}" for v in row), flush=True)


if __name__ == "__main__":
    main()
