"""The profiling scripts: the torch-profiler trace has the engine's named step ranges; the Nsight
Compute summary reads ncu's text reports. Profiles of a running engine: ``LLM.start_profile`` and
a server's ``/start_profile`` (as SGLang's)."""

from __future__ import annotations

import asyncio
import gc
import gzip
import importlib.util
import json
import sys
from pathlib import Path

import httpx
import pytest
import torch
from test_server import MODEL, wait_for

from minengine.profiling import ProfileSpec


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


# --- profiles of a running engine (LLM.start_profile, a server's /start_profile) ------------------

STEP_RANGES = {"schedule", "h2d", "forward", "sampling", "process_results"}


def trace_names(path: str) -> list[str]:
    with gzip.open(path, "rt") as f:
        return [e.get("name") for e in json.load(f)["traceEvents"]]


def test_llm_profile_of_num_steps_forward_passes(tmp_path):
    from minengine import LLM, SamplingParams

    llm = LLM(MODEL, max_running_requests=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [path] = llm.start_profile(str(tmp_path / "traces"), num_steps=3)
    assert path == str(tmp_path / "traces" / Path(path).name) and path.endswith("-rank0.trace.json.gz")
    assert not Path(path).exists()  # (written when it stops)
    llm.generate(["profile me", "and me"], params, use_tqdm=False)  # 12 forward passes, 3 recorded
    assert not llm.engine.profiler.active
    assert llm.stop_profile() == [path]  # (the one num_steps ended, once written)
    names = trace_names(path)
    assert set(names) >= STEP_RANGES and names.count("forward") == 3
    assert [p.name for p in (tmp_path / "traces").iterdir()] == [Path(path).name]  # (no partial file left)
    with pytest.raises(ValueError, match="no profile is running; start one first"):
        llm.stop_profile()
    [second] = llm.start_profile(str(tmp_path / "traces"), activities=["CPU"], record_shapes=True, with_stack=False)
    assert second != path
    with pytest.raises(ValueError, match=r"a profile is running already \(its trace: .*\); stop it first"):
        llm.start_profile(str(tmp_path / "traces"))
    llm.generate(["once more"], params, use_tqdm=False)
    assert llm.stop_profile() == [second] and trace_names(second).count("forward") == 12
    assert llm.generate(["after"], params, use_tqdm=False)[0].outputs[0].token_ids  # (nothing left running)
    assert not torch.autograd._profiler_enabled()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_steps": 0}, "num_steps is 0; allowed: an integer 1..1000000, or null (until stopped)"),
        ({"num_steps": 1_000_001}, "num_steps is 1000001; allowed: an integer 1..1000000"),
        ({"num_steps": True}, "num_steps is True; allowed: an integer 1..1000000"),
        ({"num_steps": 2.5}, "num_steps is 2.5; allowed: an integer 1..1000000"),
        ({"num_steps": "3"}, "num_steps is '3'; allowed: an integer 1..1000000"),
        ({"activities": []}, "activities is []; allowed: a non-empty list of distinct names from ['CPU', 'GPU', "),
        ({"activities": ["CPU", "CPU"]}, "activities is ['CPU', 'CPU']; allowed: a non-empty list of distinct"),
        ({"activities": ["TPU"]}, "activities is ['TPU']; allowed: a non-empty list of distinct names"),
        ({"activities": [["CPU"]]}, "activities is [['CPU']]; allowed: a non-empty list of distinct names"),
        ({"activities": "CPU"}, "activities is 'CPU'; allowed: a list of names, such as ['CPU', 'GPU']"),
        ({"activities": ["GPU"]}, "activities is ['GPU'], but this engine runs on cpu; allowed here: ['CPU']"),
        ({"activities": ["CUDA_PROFILER"]}, "activities is ['CUDA_PROFILER'], but this engine runs on cpu"),
        ({"record_shapes": "yes"}, "record_shapes is 'yes'; allowed: true or false"),
        ({"with_stack": 1}, "with_stack is 1; allowed: true or false"),
        ({"output_dir": None}, "activities by default (CPU, and GPU on CUDA) write a trace file: an output directory"),
    ],
)
def test_bad_profiles_name_the_value(tmp_path, kwargs, message):
    from minengine import LLM

    llm = LLM(MODEL)
    with pytest.raises(ValueError) as err:
        llm.start_profile(**{"output_dir": str(tmp_path), **kwargs})
    assert message in str(err.value)
    assert not llm.engine.profiler.active and not list(tmp_path.iterdir())
    assert not torch.autograd._profiler_enabled()


