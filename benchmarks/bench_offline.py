"""Offline throughput: nano-vllm's workload through minengine and through transformers.

256 requests with input and output lengths uniform in [100, 1024] (random token ids,
``ignore_eos``), on a Qwen3-0.6B-shaped and a Llama-3-8B-shaped model with random bf16 weights
(or ``--model DIR`` for a real checkpoint). Reports output tokens/s for minengine and, in the same
run on the same requests, for transformers' continuous batching (its manager, fed one request
at a time with that request's own output length, as ``generate_batch`` does for one length).
CUDA graphs and overlap scheduling come later: this is the baseline.

    python benchmarks/bench_offline.py                           # both shapes, GPU
    python benchmarks/bench_offline.py --model /path/to/ckpt --no-hf
    python benchmarks/bench_offline.py --smoke --out /tmp/bench  # tiny shapes on CPU: checks the script
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from _common import RESULTS, header, save, stem
from _common import report as make_report

# Hugging Face config.json contents of the shapes we measure (weights are random).
SHAPES = {
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
    },
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    },
    "smoke": {  # CPU check of the script
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
    },
}


def model_dir(name: str, tmp: Path) -> tuple[str, bool]:
    """(directory, random weights?) for a shape name or a checkpoint directory."""
    if name not in SHAPES:
        return name, False
    path = tmp / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(SHAPES[name]))
    word_tokenizer(SHAPES[name]["vocab_size"]).save(str(path / "tokenizer.json"))
    return str(path), True


def word_tokenizer(vocab_size: int):
    """A tokenizer with a word for every id of the model ("w0" ... "w<vocab_size - 1>", joined by
    spaces), so that every token a random-weight model samples has text: a tokenizer with fewer
    ids (tiny's 260 bytes) decodes the rest to nothing, and a server streams no chunk for them,
    which would turn TTFT into the whole request and ITL into 0. Text round-trips to the same
    ids, so a conversation's next turn (history + answer) meets its own KV in a prefix cache."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def workload(n: int, lo: int, hi: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    return prompts, [rng.randint(lo, hi) for _ in range(n)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_minengine(path: str, dummy: bool, prompts, out_lens, args) -> dict:
    from minengine import LLM, SamplingParams

    positions = json.loads((Path(path) / "config.json").read_text()).get("max_position_embeddings", args.context_length)
    config = dict(context_length=min(args.context_length, positions), load_format="dummy" if dummy else "auto")
    if args.smoke:
        config |= dict(max_total_tokens=8192)
    llm = LLM(path, **config)
    warm = SamplingParams(temperature=0.6, max_tokens=8, ignore_eos=True)
    llm.generate([p[:64] for p in prompts[:4]], warm, use_tqdm=False)  # compile kernels
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in out_lens]
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.smoke)
    sync()
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    result = {"output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
    result["kv_capacity_tokens"] = llm.engine.kv_capacity_tokens
    llm.shutdown()
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def run_transformers(path: str, dummy: bool, prompts, out_lens, args) -> dict:
    import transformers

    if dummy:  # random weights made on the GPU (an 8B model initialised on the CPU takes minutes)
        cfg = transformers.AutoConfig.from_pretrained(path)
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model = model.to("cuda").eval()
    gen_cfg = transformers.GenerationConfig(
        do_sample=True, temperature=0.6, max_new_tokens=max(out_lens), eos_token_id=None, pad_token_id=0
    )
    with model.continuous_batching_context_manager(generation_config=gen_cfg, block=True, timeout=60) as manager:
        sync()
        t0 = time.perf_counter()
        for i, (p, n) in enumerate(zip(prompts, out_lens, strict=True)):
            if manager.add_request(p, request_id=str(i), max_new_tokens=n) is None:  # it logs why, and drops it
                raise RuntimeError(f"transformers' manager refused request {i} of {len(prompts)}")
        tokens, finished = 0, 0
        while finished < len(prompts):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                finished += 1
                tokens += len(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError(f"transformers' manager stopped after {finished} of {len(prompts)} requests")
        sync()
        seconds = time.perf_counter() - t0
    attn = getattr(model.config, "_attn_implementation", None)  # what its paged cache ran on, for the record
    del model
    torch.cuda.empty_cache()
    return {"output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "attn_implementation": attn}


def markdown(report: dict) -> str:
    lines = [
        *header("bench_offline", report),
        f"- workload: {report['config']['num_requests']} requests, input/output lengths uniform in "
        f"[{report['config']['min_len']}, {report['config']['max_len']}], ignore_eos, temperature 0.6",
        "",
        "| model | minengine tok/s | transformers CB tok/s | ratio | output tokens | minengine s | transformers s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        ours, hf = r["minengine"], r.get("transformers", {})
        ratio = f"{ours['tokens_per_s'] / hf['tokens_per_s']:.2f}" if "tokens_per_s" in hf else "-"
        hf_tps = f"{hf['tokens_per_s']:.0f}" if "tokens_per_s" in hf else hf.get("error", hf.get("skipped", "-"))
        hf_s = f"{hf['seconds']:.1f}" if "seconds" in hf else "-"
        lines.append(
            f"| {r['model']} | {ours['tokens_per_s']:.0f} | {hf_tps} | {ratio} | {ours['output_tokens']} "
            f"| {ours['seconds']:.1f} | {hf_s} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", nargs="+", default=["qwen3-0.6b", "llama3-8b"], help="shape names or checkpoint dirs"
    )
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--context-length", type=int, default=4096)
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    parser.add_argument(
        "--hf-model", nargs="+", default=None, metavar="NAME",
        help="run transformers' baseline on these of --model only (default: all; on an H100 its Llama-3-8B run "
        "did not finish in a 10-minute device call beside the others)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny model and lengths on CPU; no transformers")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.hf_model or ()) - set(args.model))
    if unknown:
        parser.error(f"--hf-model {' '.join(unknown)}: not among --model; allowed: {', '.join(args.model)}")
    if args.smoke:
        args.model, args.num_requests, args.min_len, args.max_len, args.no_hf = ["smoke"], 6, 5, 20, True
    elif not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --smoke for a tiny CPU run)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    rows = []

    def write() -> dict:  # after every measurement: a run stopped at its time limit keeps what it measured
        report = make_report(argv, "bench_offline", device, args, rows)
        save(args.out, stem("offline", report), report, markdown(report))
        return report

    with tempfile.TemporaryDirectory() as tmp:
        runs = []  # minengine on every model first, then the transformers baselines (slower, less needed)
        for name in args.model:
            path, dummy = model_dir(name, Path(tmp))
            vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
            prompts, out_lens = workload(args.num_requests, args.min_len, args.max_len, vocab, args.seed)
            row = {"model": name, "minengine": run_minengine(path, dummy, prompts, out_lens, args)}
            rows.append(row)
            runs.append((row, path, dummy, prompts, out_lens))
            write()
            print(json.dumps(row), flush=True)
        for row, path, dummy, prompts, out_lens in runs if not args.no_hf else ():
            if args.hf_model is not None and row["model"] not in args.hf_model:
                row["transformers"] = {"skipped": "not in --hf-model"}
                write()
                continue
            try:
                row["transformers"] = run_transformers(path, dummy, prompts, out_lens, args)
            except Exception as exc:  # record why, keep our numbers
                row["transformers"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            write()
            print(json.dumps(row), flush=True)
    report = write()
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
