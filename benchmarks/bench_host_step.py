"""Host time per engine step, with the model's forward replaced by a stub.

Overlap scheduling hides the host's work for step N + 1 (scheduling, input preparation, reading
step N - 1's tokens) behind the device's step N only while that work is the shorter of the two.
This measures the host work alone, on CPU or GPU: a decode-only batch of B requests (greedy,
``ignore_eos``), the forward returning fixed logits, so only the engine's own Python and the
small launches around the forward remain. Medians over rounds, in ms per step:

- schedule: the policy over every running request, page allocation;
- prepare: the step's input lists and their host-to-device copies;
- launch: the stub forward, sampling, the token copy back;
- commit: appending the tokens, stop checks;
- send (server only): the scheduler process's token updates for the front end, built and pickled
  as it sends them.

Three text modes: ``server`` (the scheduler makes no text: the server's front end process
detokenizes), ``offline`` (the ``LLM`` path without stop strings: the output is decoded once, when
a request ends, so no step pays for it) and ``stop strings`` (the ``LLM`` path with a stop string:
incremental detokenization on every token).

    python benchmarks/bench_host_step.py                        # batches 1 16 64 256, this device
    python benchmarks/bench_host_step.py --smoke --out /tmp/b   # checks the script
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import time
from pathlib import Path

import torch
from _common import RESULTS, header, publish, require_positive, save, stem
from _common import report as make_report

PHASES = ("schedule", "prepare", "launch", "commit", "send")
MODES = ("server", "offline", "stop strings")


class StubModel(torch.nn.Module):
    """The model's interface, returning fixed logits: no device work but the slicing. Row i's
    greedy token is the letter ``i % 26``, so every step's token decodes to a whole character
    (a repeated incomplete UTF-8 byte would keep the detokenizer's window growing)."""

    def __init__(self, vocab_size: int, rows: int, device: torch.device, letters: list[int]):
        super().__init__()
        self.logits = torch.randn(rows, vocab_size, device=device)
        best = torch.tensor([letters[i % len(letters)] for i in range(rows)], device=device)
        self.logits[torch.arange(rows, device=device), best] = 100.0

    def forward(self, batch, kv_caches, kernels) -> torch.Tensor:
        return self.logits[: batch.logits_indices.shape[0]]


def timed(phase_ms: dict[str, float], name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phase_ms[name] += (time.perf_counter() - start) * 1e3

    return wrapper


def measure(batch: int, mode: str, steps: int, repeats: int, warmup: int, device: str, prompt_len: int) -> dict:
    from minengine.config import EngineConfig
    from minengine.engine import Engine
    from minengine.sampling_params import SamplingParams
    from minengine.server.protocol import StepOutput
    from minengine.server.scheduler_process import engine_updates

    max_tokens = warmup + steps * repeats + 8  # nobody finishes while measured
    per_request = prompt_len + max_tokens
    cfg = EngineConfig.from_kwargs(
        model="tiny", device=device, max_running_requests=batch, max_total_tokens=batch * (per_request + 16),
        context_length=per_request + 16, disable_cuda_graph=True,
    )  # fmt: skip
    engine = Engine(cfg, detokenize=mode != "server")
    letters = engine.tokenizer.encode("abcdefghijklmnopqrstuvwxyz", add_special_tokens=False)
    engine.runner.model = StubModel(engine.model_config.vocab_size, batch, engine.device, letters)
    stop = ["\x00never"] if mode == "stop strings" else None
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, stop=stop)
    vocab = engine.model_config.vocab_size
    live = {}  # the server's request ids
    for i in range(batch):
        live[f"{i:032x}"] = engine.add_request([(i * 31 + j * 7) % (vocab - 1) + 1 for j in range(prompt_len)], params)

    engine_step, engine_ms = engine.step, {"engine": 0.0}
    timed_engine_step = timed(engine_ms, "engine", engine_step)

    def server_step() -> list:
        """The scheduler process's pass: a step, then the token updates it builds and pickles."""
        engine.step, engine_ms["engine"] = timed_engine_step, 0.0
        start = time.perf_counter()
        try:
            updates = engine_updates(engine, live)
            pickle.dumps(StepOutput(0, updates, engine.stats()), protocol=pickle.HIGHEST_PROTOCOL)
        finally:
            engine.step = engine_step
        phase_ms["send"] += (time.perf_counter() - start) * 1e3 - engine_ms["engine"]
        return updates

    step = server_step if mode == "server" else engine.step
    while len(engine.scheduler.running) < batch or engine.scheduler.running[0].prefilling:
        engine.step()  # admit and prefill everyone
    for _ in range(warmup):
        engine.step()
    phase_ms = dict.fromkeys(PHASES, 0.0)
    sched, runner = engine.scheduler, engine.runner
    sched.schedule = timed(phase_ms, "schedule", sched.schedule)
    runner.prepare = timed(phase_ms, "prepare", runner.prepare)
    runner.launch = timed(phase_ms, "launch", runner.launch)
    engine._commit = timed(phase_ms, "commit", engine._commit)
    rounds = []  # per round: step ms and each phase's ms per step
    for _ in range(repeats):
        for p in PHASES:
            phase_ms[p] = 0.0
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            assert len(step()) == batch, "every request decodes in every measured step"
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        rounds.append(
            {"step_ms": (time.perf_counter() - start) * 1e3 / steps} | {p: phase_ms[p] / steps for p in PHASES}
        )
    if mode == "stop strings":  # the stub's tokens became text: row 0 decodes "a" every step
        assert engine.scheduler.running[0].text.endswith("aaaa")
    engine.shutdown()
    median = lambda key: statistics.median(r[key] for r in rounds)  # noqa: E731
    row = {"batch": batch, "text": mode, "step_ms": median("step_ms")}
    row.update({f"{p}_ms": median(p) for p in PHASES})
    row["us_per_request"] = row["step_ms"] * 1e3 / batch
    row["rounds_step_ms"] = [r["step_ms"] for r in rounds]
    return row


def markdown(report: dict) -> str:
    lines = header("Host time per engine step (stub forward)", report)
    cfg = report["config"]
    lines += [
        f"- host CPUs: {report['cpus']}; medians of {cfg['repeats']} rounds of {cfg['steps']} decode steps",
        "",
        "| batch | text | step ms | schedule | prepare | launch | commit | send | us / request |",
        "|---:|:---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        phases = " | ".join(f"{r[f'{p}_ms']:.3f}" for p in PHASES)
        lines.append(f"| {r['batch']} | {r['text']} | {r['step_ms']:.3f} | {phases} | {r['us_per_request']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--steps", type=int, default=200, help="steps per round")
    parser.add_argument("--repeats", type=int, default=5, help="rounds; the report gives their medians")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--smoke", action="store_true", help="batches 1 and 4, 5 steps (checks the script)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch, args.steps, args.repeats, args.warmup = [1, 4], 5, 2, 2
    require_positive(parser, args, "steps", "repeats", "warmup", "prompt_len", "batch")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    make = lambda: make_report(argv, "bench_host_step", torch.device(device), args, rows, cpus=os.cpu_count())  # noqa: E731
    for batch in args.batch:
        for mode in MODES:
            rows.append(measure(batch, mode, args.steps, args.repeats, args.warmup, device, args.prompt_len))
            print(rows[-1], flush=True)
            report = make()  # after every row: a run stopped at a time limit keeps what it measured
            save(args.out, stem("host_step", report), report, markdown(report))
    report = make()
    return publish(args.out, "host_step", report, markdown(report))


if __name__ == "__main__":
    main()
