"""The kernel benchmark's code path runs end to end (tiny shapes; CPU interpreter without a GPU)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from test_flashinfer_backend import install_stand_in

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_bench(name: str = "bench_attention"):
    """Import a benchmark script as a module (its folder on sys.path, as when run directly)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the real benchmark, not a test")
def test_bench_attention_smoke(tmp_path):
    bench = load_bench()
    report = bench.main(["--smoke", "--triton-variants", "--out", str(tmp_path)])
    assert [r["case"] for r in report["rows"]] == list("abcde")
    for row in report["rows"][:4]:  # the one-launch cases time the other tile configs too
        assert row["variants"] and row["triton_config"] not in [v["config"] for v in row["variants"].values()]
        assert all(v["ms"] > 0 and v["rel_err_vs_fp64"] < 1.6e-2 for v in row["variants"].values()), row
    assert "| d | 2-stages |" in (tmp_path / "attention_smoke.md").read_text()
    for row in report["rows"][:4]:  # and our backends' block orders (on CPU, Triton's)
        orders = row["block_orders"]["triton"]
        assert orders["heavy_first_ms"] > 0 and orders["in_order_ms"] > 0, orders
        assert orders["heavy_first_err"] < 1.6e-2 and orders["in_order_err"] < 1.6e-2, orders
    assert "| d | triton |" in (tmp_path / "attention_smoke.md").read_text()
    for row in report["rows"]:
        assert row["ms"] > 0 and row["kv_gbps"] > 0
        if "rel_err_vs_fp64" in row:
            assert row["rel_err_vs_fp64"] < 1.6e-2, row
    assert len(report["targets"]) == 7  # the kernels issue's four, the csrc issue's three (best of ours)
    assert any(t.startswith("(a) best of ours (") for t in report["targets"])
    assert any(t.startswith("(d) best of ours") and "not measured" in t for t in report["targets"])
    saved = json.loads((tmp_path / "attention_smoke.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(report["rows"]))
    assert "| a |" in (tmp_path / "attention_smoke.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the real benchmark, not a test")
def test_bench_attention_a_failing_variant_is_reported(tmp_path, monkeypatch):
    """A Triton tile variant or block order that fails (a compile or resource error on some device)
    is listed as failed; the case's own row, the other variants and the other order are kept."""
    import triton_kernels

    bench = load_bench()
    real = triton_kernels.paged_attention

    def paged_attention(*args, config=None, block_order="heavy-first", **kwargs):
        if config is not None and config.num_stages == 2:
            raise RuntimeError("out of resources: shared memory")
        if block_order == "in-order":
            raise RuntimeError("no such order here")
        return real(*args, config=config, **kwargs)

    monkeypatch.setattr(triton_kernels, "paged_attention", paged_attention)
    report = bench.main(["--smoke", "--cases", "a", "--triton-variants", "--no-torch", "--out", str(tmp_path)])
    variants = report["rows"][0]["variants"]
    assert variants["2-stages"]["error"] == "RuntimeError: out of resources: shared memory"
    assert report["rows"][0]["ms"] > 0 and variants["3-stages"]["ms"] > 0
    md = (tmp_path / "attention_smoke.md").read_text()
    assert "| a | 2-stages | 16/16/16/1/2 | failed: RuntimeError" in md
    orders = report["rows"][0]["block_orders"]["triton"]  # a failing order keeps what the other measured
    assert orders["heavy_first_ms"] > 0 and orders["error"] == "in-order: RuntimeError: no such order here"
    assert f"| a | triton | {orders['heavy_first_ms']:.4f} | failed: in-order: RuntimeError" in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the real benchmark, not a test")
def test_bench_attention_times_variants_after_every_case(tmp_path, monkeypatch):
    """Variants come after every case's own row (the CUDA and FlashInfer columns included), so a
    time limit cuts variants first; a variant pass that fails is reported and the next goes on."""
    bench = load_bench()
    order = []
    run_case, time_variants = bench.run_case, bench.time_variants

    def logged_case(case, *args, **kwargs):
        order.append(f"case {case.name}")
        return run_case(case, *args, **kwargs)

    def logged_variants(row, *args, **kwargs):
        order.append(f"variants {row['case']}")
        if row["case"] == "b":
            raise RuntimeError("out of memory")
        return time_variants(row, *args, **kwargs)

    monkeypatch.setattr(bench, "run_case", logged_case)
    monkeypatch.setattr(bench, "time_variants", logged_variants)
    report = bench.main(["--smoke", "--cases", "abe", "--triton-variants", "--no-torch", "--out", str(tmp_path)])
    assert order == ["case a", "case b", "case e", "variants a", "variants b"]
    a, b, e = report["rows"]
    assert a["variants"] and a["variants_pick_ms"] > 0 and "variants" not in e
    assert b["variants_error"] == "RuntimeError: out of memory" and b["ms"] > 0
    assert (
        "| b | (the rest) | - | failed: RuntimeError: out of memory |" in (tmp_path / "attention_smoke.md").read_text()
    )

    def stopped_at_b(row, *args, **kwargs):  # the phase's time limit (SIGTERM) during b's variants
        if row["case"] == "b":
            raise bench.Stopped
        return time_variants(row, *args, **kwargs)

    monkeypatch.setattr(bench, "time_variants", stopped_at_b)
    report = bench.main(["--smoke", "--cases", "ab", "--triton-variants", "--no-torch", "--out", str(tmp_path)])
    assert report["stopped_during"] == "the block orders and Triton variants of case b"
    assert report["rows"][0]["variants"] and [r["case"] for r in report["rows"]] == ["a", "b"]
    assert json.loads((tmp_path / "attention_smoke.json").read_text())["rows"][0]["variants"]


def test_flop_and_byte_counts():
    bench = load_bench()
    # one fresh 3-token prompt: queries see 1, 2, 3 keys
    assert bench.attention_flops((3,), (3,), num_q_heads=1, head_dim=1) == 4 * 6
    # a decode over 10 keys and a 2-token chunk over a 5-token prefix (sees 6 and 7 keys)
    assert bench.attention_flops((1, 2), (10, 7), num_q_heads=2, head_dim=8) == 4 * 8 * 2 * (10 + 13)
    assert bench.kv_bytes((10, 7), num_kv_heads=2, head_dim=8, elem=2) == 2 * 17 * 2 * 8 * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the real benchmark, not a test")
def test_bench_offline_smoke(tmp_path):
    bench = load_bench("bench_offline")
    report = bench.main(["--smoke", "--out", str(tmp_path)])
    (row,) = report["rows"]
    ours = row["minengine"]
    assert ours["output_tokens"] > 0 and ours["tokens_per_s"] > 0
    assert "| smoke |" in (tmp_path / "offline_smoke.md").read_text()
    prompts, out_lens = bench.workload(256, 100, 1024, 1000, seed=0)
    assert len(prompts) == 256 and all(100 <= len(p) <= 1024 for p in prompts)
    assert all(100 <= n <= 1024 for n in out_lens)


def test_bench_offline_transformers_on_some_models_only(capsys):
    bench = load_bench("bench_offline")
    with pytest.raises(SystemExit):
        bench.main(["--model", "qwen3-0.6b", "--hf-model", "llama3-8b", "qwen3-0.6b"])
    assert "--hf-model llama3-8b: not among --model; allowed: qwen3-0.6b" in capsys.readouterr().err
    ours = {"tokens_per_s": 100.0, "output_tokens": 10, "seconds": 0.1}
    rows = [{"model": "a", "minengine": ours, "transformers": {"skipped": "not in --hf-model"}}]
    config = dict(num_requests=1, min_len=1, max_len=2)
    report = {"command": "x", "date": "d", "info": {"device": "cpu"}, "config": config, "rows": rows}
    assert "| a | 100 | not in --hf-model | - | 10 | 0.1 | - |" in bench.markdown(report)


def test_benchmark_models_have_text_for_every_token(tmp_path):
    """The random-weight models the serving benchmarks run sample from the whole vocab: each id
    must decode to text (a server streams no chunk for a token without any, which made TTFT the
    whole request and ITL 0), and text must round-trip (multi-turn prompts extend the history)."""
    from minengine.detokenizer import IncrementalDetokenizer
    from minengine.tokenizer import Tokenizer

    bench = load_bench("bench_offline")
    path, dummy = bench.model_dir("smoke", tmp_path)
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    tok = Tokenizer.from_dir(path)
    assert dummy and tok.vocab_size == vocab
    ids = list(range(vocab))
    assert all(tok.decode([i]) for i in ids)
    assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids
    detok = IncrementalDetokenizer(tok)
    assert all(detok.add([i]) for i in (0, 7, vocab - 1, 3))  # a streamed piece for every token


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the real benchmark, not a test")
def test_bench_attention_stopped_during_the_cases_still_writes_the_report(tmp_path, monkeypatch):
    """The phase's time limit (SIGTERM -> Stopped) can land in the core cases, and --write-tuning can
    have nothing to write: the report with what was measured is saved either way."""
    bench = load_bench()
    real = bench.run_case

    def run_case(case, *args):
        if case.name == "b":
            raise bench.Stopped
        return real(case, *args)

    monkeypatch.setattr(bench, "run_case", run_case)
    report = bench.main(["--smoke", "--cases", "abc", "--suite", "full", "--write-tuning", "--out", str(tmp_path)])
    assert [r["case"] for r in report["rows"]] == ["a"] and report["grid"] == []
    assert report["stopped_during"] == "case b" and report["tuning"].startswith("not written")
    saved = json.loads((tmp_path / "attention_smoke.json").read_text())
    assert saved["stopped_during"] == "case b" and len(saved["rows"]) == 1
    assert "STOPPED by the time limit during case b" in (tmp_path / "attention_smoke.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the real benchmark, not a test")
def test_bench_decode_smoke(tmp_path):
    bench = load_bench("bench_decode")
    report = bench.main(["--smoke", "--out", str(tmp_path)])
    assert [(r["batch"], r["context"]) for r in report["rows"]] == [(1, 16), (3, 16)]
    assert all(r["step_ms"] > 0 and r["roofline_ms"] > 0 for r in report["rows"])
    # the roofline's KV is what the timed steps read: the context and the tokens generated by then
    assert all(r["context"] < r["kv_tokens_per_seq"] < r["context"] + 64 for r in report["rows"]), report["rows"]
    table = [line for line in (tmp_path / "decode_smoke.md").read_text().splitlines() if line.startswith("|")]
    assert len({line.count("|") for line in table}) == 1  # every row has the header's cells
    assert (tmp_path / "decode_smoke.png").stat().st_size > 0
    gpu_rows = [  # what a GPU run adds (idle times from the trace), and a point the pool could not hold
        {"batch": b, "context": 1024, "step_ms": 5.0 + b / 64, "roofline_ms": 4.5 + b / 80, "idle_overlap": 0.01,
         "idle_no_overlap": 0.08} for b in (1, 16, 64)
    ] + [{"batch": 256, "context": 4096, "skipped": "needs more KV"}]  # fmt: skip
    bench.plot(gpu_rows, tmp_path / "gpu.png")
    assert (tmp_path / "gpu.png").stat().st_size > 0


def test_bench_decode_trace_numbers():
    """Idle time, GPU-busy time per step and activities per step from (overlapping) intervals."""
    bench = load_bench("bench_decode")
    spans = [(30, 50), (0, 10), (5, 20), (60, 100)]  # busy 20 + 20 + 40 of a 100 us window
    got = bench.summarize_spans(spans, steps=2)
    assert got == {"idle": pytest.approx(0.2), "busy_ms": pytest.approx(0.04), "kernels": 2}
    assert bench.summarize_spans([], steps=2) is None
    # the window ends at the latest end, which need not be the last-starting interval's
    assert bench.summarize_spans([(0, 100), (10, 20)], steps=1)["idle"] == 0


def test_bench_serving_reads_gpu_idle_time_from_a_profile(tmp_path):
    """--profile's traces (torch.profiler's Chrome trace, gzipped): forward passes and the GPU's
    idle share of its window; None where there is nothing to read."""
    import gzip

    bench = load_bench("bench_serving")
    events = [
        {"name": "forward", "ph": "X", "cat": "user_annotation", "ts": 0, "dur": 30},
        {"name": "forward", "ph": "X", "cat": "user_annotation", "ts": 50, "dur": 30},
        {"name": "forward", "ph": "X", "cat": "gpu_user_annotation", "ts": 0, "dur": 30},  # (the GPU row's copy)
        {"name": "gemm", "ph": "X", "cat": "kernel", "ts": 10, "dur": 20},
        {"name": "copy", "ph": "X", "cat": "gpu_memcpy", "ts": 25, "dur": 10},  # (overlaps the gemm)
        {"name": "attn", "ph": "X", "cat": "kernel", "ts": 60, "dur": 50},
        {"name": "cpu op", "ph": "X", "cat": "cpu_op", "ts": 0, "dur": 500},
    ]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = bench.trace_gpu_time(str(path))
    # busy 25 (10..35) + 50 (60..110) of a 100 us window, over 2 forward passes
    assert got == {"forward_passes": 2, "idle": pytest.approx(0.25), "busy_ms": pytest.approx(0.0375), "kernels": 1.5}
    with gzip.open(path, "wt") as f:  # a CPU trace
        json.dump({"traceEvents": [e for e in events if e["cat"] not in ("kernel", "gpu_memcpy")]}, f)
    assert bench.trace_gpu_time(str(path)) is None and bench.trace_gpu_time(str(tmp_path / "elsewhere")) is None
    report = {"profile": {"traces": ["/x/p-rank0.trace.json.gz"], "gpu": {"/x/p-rank0.trace.json.gz": got}}}
    report.update(config={"dataset": "random"}, server="s", command="c", date="d")
    latency = {"mean_ms": 1, "median_ms": 1, "p99_ms": 1}
    report["summary"] = {
        "completed": 1, "failed": 0, "duration_s": 1.0, "request_throughput": 1.0, "input_token_throughput": 1.0,
        "output_token_throughput": 1.0, **dict.fromkeys(("ttft", "tpot", "itl", "e2e"), latency),
    }  # fmt: skip
    text = bench.markdown(report)
    assert "- `p-rank0.trace.json.gz`: GPU idle 25.0% of its window, 0.04 ms busy and 2 GPU activities per" in text


def test_bench_frontend_smoke(tmp_path):
    bench = load_bench("bench_frontend")
    report = bench.main(["--smoke", "--out", str(tmp_path)])
    assert [r["coalesce"] for r in report["rows"]] == [False, True]
    assert all(r["streamed_tok_s"] > 0 for r in report["rows"])
    assert report["rows"][0]["chunks"] == 8 * 10  # off: one chunk per token
    assert "| 1.0 | on |" in (tmp_path / "frontend_smoke.md").read_text()


def test_result_file_names_are_plain():
    """Result files are named after the device; a CPU's name has brackets, "@" and spaces."""
    stem = load_bench("bench_host_step").stem  # _common's
    names = {
        "Intel(R) Xeon(R) Processor @ 2.50GHz": "host_step_Intel_R_Xeon_R_Processor_2.50GHz",
        "NVIDIA H100 80GB HBM3": "host_step_NVIDIA_H100_80GB_HBM3",
        "AMD EPYC": "host_step_AMD_EPYC",
    }
    for device, expected in names.items():
        assert stem("host_step", {"config": {}, "info": {"device": device}}) == expected
    assert stem("host_step", {"config": {"smoke": True}, "info": {"device": "x y"}}) == "host_step_smoke"


def test_a_report_writes_any_config_value_as_json(tmp_path):
    """A benchmark's flags land in its report's config: a path as text, a set (bench_attention's
    FlashInfer baselines whose build failed, set only on a GPU) as a sorted list, not a TypeError
    after the measurements."""
    common = load_bench("_common")
    args = argparse.Namespace(out=tmp_path, model=tmp_path / "m", flashinfer_failed={"b x", "a y"}, n=3)
    report = common.report(None, "bench_x", torch.device("cpu"), args, [{"ms": 1.0}])
    common.save(tmp_path, "x", report, "md")
    saved = json.loads((tmp_path / "x.json").read_text())["config"]
    assert saved == {"model": str(tmp_path / "m"), "flashinfer_failed": ["a y", "b x"], "n": 3}


def test_bench_host_step_smoke(tmp_path):
    bench = load_bench("bench_host_step")
    report = bench.main(["--smoke", "--device", "cpu", "--out", str(tmp_path)])
    assert [(r["batch"], r["text"]) for r in report["rows"]] == [(b, m) for b in (1, 4) for m in bench.MODES]
    for r in report["rows"]:
        assert len(r["rounds_step_ms"]) == 2 and r["step_ms"] > 0
        assert sum(r[f"{p}_ms"] for p in bench.PHASES) <= r["step_ms"] * 1.5  # phases are parts of a step
    assert "| 4 | stop strings |" in (tmp_path / "host_step_smoke.md").read_text()


def test_bench_sampler_smoke(tmp_path):
    bench = load_bench("bench_sampler")
    report = bench.main(["--smoke", "--device", "cpu", "--out", str(tmp_path)])
    assert [(r["rows"], r["case"]) for r in report["rows"]] == [(n, c) for n in (2, 4) for c in bench.CASES]
    assert report["copy_gbps"] > 0 and all(r["ms"] > 0 and r["logits_passes"] > 0 for r in report["rows"])
    assert "| 4 | all three penalties |" in (tmp_path / "sampler_smoke.md").read_text()


def test_bench_structured_smoke(tmp_path):
    bench = load_bench("bench_structured")
    report = bench.main(["--smoke", "--device", "cpu", "--out", str(tmp_path)])
    assert [(r["case"], r["rows"]) for r in report["rows"]] == [(c, n) for c in bench.CASES for n in (1, 3)]
    assert report["vocab"] == 2000 and report["setup_ms"] > 0
    assert all(r[k] > 0 for r in report["rows"] for k in ("compile_ms", "engine_us", "loop_us", "batch_us"))
    assert "| choice (20) | 3 |" in (tmp_path / "structured_smoke.md").read_text()
    # the synthetic vocabulary: bytes first, words after, the end token last, no token twice
    vocab = bench.vocabulary(500)
    assert len(vocab) == 500 and sorted(vocab.values()) == list(range(500)) and vocab[bench.EOS] == 499
    assert "Ġself" in vocab and "self" in vocab


@pytest.mark.parametrize("tied", [False, True])
def test_bench_decode_roofline_reads_only_the_batch_rows_of_an_untied_embedding(tied):
    bench = load_bench("bench_decode")
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens = torch.nn.Embedding(1000, 8, dtype=torch.bfloat16)
    model.model.layer = torch.nn.Linear(8, 8, bias=False, dtype=torch.bfloat16)
    model.lm_head = torch.nn.Linear(8, 1000, bias=False, dtype=torch.bfloat16)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    layer, table = 8 * 8 * 2, 1000 * 8 * 2
    expected = layer + table + (16 * 8 * 2 if not tied else 0)  # lm_head reads the whole table either way
    assert bench.decode_weight_bytes(model, 16) == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the real benchmark, not a test")
def test_bench_decode_skips_points_the_pool_cannot_hold(tmp_path):
    """A point whose batch x (context + generated) exceeds the KV pool is recorded as skipped, not
    measured with fewer requests than it names."""
    bench = load_bench("bench_decode")
    report = bench.main(["--smoke", "--max-total-tokens", "64", "--out", str(tmp_path)])
    small, big = report["rows"]
    assert small["step_ms"] > 0 and "skipped" not in small
    assert "step_ms" not in big and big["skipped"].startswith("needs 144 KV tokens, the pool holds 64")
    assert "| 3 | 16 | skipped: needs 144 KV tokens" in (tmp_path / "decode_smoke.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the real benchmark, not a test")
def test_bench_attention_full_grid_smoke(tmp_path):
    bench = load_bench()
    report = bench.main(["--smoke", "--suite", "full", "--cases", "a", "--out", str(tmp_path)])
    grid = report["grid"]
    assert {r["kind"] for r in grid} == set(bench.GRID_KINDS) and {r["page"] for r in grid} == {1, 16, 64}
    assert all(r["ms"] > 0 for r in grid)
    assert (tmp_path / "attention_smoke_grid.png").stat().st_size > 0
    assert report["grid_left_out"] == []


def test_bench_attention_writes_a_tuning_table_auto_reads(tmp_path, monkeypatch):
    """--write-tuning's GPU-only path, which the first GPU run never reached: grid rows to the
    device's table, read back by `auto`'s loader (a CUDA device stood in for on CPU)."""
    from minengine.ops import tuning

    bench = load_bench()
    monkeypatch.setattr(tuning, "TABLE_DIR", tmp_path / "tuning")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    rows = []
    for kind, fast in (("decode", "triton"), ("long-decode", "triton"), ("prefill", "cuda-wgmma")):
        for backend, ms in (("triton", 1.0), ("cuda", 1.5), ("cuda-wgmma", 0.8 if fast == "cuda-wgmma" else 1.2)):
            rows.append(dict(shape="llama3-8b", page=16, dtype="bfloat16", kind=kind, head_dim=128, backend=backend,
                             ms=ms, rel_err_vs_triton=0.0))  # fmt: skip
    rows.append(dict(rows[-1], backend="flashinfer", ms=0.1))  # not ours: never picked
    report = {"command": "bench_attention", "date": "2026-11-23 11:07", "info": {"device": "NVIDIA H100 80GB HBM3"}}
    path = bench.write_tuning(rows, report, torch.device("cuda"))
    assert path == str(tmp_path / "tuning" / "nvidia-h100-80gb-hbm3.json")
    tuning.load_table.cache_clear()
    try:
        table = tuning.load_table("NVIDIA H100 80GB HBM3")
    finally:
        tuning.load_table.cache_clear()
    assert table == {"decode/bfloat16/128": "triton", "prefill/bfloat16/128": "cuda-wgmma"}
    saved = json.loads(Path(path).read_text())
    assert saved["device_name"] == "NVIDIA H100 80GB HBM3" and saved["info"] == report["info"]
    assert saved["choices"]["decode/bfloat16/128"]["total_ms"] == {"triton": 2.0, "cuda": 3.0, "cuda-wgmma": 2.4}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the real benchmark, not a test")
def test_bench_attention_time_budget_leaves_configs_out(tmp_path):
    """A spent --time-budget starts no more grid configs, names them, and still writes the report."""
    bench = load_bench()
    report = bench.main(["--smoke", "--suite", "full", "--cases", "a", "--time-budget", "0", "--out", str(tmp_path)])
    configs = bench.grid_configs(smoke=True)
    assert report["grid"] == [] and len(report["grid_left_out"]) == len(configs) == 12
    assert configs[0][1] == 16 and {c[1] for c in configs[:4]} == {16}  # page 16 first: every tuning key
    assert "Left out (12 grid configs; by --time-budget unless" in (tmp_path / "attention_smoke.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the real benchmark, not a test")
def test_bench_attention_grid_alone_has_files_of_its_own(tmp_path):
    """gpu_session.sh's grid phase (--cases ''): no case is run, and its report does not overwrite the
    cases' report of the kernels phase. Its full grid measures every tuning key (kind, dtype, head
    dim) before qwen3-0.6b, whose keys repeat llama3-8b's."""
    bench = load_bench()
    report = bench.main(["--smoke", "--suite", "full", "--cases", "", "--time-budget", "0", "--out", str(tmp_path)])
    assert report["rows"] == [] and len(report["grid_left_out"]) == 12
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attention_grid_smoke.json", "attention_grid_smoke.md"]
    page16 = [c for c in bench.grid_configs(smoke=False) if c[1] == 16]
    keys = {(kind, dtype, bench.GRID_SHAPES[shape][2]) for shape, _, dtype, kind in page16}
    before_qwen = {(kind, dtype, bench.GRID_SHAPES[shape][2]) for shape, _, dtype, kind in page16
                   if shape != "qwen3-0.6b"}  # fmt: skip
    assert page16[-1][0] == "qwen3-0.6b" and before_qwen == keys and len(keys) == 3 * 2 * 4


def test_bench_disagg_smoke(tmp_path, monkeypatch):
    """Prefill + decode + router processes on CPU, decode radix cache off then on; the report is
    saved after every row (a run stopped by a time limit keeps what it measured)."""
    pytest.importorskip("nixl")
    bench = load_bench("bench_disagg")
    saved_rows, real_save = [], bench.save
    monkeypatch.setattr(bench, "save", lambda out, stem, rep, md: (saved_rows.append(len(rep["rows"])),
                                                                   real_save(out, stem, rep, md)))  # fmt: skip
    report = bench.main(["--smoke", "--out", str(tmp_path)])
    assert saved_rows == [1, 2, 3, 4, 4]
    rows = {(r["workload"], r["decode_radix_cache"]): r for r in report["rows"]}
    assert len(rows) == 4 and all(r["failed"] == 0 and r["completed"] > 0 for r in rows.values())
    for workload in ("multi-turn", "generated-shared-prefix"):
        # the decode radix cache saves transfers: later turns and shared prefixes are already there
        assert rows[workload, True]["kv_pages"] < rows[workload, False]["kv_pages"]
    assert "| multi-turn | on |" in (tmp_path / "disagg_smoke.md").read_text()


def test_bench_attention_sigterm_stops_the_grid_and_keeps_what_it_measured(monkeypatch):
    """Under a time limit the caller's SIGTERM ends the config being measured; the configs done stay,
    the rest are listed as left out, and the run goes on to write its report."""
    import os
    import signal
    import time
    from types import SimpleNamespace

    bench = load_bench()
    measured = []

    def measure(args, device, timer, ceilings, config):
        measured.append(config)
        if len(measured) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here
        return [{"config": config}]

    monkeypatch.setattr(bench, "measure_config", measure)
    previous = signal.signal(signal.SIGTERM, bench._stop)
    try:
        rows, left_out = bench.run_grid(SimpleNamespace(smoke=True), torch.device("cpu"), None, {}, deadline=None)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # a second SIGTERM cannot cut the writing
    finally:
        signal.signal(signal.SIGTERM, previous)
    configs = bench.grid_configs(smoke=True)
    assert [r["config"] for r in rows] == configs[:2]
    assert len(left_out) == len(configs) - 2 and left_out[0].startswith(configs[2][0])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the real benchmark, not a test")
def test_bench_attention_flashinfer_rows_with_a_stand_in(monkeypatch):
    """The FlashInfer baselines' code path (CPU stand-in for FlashInfer, float64): the paged wrapper,
    and POD-Attention on mixed batches only (case d, grid kind mixed), each checked against ours; the
    mixed-batch target against the faster of the two."""
    import argparse

    install_stand_in(monkeypatch)
    bench = load_bench()
    args = argparse.Namespace(smoke=True, no_torch=True, no_flashinfer=False, flashinfer_grid="target",
                              num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16,
                              triton_variants=False)  # fmt: skip
    device, ceilings = torch.device("cpu"), {"copy_gbps": 1.0, "matmul_tflops": 1.0}
    timer = bench.timer(device)
    (mixed_case,) = [c for c in bench.cases(256) if c.name == "d"]
    d = bench.run_case(mixed_case, args, device, timer, ceilings)
    assert d["rel_err_vs_flashinfer"] < 1.6e-2 and d["rel_err_vs_flashinfer_pod"] < 1.6e-2, d
    assert d["speedup_vs_flashinfer_pod"] == d["flashinfer_pod_ms"] / d["ms"]
    rows = [{**d, "case": name} for name in "abcde"]  # check_targets reads every case
    (target,) = [t for t in bench.check_targets(rows) if t.startswith("(d) best of ours")]
    faster = "flashinfer_pod" if d["flashinfer_pod_ms"] < d["flashinfer_ms"] else "flashinfer"
    assert f"(against {faster}) vs target 1.2x" in target
    grid = bench.measure_config(args, device, timer, ceilings, ("llama3-8b", 16, torch.bfloat16, "mixed"))
    by_backend = {r["backend"]: r for r in grid}
    assert {"triton", "flashinfer", "flashinfer-pod"} <= set(by_backend)
    assert by_backend["flashinfer-pod"]["rel_err_vs_triton"] < 1.6e-2
    assert all("flashinfer_pod_over_this" in r for r in grid)
    decode = bench.measure_config(args, device, timer, ceilings, ("llama3-8b", 16, torch.bfloat16, "decode"))
    assert "flashinfer" in {r["backend"] for r in decode} and "flashinfer-pod" not in {r["backend"] for r in decode}
    report = {"command": "x", "date": "x", "info": {"device": "cpu"}, "config": {"smoke": True},
              "ceilings": ceilings, "rows": rows, "targets": [], "grid": grid}  # fmt: skip
    table = bench.markdown(report)
    assert "FlashInfer POD/this" in table and "FlashInfer POD/triton" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the real benchmark, not a test")
def test_bench_attention_a_failing_case_or_config_is_reported_and_the_rest_measured(tmp_path, monkeypatch):
    """An exception in one core case or grid config (a CUDA error, a shape a backend refuses) is
    written into the report; the other cases, the grid and the report go on."""
    bench = load_bench()
    real_case, real_config = bench.run_case, bench.measure_config

    def run_case(case, *args):
        if case.name == "b":
            raise RuntimeError("CUDA error: an illegal memory access")
        return real_case(case, *args)

    def measure_config(args, device, timer, ceilings, config):
        if config[3] == "prefill":
            raise ValueError("not this one")
        return real_config(args, device, timer, ceilings, config)

    monkeypatch.setattr(bench, "run_case", run_case)
    monkeypatch.setattr(bench, "measure_config", measure_config)
    report = bench.main(["--smoke", "--cases", "abc", "--suite", "full", "--out", str(tmp_path)])
    assert [r["case"] for r in report["rows"]] == ["a", "c"] and report["targets"] == []
    assert report["failed_cases"] == {"b": "RuntimeError: CUDA error: an illegal memory access"}
    failed = [c for c in report["grid_left_out"] if c.endswith("(failed: ValueError: not this one)")]
    assert len(failed) == 3 and {r["kind"] for r in report["grid"]} == set(bench.GRID_KINDS) - {"prefill"}
    table = (tmp_path / "attention_smoke.md").read_text()
    assert "case b FAILED: RuntimeError" in table and "prefill (failed: ValueError" in table


def test_flashinfer_builds_name_each_baseline_once():
    """The warm-up builds one baseline per (dtype, heads, head dim, batch kind, wrapper) the run will
    time: the core cases' (bf16 at the case shape) and the grid configs FlashInfer runs on."""
    import argparse

    bench = load_bench()
    args = argparse.Namespace(smoke=False, suite="core", flashinfer_grid="target", num_q_heads=32, num_kv_heads=8,
                              head_dim=128)  # fmt: skip
    core = bench.flashinfer_builds(args, bench.cases(1))
    assert core == [
        ("bfloat16", 32, 8, 128, "decode", "paged"),
        ("bfloat16", 32, 8, 128, "prefill", "paged"),
        ("bfloat16", 32, 8, 128, "mixed", "paged"),
        ("bfloat16", 32, 8, 128, "mixed", "pod"),
    ]  # case e (two launches) runs no FlashInfer
    args.suite = "full"
    assert bench.flashinfer_builds(args, bench.cases(1)) == core  # the target grid: llama3-8b bf16 page 16
    args.flashinfer_grid = "all"
    every = bench.flashinfer_builds(args, [])
    assert len(every) == len(set(every)) == len(bench.GRID_SHAPES) * 2 * 4  # shapes x dtypes x builds
    assert ("float16", 16, 4, 256, "mixed", "pod") in every


def test_warm_flashinfer_process_reports_failures_and_is_killed_whole_when_late(tmp_path):
    """The warm-up runs as one process in a session of its own: its last line names the builds that
    failed; a process that dies is reported; at the time limit the whole session is killed (its nvcc
    jobs too) and the run is told the builds did not finish."""
    import os
    import signal
    import threading

    bench = load_bench()
    mark = bench.WARMUP_MARK
    code = f"print({bench.BUILT_MARK!r} + 'a'); print('compiling'); print({mark!r} + '{{\"b\": \"why\"}}')"
    done = bench.warm_flashinfer([], seconds=60, log=tmp_path / "ok.log", command=[sys.executable, "-c", code])
    assert done["finished"] and done["built"] == ["a"] and done["failed"] == {"b": "why"}
    assert "compiling" in (tmp_path / "ok.log").read_text()

    # the real command: this script's --build-flashinfer (nothing to build here)
    assert bench.warm_flashinfer([], seconds=120, log=tmp_path / "real.log") | {"seconds": 0} == {
        "seconds": 0, "finished": True, "built": [], "failed": {}, "log": str(tmp_path / "real.log"),
        "prebuilt": [], "compiled": [],
    }  # fmt: skip

    died = [sys.executable, "-c", "import sys; sys.exit('ImportError: no flashinfer.jit')"]
    dead = bench.warm_flashinfer([], seconds=60, log=tmp_path / "died.log", command=died)
    assert not dead["finished"] and dead["failed"] == {"warm-up process": "ImportError: no flashinfer.jit"}

    slow = [  # a child in the same session stands in for nvcc
        sys.executable, "-c",
        "import os, subprocess, sys, time; "  # the stand-in for nvcc: a process group of its own, as ninja's jobs
        "subprocess.Popen([sys.executable, '-c', 'import os, time; os.setpgid(0, 0); time.sleep(60)']); "
        f"open({str(tmp_path / 'slow.pid')!r}, 'w').write(str(os.getpid())); time.sleep(60)",
    ]  # fmt: skip
    before = signal.getsignal(signal.SIGTERM)
    late = bench.warm_flashinfer([], seconds=3, log=tmp_path / "slow.log", command=slow)
    assert not late["finished"] and late["failed"] == {} and 3 <= late["seconds"] < 10
    assert signal.getsignal(signal.SIGTERM) == before and not signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert_session_gone((tmp_path / "slow.pid").read_text())

    # a stop (the phase's SIGTERM, raised as Stopped by the benchmark's handler) kills it too
    (tmp_path / "slow.pid").unlink()
    previous = signal.signal(signal.SIGTERM, bench._stop)
    timer = threading.Timer(2, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        timer.start()
        with pytest.raises(bench.Stopped):
            bench.warm_flashinfer([], seconds=60, log=tmp_path / "stopped.log", command=slow)
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, previous)
    assert_session_gone((tmp_path / "slow.pid").read_text())


def assert_session_gone(session: str) -> None:
    import subprocess
    import time

    deadline = time.monotonic() + 10
    while left := subprocess.run(["pgrep", "-s", session], capture_output=True, text=True).stdout.split():
        assert time.monotonic() < deadline, f"processes of the killed session still run: {left}"
        time.sleep(0.1)  # killed, until the kernel and init have reaped it


def test_warm_in_process_compiles_modules_together_in_rounds(monkeypatch, capsys):
    """Each round builds the pending baselines, loading compiled modules and collecting the first
    one missing; then one build_jit_specs call compiles the round's modules (a module a baseline
    asks for only after another, like the prefill wrapper's page module, comes a round later). A
    module that does not compile stops ninja: the round's others are built one by one, and it is
    not tried again; a failure is named with the error lines of its ninja output. A module in
    FlashInfer's AOT directory (benchmarks/flashinfer_aot.py) loads at once, and is named once."""
    import types

    bench = load_bench()
    loaded, batches = [], []
    ninja_error = "Ninja build failed. Ninja output:\n[1/2] nvcc bad.cu\nbad.cu(3): error: no\nninja: stopped"

    class JitSpec:
        def __init__(self, name):
            self.name = name
            self.is_aot = self.is_compiled = name in ("decode", "aot_bad")  # carried prebuilt

        def build_and_load(self):
            if self.name == "bad":
                raise RuntimeError(ninja_error)
            if self.name == "aot_bad":
                raise RuntimeError("aot_bad.so: cannot open shared object file")
            loaded.append(self.name)

    def build_jit_specs(specs):
        batches.append([s.name for s in specs])
        if "bad" in batches[-1]:
            raise RuntimeError(ninja_error)

    core = types.ModuleType("flashinfer.jit.core")
    core.JitSpec, core.build_jit_specs = JitSpec, build_jit_specs
    package = types.ModuleType("flashinfer")
    package.jit = types.ModuleType("flashinfer.jit")
    package.jit.core = core
    for name, module in (("flashinfer", package), ("flashinfer.jit", package.jit), ("flashinfer.jit.core", core)):
        monkeypatch.setitem(sys.modules, name, module)
    modules = {"decode": ["decode"], "prefill": ["prefill", "page", "decode"], "mixed": ["prefill", "page"],
               "pod": ["pod_prefill", "batch_pod"], "uses-bad": ["bad"], "uses-aot-bad": ["aot_bad"]}  # fmt: skip

    def build(item, device):
        if item[0] == "broken":
            raise ValueError("FlashInfer does not take this shape")
        for name in modules[item[0]]:
            JitSpec(name).build_and_load()

    builds = [["decode"], ["prefill"], ["mixed"], ["pod"], ["uses-bad"], ["uses-aot-bad"], ["broken"]]
    failed = bench.warm_in_process(builds, torch.device("cpu"), build)
    assert batches == [["prefill", "pod_prefill", "bad"], ["page", "batch_pod"]]
    out = capsys.readouterr().out.splitlines()
    built = [line.removeprefix(bench.BUILT_MARK) for line in out if line.startswith(bench.BUILT_MARK)]
    assert built == ["decode", "prefill", "mixed", "pod"]
    assert [line for line in out if line.startswith((bench.PREBUILT_MARK, bench.COMPILE_MARK))] == [
        bench.PREBUILT_MARK + "decode",
        bench.COMPILE_MARK + "prefill, pod_prefill, bad",
        bench.COMPILE_MARK + "page, batch_pod",
    ]
    assert loaded.count("decode") == 2  # loaded for both baselines that ask for it, named once
    assert failed == {
        "broken": "ValueError: FlashInfer does not take this shape",
        "uses-bad": "RuntimeError: Ninja build failed. Ninja output: | bad.cu(3): error: no",
        "uses-aot-bad": "RuntimeError: aot_bad.so: cannot open shared object file",  # not named prebuilt
    }
    assert "bad" not in loaded and core.JitSpec.build_and_load.__name__ == "build_and_load"  # restored


def test_a_baseline_whose_build_failed_is_not_tried_again(monkeypatch):
    import argparse

    install_stand_in(monkeypatch)
    bench = load_bench()
    args = argparse.Namespace(no_flashinfer=False, flashinfer_failed={"bfloat16 32 8 128 mixed pod"})
    mixed, decode = (1024, 1, 1), (1, 1)
    assert list(bench.flashinfer_baselines(args, torch.bfloat16, 32, 8, 128, mixed)) == ["paged"]
    assert list(bench.flashinfer_baselines(args, torch.float16, 32, 8, 128, mixed)) == ["paged", "pod"]
    assert list(bench.flashinfer_baselines(args, torch.bfloat16, 32, 8, 128, decode)) == ["paged"]
    args.no_flashinfer = True
    assert bench.flashinfer_baselines(args, torch.bfloat16, 32, 8, 128, decode) == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the real benchmark, not a test")
def test_build_baseline_builds_each_kind(monkeypatch):
    """What a warm-up process runs, here in process on the CPU stand-in of FlashInfer."""
    from test_flashinfer_backend import _Wrapper

    install_stand_in(monkeypatch)
    bench = load_bench()
    for kind, baseline in (("decode", "paged"), ("prefill", "paged"), ("mixed", "paged"), ("mixed", "pod")):
        runs = _Wrapper.runs
        bench.build_baseline(["float32", 4, 2, 32, kind, baseline], torch.device("cpu"))
        assert _Wrapper.runs > runs, (kind, baseline)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the real benchmark, not a test")
def test_bench_attention_warmup_only_measures_nothing(tmp_path):
    """--warmup-only builds FlashInfer's modules and stops: without a GPU there is nothing to build."""
    import signal

    bench = load_bench()
    before = signal.getsignal(signal.SIGTERM)
    assert bench.main(["--smoke", "--warmup-only", "--out", str(tmp_path)]) == {"flashinfer_jit": None}
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) == before  # main's stop handler is not left behind


def test_bench_attention_grid_on_a_gpu_checks_and_times_torch_sdpa(monkeypatch):
    """On a GPU the grid also times torch SDPA on gathered K/V; it is checked like the others (it
    once had no error entry, so every grid config failed there). Runs on CPU with a device whose
    type reads "cuda" (the batches stay on the CPU)."""
    import argparse
    import types

    bench = load_bench()
    from minengine.ops import testing

    real = testing.make_paged_batch
    monkeypatch.setattr(testing, "make_paged_batch", lambda *a, **k: real(*a, **{**k, "device": "cpu"}))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    gpu = types.SimpleNamespace(type="cuda")  # what measure_config branches on
    args = argparse.Namespace(smoke=True, no_torch=False, no_flashinfer=True, flashinfer_grid="all")
    ceilings = {"copy_gbps": 1.0, "matmul_tflops": 1.0}
    config = ("llama3-8b", 16, torch.bfloat16, "decode")
    rows = bench.measure_config(args, gpu, bench.timer(torch.device("cpu")), ceilings, config)
    assert {r["backend"] for r in rows} >= {"triton", "torch_sdpa"}
    sdpa = next(r for r in rows if r["backend"] == "torch_sdpa")
    assert sdpa["rel_err_vs_triton"] < 2e-2


@pytest.mark.parametrize(
    "lines, ok, error",
    [
        (
            [
                '{"choices":[{"text":"a"}]}',
                '{"choices":[{"text":"b"}]}',
                '{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}',
            ],
            True,
            None,
        ),
        (['{"error":{"message":"boom","code":500}}'], False, "stream error: boom"),
        (['{"choices":[{"text":"a"}]}', '{"error":{"message":"late","code":500}}'], False, "stream error: late"),
        (['{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":0}}'], False, "without a choice"),
        (['{"choices":[{"text":"a"}]}', "{not json"], False, "JSONDecodeError"),
    ],
)
def test_bench_serving_counts_only_streams_that_finish(lines, ok, error):
    """A failure the server streams after its 200 (an error chunk, then [DONE]), a stream with no
    choice, and a malformed line are failed requests, as in vLLM's client: not completions with a
    zero TTFT, and not an exception that loses the whole run."""
    import asyncio

    import httpx

    bench = load_bench("bench_serving")
    body = "".join(f"data: {line}\n\n" for line in lines) + "data: [DONE]\n\n"

    async def go():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body))
        async with httpx.AsyncClient(transport=transport) as http:
            args = argparse.Namespace(model="m", base_url="http://x")
            return await bench.send(http, args, bench.Request("hi", 2))

    res = asyncio.run(go())
    assert res.ok is ok
    if ok:
        assert res.output_tokens == 2 and res.ttft > 0 and len(res.itl) == 1 and res.e2e >= res.ttft
        assert res.e2e == res.chunk_times[-1] - res.start
    else:
        assert error in res.error
        summary = bench.summarize([res], 1.0)
        assert summary["completed"] == 0 and summary["failed"] == 1


