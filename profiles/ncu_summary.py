"""One line per kernel from Nsight Compute's text reports (profiles/ncu_kernels.sh's output).

    python profiles/ncu_summary.py profiles/out/ncu_*.txt > profiles/out/ncu_summary.md

For each report, a markdown table with a row per kernel (name and launch shape; a kernel profiled
more than once keeps its last, warm launch): duration (3 significant digits: ncu prints 2 decimals
in its own unit), DRAM and SM throughput as % of peak, the tensor pipe's share of elapsed cycles,
achieved / theoretical occupancy, registers per thread, and the three warp-stall reasons with the
most cycles per issued instruction. The full sections stay in the report itself.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

# "  void attention_mma_kernel<__nv_bfloat16, 128, 1>(MmaParams) (260, 8, 1)x(128, 1, 1), Context 1, ..."
KERNEL = re.compile(r"^  (?!\s)(.+?) \((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\), Context ")
# "    Duration                         us         2.75": name, unit (may be empty), value
METRIC = re.compile(r"^    (\S.*?)\s{2,}(?:(\S+)\s+)?(-?[\d,]*\.?\d+)$")
TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}


def short_name(signature: str) -> str:
    """'void attention_mma_kernel<__nv_bfloat16, 128, 1>(MmaParams)' -> 'attention_mma_kernel<__nv_bfloat16, 128, 1>'
    (name and template arguments, no parameters)."""
    name = signature.removeprefix("void ").strip()
    depth = 0
    for i, ch in enumerate(name):  # cut at the parameter list: the first '(' outside template brackets
        depth += {"<": 1, ">": -1}.get(ch, 0)
        if ch == "(" and depth == 0:
            return name[:i]
    return name


def parse(text: str) -> list[dict]:
    """The kernels of one report, in order: name, grid, block and each metric's first value (the
    first table that has it: pipe utilization over elapsed cycles, warp states over all cycles)."""
    kernels: list[dict] = []
    for line in text.splitlines():
        if m := KERNEL.match(line):
            grid, block = tuple(map(int, m.group(2, 3, 4))), tuple(map(int, m.group(5, 6, 7)))
            kernels.append({"name": short_name(m[1]), "grid": grid, "block": block, "metrics": {}})
        elif kernels and (m := METRIC.match(line)):
            kernels[-1]["metrics"].setdefault(m[1], (m[2] or "", float(m[3].replace(",", ""))))
    return kernels


def summarize(kernels: list[dict]) -> list[dict]:
    """A row per (kernel, launch shape), the last launch's numbers."""
    last = {(k["name"], k["grid"], k["block"]): k for k in kernels}
    rows = []
    for k in last.values():
        metrics = {name: value for name, (_, value) in k["metrics"].items()}
        unit = k["metrics"].get("Duration", ("",))[0]
        stalls = sorted(
            ((v, n.removeprefix("Stall ")) for n, v in metrics.items() if n.startswith("Stall ")), reverse=True
        )
        value = metrics.get
        nan = float("nan")
        rows.append({
            "kernel": k["name"],
            "launch": "x".join(map(str, k["grid"])) + " x " + "x".join(map(str, k["block"])),
            "us": value("Duration", nan) * TO_US.get(unit, nan),
            "dram_pct": value("DRAM Throughput", nan),
            "sm_pct": value("Compute (SM) Throughput", nan),
            "tensor_pct": value("Tensor (All)", nan),
            "occupancy_pct": value("Achieved Occupancy", nan),
            "theoretical_pct": value("Theoretical Occupancy", nan),
            "registers": value("Registers Per Thread", nan),
            "stalls": [(name, v) for v, name in stalls[:3] if v > 0],
        })  # fmt: skip
    return rows


def three_digits(x: float) -> str:
    """1730.0 -> '1730', 11.74 -> '11.7', 2.754 -> '2.75' (no exponent; nan as is)."""
    if not math.isfinite(x) or x == 0:
        return f"{x:g}"
    return f"{x:.{max(0, 2 - math.floor(math.log10(abs(x))))}f}"


def markdown(title: str, rows: list[dict]) -> str:
    columns = "kernel | grid x block | us | DRAM % | SM % | tensor pipe % | occupancy % (theory) | regs | top stalls"
    lines = [f"### {title}", "", f"| {columns} (cycles/inst) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        stalls = ", ".join(f"{name} {v:.2f}" for name, v in r["stalls"]) or "-"
        occupancy = f"{r['occupancy_pct']:.1f} ({r['theoretical_pct']:.1f})"
        lines.append(
            f"| `{r['kernel']}` | {r['launch']} | {three_digits(r['us'])} | {r['dram_pct']:.1f} | {r['sm_pct']:.1f} | "
            f"{r['tensor_pct']:.1f} | {occupancy} | {r['registers']:.0f} | {stalls} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", type=Path, help="ncu text reports (ncu_<backend>.txt)")
    args = parser.parse_args(argv)
    parts = []
    for path in args.reports:
        rows = summarize(parse(path.read_text(errors="replace")))
        if not rows:
            sys.exit(f"{path}: no kernel found in it (is it the text output of ncu?)")
        parts.append(markdown(path.stem.removeprefix("ncu_"), rows))
    text = "\n".join(parts)
    print(text, end="")
    return text


if __name__ == "__main__":
    main()