def test_one_torch_profiler_at_a_time(tmp_path):
    """torch lets a second profiler take the first one's session over, and crashes writing the
    first (a segfault): neither order is let through."""
    from minengine import LLM, SamplingParams

    llm = LLM(MODEL)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    running = pytest.raises(ValueError, match="another torch.profiler is running in this process; allowed: one")
    with torch.profiler.profile(), running:
        llm.start_profile(str(tmp_path))
    llm.start_profile(str(tmp_path))
    with torch.profiler.profile():  # (the caller's own, around a generate)
        llm.generate(["x"], params, use_tqdm=False)
    with pytest.raises(ValueError, match="another torch.profiler in this process ended this profile; it has no"):
        llm.stop_profile()
    assert not llm.engine.profiler.active and not list(tmp_path.iterdir())
    assert llm.start_profile(str(tmp_path)) and llm.generate(["y"], params, use_tqdm=False)
    assert trace_names(llm.stop_profile()[0]).count("forward") == 3


def test_a_profile_dropped_without_a_stop_ends_its_torch_profiler(tmp_path):
    from minengine.profiling import ProfileSpec, StepProfiler

    profiler = StepProfiler(torch.device("cpu"))
    profiler.start(ProfileSpec(str(tmp_path), "p"))
    assert torch.autograd._profiler_enabled()
    del profiler
    gc.collect()
    assert not torch.autograd._profiler_enabled()


