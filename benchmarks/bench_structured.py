"""Structured outputs' cost at a real vocabulary size: compiling a constraint, and the host's mask
work per decode step.

The vocabulary is synthetic (nothing is downloaded): the 256 byte tokens, then the most frequent
words and punctuation runs of the Python standard library's sources, with and without a leading
space, up to ``--vocab`` tokens (Qwen's 152k by default), in a byte-level BPE ``tokenizer.json``
as the engine reads one: text-like tokens, many holding JSON's punctuation, as in a real tokenizer.

Per constraint (a JSON schema, ``json_object``, a regex, a choice):
- ``compile_ms``: xgrammar compiling it for that vocabulary, cold (its cache cleared); and, once,
  ``setup_ms``: reading the vocabulary into a compiler (the engine does it at the first
  constrained request).
- per decode step of ``rows`` constrained requests, each at another place of a valid output: the
  engine's ``allowed_mask`` (each row's matcher takes its new token and fills its bitmask row),
  next to xgrammar's fill one row at a time and xgrammar's multithreaded ``BatchGrammarMatcher``
  (the same bitmask: checked), in microseconds per step; and ``apply_ms``, the sampler setting the
  banned logits to -inf on this device ([rows, vocab] float32, the bitmask copied there first).

    python benchmarks/bench_structured.py                        # rows 1 8 32 128, vocab 152064
    python benchmarks/bench_structured.py --smoke --out /tmp/b   # checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sysconfig
import time
from collections import Counter
from concurrent.futures import Future
from pathlib import Path

import torch
from _common import RESULTS, header, publish, require_positive, save, stem, timed
from _common import report as make_report

from minengine.engine import resolve_device
from minengine.models.tiny import _BYTE_OF
from minengine.structured import Matcher, StructuredOutputs, _compile, allowed_mask, apply_mask, xgrammar

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "[0-9]{5}"}},
            "required": ["city", "zip"],
        },
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["name", "age", "tags", "address", "unit"],
}
INSTANCE = {
    "name": "Ada Lovelace",
    "age": 36,
    "tags": ["math", "engines", "notes"],
    "address": {"city": "London", "zip": "12345"},
    "unit": "celsius",
}
CHOICES = [f"option {i}: {word}" for i, word in enumerate(["alpha", "beta", "gamma", "delta", "epsilon"] * 4)]
# each constraint, and an output it allows (the steps walk along it)
CASES = {
    "json schema": (StructuredOutputs(json=SCHEMA), json.dumps(INSTANCE)),
    "json_object": (StructuredOutputs(json_object=True), json.dumps(INSTANCE)),
    "regex": (StructuredOutputs(regex=r"[0-9]{3}-[0-9]{4} [A-Za-z ]{5,40}"), "555-1234 Charles Babbage"),
    "choice (20)": (StructuredOutputs(choice=CHOICES), CHOICES[13]),
}
EOS = "<|endoftext|>"


def vocabulary(size: int) -> dict[str, int]:
    """``size`` byte-level BPE tokens (their printable form, as in a ``tokenizer.json``): the 256
    bytes, then the standard library's most frequent words and punctuation runs, as they are and
    after a space. The last id is the end token."""
    chars = {b: ch for ch, b in _BYTE_OF.items()}
    vocab = {chars[b]: b for b in range(256)}
    counts: Counter[str] = Counter()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("**/*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for piece in re.findall(r"\w+|[^\w\s]+", text):
            counts[piece] += 1
            counts[" " + piece] += 1
        if len(counts) > 4 * size:
            break
    for piece, _ in counts.most_common():
        if len(vocab) >= size - 1:
            break
        token = "".join(chars[b] for b in piece.encode("utf-8"))
        if len(piece) > 1 and token not in vocab:
            vocab[token] = len(vocab)
    vocab[EOS] = len(vocab)
    return vocab


def tokenizer_info(size: int):
    """xgrammar's view of the synthetic tokenizer (as ``Grammars`` builds it for the engine), its
    vocabulary size, end token id, and the ms that reading the vocabulary into xgrammar took."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = vocabulary(size)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([EOS])
    eos = vocab[EOS]
    xgr = xgrammar()
    start = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_object=backend)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(vocab), stop_token_ids=[eos])
    return info, len(vocab), eos, (time.perf_counter() - start) * 1e3


def path_of(text: str) -> list[int]:
    """``text`` as byte tokens (ids 0..255 are the bytes): every state of the grammar on the way."""
    return list(text.encode("utf-8"))


