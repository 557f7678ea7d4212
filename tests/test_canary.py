"""benchmarks/canary.py: each of our backends once in a child process before a GPU run times them;
one that hangs, dies (a sticky CUDA error) or writes wrong values is left out with the reason, and
the rest still run."""

from __future__ import annotations

import sys
import textwrap
import time
import types

import pytest
import torch
from test_bench_smoke import load_bench

from minengine.models import load_model_config

# A stand-in child: the backend's name says what it does.
FAKE_CHILD = textwrap.dedent(
    """
    import os, sys, time
    for name in sys.argv[1:]:
        print("CANARY start " + name, flush=True)
        if name.startswith("hang"):
            time.sleep(60)
        if name.startswith("die"):
            print("RuntimeError: CUDA error: an illegal memory access was encountered", flush=True)
            os._exit(3)
        if name.startswith("warn"):
            print("UserWarning: something about " + name, flush=True)
        if name.startswith("silent"):
            os._exit(4)
        if name.startswith("bad"):
            print("CANARY bad " + name + " mixed, page 16: relative error 0.9 against float64", flush=True)
            sys.exit(0)  # as the real child on a GPU: the rest in a fresh process
        print("CANARY ok " + name, flush=True)
    """
)


def fake(names: list[str]) -> list[str]:
    return [sys.executable, "-c", FAKE_CHILD, *names]


def test_a_backend_that_hangs_dies_or_is_wrong_is_left_out_and_the_rest_still_run():
    canary = load_bench("canary")
    names = ["triton", "hang-1", "cuda", "die-1", "bad-1", "cuda-wgmma", "warn-1", "silent-1"]
    results = canary.run_canary(names, seconds=1.0, startup_seconds=20.0, command=fake)
    assert list(results) == names
    assert results["triton"] == results["cuda"] == results["cuda-wgmma"] == "ok"
    assert results["hang-1"] == "no result within 1 s of hang-1's start (a hang?)"
    assert results["die-1"].startswith("its process ended (exit 3): RuntimeError: CUDA error: an illegal memory")
    assert results["bad-1"] == "mixed, page 16: relative error 0.9 against float64"
    assert results["warn-1"] == "ok"
    assert results["silent-1"] == "its process ended (exit 4)"  # (not told by warn-1's output)
    assert canary.failed(results).keys() == {"hang-1", "die-1", "bad-1", "silent-1"}


def test_a_childs_start_and_tritons_compile_get_the_startup_time():
    """A child's imports and CUDA's start (before its first line) and Triton's backend (it compiles)
    get ``startup_seconds``; every other backend, the first of a child too, ``seconds``."""
    canary = load_bench("canary")
    slow = textwrap.dedent(
        """
        import sys, time
        time.sleep(1.5)  # imports
        for name in sys.argv[1:]:
            print("CANARY start " + name, flush=True)
            time.sleep(1.5 if name in ("triton", "slow") else 0)
            print("CANARY ok " + name, flush=True)
        """
    )
    command = lambda names: [sys.executable, "-c", slow, *names]  # noqa: E731
    results = canary.run_canary(["cuda", "triton", "slow", "last"], seconds=0.5, startup_seconds=20.0, command=command)
    assert results == {
        "cuda": "ok", "triton": "ok", "slow": "no result within 0.5 s of slow's start (a hang?)", "last": "ok"
    }  # fmt: skip


def test_the_childs_lines_are_read_whatever_comes_before_them():
    """A native library's unfinished line before a mark, bytes that are not UTF-8, and a reason that
    came in several lines (the child joins them)."""
    canary = load_bench("canary")
    noisy = textwrap.dedent(
        """
        import sys
        out = sys.stdout.buffer
        out.write(b"CANARY start a\\n\\xff\\xfe not utf-8\\n[native] half a line CANARY ok a\\n")
        out.write(b"CANARY start b\\nCANARY bad b CompilationError: at 12:4: / x = y\\n")
        out.flush()
        """
    )
    command = lambda names: [sys.executable, "-c", noisy]  # noqa: E731
    results = canary.run_canary(["a", "b"], seconds=5.0, startup_seconds=20.0, command=command)
    assert results == {"a": "ok", "b": "CompilationError: at 12:4: / x = y"}


