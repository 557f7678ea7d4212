"""How many streamed tokens per second the server's front end keeps up with, coalescing on and off.

In-process, no scheduler and no sockets: B streams run the real ``frontend.generate`` (queues,
incremental detokenization, metrics, stop-string checks, coalescing) and build each stream chunk's
JSON as the server does; a fixed busy wait per chunk (``--send-us``) stands in for the socket
write. A producer queues one token per stream every ``--step-ms``, on time however busy the event
loop is (the real scheduler runs in its own process, and the real dispatcher reads every step
that has arrived before the streams run). Reported: the offered rate, the rate actually streamed
(total tokens over the time until the last stream ended) and the number of chunks.

With coalescing off, a front end that falls behind streams one chunk per token and its lag grows
without bound; with it on, the tokens queued for a stream go out as one chunk.

    python benchmarks/bench_frontend.py                        # 256 streams, steps of 20 / 5 / 2 ms
    python benchmarks/bench_frontend.py --smoke --out /tmp/b   # checks the script
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import torch
from _common import RESULTS, header, publish, require_positive
from _common import report as make_report


class QueueClient:
    """What ``generate`` needs of the scheduler client: a queue per request, and its ``Ready``
    (None here: no end tokens but the tokenizer's EOS)."""

    ready = None

    def __init__(self):
        self.queues: dict[str, asyncio.Queue] = {}

    def submit(self, rid, prompt_ids, params, bootstrap):
        self.queues[rid] = asyncio.Queue()
        return self.queues[rid]

    def abort(self, rid):
        pass

    def release(self, rid):
        pass


async def run_point(streams: int, steps: int, step_s: float, send_us: float) -> dict:
    from minengine.models.tiny import tiny_tokenizer
    from minengine.sampling_params import SamplingParams
    from minengine.server.frontend import generate
    from minengine.server.metrics import Metrics
    from minengine.server.protocol import TokenUpdate

    tokenizer = tiny_tokenizer()
    letters = tokenizer.encode("abcdefghij", add_special_tokens=False)
    client, metrics, ends, chunks = QueueClient(), Metrics(), [], [0]

    async def stream(rid: str) -> None:
        params = SamplingParams(max_tokens=steps)
        async for piece in generate(client, tokenizer, metrics, rid, [1], params):
            body = {"id": rid, "object": "text_completion", "choices": [{"index": 0, "text": piece.text}]}
            _ = f"data: {json.dumps(body)}\n\n"
            start = time.perf_counter()
            while time.perf_counter() - start < send_us * 1e-6:  # the socket write
                pass
            chunks[0] += 1
            await asyncio.sleep(0)
        ends.append(time.perf_counter())

    rids = [f"r{i}" for i in range(streams)]
    tasks = [asyncio.create_task(stream(rid)) for rid in rids]
    await asyncio.sleep(0.01)  # every stream is waiting on its queue
    start, step = time.perf_counter(), 0
    while step < steps:
        due = min(steps, int((time.perf_counter() - start) / step_s) + 1)
        for s in range(step, due):
            finish = "length" if s == steps - 1 else None
            for rid in rids:
                client.queues[rid].put_nowait(TokenUpdate(rid, [letters[s % len(letters)]], finish))
        step = due
        await asyncio.sleep(min(step_s, 0.0005))
    await asyncio.gather(*tasks)
    elapsed = max(ends) - start
    tokens = streams * steps
    return {
        "offered_tok_s": tokens / (steps * step_s),
        "streamed_tok_s": tokens / elapsed,
        "lag_s": max(0.0, elapsed - steps * step_s),
        "chunks": chunks[0],
    }


def measure(streams: int, steps: int, step_ms: float, send_us: float, coalesce: bool) -> dict:
    from minengine.server import frontend

    original = frontend._waiting_updates
    if not coalesce:
        frontend._waiting_updates = lambda update, queue: ([update], None)
    try:
        result = asyncio.run(run_point(streams, steps, step_ms / 1e3, send_us))
    finally:
        frontend._waiting_updates = original
    return {"streams": streams, "step_ms": step_ms, "coalesce": coalesce, **result}


def markdown(report: dict) -> str:
    cfg = report["config"]
    lines = header("Front-end streaming capacity (in-process, simulated sends)", report)
    lines += [
        f"- host CPUs: {report['cpus']}; {cfg['streams']} streams x {cfg['steps']} tokens; "
        f"{cfg['send_us']} us busy wait per chunk for the socket write",
        "",
        "| step ms | coalescing | offered tok/s | streamed tok/s | lag s | chunks |",
        "|---:|:---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['step_ms']} | {'on' if r['coalesce'] else 'off'} | {r['offered_tok_s']:.0f} | "
            f"{r['streamed_tok_s']:.0f} | {r['lag_s']:.2f} | {r['chunks']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200, help="tokens per stream")
    parser.add_argument("--step-ms", type=float, nargs="+", default=[20.0, 5.0, 2.0])
    parser.add_argument("--send-us", type=float, default=20.0, help="busy wait per chunk (the socket write)")
    parser.add_argument("--smoke", action="store_true", help="8 streams x 10 tokens (checks the script)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.streams, args.steps, args.step_ms = 8, 10, [1.0]
    require_positive(parser, args, "streams", "steps")
    if min(args.step_ms) <= 0 or args.send_us < 0:
        parser.error(f"--step-ms {min(args.step_ms)} / --send-us {args.send_us}; allowed: > 0 / >= 0")
    rows = []
    for step_ms in args.step_ms:
        for coalesce in (False, True):
            rows.append(measure(args.streams, args.steps, step_ms, args.send_us, coalesce))
            print(rows[-1], flush=True)
    report = make_report(argv, "bench_frontend", torch.device("cpu"), args, rows, cpus=os.cpu_count())
    return publish(args.out, "frontend", report, markdown(report))


if __name__ == "__main__":
    main()
