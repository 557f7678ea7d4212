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