def test_a_child_that_ends_before_any_backend_fails_them_all_once():
    canary = load_bench("canary")
    broken = lambda names: [sys.executable, "-c", "import sys; print('ImportError: no torch'); sys.exit(1)"]  # noqa: E731
    results = canary.run_canary(["triton", "cuda"], seconds=1.0, startup_seconds=20.0, command=broken)
    assert results == dict.fromkeys(["triton", "cuda"], "its process ended (exit 1): ImportError: no torch")
    silent = lambda names: [sys.executable, "-c", "import time; time.sleep(60)"]  # noqa: E731
    results = canary.run_canary(["triton"], seconds=1.0, startup_seconds=1.0, command=silent)
    assert results == {"triton": "no result within 1 s of the process's start (a hang?)"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the child on CPU, in this process")
def test_the_child_checks_every_sequences_output_against_float64(monkeypatch, capsys):
    """In process, on CPU: a backend writing wrong values, nothing (the output is poisoned), or one
    long decode's row as zeros (a failed split merge; on the GPU batch, within 2e-2 of float64 over
    the whole batch) is bad, with that sequence's error; one that raises is bad with its error, in
    one line; the others are ok."""
    canary = load_bench("canary")
    from minengine.ops import cuda as cuda_backend

    real = canary._attention

    def zero_long_decode(*args, out):
        real("triton")(*args, out=out)
        out[70].zero_()  # the decode at 300 keys
        return out

    def attention(backend: str):
        if backend == "wrong":
            return lambda *args, out: out.zero_()
        if backend == "nothing":
            return lambda *args, out: out
        if backend == "one-row":
            return zero_long_decode
        if backend == "raises":
            return lambda *args, out: (_ for _ in ()).throw(RuntimeError("CUDA error\nat line 2"))
        return real(backend)

    monkeypatch.setattr(canary, "_attention", attention)
    (_, batch, _), *_ = canary.batches("cpu")
    assert batch.seq_lens_host[1] == 300 and batch.q_lens[:2] == [70, 1]
    try:
        canary.child(["wrong", "triton", "nothing", "cuda-nope", "one-row", "raises"], "cpu")
    finally:
        cuda_backend.use_emulator(False)
    lines = capsys.readouterr().out.splitlines()
    verdicts = [line for line in lines if line.startswith("CANARY ") and not line.startswith("CANARY start")]
    assert verdicts[0].startswith("CANARY bad wrong mixed, page 16: relative error 1 against float64")
    assert verdicts[1] == "CANARY ok triton"
    assert verdicts[2].startswith("CANARY bad nothing mixed, page 16: relative error nan")
    assert verdicts[4].startswith("CANARY bad one-row mixed, page 16: relative error 1 against float64 (a sequence's")
    assert verdicts[5] == "CANARY bad raises RuntimeError: CUDA error / at line 2"
    assert verdicts[3].startswith(
        "CANARY bad cuda-nope refused: ValueError: unknown backend 'cuda-nope'; allowed: triton,"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run (on a GPU, the bench runs the canary)")
def test_canary_passes_each_of_ours_on_cpu(capsys):
    """The real child process: the Triton interpreter and the CUDA kernels' emulator (every impl,
    the TMA ones on 16-token pages and their fallback on 1-token pages)."""
    canary = load_bench("canary")
    backends = canary.backends_for("cpu")
    results = canary.main(["--device", "cpu", "--passed"])
    assert results == dict.fromkeys(backends, "ok")
    assert capsys.readouterr().out.split() == backends
    from minengine.ops import cuda as cuda_backend
    from minengine.ops import cuda_emulator

    if not cuda_emulator.unavailable_reason():
        assert "cuda-wgmma-2wg" in backends and "cuda-simt" in backends
        cuda_backend.use_emulator()
        try:
            (_, tma, _), (_, fallback, _), *others = canary.batches("cpu")
            assert cuda_backend.chosen_kernel(*tma.args(), impl="wgmma-2wg") == "wgmma-2wg"
            assert cuda_backend.chosen_kernel(*fallback.args(), impl="wgmma-2wg") == "wgmma"
            (_, d64, for_d64), (_, d256, for_d256) = others  # the grid's other instantiations
            assert d64.q.dtype == torch.float16 and d64.q.shape[-1] == 64 and d256.q.shape[-1] == 256
            assert cuda_backend.chosen_kernel(*d64.args(), impl="wgmma-2wg") == "wgmma-2wg"
            assert cuda_backend.chosen_kernel(*d256.args()) == "mma"
            assert [b for b in backends if for_d64(b)] == [b for b in backends if b != "triton"]
            assert [b for b in backends if for_d256(b)] == ["cuda", "cuda-simt"]
        finally:
            cuda_backend.use_emulator(False)


def test_bounded_runs_end_with_their_script(tmp_path):
    """profiles/bounded.sh: a caller's time limit on the script (SIGTERM to its process group) also
    ends the bounded command, which GNU timeout had put in a group of its own."""
    import subprocess
    import uuid
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    marker = f"27.{uuid.uuid4().int % 10**6:06d}"
    script = f"source {root}/profiles/bounded.sh; bounded 30 sleep {marker}; echo after"
    done = subprocess.run(["timeout", "1", "bash", "-c", script], capture_output=True, text=True)
    assert done.returncode == 124 and "after" not in done.stdout
    time.sleep(0.5)
    alive = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True).stdout
    subprocess.run(["pkill", "-f", f"sleep {marker}"])
    assert not alive
    done = subprocess.run(["bash", "-c", f"source {root}/profiles/bounded.sh; bounded 1 sleep 5"])
    assert done.returncode == 124
    # SIGTERM to the script alone: passed on to the command, waited for, exit 143
    marker = f"28.{uuid.uuid4().int % 10**6:06d}"
    script = f"source {root}/profiles/bounded.sh; bounded 30 sleep {marker} > {tmp_path}/out; echo after"
    proc = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, text=True)
    for _ in range(100):
        if subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True).returncode == 0:
            break
        time.sleep(0.05)
    proc.terminate()
    assert proc.wait(timeout=15) == 143 and "after" not in proc.stdout.read()
    alive = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True).stdout
    subprocess.run(["pkill", "-f", f"sleep {marker}"])
    assert not alive