def test_a_profile_that_cannot_be_written_does_not_stop_the_engine(tmp_path, monkeypatch, caplog):
    from minengine import LLM, SamplingParams

    def full_disk(self, path):
        Path(path).write_text("half a trace")
        raise OSError(28, "No space left on device")

    llm = LLM(MODEL)
    llm.start_profile(str(tmp_path), num_steps=2)
    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", full_disk)
    [out] = llm.generate(["still answered"], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 5 and not llm.engine.profiler.active
    with pytest.raises(OSError, match="No space left on device"):
        llm.stop_profile()
    assert wait_for(lambda: "writing the profile of 2 forward passes failed" in caplog.text)
    assert not list(tmp_path.iterdir())  # (the partial file went)
    llm.start_profile(str(tmp_path))  # (an engine shut down while profiling writes the trace first)
    llm.shutdown()
    assert "writing a profile failed: [Errno 28] No space left on device" in caplog.text


def test_profiles_of_data_parallel_workers(tmp_path):
    from minengine import LLM, SamplingParams

    with LLM(MODEL, dp_size=2) as llm:
        paths = llm.start_profile(str(tmp_path))
        assert [p[-len("-rank0.trace.json.gz") :] for p in paths] == ["-rank0.trace.json.gz", "-rank1.trace.json.gz"]
        assert paths[0][: -len("0.trace.json.gz")] == paths[1][: -len("1.trace.json.gz")]  # one name, each rank's
        with pytest.raises(ValueError, match=r"scheduler 0: a profile is running already"):
            llm.start_profile(str(tmp_path))
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        llm.generate(["one", "two", "three", "four"], params, use_tqdm=False)
        assert llm.stop_profile() == paths
        for path in paths:  # round-robin: two requests each, 4 tokens, at least 4 forward passes
            assert trace_names(path).count("forward") >= 4
        with pytest.raises(ValueError, match="activities is \\['GPU'\\], but this engine runs on cpu"):
            llm.start_profile(str(tmp_path), activities=["GPU"])
        # num_steps counts each worker's own passes: one that got no request still runs at the stop
        paths = llm.start_profile(str(tmp_path), num_steps=2)
        llm.generate(["only one"], params, use_tqdm=False)
        assert llm.stop_profile() == paths
        assert sorted(trace_names(p).count("forward") for p in paths) == [0, 2]


def test_server_profiles(tmp_path):
    from test_server import start_server, stop_server

    traces = tmp_path / "traces"
    proc, url = start_server("--torch-profiler-dir", str(traces), "--dp-size", "2")
    try:
        http = httpx.Client(base_url=url, timeout=60)
        r = http.post("/stop_profile")
        assert r.status_code == 400 and "scheduler 0: no profile is running" in r.json()["error"]["message"]
        r = http.post("/start_profile")  # (no body: SGLang's curl call)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["status"] == "started" and body["num_steps"] is None and len(body["traces"]) == 2
        assert all(p.startswith(str(traces) + "/profile-") for p in body["traces"])
        r = http.post("/start_profile", json={"num_steps": 5})
        assert r.status_code == 400 and "a profile is running already" in r.json()["error"]["message"]
        for _ in range(2):  # one request a worker
            r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True})
            assert r.status_code == 200, r.text
        r = http.get("/stop_profile")  # (GET or POST, as SGLang's)
        assert r.status_code == 200 and r.json() == {"status": "stopped", "traces": body["traces"]}
        for path in body["traces"]:
            assert trace_names(path).count("forward") >= 4
        # num_steps: each worker stops by itself; /stop_profile then answers with the traces written
        r = http.post("/start_profile", json={"num_steps": 2, "activities": ["CPU"], "with_stack": False})
        assert r.status_code == 200 and r.json()["num_steps"] == 2
        for _ in range(2):
            http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True})
        stopped = http.post("/stop_profile")
        assert stopped.status_code == 200 and stopped.json()["traces"] == r.json()["traces"]
        for path in r.json()["traces"]:
            assert trace_names(path).count("forward") == 2
        assert http.post("/stop_profile").status_code == 400
        for body, message, param in [
            ({"output_dir": "/tmp"}, "output_dir is not a field minengine's /start_profile takes (the server's", None),
            ({"start_step": 3}, "start_step is not a field minengine's /start_profile takes", "start_step"),
            ({"num_steps": 0}, "num_steps is 0; allowed: an integer 1..1000000, or null (until stopped)", "num_steps"),
            ({"num_steps": "5"}, "num_steps", "num_steps"),
            ({"activities": ["MEM"]}, "activities is ['MEM']; allowed: a non-empty list of distinct names", None),
            ({"activities": ["GPU"]}, "scheduler 0: activities is ['GPU'], but this engine runs on cpu", None),
        ]:
            r = http.post("/start_profile", json=body)
            assert r.status_code == 400 and message in r.json()["error"]["message"], (body, r.text)
            if param is not None:
                assert r.json()["error"]["param"] == param
        assert http.post("/stop_profile").status_code == 400  # (none left running by a failed start)
        # bench_serving --profile: the measured requests, profiled
        from test_bench_smoke import load_bench

        bench = load_bench("bench_serving")
        argv = ["--base-url", url, "--num-prompts", "4", "--random-input-len", "20", "--random-output-len", "5"]
        argv += ["--random-range-ratio", "1"]  # (5 tokens each: at least 5 forward passes a worker)
        argv += ["--tokenizer", "tiny", "--out", str(tmp_path), "--no-progress", "--profile"]
        report = bench.main(argv)
        assert report["summary"]["completed"] == 4 and len(report["profile"]["traces"]) == 2
        assert all(trace_names(p).count("forward") >= 5 for p in report["profile"]["traces"])
        assert "- profiled (the latencies above include the profiler's cost): " in bench.markdown(report)
        assert http.post("/start_profile").status_code == 200
        with pytest.raises(SystemExit, match="--profile: /start_profile answered 400: .*a profile is running already"):
            bench.main(argv)
        assert http.post("/stop_profile").status_code == 200
        assert not [p for p in traces.iterdir() if ".partial" in p.name]
    finally:
        stop_server(proc)


