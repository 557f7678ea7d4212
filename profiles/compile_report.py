"""Registers, spills, shared memory and matrix instructions of each attention tile config.

Compiles for a GPU target on any machine (no GPU needed; see triton_kernels/aot.py):

    python profiles/compile_report.py                 # sm_90 and sm_80, the configs the launcher picks
    python profiles/compile_report.py --arch 90 --head-dims 128 --dtypes bf16
    python profiles/compile_report.py --variants      # also the tile configs bench_attention.py
                                                      # --triton-variants times beside each pick
    python profiles/compile_report.py --csrc          # the CUDA C++ kernels instead (needs nvcc)

HGMMA in the mma column is Hopper's wgmma, HMMA is mma.sync; fp32 runs exact dots on FMA units.
per_sm: programs resident on one SM at once (registers, warps and shared memory of that arch).
loops: SASS instructions per trip of each KV loop that issues matrix instructions, in code order
(a prefill config: the small block's unmasked and masked loops, then the big block's; a decode
config: its unmasked and masked loops), i.e. a KV tile's cost per thread outside the waits.
For csrc/, ptxas -v of every instantiation of paged_attention.cu: registers, spill bytes, and how
many times ptxas injected a warpgroup.arrive (a wgmma serialized because registers it uses were
written between the wgmmas of a group).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
from pathlib import Path

import torch

from triton_kernels.aot import compile_attention, resources
from triton_kernels.attention import tile_variants

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
KINDS = (("decode", 1, 1), ("split", 1, 4), ("prefill", 2048, 1))  # (name, max_seqlen_q, num_splits)


CSRC = Path(__file__).resolve().parents[1] / "csrc"
TYPES = {"6__half": "fp16", "13__nv_bfloat16": "bf16", "f": "fp32"}


def _mma_kernel(m: re.Match) -> str:
    """attention_mma_kernel<T, D, WG, TMA, PIPE, WGS>'s readable name."""
    wg, tma, pipe, wgs = (m[i] for i in (3, 4, 5, 6))
    impl = "mma" if wg == "0" else "wgmma-2wg" if wgs == "2" else "wgmma-pipe" if pipe == "1" else "wgmma"
    impl = "wgmma-tma" if impl == "wgmma" and tma == "1" else impl
    return f"{impl} {TYPES.get(m[1], m[1])} D{m[2]}"


KERNEL_NAMES = {  # mangled-name pattern -> readable name
    r"attention_mma_kernelI(\w+?)Li(\d+)ELb([01])ELb([01])ELb([01])ELi(\d)E": _mma_kernel,
    r"attention_simt_kernelI(\w+?)EEv": lambda m: f"simt {TYPES.get(m[1], m[1])}",
    r"merge_splits_kernelI(\w+?)EEv": lambda m: f"merge {TYPES.get(m[1], m[1])}",
}


def readable(mangled: str) -> str:
    for pattern, name in KERNEL_NAMES.items():
        if (m := re.search(pattern, mangled)) is not None:
            return name(m)
    return mangled


def nvcc() -> str:
    """nvcc on PATH, else CUDA_HOME's or /usr/local/cuda's."""
    homes = [os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    found = [Path(h) / "bin" / "nvcc" for h in homes if h and (Path(h) / "bin" / "nvcc").exists()]
    return shutil.which("nvcc") or (str(found[0]) if found else "nvcc")


def csrc_report(archs: list[str]) -> list[dict]:
    """ptxas -v of csrc/paged_attention.cu per target: one row per kernel instantiation."""
    nvcc_path = nvcc()
    rows = []
    for arch in archs:
        cmd = [nvcc_path, "-std=c++17", "-O3", f"-arch=sm_{arch}", f"-I{CSRC}", "-Xptxas", "-v", "-c"]
        cmd += [str(CSRC / "paged_attention.cu"), "-o", "/dev/null"]
        if arch == "90a":
            cmd.append("-DMINENGINE_SM90A=1")
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
        by_name: dict[str, dict] = {}
        current = None
        for line in log.splitlines():
            if (m := re.search(r"Compiling entry function '(\w+)'", line)) is not None:
                current = {"arch": arch, "kernel": readable(m[1]), "regs": 0, "spill": 0, "arrive": 0}
                by_name[current["kernel"]] = current
            elif current is not None and (m := re.search(r"(\d+) bytes spill stores", line)) is not None:
                current["spill"] = int(m[1])
            elif current is not None and (m := re.search(r"Used (\d+) registers", line)) is not None:
                current["regs"] = int(m[1])
        for m in re.finditer(r"warpgroup.arrive is injected.*?function '(\w+)'", log):
            by_name[readable(m[1])]["arrive"] += 1
        # Outside sm_90a the wgmma instantiations are trap stubs that are never launched.
        rows += [r for r in by_name.values() if arch == "90a" or not r["kernel"].startswith("wgmma")]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp16", "fp32"], choices=list(DTYPES))
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--groups", type=int, nargs="+", default=[4])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--csrc", action="store_true", help="report csrc/paged_attention.cu (sm_80, sm_90a)")
    parser.add_argument("--variants", action="store_true", help="also each pick's tile_variants (a row each)")
    args = parser.parse_args()
    if args.csrc:
        print(f"{'arch':>5} {'kernel':<18} {'regs':>5} {'spill':>6} {'arrive':>7}")
        for r in csrc_report(["80", "90a"]):
            print(f"{r['arch']:>5} {r['kernel']:<18} {r['regs']:>5} {r['spill']:>6} {r['arrive']:>7}", flush=True)
        return
    header = (
        *("arch", "dtype", "D", "grp", "kind", "BM", "TN", "warps", "stages"),
        *("regs", "spill", "smem", "per_sm", "mma"),
    )
    print(" ".join(f"{h:>6}" for h in header), f"{'loops':>19}", " variant")
    for arch in args.arch:
        for dt in args.dtypes:
            for d in args.head_dims:
                for group in args.groups:
                    for kind, max_q, splits in KINDS:
                        shape = (arch, DTYPES[dt], d, group, args.page_size, splits, max_q)
                        cfg, compiled = compile_attention(*shape)
                        configs = {"": (cfg, compiled)}
                        for name, other in (tile_variants(cfg) if args.variants else {}).items():
                            try:
                                configs[name] = (other, compile_attention(*shape, config=other)[1])
                            except Exception as exc:  # noqa: BLE001 (out of resources: reported, the rest go on)
                                print(f"{name}: {type(exc).__name__}: {exc}"[:200], flush=True)
                        for name, (c, kernel) in configs.items():
                            r = resources(kernel)
                            row = (arch, dt, d, group, kind, c.block_m, c.tile_n, c.num_warps, c.num_stages)
                            row += (r["regs"], r["spill_bytes"], r["shared_bytes"], r["per_sm"], r["mma"])
                            loops = "/".join(map(str, r["mma_loops"]))
                            print(" ".join(f"{v:>6}" for v in row), f"{loops:>19}", "", name, flush=True)


if __name__ == "__main__":
    main()
