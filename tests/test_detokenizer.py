"""Incremental detokenization: same text as a full decode; stop strings never leak."""

from __future__ import annotations

import random

import pytest

from minengine.detokenizer import _PENDING, IncrementalDetokenizer
from minengine.models.tiny import tiny_tokenizer
from minengine.tokenizer import Tokenizer

TOK = tiny_tokenizer()
PIECES = TOK.encode("héllo wörld 東京 🚀 ok", add_special_tokens=False)


def random_ids(rng: random.Random) -> list[int]:
    # real multi-byte characters, lone bytes (invalid UTF-8) and special tokens, in any order,
    # and now and then a run of one of them (invalid bytes or special tokens, for a while)
    ids = []
    while len(ids) < 100 and rng.random() > 0.05:
        ids += [rng.choice([rng.randrange(260), *PIECES])] * (rng.randrange(1, 80) if rng.random() < 0.1 else 1)
    return ids or [rng.randrange(260)]


def test_pieces_join_to_the_full_decode():
    rng = random.Random()
    for _ in range(300):
        ids = random_ids(rng)
        d = IncrementalDetokenizer(TOK)
        pieces = [d.add([t]) for t in ids] + [d.finish()]
        assert "".join(pieces) == TOK.decode(ids) == d.text


def test_special_tokens_are_in_the_text_when_not_skipped():
    """skip_special_tokens=False: the same pieces-join-to-the-full-decode rule, special tokens in;
    stop strings find them too."""
    rng = random.Random()
    for _ in range(200):
        ids = random_ids(rng)
        d = IncrementalDetokenizer(TOK, skip_special_tokens=False)
        pieces = [d.add(ids[i : i + 3]) for i in range(0, len(ids), 3)] + [d.finish()]
        assert "".join(pieces) == TOK.decode(ids, skip_special_tokens=False) == d.text
    ids = TOK.encode("ab", add_special_tokens=False) + [258, *TOK.encode("cd", add_special_tokens=False)]
    assert IncrementalDetokenizer(TOK).add(ids) == "abcd"
    d = IncrementalDetokenizer(TOK, stop=("start|>",), skip_special_tokens=False)
    assert d.add(ids) + d.finish() == "ab<|im_" and d.stop_string == "start|>"


def test_multibyte_character_waits_until_complete():
    d = IncrementalDetokenizer(TOK)
    emoji = list("🚀".encode())
    assert [d.add([b]) for b in emoji[:-1]] == ["", "", ""]
    assert d.add([emoji[-1]]) == "🚀"


@pytest.mark.parametrize("stop", ["lo w", "ö", "🚀 o"])
def test_stop_string_cuts_and_never_leaks(stop):
    text = "héllo wörld 東京 🚀 ok"
    final = text[: text.find(stop)]
    d = IncrementalDetokenizer(TOK, (stop, "never-there"))
    out = ""
    for t in TOK.encode(text, add_special_tokens=False):
        out += d.add([t])
        assert final.startswith(out)  # nothing handed out is ever taken back
    out += d.finish()
    assert d.stopped and out == final and d.stop_string == stop


def test_the_first_stop_string_to_appear_is_the_one_reported():
    d = IncrementalDetokenizer(TOK, ("wörld", "lo"))
    d.add(TOK.encode("héllo wörld", add_special_tokens=False))
    assert d.stopped and d.text == "hél" and d.stop_string == "lo"


def test_hold_back_is_released_at_finish():
    d = IncrementalDetokenizer(TOK, ("xyz",))
    streamed = "".join(d.add([t]) for t in TOK.encode("abcdef", add_special_tokens=False))
    assert streamed == "abcd"  # the last 2 characters could start "xyz"
    assert d.finish() == "ef" and not d.stopped


@pytest.mark.parametrize("skip", [True, False], ids=["skip-special", "keep-special"])
@pytest.mark.parametrize("run", [[0x83], [0xE6, 0x9D], [256, 258], [0xF0, 0x9F, 0x9A]])
def test_work_per_token_stays_bounded(run, skip):
    # invalid bytes (lone, or a character's start without its end) and special tokens, for ever:
    # each decode call sees a short window, not the whole output so far
    class Counting:
        special_ids, seen = TOK.special_ids, []

        def decode(self, ids, skip_special_tokens=True):
            self.seen.append(len(ids))
            return TOK.decode(ids, skip_special_tokens=skip_special_tokens)

    tok = Counting()
    ids = PIECES + run * 1000 + PIECES
    d = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    streamed = "".join(d.add([t]) for t in ids) + d.finish()
    assert streamed == TOK.decode(ids, skip_special_tokens=skip)
    assert max(tok.seen) <= 2 * (_PENDING + len(PIECES)) < len(ids) / 5