def test_profile_calls_time_out_and_late_answers_are_dropped(tmp_path, monkeypatch):
    """A worker that does not answer in time: a TimeoutError naming the wait; its late answer is
    not taken for the next call's."""
    import zmq

    from minengine.server import frontend
    from minengine.server.frontend import SchedulerClient
    from minengine.server.metrics import Metrics
    from minengine.server.protocol import ProfileReply, Ready, StopProfile

    monkeypatch.setattr(frontend, "PROFILE_REPLY_SECONDS", 0.3)
    requests, outputs = f"ipc://{tmp_path}/requests-0", f"ipc://{tmp_path}/outputs"

    async def scenario():
        client = SchedulerClient([requests], outputs, Metrics())
        ctx = zmq.Context()
        inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        inbox.connect(requests)
        outbox.connect(outputs)
        try:
            outbox.send_pyobj(Ready(260, 4096, 65536))
            await client.start(lambda: True)
            with pytest.raises(TimeoutError, match="1 scheduler\\(s\\) did not answer StopProfile within 0.3 s"):
                await client.profile(StopProfile())
            first = inbox.recv_pyobj(zmq.NOBLOCK)
            outbox.send_pyobj(ProfileReply(0, first.call, "/late"))  # (the call that timed out)
            call = asyncio.create_task(client.profile(StopProfile()))
            await asyncio.sleep(0.1)
            second = inbox.recv_pyobj(zmq.NOBLOCK)
            assert second.call == first.call + 1
            outbox.send_pyobj(ProfileReply(0, second.call, "/answer"))
            assert [r.path for r in await call] == ["/answer"]
        finally:
            client.close()
            inbox.close(0)
            outbox.close(0)
            ctx.term()

    asyncio.run(scenario())


def test_profiling_is_off_without_a_folder_and_guarded_by_the_api_key(tmp_path):
    from test_server import _app_with_access

    http = _app_with_access([])
    for path in ("/start_profile", "/stop_profile"):
        r = http.post(path)
        assert r.status_code == 400
        assert r.json()["error"]["message"] == (
            "profiling is off; start the server with --torch-profiler-dir DIR to take profiles"
        )
    http = _app_with_access(["--api-key", "sesame", "--torch-profiler-dir", str(tmp_path / "t")])
    assert (tmp_path / "t").is_dir()  # (made at start: a folder that cannot be made fails the start)
    for path in ("/start_profile", "/stop_profile"):
        assert http.post(path).status_code == 401 and http.get(path).status_code == 401


def test_a_profile_folder_that_cannot_be_made_fails_the_start(tmp_path):
    from test_server import run_cli

    (tmp_path / "file").write_text("")
    r = run_cli([sys.executable, "-m", "minengine.serve", "--torch-profiler-dir", str(tmp_path / "file" / "t")], 60)
    assert r.returncode == 2
    [line] = r.stderr.strip().splitlines()
    assert "error: argument --torch-profiler-dir: cannot make the folder:" in line