@pytest.mark.parametrize("cuda_err", [float("nan"), 0.3])
def test_bench_attention_targets_leave_out_a_backend_with_a_wrong_output(cuda_err):
    """A kernel that is fast and wrong (NaN: never written, or far from float64) meets no target,
    and the table shows every backend's error beside its time."""
    bench = load_bench()
    base = dict(ms=1.0, kv_bw_frac=0.5, tflops_frac=0.4, rel_err_vs_fp64=2.3e-3, flashinfer_ms=1.0)
    rows = [{**base, "case": name, "cuda_ms": 0.1, "cuda_rel_err_vs_fp64": cuda_err} for name in "abcde"]
    verdicts = bench.check_targets(rows)
    (c,) = [t for t in verdicts if t.startswith("(c) best of ours")]
    assert "best of ours (triton)" in c and "40% vs target 70%: MISSED; left out, wrong output: cuda" in c
    (d,) = [t for t in verdicts if t.startswith("(d) best of ours")]
    assert "(triton), flashinfer_over_ours 1.00x" in d and "wrong output: cuda" in d
    rows[2]["rel_err_vs_fp64"] = float("nan")  # triton wrong too: nothing of ours is measured on c
    verdicts = bench.check_targets(rows)
    assert "(c) tflops_frac 40% vs target 50%: MISSED (wrong output)" in verdicts
    assert any(t.startswith("(c) best of ours") and "every backend's output was wrong" in t for t in verdicts)
    for r in rows:
        r.update(case=r["case"], label="x", kv_gbps=1.0, tflops=1.0)
    report = {"command": "x", "date": "x", "info": {"device": "cpu"}, "config": {"smoke": True},
              "ceilings": {}, "rows": rows, "targets": verdicts}  # fmt: skip
    table = bench.markdown(report)
    assert "| cuda ms | cuda err |" in table and f"| 0.1000 | {cuda_err:.1e} |" in table