def measure(kind: str, rows: int, info, vocab: int, eos: int, device: torch.device, steps: int) -> dict:
    xgr = xgrammar()
    spec, text = CASES[kind]
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    start = time.perf_counter()
    compiled = _compile(compiler, spec.key)
    compile_ms = (time.perf_counter() - start) * 1e3
    path = [*path_of(text), eos]
    done = Future()
    done.set_result(compiled)
    matchers = [Matcher(done) for _ in range(rows)]
    plain = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
    outputs: list[list[int]] = [[] for _ in range(rows)]
    batch = xgr.BatchGrammarMatcher()
    loop_mask = xgr.allocate_token_bitmask(rows, vocab)
    batch_mask = xgr.allocate_token_bitmask(rows, vocab)
    # row r starts r / rows of the way along the output (the end token last, so never at it)
    for r in range(rows):
        for token in path[: r * (len(path) - 1) // rows]:
            outputs[r].append(token)
            assert plain[r].accept_token(token)
    engine_us, loop_us, batch_us = [], [], []
    for _ in range(steps):
        start = time.perf_counter()
        mask = allowed_mask(matchers, outputs, vocab)
        engine_us.append((time.perf_counter() - start) * 1e6)
        start = time.perf_counter()
        for r, m in enumerate(plain):
            m.fill_next_token_bitmask(loop_mask, r)
        loop_us.append((time.perf_counter() - start) * 1e6)
        start = time.perf_counter()
        batch.batch_fill_next_token_bitmask(plain, batch_mask)
        batch_us.append((time.perf_counter() - start) * 1e6)
        assert torch.equal(loop_mask, batch_mask) and torch.equal(mask, loop_mask), "the masks differ"
        for r in range(rows):  # each row takes its next token; one that ends starts over
            at = len(outputs[r])
            if at == len(path) - 1:
                outputs[r], matchers[r] = [], Matcher(done)
                plain[r].reset()
            else:
                outputs[r].append(path[at])
                assert plain[r].accept_token(path[at])
    logits = torch.randn(rows, vocab, device=device)
    apply_ms = timed_apply(logits, mask, device)
    return {
        "case": kind,
        "rows": rows,
        "vocab": vocab,
        "compile_ms": compile_ms,
        "engine_us": statistics.median(engine_us),
        "loop_us": statistics.median(loop_us),
        "batch_us": statistics.median(batch_us),
        "apply_ms": apply_ms,
    }


def timed_apply(logits: torch.Tensor, mask: torch.Tensor, device: torch.device) -> float:
    """Median ms of copying the bitmask to ``device`` and applying it (as ``Sampler._adjust``)."""

    def once():
        on_device = mask.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else mask
        apply_mask(logits, on_device)

    once()  # warm-up
    return timed(once, device, calls=1, repeats=20)


def markdown(report: dict) -> str:
    lines = header("Structured outputs: compile and mask cost", report)
    lines += [
        f"- vocabulary: {report['vocab']} tokens (synthetic: bytes + standard-library words); "
        f"compiler set-up {report['setup_ms']:.0f} ms; batch matcher threads: auto "
        f"(half of {report['cpu_threads']} hardware threads)",
        "",
        "| case | rows | compile ms (cold) | engine µs/step | xgrammar loop µs/step | xgrammar batch µs/step "
        "| batch vs loop | apply ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['case']} | {r['rows']} | {r['compile_ms']:.1f} | {r['engine_us']:.0f} | {r['loop_us']:.0f} "
            f"| {r['batch_us']:.0f} | {r['loop_us'] / r['batch_us']:.1f}x | {r['apply_ms']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--vocab", type=int, default=152064, help="vocabulary size (Qwen's by default)")
    parser.add_argument("--steps", type=int, default=60, help="decode steps per case; the report gives medians")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--smoke", action="store_true", help="rows 1 and 3, vocab 2000 (checks the script)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.vocab, args.steps = [1, 3], 2000, 4
    require_positive(parser, args, "rows", "vocab", "steps")
    if args.vocab < 300:
        parser.error(f"--vocab {args.vocab}; allowed: 300 or more (the 256 bytes, then words)")
    device = resolve_device(args.device)
    info, vocab, eos, setup_ms = tokenizer_info(args.vocab)
    rows = []

    def make() -> dict:
        extra = {"vocab": vocab, "setup_ms": setup_ms, "cpu_threads": os.cpu_count()}
        return make_report(argv, "bench_structured", device, args, rows, **extra)

    for kind in CASES:
        for n in args.rows:
            rows.append(measure(kind, n, info, vocab, eos, device, args.steps))
            print(rows[-1], flush=True)
            report = make()  # after every row: a run stopped at a time limit keeps what it measured
            save(args.out, stem("structured", report), report, markdown(report))
    return publish(args.out, "structured", make(), markdown(make()))


if __name__ == "__main__":
    main()
