"""The profiling scripts: the torch-profiler trace has the engine's named step ranges; the Nsight
Compute summary reads ncu's text reports."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest


def load(name: str):
    path = Path(__file__).resolve().parents[1] / "profiles" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_torch_trace_has_engine_ranges(tmp_path):
    module = load("torch_trace")
    out = module.main(["--steps", "3", "--batch", "2", "--prompt-len", "8", "--out", str(tmp_path / "t.json")])
    names = {e.get("name") for e in json.loads(Path(out).read_text())["traceEvents"]}
    assert {"schedule", "h2d", "forward", "sampling", "process_results"} <= names


# The shape of `ncu --print-details all` text (ncu 2025.3, H100), cut down: two launches of one
# kernel (the second wins), a metric with no unit, thousands separators, and a second pipe table
# whose "Tensor (All)" is over active cycles, not elapsed ones.
KERNEL = "  void attention_mma_kernel<__nv_bfloat16, 128, 1>(MmaParams) (260, 8, 1)x(128, 1, 1), Context 1, Stream 7"
NCU_TEXT = f"""==PROF== Connected to process 3347 (/usr/bin/python3.12)
[3347] python3.12@127.0.0.1
{KERNEL}, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    Elapsed Cycles                cycle    4,034,687
    DRAM Throughput                   %        99.00
    Duration                         ms         9.99
{KERNEL}, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    DRAM Throughput                   %        19.90
    Duration                         ms         1.73
    Compute (SM) Throughput           %        51.70
    Section: Compute Workload Analysis
    Table Name : Pipe Utilization (% of elapsed cycles)
    Tensor (All)                   %        20.10
    Table Name : Pipe Utilization (% of active cycles)
    Tensor (All)                   %        26.54
    Section: Warp State Statistics
    Issued Warp Per Scheduler                                    0.32
    Stall Long Scoreboard           inst         0.40
    Selected                        inst         1.00
    Stall Wait                      inst         1.28
    Stall Not Selected              inst         0.80
    Stall Dispatch Stall            inst         0.44
    Stall Membar                    inst            0
    Section: Occupancy
    Theoretical Occupancy                     %        18.75
    Achieved Occupancy                        %        17.80
    % Occupancy Per Register Count      %/register     4,761 (25; 25; 25;
    Registers Per Thread           register/thread                             168
  _store_kv_kernel (2111, 1, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Duration                         us         5.80
"""


def test_ncu_summary_gives_a_row_per_kernel(tmp_path):
    summary = load("ncu_summary")
    (tmp_path / "ncu_cuda-wgmma.txt").write_text(NCU_TEXT)
    rows = summary.summarize(summary.parse(NCU_TEXT))
    assert [r["kernel"] for r in rows] == ["attention_mma_kernel<__nv_bfloat16, 128, 1>", "_store_kv_kernel"]
    mma = rows[0]
    assert mma["launch"] == "260x8x1 x 128x1x1" and mma["us"] == 1730.0
    assert (mma["dram_pct"], mma["sm_pct"], mma["tensor_pct"], mma["registers"]) == (19.9, 51.7, 20.1, 168)
    assert (mma["occupancy_pct"], mma["theoretical_pct"]) == (17.8, 18.75)
    assert mma["stalls"] == [("Wait", 1.28), ("Not Selected", 0.8), ("Dispatch Stall", 0.44)]
    assert rows[1]["us"] == 5.8 and rows[1]["stalls"] == []
    text = summary.main([str(tmp_path / "ncu_cuda-wgmma.txt")])
    assert text.startswith("### cuda-wgmma\n")
    row = "| `attention_mma_kernel<__nv_bfloat16, 128, 1>` | 260x8x1 x 128x1x1 | 1730 | 19.9 | 51.7 | 20.1 |"
    assert row + " 17.8 (18.8) | 168 | Wait 1.28, Not Selected 0.80, Dispatch Stall 0.44 |" in text
    (tmp_path / "empty.txt").write_text("==PROF== nothing\n")
    assert [summary.three_digits(x) for x in (1730.0, 11.74, 2.754, 0.0312)] == ["1730", "11.7", "2.75", "0.0312"]
    with pytest.raises(SystemExit, match="no kernel found"):
        summary.main([str(tmp_path / "empty.txt")])
