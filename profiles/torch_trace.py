"""Chrome trace of N engine steps with torch.profiler (works where Nsight does not, CPU too).

    python profiles/torch_trace.py --steps 20 --out /tmp/trace.json            # tiny model
    python profiles/torch_trace.py --model DIR --batch 64 --prompt-len 1024    # a real checkpoint

Open the JSON in chrome://tracing or Perfetto. The engine marks each step's parts: schedule,
h2d, forward, sampling, process_results. Look for gaps between forward ranges on the GPU
stream (idle time; overlap scheduling should close them) and for the host ranges that cover
them.
"""

from __future__ import annotations

import argparse
import random

import torch
from torch.profiler import ProfilerActivity, profile

from minengine import LLM, SamplingParams


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default="trace.json")
    p.add_argument("--disable-overlap-schedule", action="store_true")
    args = p.parse_args(argv)
    llm = LLM(args.model, disable_overlap_schedule=args.disable_overlap_schedule)
    eng, rng = llm.engine, random.Random(0)
    vocab = eng.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.steps * 2 + 8, ignore_eos=True)
    for _ in range(args.batch):
        eng.add_request([rng.randrange(vocab) for _ in range(args.prompt_len)], params)
    for _ in range(3):  # warm up (kernels compile)
        eng.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            eng.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    prof.export_chrome_trace(args.out)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
    print(f"trace: {args.out}")
    return args.out


if __name__ == "__main__":
    main()
