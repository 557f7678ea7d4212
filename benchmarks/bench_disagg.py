"""Prefill/decode disaggregation through the router, decode radix cache off vs on.

For each setting it starts a prefill server, a decode server (sharing the device) and the
router, runs ``bench_serving.py`` multi-turn and generated-shared-prefix workloads through the
router, and reads the decode server's transfer counters around each run. Reported per workload:
KV pages and bytes transferred, TTFT p50 / p99, ITL, request throughput, and the on/off ratios.

    python benchmarks/bench_disagg.py                       # GPU: Qwen3-0.6B-shaped random bf16 weights
    python benchmarks/bench_disagg.py --model DIR           # a local checkpoint
    python benchmarks/bench_disagg.py --smoke --out /tmp/b  # tiny model on CPU: checks the script
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serving  # noqa: E402
from _common import RESULTS, header, report, save, stem  # noqa: E402

from minengine.server.workers import free_port  # noqa: E402

COUNTERS = ("minengine:kv_transfer_pages_total", "minengine:kv_transfer_bytes_total")


def counters(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in COUNTERS:
            out[name] = float(value)
    return out


def wait_up(url: str, proc: subprocess.Popen, path: str, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not start in {timeout:.0f} s")


@contextlib.contextmanager
def cluster(args, decode_radix: bool):
    """A prefill server, a decode server and the router; yields (router url, decode url)."""
    boot, pport, dport, rport = (free_port() for _ in range(4))
    serve = [sys.executable, "-m", "minengine.serve", "--model", args.model, "--log-level", "warning"]
    serve += args.server_flags
    if args.load_dummy:
        serve += ["--load-format", "dummy"]
    # The two share the GPU. A server's fraction bounds everything in use on the device when it
    # sizes its KV pool, the other server included: the prefill server (started first) gets up to
    # 0.4 of the GPU, the decode server up to 0.8 minus what the prefill server holds.
    cuda = torch.cuda.is_available()
    mem = lambda fraction: ["--mem-fraction-static", fraction] if cuda else []  # noqa: E731
    procs = []
    try:
        prefill = serve + ["--port", str(pport), "--disaggregation-mode", "prefill", *mem("0.4")]
        prefill += ["--disaggregation-bootstrap-port", str(boot)]
        decode = serve + ["--port", str(dport), "--disaggregation-mode", "decode", *mem("0.8")]
        decode += ["--disaggregation-decode-enable-radix-cache"] if decode_radix else []
        for cmd, port in ((prefill, pport), (decode, dport)):
            procs.append(subprocess.Popen(cmd))
            wait_up(f"http://127.0.0.1:{port}", procs[-1], "/health")  # one at a time: GPU memory is measured
        router = [sys.executable, "-m", "minengine.router", "--port", str(rport), "--log-level", "warning"]
        router += ["--prefill", f"http://127.0.0.1:{pport}", str(boot), "--decode", f"http://127.0.0.1:{dport}"]
        procs.append(subprocess.Popen(router))
        wait_up(f"http://127.0.0.1:{rport}", procs[-1], "/health")
        yield f"http://127.0.0.1:{rport}", f"http://127.0.0.1:{dport}"
    finally:
        for p in reversed(procs):
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def workloads(args) -> dict[str, list[str]]:
    if args.smoke:
        return {
            "multi-turn": ["--multi-turn-num-conversations", "2", "--multi-turn-num-turns", "3"]
            + ["--multi-turn-question-len", "24", "--multi-turn-output-len", "6"],
            "generated-shared-prefix": ["--gsp-num-groups", "2", "--gsp-prompts-per-group", "2"]
            + ["--gsp-system-prompt-len", "48", "--gsp-question-len", "8", "--gsp-output-len", "6"],
        }
    return {
        "multi-turn": ["--multi-turn-num-conversations", "64", "--multi-turn-num-turns", "6"]
        + ["--multi-turn-question-len", "256", "--multi-turn-output-len", "128"],
        "generated-shared-prefix": ["--gsp-num-groups", "32", "--gsp-prompts-per-group", "16"]
        + ["--gsp-system-prompt-len", "2048", "--gsp-question-len", "128", "--gsp-output-len", "128"],
    }


def run(args, on_row=lambda rows: None) -> list[dict]:
    """Every workload with the decode radix cache off, then on; ``on_row(rows)`` after each row (the
    report is saved there, so a run stopped by a time limit keeps what it measured)."""
    rows = []
    for decode_radix in (False, True):
        with cluster(args, decode_radix) as (router, decode):
            for name, flags in workloads(args).items():
                before = counters(decode)
                bench_args = ["--base-url", router, "--dataset", name, "--tokenizer", args.tokenizer]
                bench_args += ["--max-concurrency", str(args.max_concurrency), "--no-progress", "--out", args.tmp]
                result = bench_serving.main([*bench_args, *flags, "--tag", f"radix{int(decode_radix)}"])
                after = counters(decode)
                s = result["summary"]
                rows.append(
                    {
                        "workload": name,
                        "decode_radix_cache": decode_radix,
                        "completed": s["completed"],
                        "failed": s["failed"],
                        "kv_pages": after.get(COUNTERS[0], 0) - before.get(COUNTERS[0], 0),
                        "kv_bytes": after.get(COUNTERS[1], 0) - before.get(COUNTERS[1], 0),
                        "ttft_p50_ms": s["ttft"]["median_ms"],
                        "ttft_p99_ms": s["ttft"]["p99_ms"],
                        "itl_mean_ms": s["itl"]["mean_ms"],
                        "itl_p99_ms": s["itl"]["p99_ms"],
                        "request_throughput": s["request_throughput"],
                    }
                )
                add_ratios(rows)
                on_row(rows)
    return rows


def add_ratios(rows: list[dict]) -> None:
    """Radix-on rows against the radix-off row of the same workload."""
    for row in rows:
        if row["decode_radix_cache"]:
            off = next(r for r in rows if r["workload"] == row["workload"] and not r["decode_radix_cache"])
            row["throughput_vs_off"] = row["request_throughput"] / max(off["request_throughput"], 1e-9)
            row["ttft_p50_off_over_on"] = off["ttft_p50_ms"] / max(row["ttft_p50_ms"], 1e-9)
            row["bytes_vs_off"] = row["kv_bytes"] / max(off["kv_bytes"], 1)


def markdown(rep: dict) -> str:
    lines = header("Disaggregated serving through the router, decode radix cache off vs on", rep)
    lines += [
        "",
        "| workload | decode radix | done | KV pages | KV MB | TTFT p50 ms | TTFT p99 ms | ITL mean ms | req/s "
        "| req/s vs off | TTFT p50 off/on | bytes vs off |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rep["rows"]:
        ratios = [
            f"{r[k]:.2f}" if k in r else "" for k in ("throughput_vs_off", "ttft_p50_off_over_on", "bytes_vs_off")
        ]
        radix, total = "on" if r["decode_radix_cache"] else "off", r["completed"] + r["failed"]
        lines.append(
            f"| {r['workload']} | {radix} | {r['completed']}/{total} "
            f"| {r['kv_pages']:.0f} | {r['kv_bytes'] / 1e6:.2f} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} "
            f"| {r['itl_mean_ms']:.2f} | {r['request_throughput']:.2f} | " + " | ".join(ratios) + " |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: a Qwen3-0.6B-shaped dummy; smoke: tiny)")
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, a few requests")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    args.load_dummy = False
    args.server_flags = ["--context-length", "16384"] if not args.smoke else ["--device", "cpu", "--page-size", "4"]
    if args.model is None and args.smoke:
        args.model = "tiny"
    elif args.model is None:
        from bench_offline import model_dir

        args.model = str(model_dir("qwen3-0.6b", Path(tempfile.mkdtemp()))[0])
        args.load_dummy = True
    args.tokenizer = args.model
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    config = argparse.Namespace(**vars(args))  # the report's config, without the temporary dir set below

    def write(rows: list[dict]) -> dict:
        rep = report(argv, "bench_disagg", device, config, rows)
        save(args.out, stem("disagg", rep), rep, markdown(rep))
        return rep

    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        rep = write(run(args, on_row=write))
    print(markdown(rep))
    return rep


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
