"""The sampler's cost per step: plain greedy and sampled rows against rows whose logits are
adjusted first (``allowed_token_ids``, ``bad_words``, ``logit_bias``, ``min_tokens``, the
repetition / frequency / presence penalties).

One call of ``Sampler`` on a decode batch of ``rows`` requests, each with a 200-token prompt and 100
output tokens, float32 logits [rows, vocab]. Per case: the median ms per call, its ratio to plain
greedy (an argmax) in the same run, and "logits passes": the time over one read of the logits at
the copy bandwidth measured in the same run, so 1.0 is a single memory-bound pass over them.

    python benchmarks/bench_sampler.py                        # rows 16 64 256, vocab 152064, this device
    python benchmarks/bench_sampler.py --smoke --out /tmp/b   # checks the script
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from _common import RESULTS, header, publish, require_positive, save, stem, timed
from _common import report as make_report

from minengine.engine import resolve_device
from minengine.request import Request
from minengine.sampler import Sampler
from minengine.sampling_params import SamplingParams

CASES = {
    "greedy": SamplingParams(temperature=0),
    "sampled (top_p 0.9)": SamplingParams(temperature=0.8, top_p=0.9),
    "logit_bias (4 tokens)": SamplingParams(temperature=0, logit_bias={5: 1.0, 6: -1.0, 7: 2.0, 8: -100.0}),
    "min_tokens (ends banned)": SamplingParams(temperature=0, min_tokens=1000, max_tokens=1000),
    "allowed_token_ids (64 tokens)": SamplingParams(temperature=0, allowed_token_ids=list(range(100, 164))),
    # tokenized as BAD_WORDS (the sampler reads the tokens; no tokenizer here)
    "bad_words (8: 1 to 4 tokens)": SamplingParams(temperature=0, bad_words=["w"] * 8),
    "presence + frequency": SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.5),
    "all three penalties": SamplingParams(
        temperature=0, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5
    ),
    "all three penalties, sampled": SamplingParams(
        temperature=0.8, top_p=0.9, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5
    ),
}


BAD_WORDS = ((11,), (12, 13), (14, 15), (16, 17, 18), (19, 20, 21), (22, 23, 24, 25), (26, 13), (27, 28))


def requests(n: int, params: SamplingParams, vocab: int) -> list[Request]:
    """Decode requests in flight (as the sampler sees them after the scheduler's advance)."""
    reqs = []
    for i in range(n):
        prompt = [(7 * i + 13 * j) % vocab for j in range(200)]
        req = Request(
            rid=i, prompt_ids=prompt, params=params, max_len=2000, bad_words_ids=BAD_WORDS * bool(params.bad_words)
        )
        req.token_ids += [(11 * i + 17 * j) % vocab for j in range(100)]
        req.num_inflight = 1
        reqs.append(req)
    return reqs


def copy_bandwidth(device: torch.device, calls: int, repeats: int) -> float:
    """GB/s of a 1 GiB (CUDA) or 256 MiB (CPU) device-to-device copy: read plus write."""
    n = (2**30 if device.type == "cuda" else 2**28) // 4
    src, dst = torch.empty(n, device=device), torch.empty(n, device=device)
    src.fill_(1.0)
    ms = timed(lambda: dst.copy_(src), device, calls, repeats)
    return 2 * n * 4 / (ms / 1e3) / 1e9


def measure(case: str, rows: int, vocab: int, device: torch.device, calls: int, repeats: int, gbps: float) -> dict:
    sampler = Sampler(device, seed=0, eos_token_ids=frozenset({0, 1}))
    reqs = requests(rows, CASES[case], vocab)
    logits = torch.randn(rows, vocab, device=device)
    sampler(logits, reqs)  # warm-up; penalised requests make their counts here
    ms = timed(lambda: sampler(logits, reqs), device, calls, repeats)
    one_pass_ms = rows * vocab * 4 / (gbps * 1e9) * 1e3
    return {"case": case, "rows": rows, "vocab": vocab, "ms": ms, "logits_passes": ms / one_pass_ms}


def markdown(report: dict) -> str:
    lines = header("Sampler cost per step", report)
    lines += [f"- copy bandwidth (same run): {report['copy_gbps']:.0f} GB/s", ""]
    lines += ["| rows | case | ms per call | vs greedy | logits passes |", "| --- | --- | --- | --- | --- |"]
    greedy = {r["rows"]: r["ms"] for r in report["rows"] if r["case"] == "greedy"}
    for r in report["rows"]:
        ratio = f"{r['ms'] / greedy[r['rows']]:.1f}x" if r["rows"] in greedy else "-"
        lines.append(f"| {r['rows']} | {r['case']} | {r['ms']:.3f} | {ratio} | {r['logits_passes']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--vocab", type=int, default=152064, help="vocabulary size (Qwen's by default)")
    parser.add_argument("--calls", type=int, default=20, help="calls per round")
    parser.add_argument("--repeats", type=int, default=5, help="rounds; the report gives their median")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--smoke", action="store_true", help="rows 2 and 4, vocab 512 (checks the script)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.vocab, args.calls, args.repeats = [2, 4], 512, 2, 2
    require_positive(parser, args, "rows", "vocab", "calls", "repeats")
    device = resolve_device(args.device)
    gbps = copy_bandwidth(device, args.calls, args.repeats)
    rows = []

    def make() -> dict:
        return make_report(argv, "bench_sampler", device, args, rows, copy_gbps=gbps)

    for n in args.rows:
        for case in CASES:
            rows.append(measure(case, n, args.vocab, device, args.calls, args.repeats, gbps))
            print(rows[-1], flush=True)
            report = make()  # after every row: a run stopped at a time limit keeps what it measured
            save(args.out, stem("sampler", report), report, markdown(report))
    return publish(args.out, "sampler", make(), markdown(make()))


if __name__ == "__main__":
    main()