def test_bench_serving_long_short_mix_and_bursty_arrivals(capsys):
    """--random-long-fraction makes that share of the prompts exactly --random-long-input-len long
    (the chunk ablation's long/short mix); --burstiness draws gamma gaps with the same mean rate from
    a generator of their own; bad values are refused naming the allowed range."""
    import random

    bench = load_bench("bench_serving")
    argv = ["--num-prompts", "50", "--random-input-len", "20", "--random-range-ratio", "0.5",
            "--random-output-len", "8", "--random-long-fraction", "0.2", "--random-long-input-len", "300"]  # fmt: skip
    args = bench.parse_args(argv)
    rng = random.Random(0)
    dataset = bench.build_dataset(args, bench.Prompts(None, rng), rng)
    lengths = [len(r.prompt.split()) for r in dataset]
    assert lengths.count(300) == 10 and all(10 <= n <= 20 for n in lengths if n != 300)
    assert all(4 <= r.output_len <= 8 for r in dataset)
    for bad, allowed in ((["--burstiness", "0"], "allowed: > 0"), (["--random-long-fraction", "1.5"], "0 to 1")):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
        assert allowed in capsys.readouterr().err
    gen = random.Random(1)
    gaps = [gen.gammavariate(0.25, 1 / (10 * 0.25)) for _ in range(20000)]
    assert abs(sum(gaps) / len(gaps) - 0.1) < 0.01  # the rate holds; the gaps' spread grows (bursts)
    assert sorted(gaps)[len(gaps) // 2] < 0.03


def test_bench_attention_a_kernel_that_writes_nothing_has_a_nan_error(monkeypatch):
    """Every backend of a case writes into one buffer: it is poisoned before each check, so a kernel
    that writes nothing is not scored on the previous backend's output (and meets no target)."""
    from minengine.ops import cuda as cuda_backend

    bench = load_bench()
    monkeypatch.setattr(cuda_backend, "available", lambda: True)
    monkeypatch.setattr(cuda_backend, "paged_attention", lambda *a, out=None, **k: out)
    monkeypatch.setattr(cuda_backend, "chosen_kernel", lambda *a, **k: "mma")
    args = argparse.Namespace(smoke=True, no_torch=True, no_flashinfer=True, num_q_heads=4, num_kv_heads=2,
                              head_dim=32, page_size=16, triton_variants=False)  # fmt: skip
    device, ceilings = torch.device("cpu"), {"copy_gbps": 1.0, "matmul_tflops": 1.0}
    (case,) = [c for c in bench.cases(256) if c.name == "a"]
    row = bench.run_case(bench.Case(case.name, case.label, case.q_lens[:3], case.seq_lens[:3], None), args, device,
                         bench.timer(device), ceilings)  # fmt: skip
    assert row["rel_err_vs_fp64"] < 1e-2 and row["cuda_rel_err_vs_fp64"] != row["cuda_rel_err_vs_fp64"]
    assert bench.wrong_output(row, "cuda") and not bench.wrong_output(row, "triton")


def test_bench_serving_spreads_its_streams_over_connection_pools(monkeypatch):
    """Conversation i streams through pool i % CLIENT_POOLS: httpcore scans a pool's connections for
    each idle one whenever a request comes or goes, so one pool of 256 streams took about half of
    the client's CPU (and delayed the chunks it timed)."""
    import asyncio
    import collections
    import random

    import httpx

    bench = load_bench("bench_serving")
    body = 'data: {"choices":[{"text":"a"}]}\n\ndata: {"choices":[{"text":"b"}]}\n\ndata: [DONE]\n\n'
    streams = collections.Counter()
    real = httpx.AsyncClient

    class Pool(real):
        def __init__(self, timeout=None, limits=None, verify=None):
            def handler(request):
                streams[id(self)] += request.url.path == "/v1/completions"
                return httpx.Response(200, text=body if request.url.path == "/v1/completions" else "")

            super().__init__(transport=httpx.MockTransport(handler), timeout=timeout)

    monkeypatch.setattr(httpx, "AsyncClient", Pool)
    argv = ["--base-url", "http://x", "--model", "m", "--num-prompts", str(2 * bench.CLIENT_POOLS),
            "--random-input-len", "4", "--random-output-len", "2", "--warmup-requests", "0",
            "--no-progress"]  # fmt: skip
    args, rng = bench.parse_args(argv), random.Random(0)
    prompts = bench.Prompts(None, rng)
    results, _, _, _ = asyncio.run(bench.run(args, bench.build_dataset(args, prompts, rng), prompts, random.Random(1)))
    assert all(r.ok for r in results) and sorted(streams.values()) == [2] * bench.CLIENT_POOLS