@pytest.mark.skipif(torch.cuda.is_available(), reason="smoke runs on CPU")
def test_bench_attention_leaves_out_what_failed_its_canary_run(tmp_path, monkeypatch):
    """The run's report lists the canary runs; a failed CUDA backend gets no column in the cases (nor
    rows in the grid), and a failed triton (every row's base) runs no case."""
    bench = load_bench()
    from minengine.ops import cuda as cuda_backend

    calls = []

    def canary(backends, device="cuda"):
        calls.append(device)
        return {"triton": "ok", "cuda": "ok", "cuda-wgmma-2wg": "its process ended (exit -11)"}

    monkeypatch.setattr(bench, "run_canary", canary)
    report = bench.main(["--smoke", "--canary", "on", "--cases", "a", "--out", str(tmp_path)])
    assert calls == ["cpu"] and [r["case"] for r in report["rows"]] == ["a"]
    assert report["canary"]["cuda-wgmma-2wg"] == "its process ended (exit -11)"
    text = (tmp_path / "attention_smoke.md").read_text()
    assert "- canary runs (each of ours once, small batches, a child process): 2 of 3 passed" in text
    assert "- LEFT OUT of this run, cuda-wgmma-2wg did not pass its canary run: its process ended (exit -11)" in text
    report = bench.main(["--smoke", "--cases", "a", "--out", str(tmp_path)])  # auto: on a GPU only
    assert report["canary"] is None and calls == ["cpu"]

    monkeypatch.setattr(bench, "run_canary", lambda backends, device="cuda": {"triton": "hang", "cuda": "ok"})
    report = bench.main(["--smoke", "--canary", "on", "--cases", "ab", "--suite", "full", "--out", str(tmp_path)])
    assert report["rows"] == [] and report["grid"] == []
    assert report["failed_cases"] == dict.fromkeys("ab", "not run: triton did not pass its canary run (hang)")

    # the CUDA columns of a case and the grid's rows, on CPU through the emulator with a device
    # that reads "cuda"
    from minengine.ops import testing

    cuda_backend.use_emulator()
    try:
        real = testing.make_paged_batch
        monkeypatch.setattr(testing, "make_paged_batch", lambda *a, **k: real(*a, **{**k, "device": "cpu"}))
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        monkeypatch.setattr(cuda_backend, "available", lambda: True)
        gpu = types.SimpleNamespace(type="cuda")
        left_out = {"cuda": "x", "cuda-wgmma-2wg": "y", "cuda-simt": "z"}
        args = types.SimpleNamespace(
            smoke=True, no_torch=True, no_flashinfer=True, flashinfer_grid="all", canary_failed=left_out,
            num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, triton_variants=False,
        )  # fmt: skip
        ceilings = {"copy_gbps": 1.0, "matmul_tflops": 1.0}
        timer = bench.timer(torch.device("cpu"))
        case = bench.Case("c", "prefill", (40,), (100,), None)
        row = bench.run_case(case, args, gpu, timer, ceilings)
        assert "cuda_wgmma_pipe_ms" in row and "cuda_wgmma_ms" in row
        assert "cuda_ms" not in row and "cuda_wgmma_2wg_ms" not in row
        rows = bench.measure_config(args, gpu, timer, ceilings, ("llama3-8b", 16, torch.bfloat16, "decode"))
        backends = {r["backend"] for r in rows}
        assert {"triton", "cuda-wgmma", "cuda-wgmma-tma"} <= backends
        assert not backends & set(left_out)
    finally:
        cuda_backend.use_emulator(False)