@pytest.mark.gpu
def test_a_gpu_profile_records_the_kernels_under_cuda_graphs(tmp_path):
    """On CUDA: the default activities (CPU and GPU) with the CUDA profiler range (nsys's
    cudaProfilerApi capture range) around decode steps that replay CUDA graphs."""
    from minengine import LLM, SamplingParams

    llm = LLM(MODEL, device="cuda")
    assert llm.engine.use_cuda_graphs
    llm.generate(["warm up"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    [path] = llm.start_profile(str(tmp_path), num_steps=6, activities=["CPU", "GPU", "CUDA_PROFILER"])
    llm.generate(["profile me"] * 3, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    assert [e.get("name") for e in events].count("forward") == 6
    assert any(e.get("cat") == "kernel" for e in events)  # (device work: CUPTI recorded it)
    assert not llm.engine.profiler.active


def test_a_worker_answers_a_library_failure_as_a_failure_not_a_bad_request(tmp_path):
    """Only minengine's own ValueErrors (what the request asked cannot be done) are the caller's
    error (a 400); a library's (torch's UnicodeDecodeError, a ValueError) is a failure (a 500)."""
    from types import SimpleNamespace

    from minengine.profiling import StepProfiler
    from minengine.server.protocol import StopProfile
    from minengine.server.scheduler_process import profile_reply

    engine = SimpleNamespace(profiler=StepProfiler(torch.device("cpu")))
    reply = profile_reply(engine, StopProfile(call=7), rank=1).result()
    assert (reply.rank, reply.call, reply.user_error) == (1, 7, True)
    assert reply.error == "no profile is running; start one first"

    def torch_fails(discard=False):
        raise UnicodeDecodeError("utf-8", b"\xe8", 0, 1, "invalid continuation byte")

    engine.profiler.stop = torch_fails
    reply = profile_reply(engine, StopProfile(call=8), rank=1).result()
    assert not reply.user_error and reply.error.startswith("UnicodeDecodeError: 'utf-8' codec can't decode")


def test_no_profile_starts_while_the_last_trace_is_written(tmp_path, monkeypatch):
    """A profile started beside the writer thread would record its work (with stacks, ten times
    the events): a worker refuses it; the offline LLM waits for the write."""
    import threading

    from minengine import LLM, SamplingParams

    release = threading.Event()
    real = torch.profiler.profile.export_chrome_trace

    def slow(self, path):
        release.wait(30)
        real(self, path)

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", slow)
    llm = LLM(MODEL)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    profiler = llm.engine.profiler
    [first] = llm.start_profile(str(tmp_path))
    llm.generate(["a"], params, use_tqdm=False)
    written = profiler.stop()
    with pytest.raises(
        ValueError, match=r"the last profile's trace is still being written \(.*-rank0\.trace\.json\.gz\)"
    ):
        profiler.start(ProfileSpec(str(tmp_path), "next"))
    assert not written.done() and not Path(first).exists()
    threading.Timer(0.5, release.set).start()
    [second] = llm.start_profile(str(tmp_path))  # (waits for the write)
    assert written.result() == first and Path(first).exists()
    llm.generate(["b"], params, use_tqdm=False)
    assert llm.stop_profile() == [second] and trace_names(second).count("forward") == 3


def test_a_profile_is_the_thread_s_that_started_it(tmp_path):
    """torch.profiler records the thread that started it: passes of another thread are not
    counted, and a stop from another thread is refused with the profile left as it was."""
    import threading

    from minengine import LLM, SamplingParams

    llm = LLM(MODEL)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    [path] = llm.start_profile(str(tmp_path), num_steps=2)
    elsewhere = threading.Thread(target=llm.generate, args=(["a"], params), kwargs={"use_tqdm": False})
    elsewhere.start()
    elsewhere.join()
    assert llm.engine.profiler.active  # (its 4 passes were another thread's)
    failed = []
    stopper = threading.Thread(target=lambda: failed.append(pytest.raises(ValueError, llm.stop_profile)))
    stopper.start()
    stopper.join()
    assert "the profile was started on another thread; allowed: stop it on that thread" in str(failed[0].value)
    assert llm.engine.profiler.active
    llm.generate(["b"], params, use_tqdm=False)  # (here: 4 passes, the profile stops at 2)
    assert llm.stop_profile() == [path] and trace_names(path).count("forward") == 2


def test_a_discarded_start_does_not_take_the_trace_num_steps_ended(tmp_path):
    from minengine.profiling import StepProfiler

    profiler = StepProfiler(torch.device("cpu"))
    profiler.start(ProfileSpec(str(tmp_path), "p", num_steps=1))
    profiler.forward_pass()
    with pytest.raises(ValueError, match="no profile is running"):
        profiler.stop(discard=True)  # (a start that failed on another worker is rolled back)
    assert profiler.stop().result() == str(tmp_path / "p-rank0.trace.json.gz")
