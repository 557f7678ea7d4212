"""Decode step time against the roofline, and GPU idle time between steps (overlap on vs off).

For a Llama-3-8B-shaped model with random bf16 weights, at batch 1, 16, 64, 256 and context 1k
and 4k: fill the batch (prompts of that length), then time steady-state decode steps.

    roofline = (weight bytes read + KV bytes read per step) / measured copy bandwidth

(Weight bytes: every parameter once, but only the batch's rows of an untied input embedding.)

Target: step time <= 1.25 x roofline at batch >= 16. Idle time: a torch-profiler trace of
decode steps; idle = 1 - (union of GPU kernel intervals) / (trace window), with overlap
scheduling on and off. Target: < 5 % idle with overlap on. The same trace gives the GPU-busy
time and the GPU kernels (and copies) per step. Last, unless ``--no-layer-ablation``, the step time
and kernel count again with the decoder's elementwise layers left to torch (``--layer-kernels
torch``: about 30 small kernels per layer instead of 4 fused ones). Writes JSON + markdown, and a
PNG: step time against the roofline per batch, and idle time with overlap on and off.

    python benchmarks/bench_decode.py
    python benchmarks/bench_decode.py --smoke --out /tmp/bench   # tiny shapes on CPU: checks the script
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from _common import RESULTS, header, save, stem, summarize_spans
from _common import report as make_report
from bench_offline import model_dir


def max_tokens(steps: int) -> int:
    """Tokens each request may generate: the filling, the warm-up and both timed runs fit."""
    return steps * 4 + 16


def build(args, tmp: Path, overlap: bool, layer_kernels: str = "auto"):
    """One engine for every point of a setting: room for the largest batch and context."""
    from minengine import LLM

    path, dummy = model_dir(args.model, tmp)
    batch, context = max(args.batches), max(args.contexts)
    config = dict(
        load_format="dummy" if dummy else "auto",
        max_running_requests=batch,
        context_length=context + max_tokens(args.steps) + 64,
        disable_overlap_schedule=not overlap,
        cuda_graph_max_bs=batch,
        layer_kernels=layer_kernels,
    )
    if args.max_total_tokens is not None:
        config["max_total_tokens"] = args.max_total_tokens
    elif args.smoke:
        config["max_total_tokens"] = batch * (context + max_tokens(args.steps) + 64)
    return LLM(path, **config), json.loads((Path(path) / "config.json").read_text())


def fill(llm, batch: int, context: int, steps: int, vocab: int) -> list:
    """Admit ``batch`` requests of ``context`` tokens and run until all of them decode together."""
    from minengine import SamplingParams

    rng = random.Random(context * 1000 + batch)  # fresh prompts per point: no prefix-cache hits
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens(steps), ignore_eos=True)
    reqs = [eng.add_request([rng.randrange(vocab) for _ in range(context)], params) for _ in range(batch)]
    while any(r.prefilling or r.num_inflight == 0 and not r.output_ids for r in reqs):
        eng.step()
    for _ in range(3):  # reach the steady decode state
        eng.step()
    running = len(eng.scheduler.running)
    if running != batch:
        raise RuntimeError(f"batch {batch} x context {context}: only {running} requests decode together")
    return reqs


def drain(llm, reqs: list) -> None:
    """Abort the point's requests and step until the engine is idle (their KV freed)."""
    for r in reqs:
        llm.engine.abort(r)
    while llm.engine.has_unfinished():
        llm.engine.step()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_steps(llm, steps: int) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        llm.engine.step()
    sync()
    return (time.perf_counter() - t0) / steps


def trace_steps(llm, steps: int) -> dict | None:
    """From a profiler trace of ``steps`` decode steps (CUDA only): ``idle`` = 1 - busy/window,
    ``busy_ms`` = GPU-busy time per step (the union of kernel and copy intervals) and ``kernels``
    = GPU activities (kernels, copies, memsets) per step; graph replays count each node."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.engine.step()
        sync()
    spans = [
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    ]
    return summarize_spans(spans, steps)


def decode_weight_bytes(model: torch.nn.Module, batch: int) -> int:
    """Weight bytes one decode step reads: every parameter once (tied embeddings are one tensor,
    read in full by lm_head), except an untied input embedding, of which only ``batch`` rows."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    if embed is not head:
        total -= embed.numel() * embed.element_size() - batch * embed.shape[1] * embed.element_size()
    return total


def roofline_seconds(cfg: dict, batch: int, context: float, copy_gbps: float, weight_bytes: int) -> float:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv = batch * context * cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 2
    return (weight_bytes + kv) / (copy_gbps * 1e9)


