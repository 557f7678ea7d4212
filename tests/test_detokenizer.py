"""Incremental detokenization: same text as a full decode; stop strings never leak."""

from __future__ import annotations

import random

import pytest

from minengine.detokenizer import _PENDING, IncrementalDetokenizer
from minengine.models.tiny import tiny_tokenizer

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


@pytest.mark.parametrize("run", [[0x83], [0xE6, 0x9D], [256, 258], [0xF0, 0x9F, 0x9A]])
def test_work_per_token_stays_bounded(run):
    # invalid bytes (lone, or a character's start without its end) and special tokens, for ever:
    # each decode call sees a short window, not the whole output so far
    class Counting:
        special_ids, seen = TOK.special_ids, []

        def decode(self, ids):
            self.seen.append(len(ids))
            return TOK.decode(ids)

    tok = Counting()
    ids = PIECES + run * 1000 + PIECES
    d = IncrementalDetokenizer(tok)
    streamed = "".join(d.add([t]) for t in ids) + d.finish()
    assert streamed == TOK.decode(ids)
    assert max(tok.seen) <= 2 * (_PENDING + len(PIECES)) < len(ids) / 5
