"""Serving benchmark: a streaming client for any OpenAI-compatible server (minengine, vLLM, SGLang).

Datasets (lengths in tokens when --tokenizer is given, else in words of random text):
  random                   input/output lengths uniform in [len * range_ratio, len]; with
                           --random-long-fraction F, that fraction of the requests (chosen at random)
                           has prompts of exactly --random-long-input-len tokens instead: a long/short mix
  generated-shared-prefix  groups x prompts per group; each prompt = the group's system prompt + a question
  multi-turn               conversations that grow turn by turn (each turn = history + answer + new question)

Requests go to /v1/completions with stream=true, ignore_eos and usage, at --request-rate (inf by
default; Poisson, or with --burstiness B gamma-distributed gaps of shape B as in vLLM's client: below
1 burstier) and at most --max-concurrency at a time, after --warmup-requests. Reports request
throughput, input/output token throughput, and mean / median / p99 of TTFT, TPOT, ITL and E2E
latency; saves JSON + markdown; --plot adds latency CDFs and throughput over time (PNG). Where
the server has a Prometheus ``/metrics`` (minengine, vLLM), the report adds what its preemption
and prefix-cache counters gained during the run (``server_counters``). --profile (as SGLang's)
has the server profile the measured requests (/start_profile before them, /stop_profile after: a
minengine server started with --torch-profiler-dir, or SGLang's); the report lists the traces.

    python -m minengine.serve &                                       # or any other server
    python benchmarks/bench_serving.py --dataset random --num-prompts 200 --tokenizer tiny
    python benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 --dataset multi-turn --plot
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from _common import RESULTS, command, now, save, summarize_spans
from tqdm.asyncio import tqdm

_WORD_TEXT = (
    "the of and to in is was for on are with as by at from his her they be this that have not one all "
    "were when which their time more can will there been other about many some would into first then "
    "these model token cache page batch prefill decode kernel memory attention scheduler request stream"
)
WORDS = tuple(_WORD_TEXT.split())


class Prompts:
    """Makes prompts of a given length: token ids with a tokenizer, random words without."""

    def __init__(self, tokenizer: str | None, rng: random.Random):
        self.rng = rng
        self.tok = None
        if tokenizer:
            from minengine.models import load_tokenizer

            self.tok = load_tokenizer(tokenizer)
            special = {i for i, t in self.tok.backend.get_added_tokens_decoder().items() if t.special}
            self.ids = [i for i in range(self.tok.vocab_size) if i not in special]

    def make(self, n: int) -> list[int] | str:
        if self.tok is not None:
            return [self.rng.choice(self.ids) for _ in range(n)]
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def extend(self, prompt: list[int] | str, answer: str, n: int) -> list[int] | str:
        """A conversation's next prompt: history, the answer it got, a new question."""
        question = self.make(n)
        if self.tok is not None:
            return prompt + self.tok.encode(answer, add_special_tokens=False) + question
        return f"{prompt} {answer} {question}"


@dataclass
class Request:
    prompt: list[int] | str
    output_len: int
    conversation: int | None = None  # multi-turn: follow-up turns are made from the answer
    turns_left: int = 0


@dataclass
class Result:
    ok: bool
    start: float
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def build_dataset(args, prompts: Prompts, rng: random.Random) -> list[Request]:
    if args.dataset == "random":

        def length(n: int) -> int:
            return rng.randint(max(1, int(n * args.random_range_ratio)), n)

        long = set(rng.sample(range(args.num_prompts), round(args.random_long_fraction * args.num_prompts)))
        return [
            Request(
                prompts.make(args.random_long_input_len if i in long else length(args.random_input_len)),
                length(args.random_output_len),
            )
            for i in range(args.num_prompts)
        ]
    if args.dataset == "generated-shared-prefix":
        out = []
        for _ in range(args.gsp_num_groups):
            system = prompts.make(args.gsp_system_prompt_len)
            for _ in range(args.gsp_prompts_per_group):
                question = prompts.make(args.gsp_question_len)
                joined = system + question if isinstance(system, list) else f"{system} {question}"
                out.append(Request(joined, args.gsp_output_len))
        rng.shuffle(out)
        return out
    return [
        Request(
            prompts.make(args.multi_turn_question_len), args.multi_turn_output_len, c, args.multi_turn_num_turns - 1
        )
        for c in range(args.multi_turn_num_conversations)
    ]