def sentencepiece_tokenizer() -> Tokenizer:
    """Llama-2 / Mistral style: "▁" for spaces, byte fallback, a decoder that strips the leading space."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    merges = []
    for word in ["▁Paris", "▁is"]:
        for i in range(1, len(word)):
            for piece in (word[:i], word[i]):
                vocab.setdefault(piece, len(vocab))
            merges.append((word[:i], word[i]))
            vocab.setdefault(word[: i + 1], len(vocab))
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    return Tokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>"}, None)


def test_first_output_token_keeps_its_leading_space():
    """A SentencePiece decoder strips the first decoded token's space: the prompt's tail is decoded
    ahead of the output (as vLLM does), so prompt text + output text is the decode of both."""
    tok = sentencepiece_tokenizer()
    prompt = tok.encode("Paris is")
    out = tok.encode("Paris 東", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, (), prompt)
    text = "".join([d.add([t]) for t in out] + [d.finish()])
    assert text == " Paris 東" == tok.decode(prompt + out)[len(tok.decode(prompt)) :]


def test_chat_templates_render_as_transformers_renders_them(tmp_path):
    """{% break %} (loopcontrols), a tojson that does not HTML-escape, template variables."""
    import json

    template = (
        "{%- for m in messages %}{%- if m.role == 'user' %}{%- break %}{%- endif %}{%- endfor %}"
        "{%- for m in messages %}{{ m.role }}:{{ m.content | tojson }};{%- endfor %}"
        "{%- if enable_thinking is defined and not enable_thinking %}nothink{%- endif %}"
        "{%- if tools is not none %}tools{%- endif %}"
    )
    tiny_tokenizer().backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = Tokenizer.from_dir(tmp_path)
    text = tok.apply_chat_template([{"role": "user", "content": "<a & 'b'>"}], enable_thinking=False)
    assert text == """user:"<a & 'b'>";nothink"""


def test_load_chat_template_takes_a_file_or_the_text_as_vllm(tmp_path):
    """vLLM's --chat-template: a file's path, or the template itself (however long), its escapes
    decoded; anything else, or a template that does not parse, is a ValueError naming why."""
    from minengine.tokenizer import load_chat_template

    file = tmp_path / "chat.jinja"
    file.write_text("{{ messages[0].content }}\\n東")
    assert load_chat_template(str(file)) == "{{ messages[0].content }}\\n東"  # a file's text as it is
    inline = "{{ messages[0].content }}" + "x" * 300 + "\\n東é"  # longer than a file name may be
    assert load_chat_template(inline) == inline[:-4] + "\n東é"
    for bad, why in (
        ("chat.jinja", "is no file, nor a template"),
        ("{% if %}", "the template does not parse"),
        ("{{ x }}\\x4", "broken backslash escape"),
        ("{% for x in y %}" * 40 + "{% endfor %}" * 40, "the template does not parse"),
    ):
        with pytest.raises(ValueError, match=why):
            load_chat_template(bad)


def _with_post_processor(processor) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    backend = HFTokenizer.from_str(TOK.backend.to_str())
    backend.post_processor = processor
    return Tokenizer(backend, TOK.special_tokens, None)


def _old_truncation(tok: Tokenizer, text: str, keep: int, special: bool) -> tuple[list[int], bool]:
    """What ``encode_truncated`` must equal: the backend's own left truncation, then its post-processor."""
    encoding = tok.backend.encode(text, add_special_tokens=False)
    added = tok.backend.num_special_tokens_to_add(False) if special else 0
    cut = len(encoding.ids) + added > keep
    if cut:
        encoding.truncate(max(keep - added, 0), direction="left")
    return tok.backend.post_process(encoding, add_special_tokens=special).ids, cut


@pytest.mark.parametrize("processor", ["bos", "bos and eos", "none", "byte level", "not a plain wrap"])
def test_left_truncation_keeps_the_special_tokens_and_the_last_ones(processor):
    """``encode_truncated`` cuts a text's tokens itself, between the post-processor's special ones
    (``Encoding.truncate`` keeps the cut tokens as pieces that post_process then goes over: 11 s
    for a 12 MB prompt, holding the GIL); the same ids as truncating with the backend, for any
    post-processor, and as ``encode`` when nothing is cut."""
    from tokenizers import processors

    made = {
        "bos": lambda: TOK,
        "bos and eos": lambda: _with_post_processor(
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A <|end_of_text|>",
                special_tokens=[("<|begin_of_text|>", 256), ("<|end_of_text|>", 257)],
            )
        ),
        "none": lambda: _with_post_processor(None),
        "byte level": lambda: _with_post_processor(processors.ByteLevel()),  # (adds nothing: offsets only)
    }
    tok = made.get(processor, made["bos and eos"])()
    if processor == "not a plain wrap":  # (as if the probe found the text's tokens changed: the backend truncates)
        tok._ends = None
    rng = random.Random()
    for _ in range(200):
        text = "".join(rng.choice(["a", "b ", "é", "東", "🚀", "<|end_of_text|>"]) for _ in range(rng.randrange(12)))
        keep, special = rng.randrange(1, 12), rng.random() < 0.7
        want = _old_truncation(tok, text, keep, special)
        assert tok.encode_truncated(text, keep, special) == want, (text, keep, special)
        assert tok.encode(text, special, truncate_left=keep) == want[0]
        if not want[1]:
            assert want[0] == tok.encode(text, special)
    long = "hello world " * 2000  # (through encode_batch, which lets go of the GIL)
    assert tok.encode_truncated(long, 9) == _old_truncation(tok, long, 9, True)
    assert tok.encode(long) == tok.backend.encode(long).ids
