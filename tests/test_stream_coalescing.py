"""A front end that falls behind merges what is already waiting: the token updates queued for one
request become one piece (one detokenizer call), and the pieces queued for one choice become one
stream chunk. Nothing is lost, reordered or merged across requests; errors and ends still end
the stream where they arrive. (No scheduler: updates are queued by hand.)"""

from __future__ import annotations

import asyncio

import pytest

from minengine.models.tiny import tiny_tokenizer
from minengine.sampling_params import SamplingParams
from minengine.server import api
from minengine.server.frontend import Piece, RequestFailed, SchedulerDied, generate
from minengine.server.metrics import Metrics
from minengine.server.protocol import Fatal, TokenUpdate

TOK = tiny_tokenizer()
IDS = TOK.encode("héllo wörld, streaming 東京 🚀 text", add_special_tokens=False)


class QueuedClient:
    """``submit`` returns a queue already holding ``items``; aborts are recorded. No ``Ready``: no
    end tokens but the tokenizer's EOS."""

    ready = None

    def __init__(self, items):
        self.items, self.aborted = items, []

    def submit(self, rid, prompt_ids, params, bootstrap):
        queue = asyncio.Queue()
        for item in self.items:
            queue.put_nowait(item)
        return queue

    def abort(self, rid):
        self.aborted.append(rid)

    def release(self, rid):
        pass


def run(items, **params):
    """(pieces, the exception that ended the stream or None, client, metrics)."""
    client, metrics = QueuedClient(items), Metrics()

    async def consume():
        pieces = []
        try:
            async for piece in generate(client, TOK, metrics, "r", [1, 2], SamplingParams(**params)):
                pieces.append(piece)
        except (RequestFailed, SchedulerDied) as exc:
            return pieces, exc
        return pieces, None

    pieces, exc = asyncio.run(consume())
    return pieces, exc, client, metrics


def updates(ids, finish="length"):
    """One update per token: the first reports 7 cached prompt tokens, the last ends the request."""
    last = len(ids) - 1
    return [TokenUpdate("r", [t], finish if i == last else None, 7 if i == 0 else 0) for i, t in enumerate(ids)]


def test_waiting_updates_become_one_piece():
    pieces, exc, _, metrics = run(updates(IDS), max_tokens=len(IDS))
    assert exc is None and len(pieces) == 1
    (piece,) = pieces
    assert piece.token_ids == IDS and piece.text == TOK.decode(IDS) and piece.finish_reason == "length"
    assert piece.cached_tokens == 7
    assert metrics.generation_tokens._value.get() == len(IDS)
    assert metrics.itl._sum.get() >= 0 and sum(b.get() for b in metrics.itl._buckets) == len(IDS) - 1


@pytest.mark.parametrize("after", ["length", None, "abort"])
def test_stop_string_inside_a_merged_batch_ends_it_there(after):
    """The updates of a batch count as if they came one by one: the stream ends at the update that
    completes the stop string, with reason "stop" and only the tokens up to it (the scheduler went
    on, and is aborted); what was queued after it (more tokens, the end, an abort) is not output."""
    text, stop = TOK.decode(IDS), "wörld"
    k = next(k for k in range(1, len(IDS) + 1) if stop in TOK.decode(IDS[:k]))
    items = updates(IDS, "length" if after == "length" else None)
    if after == "abort":
        items.append(TokenUpdate("r", [], "abort"))
    pieces, exc, client, metrics = run(items, max_tokens=99, stop=[stop])
    assert exc is None and "".join(p.text for p in pieces) == text[: text.find(stop)]
    assert [t for p in pieces for t in p.token_ids] == IDS[:k]
    assert pieces[-1].finish_reason == "stop" and client.aborted == ["r"]
    assert metrics.generation_tokens._value.get() == k


def test_abort_after_tokens_is_its_own_update():
    pieces, exc, _, metrics = run(updates(IDS[:4], None) + [TokenUpdate("r", [], "abort")], max_tokens=99)
    assert exc is None and [p.finish_reason for p in pieces] == [None, "abort"]
    assert pieces[0].token_ids == IDS[:4] and pieces[1].token_ids == []
    assert sum(b.get() for b in metrics.itl._buckets) == 3  # one per token after the first


@pytest.mark.parametrize("kind", ["error", "fatal"])
def test_tokens_before_an_error_are_yielded_first(kind):
    items = updates(IDS[:5], finish=None)
    items.append(TokenUpdate("r", [], "abort", error="peer gone") if kind == "error" else Fatal("scheduler died"))
    pieces, exc, _, _ = run(items, max_tokens=50)
    assert [t for p in pieces for t in p.token_ids] == IDS[:5]
    assert isinstance(exc, RequestFailed if kind == "error" else SchedulerDied)


def test_stream_merges_waiting_pieces_of_one_choice_only():
    queue = asyncio.Queue()
    for item in [(0, Piece("b", [2])), (0, Piece("c", [3], "stop")), (0, Piece("never", [9]))]:
        queue.put_nowait(item)
    merged, held = api._merge_waiting(0, Piece("a", [1], cached_tokens=4), queue)
    assert (merged.text, merged.token_ids, merged.finish_reason, merged.cached_tokens) == ("abc", [1, 2, 3], "stop", 4)
    assert held is None and queue.qsize() == 1  # nothing past the end is taken
    queue = asyncio.Queue()
    for item in [(0, Piece("b", [2])), (1, Piece("x", [5])), (0, Piece("c", [3]))]:
        queue.put_nowait(item)
    merged, held = api._merge_waiting(0, Piece("a", [1]), queue)
    assert merged.text == "ab" and held[0] == 1 and held[1].text == "x"
    assert queue.qsize() == 1  # choice 0's "c" stays queued, after choice 1's piece


def test_step_output_round_trips_through_its_column_pickle():
    import pickle

    from minengine.server.protocol import StepOutput

    updates = [
        TokenUpdate("a", [5]),
        TokenUpdate("b", [6, 7], "length", 12),
        TokenUpdate("c", [], "abort", error="peer gone"),
        TokenUpdate("d", [8], cached_tokens=3),
    ]
    out = StepOutput(2, updates, {"num_requests_running": 3}, [], [(4, 1024, 0.5)], 7)
    back = pickle.loads(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
    assert back == out and all(isinstance(u, TokenUpdate) for u in back.updates)
    assert pickle.loads(pickle.dumps(StepOutput(0, []))) == StepOutput(0, [])