@pytest.mark.parametrize("skip", ["", "cuda-wgmma-2wg", None])
def test_ncu_script_skips_what_the_canary_left_out(tmp_path, skip):
    """profiles/ncu_kernels.sh with NCU_SKIP (from bench_attention's canary) profiles the rest;
    without it, what its own canary run passes. A stand-in ncu and python3 record what ran."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "ran.txt"
    (bin_dir / "ncu").write_text(f'#!/bin/bash\n[ "$1" = --help ] && exit 0\necho "${{@: -1}}" >> {log}\necho ok\n')
    # python3: the capability check says sm_90, the canary passes three, the summary prints a line
    (bin_dir / "python3").write_text(
        '#!/bin/bash\ncase "$*" in *get_device_capability*) exit 0 ;;\n'
        "  *canary.py*) echo '{}' >&2; echo triton cuda-wgmma cuda ;;\n  *ncu_summary*) echo summary ;; esac\n"
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "NCU_OUT": str(out)}
    env.pop("NCU_SKIP", None)
    if skip is not None:
        env["NCU_SKIP"] = skip
    done = subprocess.run(["bash", str(root / "profiles/ncu_kernels.sh")], env=env, capture_output=True, text=True)
    ran = log.read_text().split()
    every = ["triton", "cuda-wgmma-2wg", "cuda-wgmma-pipe", "cuda-wgmma-tma", "cuda-wgmma", "cuda"]
    expected = ["triton", "cuda-wgmma", "cuda"] if skip is None else [b for b in every if b != skip]
    assert ran == expected, done.stdout + done.stderr
    assert done.returncode == (0 if skip == "" else 1), done.stdout + done.stderr
    for backend in set(every) - set(expected):
        assert f"ncu on {backend} SKIPPED: did not pass its canary run" in done.stdout
    names = [f"ncu_{b}.txt" for b in ran] + ["ncu_summary.md"] + (["canary.json"] if skip is None else [])
    assert sorted(p.name for p in out.iterdir()) == sorted(names)


def test_serving_runs_start_only_servers_whose_kernels_passed_their_canary_run(tmp_path):
    """benchmarks/run_ablations.sh: a run whose --attention-backend's kernels failed the canary (at
    the model's shape and the server's dtype) is skipped with the reason and starts no server; one
    whose canary script itself failed goes ahead, and the script is tried again for the next; a
    verdict is kept per backend and dtype; a run without the flag is checked as auto; a benchmark
    past RUN_SECONDS is stopped, the server's processes killed (one that ignores SIGTERM too), and
    the next run goes on. A stand-in python3 records what ran."""
    import os
    import subprocess
    import uuid
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "ran.txt"
    marker = f"300.{uuid.uuid4().int % 10**6:06d}"  # the server's child that ignores SIGTERM
    canary = f"*canary.py\\ --served\\ %s\\ --model\\ {tmp_path}\\ --dtype\\ auto\\ --failed\\ *"
    (bin_dir / "python3").write_text(
        "#!/bin/bash\n"
        'case "$*" in\n'
        f"  {canary % 'triton'}) echo canary triton >> {log}; echo 'triton: no result (a hang?)' ;;\n"
        f"  {canary % 'cuda'}) echo canary cuda >> {log}; echo 'Traceback: boom' >&2; exit 1 ;;\n"
        f"  {canary % 'flashinfer'}) echo canary flashinfer >> {log}; echo '{{}}' >&2 ;;\n"
        f'  {canary % "auto"}) echo canary auto >> {log}; echo \'{{"triton": "ok"}}\' >&2 ;;\n'
        f'  *canary.py*) echo "canary called otherwise: $*" >> {log} ;;\n'
        "  *urllib*) exit 0 ;;\n"
        f'  *minengine.serve*) echo "serve ${{*: -1}}" >> {log}\n'
        f'    (trap "" TERM; exec sleep {marker} > /dev/null 2>&1) & exec sleep 60 ;;\n'
        f'  *bench_serving.py*backend-flashinfer*) echo "bench flashinfer" >> {log}; exec sleep 60 ;;\n'
        f'  *bench_serving.py*--tag\\ *) echo "bench $*" | grep -o "tag [^ ]*" >> {log} ;;\n'
        "esac\n"
    )
    (bin_dir / "python3").chmod(0o755)
    env = {
        **os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MODEL": str(tmp_path), "RUN_SECONDS": "2",
        "CANARY_DIR": str(tmp_path / "canary"), "RESULTS_DIR": str(tmp_path / "results"),
    }  # fmt: skip
    script = str(root / "benchmarks/run_ablations.sh")
    try:
        done = subprocess.run(["bash", script, "backends", "backends", "admission"], env=env, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        alive = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True).stdout
    finally:
        subprocess.run(["pkill", "-KILL", "-f", f"sleep {marker}"])  # (it ignores SIGTERM)
    err = done.stderr
    assert done.returncode == 1, done.stdout + err
    assert not alive, "a server's child outlived its run"
    ran = log.read_text().splitlines()
    # the serve stand-in logs its last flag (the backend's name, or the admission runs' token count)
    cuda = ["canary cuda", "serve cuda", "tag backend-cuda"]
    flashinfer = ["serve flashinfer", "bench flashinfer"]
    admission = ["serve 65536", "tag admission-preempt", "serve 65536", "tag admission-reserve"]
    assert ran == ["canary triton", *cuda, "canary flashinfer", *flashinfer, *cuda, *flashinfer, "canary auto",
                   *admission]  # fmt: skip
    assert err.count("== backend-triton: run skipped: its kernels did not pass their canary run") == 2
    assert "     triton: no result (a hang?)" in err
    assert err.count("the canary script failed for --attention-backend cuda (Traceback: boom); the run goes ahead") == 2
    assert err.count("== backend-flashinfer: the benchmark ran past RUN_SECONDS=2") == 2
    assert "ran past" not in err.replace("== backend-flashinfer: the benchmark ran past", "")
    assert sorted(p.name for p in (tmp_path / "canary").iterdir()) == sorted(
        [f"{b}-auto.{ext}" for b in ("triton", "flashinfer", "auto") for ext in ("txt", "json")] + ["cuda-auto.json"]
    )
    done = subprocess.run(["bash", script, "backends"], env={**env, "RUN_SECONDS": "0"}, capture_output=True, text=True)
    assert done.returncode == 2 and "RUN_SECONDS=0: expected a whole number of seconds, at least 1" in done.stderr


def llama_config(path, heads: int, kv_heads: int, head_dim: int):
    """A config-only checkpoint directory (what a server's shape is read from)."""
    import json

    path.mkdir()
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": heads * head_dim,
           "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads}  # fmt: skip
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_served_runs_the_backends_kernels_at_the_models_shape(tmp_path, monkeypatch, capsys):
    """canary.py --served NAME --model DIR: the kernels that backend runs here, on the first two
    batches at the model's head counts and head dim and the server's dtype (not the grid's other
    instantiations); --failed prints "name: why" per failure on stdout and the JSON on stderr; bad
    arguments name the value and what is allowed."""
    import json

    canary = load_bench("canary")
    model = llama_config(tmp_path / "m", 8, 2, 32)
    calls = []

    def run(backends, seconds, startup, device, shape=None):
        calls.append((backends, device, shape))
        return {b: "ok" if b == "triton" else "refused: ValueError: no" for b in backends}

    monkeypatch.setattr(canary, "run_canary", run)
    assert canary.main(["--served", "cuda", "--model", str(model), "--dtype", "float16", "--failed", "--device", "cpu"])
    assert calls == [(["cuda"], "cpu", ("float16", 8, 2, 32))]
    out, err = capsys.readouterr()
    assert out == "cuda: refused: ValueError: no\n" and json.loads(err) == {"cuda": "refused: ValueError: no"}
    canary.main(["--served", "triton", "--model", str(model), "--failed", "--device", "cpu"])  # auto: the engine's
    assert calls[-1] == (["triton"], "cpu", ("float32", 8, 2, 32)) and capsys.readouterr().out == ""
    canary.main(["--served", "triton", "--model", "tiny", "--failed", "--device", "cpu"])  # the embedded model
    tiny = load_model_config("tiny")
    assert calls[-1] == (["triton"], "cpu", ("float32", tiny.num_heads, tiny.num_kv_heads, tiny.head_dim))
    canary.main(["--served", "flashinfer", "--failed", "--device", "cpu"])  # none of ours, no shape
    assert calls[-1] == ([], "cpu", None) and capsys.readouterr().out == ""
    for argv, message in [
        (["--served", "tvm"], "--served: unknown attention backend 'tvm'; allowed: auto, torch, triton, cuda"),
        (["--served", "cuda", "--model", str(model), "--dtype", "fp8"], "--dtype 'fp8'; allowed: auto, float32"),
        (["--served", "cuda", "--model", str(tmp_path)], f"--model {tmp_path}: no usable config.json (FileNotFound"),
        (["--model", str(model)], "--model goes with --served"),
        (["--served", "cuda", "--backends", "triton"], "not allowed with argument"),
    ]:
        with pytest.raises(SystemExit) as stopped:
            canary.main(argv)
        assert stopped.value.code == 2 and message in capsys.readouterr().err, argv
    # the child's batches at that shape: the first two of the default ones, named for the model
    default, shaped = canary.batches("cpu"), canary.batches("cpu", canary.parse_shape("float16:8:2:32"))
    assert [name.split(",")[0] for name, _, _ in shaped] == [name.split(",")[0] for name, _, _ in default[:2]]
    for (name, batch, runs), (_, _, default_runs) in zip(shaped, default, strict=False):
        assert name.endswith("the model's float16 8/2/32") and runs.__name__ == default_runs.__name__
        assert batch.q.dtype == torch.float16 and tuple(batch.q.shape[1:]) == (8, 32) and batch.k_cache.shape[-2] == 2


def test_triton_runs_unsplit_for_the_bench_and_as_served_at_a_models_shape(monkeypatch, capsys):
    """The bench's canary runs Triton unsplit (its compile is the bench's cases'); at a served
    model's shape, with the splits a server's calls get (its long decodes: split KV)."""
    canary = load_bench("canary")
    calls = []
    real = canary._attention

    def recording(backend: str):
        def call(*args, **kwargs):
            calls.append(kwargs.get("num_splits"))
            return real(backend)(*args, **kwargs)

        return call

    monkeypatch.setattr(canary, "_attention", recording)
    canary.child(["triton"], "cpu")
    canary.child(["triton"], "cpu", ("float32", 4, 2, 32))
    verdicts = [line for line in capsys.readouterr().out.splitlines() if line.startswith("CANARY ok")]
    assert calls == [1, None] and verdicts == ["CANARY ok triton"] * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run")
def test_served_canary_runs_our_kernels_at_a_models_shape_on_cpu(tmp_path, capsys):
    """The real child process with a model's shape (the Triton interpreter and the CUDA kernels'
    emulator): both pass at GQA group 4, head dim 32."""
    canary = load_bench("canary")
    model = llama_config(tmp_path / "m", 8, 2, 32)
    from minengine.ops import cuda_emulator

    backends = ["triton"] if cuda_emulator.unavailable_reason() else ["triton", "cuda"]
    for backend in backends:
        results = canary.main(["--served", backend, "--model", str(model), "--failed", "--device", "cpu"])
        assert results == {backend: "ok"} and capsys.readouterr().out == ""


def test_a_flags_value_is_read_as_argparse_reads_it():
    """run_ablations.sh's flag_value: ``--name value`` and ``--name=value``, the last one winning,
    the default without either."""
    import subprocess
    from pathlib import Path

    script = (Path(__file__).resolve().parents[1] / "benchmarks/run_ablations.sh").read_text()
    function = script[script.index("flag_value() {") :].split("\n}\n")[0] + "\n}\n"
    for flags, expected in [
        ("--attention-backend cuda", "cuda"),
        ("--port 1 --attention-backend=flashinfer --disable-cuda-graph", "flashinfer"),
        ("--attention-backend triton --attention-backend=cuda", "cuda"),
        ("--disable-cuda-graph", "auto"),
        ("", "auto"),
    ]:
        code = function + f'flag_value attention-backend "{flags}" auto'
        assert subprocess.run(["bash", "-c", code], capture_output=True, text=True).stdout.strip() == expected


def test_gpu_test_runs_fail_the_tests_of_a_kernel_that_failed_its_canary_run(monkeypatch):
    """conftest's guard (on a GPU, before the tests run): the tests launching a CUDA backend that
    faulted, hung or was wrong fail at set-up with the reason; a refused backend's tests (a build
    without 9.0a) and the others run."""
    from pathlib import Path

    import conftest

    def item(module: str, fixtures=("dev",), **params):
        return types.SimpleNamespace(
            path=Path(module), callspec=types.SimpleNamespace(params=params), stash=pytest.Stash(),
            fixturenames=list(fixtures),
        )  # fmt: skip

    items = [
        item("test_cuda_kernels.py", impl="wgmma-2wg", dtype=torch.bfloat16),
        item("test_cuda_kernels.py", impl="auto"),
        item("test_cuda_kernels.py"),  # the default impl
        item("test_cuda_kernels.py", impl="wgmma-tma"),
        item("test_backend_logits.py", backend="cuda-wgmma-2wg"),
        item("test_backend_logits.py", backend="triton"),
        item("test_paged_attention.py", kernels="cuda"),
        item("test_paged_attention.py", kernels="triton"),
        item("test_engine.py", impl="wgmma-2wg"),  # another module's `impl` is not a kernel
        item("test_store_kv.py", kernels="cuda"),  # the kernels fixture's other kernels
        item("test_cuda_kernels.py", fixtures=()),  # no `dev`: launches nothing (fast_div)
        item("test_backend_logits.py", impl="wgmma-2wg"),  # the emulator's
    ]
    asked = []

    def run(backends):
        asked.append(backends)
        return {b: "ok" for b in backends} | {
            "cuda-wgmma-2wg": "no result within 30 s of cuda-wgmma-2wg's start (a hang?)",
            "cuda-wgmma-tma": "refused: ValueError: the wgmma kernel needs a build with 9.0a",
        }

    failures = conftest.canary_guard(items, run=run)
    assert asked == [["cuda", "cuda-wgmma-2wg", "cuda-wgmma-tma"]]
    assert failures == {"cuda-wgmma-2wg": "no result within 30 s of cuda-wgmma-2wg's start (a hang?)"}
    failing = [i for i, it in enumerate(items) if conftest._CANARY in it.stash]
    assert failing == [0, 4]
    with pytest.raises(pytest.fail.Exception, match="not launched: cuda-wgmma-2wg failed its canary run"):
        conftest.pytest_runtest_setup(items[0])
    conftest.pytest_runtest_setup(items[1])  # no mark: runs
    monkeypatch.setenv("MINENGINE_TEST_CANARY", "0")
    assert conftest.canary_guard(items, run=run) == {} and len(asked) == 1


def test_memcheck_script_bounds_each_small_run_and_runs_every_kernel(tmp_path):
    """profiles/memcheck.sh keeps the kernels that fail a canary run (the sanitizer is what says
    where they go wrong), bounds each small-batch run (a hang costs MEMCHECK_RUN_SECONDS, and the
    runs after it go on), and turns the tests' canary guard off. Stand-ins for compute-sanitizer
    and python3 record what ran."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "ran.txt"
    (bin_dir / "compute-sanitizer").write_text(  # "<tool> <backend, or pytest's second-last argument> canary=..."
        "#!/bin/bash\n"
        f'echo "$4 ${{@: -2:1}} canary=$MINENGINE_TEST_CANARY" >> {log}\n'
        'case "$*" in *"cuda-wgmma-2wg --small"*) sleep 30 ;; esac\n'
    )
    (bin_dir / "python3").write_text("#!/bin/bash\nexit 0\n")  # the capability check: sm_90
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MEMCHECK_RUN_SECONDS": "1"}
    done = subprocess.run(
        ["bash", str(root / "profiles/memcheck.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    cuda = ["cuda", "cuda-wgmma", "cuda-wgmma-tma", "cuda-wgmma-pipe", "cuda-wgmma-2wg"]
    expected = [f"{tool} {b} canary=0" for tool in ("racecheck", "synccheck") for b in cuda]
    expected += [f"memcheck {b} canary=0" for b in ["triton", *cuda]] + ["memcheck -x canary=0", "memcheck -k canary=0"]
    assert log.read_text().splitlines() == expected, done.stdout + done.stderr
    failed = [line for line in done.stdout.splitlines() if line.startswith("== FAILED")]
    assert len(failed) == 3 and all("--backend cuda-wgmma-2wg --small" in line for line in failed), failed
    assert done.returncode == 1


def test_a_child_whose_parent_is_already_gone_exits():
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "canary.py"
    done = subprocess.run(
        [sys.executable, str(script), "--parent", "1", "--child", "cpu", "triton"], capture_output=True, text=True
    )
    assert done.returncode == 1 and "the canary's parent process is gone" in done.stderr
    assert "CANARY" not in done.stdout


def test_a_child_dies_with_its_canary_parent(tmp_path):
    """The parent killed outright (no clean-up runs): its child, in a session of its own, goes too,
    so a hung kernel's process does not outlive the run."""
    import os
    import signal
    import subprocess
    from pathlib import Path

    benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
    pid_file = tmp_path / "child.pid"
    child = (
        f"import os, sys, time; sys.path.insert(0, {str(benchmarks)!r}); import canary; "
        f"canary.die_with_parent(int(sys.argv[1])); open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
        "print('CANARY start hang', flush=True); time.sleep(60)"
    )
    parent = (
        f"import os, sys; sys.path.insert(0, {str(benchmarks)!r}); import canary; "
        f"canary.run_canary(['hang'], seconds=60, command=lambda names: [sys.executable, '-c', {child!r}, "
        "str(os.getpid())])"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent])
    try:
        for _ in range(200):
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.05)
        child_pid = int(pid_file.read_text())
        os.kill(child_pid, 0)  # alive
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for _ in range(100):
            try:
                os.kill(child_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            os.kill(child_pid, signal.SIGKILL)
            raise AssertionError("the child outlived its parent")
    finally:
        proc.kill()