def markdown(report: dict) -> str:
    lines = [
        *header("bench_decode", report),
        f"- copy bandwidth {report['copy_gbps']:.0f} GB/s (read + write); model {report['config']['model']}",
        "",
        "| batch | context | step ms | roofline ms | x roofline | GPU busy ms | kernels/step "
        "| idle, overlap on | idle, overlap off | step ms, torch layers | kernels/step, torch layers |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:.1%}"

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    def count(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    for r in report["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['batch']} | {r['context']} | skipped: {r['skipped']} |" + " |" * 8)
        elif "step_ms" not in r:
            lines.append(f"| {r['batch']} | {r['context']} | not measured |" + " |" * 8)
        else:
            lines.append(
                f"| {r['batch']} | {r['context']} | {r['step_ms']:.3f} | {r['roofline_ms']:.3f} | "
                f"{r['step_ms'] / r['roofline_ms']:.2f} | {ms(r.get('gpu_busy_ms'))} | "
                f"{count(r.get('kernels_per_step'))} | {pct(r.get('idle_overlap'))} | "
                f"{pct(r.get('idle_no_overlap'))} | {ms(r.get('step_ms_torch_layers'))} | "
                f"{count(r.get('kernels_per_step_torch_layers'))} |"
            )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (steps, idle) = plt.subplots(1, 2, figsize=(10, 3.8))
    for context in sorted({r["context"] for r in rows}):
        measured = [r for r in rows if r["context"] == context and "step_ms" in r]
        if not measured:
            continue
        batches = [r["batch"] for r in measured]
        line = steps.plot(batches, [r["step_ms"] for r in measured], "o-", label=f"step, context {context}")[0]
        steps.plot(batches, [r["roofline_ms"] for r in measured], "--", color=line.get_color(),
                   label=f"roofline, context {context}")  # fmt: skip
        for key, style in (("idle_overlap", "o-"), ("idle_no_overlap", "x:")):
            got = [(r["batch"], 100 * r[key]) for r in measured if key in r]
            if got:
                idle.plot(*zip(*got, strict=True), style, color=line.get_color(),
                          label=f"context {context}, overlap {'on' if key == 'idle_overlap' else 'off'}")  # fmt: skip
    steps.set(xscale="log", yscale="log", xlabel="batch", ylabel="ms per decode step", title="decode step vs roofline")
    idle.axhline(5, color="gray", lw=0.8)  # the target with overlap on
    idle.set(xscale="log", xlabel="batch", ylabel="GPU idle %", title="GPU idle between kernels")
    for ax in (steps, idle):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b", help="a shape name from bench_offline or a checkpoint dir")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per point")
    parser.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size (default: GPU memory)")
    parser.add_argument("--smoke", action="store_true", help="tiny model and sizes on CPU")
    parser.add_argument("--no-layer-ablation", action="store_true", help="skip the torch-layers step times")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.batches, args.contexts, args.steps = "smoke", [1, 3], [16], 4
    elif not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --smoke for a tiny CPU run)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    from bench_attention import measure_ceilings, timer

    copy_gbps = measure_ceilings(device, timer(device), args.smoke)["copy_gbps"]
    rows = [{"batch": b, "context": c} for c in args.contexts for b in args.batches]

    def write() -> dict:  # after every point: a run stopped at its time limit keeps what it measured
        report = make_report(argv, "bench_decode", device, args, rows, copy_gbps=copy_gbps)
        save(args.out, stem("decode", report), report, markdown(report))
        plot(rows, args.out / f"{stem('decode', report)}.png")
        return report

    with tempfile.TemporaryDirectory() as tmp:
        settings = [("overlap", True, "auto"), ("no-overlap", False, "auto")]
        if not args.no_layer_ablation:
            settings.append(("torch-layers", True, "torch"))
        for name, overlap, layer_kernels in settings:  # one engine per setting, reused by every point
            sub = Path(tmp) / name
            sub.mkdir()
            llm, cfg = build(args, sub, overlap, layer_kernels)
            capacity = llm.engine.kv_capacity_tokens
            for row in rows:
                batch, context = row["batch"], row["context"]
                need = batch * (context + max_tokens(args.steps))
                if need > capacity:
                    row["skipped"] = f"needs {need} KV tokens, the pool holds {capacity}"
                    continue
                reqs = fill(llm, batch, context, args.steps, cfg["vocab_size"])
                if name == "overlap":
                    generated = sum(len(r.output_ids) for r in reqs)
                    row["step_ms"] = time_steps(llm, args.steps) * 1e3
                    generated += sum(len(r.output_ids) for r in reqs)
                    # the KV the timed steps read: the prompt and, on average, the tokens generated by then
                    row["kv_tokens_per_seq"] = context + generated / (2 * batch)
                    weights = decode_weight_bytes(llm.engine.model, batch)
                    roofline = roofline_seconds(cfg, batch, row["kv_tokens_per_seq"], copy_gbps, weights)
                    row["roofline_ms"] = roofline * 1e3
                    if trace := trace_steps(llm, args.steps):
                        row["idle_overlap"] = trace["idle"]
                        row["gpu_busy_ms"], row["kernels_per_step"] = trace["busy_ms"], trace["kernels"]
                elif name == "no-overlap":
                    if trace := trace_steps(llm, args.steps):
                        row["idle_no_overlap"] = trace["idle"]
                else:
                    row["step_ms_torch_layers"] = time_steps(llm, args.steps) * 1e3
                    if trace := trace_steps(llm, args.steps):
                        row["kernels_per_step_torch_layers"] = trace["kernels"]
                drain(llm, reqs)
                print(json.dumps(row), flush=True)
                write()
            llm.shutdown()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    report = write()
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