async def send(http: httpx.AsyncClient, args, req: Request) -> Result:
    body = {
        "model": args.model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = Result(ok=False, start=time.perf_counter())
    last = res.start
    try:
        async with http.stream("POST", args.base_url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("error"):  # a failure after the 200 (the server streams it, then [DONE])
                    err = chunk["error"]
                    res.error = "stream error: " + str(err.get("message", err) if isinstance(err, dict) else err)[:200]
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                if not res.chunk_times:
                    res.ttft = now - res.start
                else:
                    res.itl.append(now - last)
                res.chunk_times.append(now)
                res.text += chunk["choices"][0].get("text") or ""
                last = now
        if not res.chunk_times:  # as vLLM's client: a stream without a single choice is a failure
            res.error = "the stream ended without a choice"
            return res
        res.e2e = last - res.start  # at the last choice (vLLM's latency), not at the stream's close
        res.output_tokens = res.output_tokens or len(res.chunk_times)
        res.ok = True
    except Exception as exc:  # noqa: BLE001 (one bad response is a failed request, not a lost run)
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    return res


CLIENT_POOLS = 16  # HTTP connection pools the requests are spread over (see run)
COUNTER_WORDS = ("preempt", "prefix_cache", "cache_hit")  # the server counters a report keeps


async def counters(http: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    """The server's Prometheus counters about preemption and prefix caching ({} without /metrics)."""
    try:
        resp = await http.get(base_url + "/metrics", timeout=10)
    except httpx.HTTPError:
        return {}
    if resp.status_code != 200:
        return {}
    out = {}
    for line in resp.text.splitlines():
        name, _, value = line.rpartition(" ")
        if line.startswith("#") or not name.split("{")[0].endswith("_total"):
            continue
        if any(w in name for w in COUNTER_WORDS):
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


async def profile(http: httpx.AsyncClient, base_url: str, what: str, body: dict | None = None) -> dict:
    """/start_profile or /stop_profile; the server's answer, or SystemExit with its error."""
    try:
        resp = await http.post(f"{base_url}/{what}_profile", json=body or {}, timeout=900)
    except httpx.HTTPError as exc:
        raise SystemExit(f"bench_serving: error: --profile: /{what}_profile failed: {exc!r}") from None
    if resp.status_code != 200:
        raise SystemExit(f"bench_serving: error: --profile: /{what}_profile answered {resp.status_code}: {resp.text}")
    try:
        return resp.json()
    except ValueError:  # (SGLang answers plain text)
        return {"answer": resp.text}


GPU_ACTIVITY = ("kernel", "gpu_memcpy", "gpu_memset")  # the device rows of torch.profiler's Chrome trace


def trace_gpu_time(path: str) -> dict | None:
    """A worker's trace (a --profile run on this machine): its forward passes, and GPU idle time
    over the trace's GPU window (``summarize_spans``, per forward pass). None for a trace that
    cannot be read here (a server on another machine) or has no GPU activity (CPU)."""
    import gzip

    try:
        with gzip.open(path, "rt") as f:
            events = json.load(f)["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError, MemoryError):  # (a long trace with stacks: GBs of JSON)
        return None
    # the host's ranges (the GPU row repeats them as "gpu_user_annotation")
    passes = sum(e.get("name") == "forward" and e.get("cat") == "user_annotation" for e in events)
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_ACTIVITY and e.get("dur", 0) > 0]
    got = summarize_spans(spans, max(passes, 1))
    return None if got is None else {"forward_passes": passes, **got}


async def run(args, dataset: list[Request], prompts: Prompts, arrivals: random.Random):
    """(results, seconds, what the server's counters gained during the measured requests, the
    server's answer to --profile's /stop_profile or None).
    ``arrivals`` draws only the gaps between requests (multi-turn follow-ups draw from the prompts'
    generator in completion order), so a seed gives the same arrival times in every run."""
    limits = httpx.Limits(max_connections=args.max_concurrency or 10_000, max_keepalive_connections=None)
    # conversation i streams through pool i % CLIENT_POOLS: httpcore's pool scans its connections for
    # each idle one whenever a request comes or goes (quadratic in the connections); with one pool,
    # 256 fake streams of a chunk every 20 ms read TPOT 5% high and its p99 20% high (README)
    timeout, tls = httpx.Timeout(args.timeout), httpx.create_ssl_context()  # (one CA bundle load for all)
    pools = [httpx.AsyncClient(timeout=timeout, limits=limits, verify=tls) for _ in range(CLIENT_POOLS)]
    async with contextlib.AsyncExitStack() as stack:
        for pool in pools:
            await stack.enter_async_context(pool)
        http = pools[0]
        for warm in dataset[: args.warmup_requests]:
            await send(http, args, Request(warm.prompt, min(warm.output_len, 16)))
        before = await counters(http, args.base_url)
        if args.profile:
            await profile(http, args.base_url, "start")
        gate = asyncio.Semaphore(args.max_concurrency or 10_000)
        total = len(dataset) * (args.multi_turn_num_turns if args.dataset == "multi-turn" else 1)
        bar = tqdm(total=total, desc="requests", disable=args.no_progress)
        results: list[Result] = []

        async def conversation(req: Request, http: httpx.AsyncClient) -> None:
            while True:
                async with gate:
                    res = await send(http, args, req)
                results.append(res)
                bar.update(1)
                if not res.ok or req.turns_left == 0:
                    return
                nxt = prompts.extend(req.prompt, res.text, args.multi_turn_question_len)
                req = Request(nxt, req.output_len, req.conversation, req.turns_left - 1)

        tasks = []
        t0 = time.perf_counter()
        for i, req in enumerate(dataset):
            tasks.append(asyncio.create_task(conversation(req, pools[i % CLIENT_POOLS])))
            if args.request_rate != float("inf"):  # mean gap 1 / rate; shape 1 is exponential (Poisson)
                await asyncio.sleep(arrivals.gammavariate(args.burstiness, 1 / (args.request_rate * args.burstiness)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
        profiled = await profile(http, args.base_url, "stop") if args.profile else None
        after = await counters(http, args.base_url)
        return results, duration, {k: v - before[k] for k, v in after.items() if k in before}, profiled


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]

    def stats(values: list[float]) -> dict[str, float]:
        if not values:
            return {"mean_ms": 0.0, "median_ms": 0.0, "p99_ms": 0.0}
        a = np.asarray(values) * 1e3
        return {"mean_ms": float(a.mean()), "median_ms": float(np.median(a)), "p99_ms": float(np.percentile(a, 99))}

    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "input_token_throughput": in_tokens / duration,
        "output_token_throughput": out_tokens / duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "ttft": stats([r.ttft for r in ok]),
        "tpot": stats([t for r in ok if (t := r.tpot) is not None]),
        "itl": stats([x for r in ok for x in r.itl]),
        "e2e": stats([r.e2e for r in ok]),
    }


def plot(results: list[Result], out_dir: Path, stem: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    series = {
        "TTFT": [r.ttft for r in ok],
        "TPOT": [t for r in ok if (t := r.tpot) is not None],
        "ITL": [x for r in ok for x in r.itl],
        "E2E": [r.e2e for r in ok],
    }
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.5))
    for ax, (name, values) in zip(axes, series.items(), strict=True):
        v = np.sort(np.asarray(values) * 1e3)
        ax.plot(v, np.arange(1, len(v) + 1) / max(len(v), 1))
        ax.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    cdf = out_dir / f"{stem}_latency_cdf.png"
    fig.savefig(cdf, dpi=100)
    plt.close(fig)

    times = np.asarray([t for r in ok for t in r.chunk_times])
    fig, ax = plt.subplots(figsize=(8, 3.5))
    if len(times):
        t = times - times.min()
        bins = np.arange(0, t.max() + 1.0, 1.0)
        counts, edges = np.histogram(t, bins=bins if len(bins) > 1 else 1)
        ax.step(edges[:-1], counts / np.diff(edges), where="post")
    ax.set(title="output chunks per second (about tokens/s)", xlabel="s", ylabel="chunks/s")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tput = out_dir / f"{stem}_throughput.png"
    fig.savefig(tput, dpi=100)
    plt.close(fig)
    return [str(cdf), str(tput)]


def markdown(report: dict) -> str:
    s = report["summary"]
    lines = [
        f"# bench_serving: {report['config']['dataset']} against {report['server']}",
        "",
        f"- command: `{report['command']}`",
        f"- date (UTC): {report['date']}",
        f"- completed {s['completed']}, failed {s['failed']}, duration {s['duration_s']:.1f} s",
        f"- request throughput {s['request_throughput']:.2f} req/s; input {s['input_token_throughput']:.0f} tok/s; "
        f"output {s['output_token_throughput']:.0f} tok/s",
        "",
        "| latency (ms) | mean | median | p99 |",
        "|---|---|---|---|",
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        m = s[name]
        lines.append(f"| {name.upper()} | {m['mean_ms']:.1f} | {m['median_ms']:.1f} | {m['p99_ms']:.1f} |")
    if s["failed"]:
        lines += ["", "- errors (up to 5 kinds): " + "; ".join(f"`{e}`" for e in s["errors"])]
    if report.get("server_counters"):
        gained = ", ".join(f"`{k}` +{v:g}" for k, v in report["server_counters"].items())
        lines += ["", f"- server counters during the run: {gained}"]
    if "profile" in report:
        traces = report["profile"].get("traces") or [report["profile"].get("answer", "")]
        lines += ["", "- profiled (the latencies above include the profiler's cost): " + ", ".join(map(str, traces))]
        for path, g in (report["profile"].get("gpu") or {}).items():
            if g:
                lines.append(
                    f"- `{Path(path).name}`: GPU idle {100 * g['idle']:.1f}% of its window, "
                    f"{g['busy_ms']:.2f} ms busy and {g['kernels']:.0f} GPU activities per forward pass "
                    f"({g['forward_passes']} passes)"
                )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--tokenizer", default=None, help="'tiny' or a tokenizer dir: exact token lengths")
    p.add_argument("--dataset", choices=["random", "generated-shared-prefix", "multi-turn"], default="random")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-long-fraction", type=float, default=0.0, help="share of prompts that are long")
    p.add_argument("--random-long-input-len", type=int, default=8192, help="their length")
    p.add_argument("--gsp-num-groups", type=int, default=16)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    p.add_argument("--gsp-question-len", type=int, default=128)
    p.add_argument("--gsp-output-len", type=int, default=256)
    p.add_argument("--multi-turn-num-conversations", type=int, default=32)
    p.add_argument("--multi-turn-num-turns", type=int, default=4)
    p.add_argument("--multi-turn-question-len", type=int, default=128)
    p.add_argument("--multi-turn-output-len", type=int, default=128)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 Poisson, < 1 bursty")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", action="store_true")
    p.add_argument("--profile", action="store_true", help="the server profiles the measured requests")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--tag", default="", help="suffix of the result file names")
    args = p.parse_args(argv)
    if args.request_rate <= 0:
        p.error(f"--request-rate is {args.request_rate}; allowed: > 0 (or inf)")
    if not args.burstiness > 0:
        p.error(f"--burstiness is {args.burstiness}; allowed: > 0 (1: Poisson)")
    if not 0 <= args.random_long_fraction <= 1:
        p.error(f"--random-long-fraction is {args.random_long_fraction}; allowed: 0 to 1")
    if args.random_long_input_len < 1:
        p.error(f"--random-long-input-len is {args.random_long_input_len}; allowed: >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error(f"--max-concurrency is {args.max_concurrency}; allowed: >= 1")
    args.base_url = args.base_url.rstrip("/")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.model is None:
        args.model = httpx.get(args.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    rng = random.Random(args.seed)
    prompts = Prompts(args.tokenizer, rng)
    dataset = build_dataset(args, prompts, rng)
    results, duration, gained, profiled = asyncio.run(run(args, dataset, prompts, random.Random(args.seed + 1)))
    summary = summarize(results, duration)
    stem = f"serving_{args.dataset}" + (f"_{args.tag}" if args.tag else "")
    report = {
        "command": command(argv, "bench_serving"),
        "date": now(),
        "server": args.base_url,
        "model": args.model,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"},
        "summary": summary,
        "server_counters": gained,
    }
    if profiled is not None:  # (the latencies were measured under the profiler)
        report["profile"] = profiled
        gpu = {p: trace_gpu_time(p) for p in profiled.get("traces") or []}
        if any(gpu.values()):
            report["profile"]["gpu"] = gpu
    args.out.mkdir(parents=True, exist_ok=True)
    if args.plot:
        report["plots"] = plot(results, args.out, stem)
    save(args.out, stem, report, markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
