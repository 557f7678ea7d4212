"""The torch-profiler script writes a Chrome trace with the engine's named step ranges."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path


def test_torch_trace_has_engine_ranges(tmp_path):
    path = Path(__file__).resolve().parents[1] / "profiles" / "torch_trace.py"
    spec = importlib.util.spec_from_file_location("torch_trace", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.main(["--steps", "3", "--batch", "2", "--prompt-len", "8", "--out", str(tmp_path / "t.json")])
    names = {e.get("name") for e in json.loads(Path(out).read_text())["traceEvents"]}
    assert {"schedule", "h2d", "forward", "sampling", "process_results"} <= names
