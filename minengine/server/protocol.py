"""Messages between the HTTP front end and the scheduler process (pickled over ZMQ)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from minengine.profiling import ProfileSpec
from minengine.sampling_params import SamplingParams
from minengine.scheduler.prefill_delayer import Outcome


@dataclass(frozen=True)
class Bootstrap:
    """Where a disaggregated request's KV comes from: the prefill server's bootstrap endpoint and
    the room id that pairs the two halves of the request."""

    host: str
    port: int
    room: int


@dataclass(frozen=True)
class AddRequest:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams  # stop strings are the front end's: it makes the text
    bootstrap: Bootstrap | None = None  # set on prefill and decode servers


# a prefill server's reason for a request whose decode server ended the pairing (it rejected
# the request, its client went away, or it failed): that server's answer is the one to give, so
# the prefill server answers 499, as to a client that went away (a router waits for the decode half)
DECODE_ABORTED = "aborted by the decode server"


@dataclass(frozen=True)
class FailRoom:
    """The front end rejected a disaggregated request: tell the other server at once."""

    bootstrap: Bootstrap
    reason: str


@dataclass(frozen=True)
class AbortRequest:
    rid: str


@dataclass(frozen=True)
class StartProfile:
    spec: ProfileSpec
    call: int = 0  # the front end's number for the call, which each ProfileReply repeats


@dataclass(frozen=True)
class StopProfile:
    call: int = 0
    discard: bool = False  # (a start that failed on another worker: no trace)


@dataclass(frozen=True)
class ProfileReply:
    """A worker's answer to StartProfile / StopProfile: the trace file it writes or wrote (None:
    none), or why not (``error``; ``user_error``: a request that cannot be taken, else a failure
    such as a folder that cannot be written). A stop is answered once its trace is written."""

    rank: int
    call: int
    path: str | None = None
    error: str | None = None
    user_error: bool = True


@dataclass(frozen=True)
class Shutdown:
    """Abort everything, report it, exit."""


@dataclass(frozen=True)
class Ready:
    vocab_size: int
    context_length: int
    kv_capacity_tokens: int
    rank: int = 0
    eos_token_ids: frozenset[int] = frozenset()  # what ``min_tokens`` holds back (request checks)


# ``new_record(TokenUpdate, fields)``, every field given: as in scheduler/policy.py, the fast way to
# make the records a scheduler sends (and its front end receives) per running request every step
new_record = tuple.__new__


# NOTE: a NamedTuple, not a frozen dataclass: a scheduler makes one per running request every step
# (about 3x cheaper to build).
class TokenUpdate(NamedTuple):
    rid: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" when this ends the request
    cached_tokens: int = 0  # prompt tokens served by the prefix cache (sent with the first update)
    error: str | None = None  # why an aborted request failed (KV transfer, rejection by the peer)
    logprobs: list | None = None  # one ``TokenLogprobs`` per new token, when the request asked for them
    # with the first update of a request that asked for them: one ``TokenLogprobs`` per prompt token
    # from the second on
    prompt_logprobs: list | None = None


@dataclass(frozen=True)
class StepOutput:
    """One scheduler pass's results. Pickled by columns (``__reduce__``): request ids and new
    tokens as two lists, the rarer fields only for the updates that have them, about 6x cheaper for
    the scheduler to send than one pickled object per update."""

    rank: int  # the data-parallel worker it comes from
    updates: list[TokenUpdate]
    stats: dict[str, int] = field(default_factory=dict)
    delayer: list[Outcome] = field(default_factory=list)  # prefill-delayer passes since the last output
    kv_received: list[tuple[int, int, float]] = field(default_factory=list)  # decode: (pages, bytes, seconds)
    kv_pages_sent: int = 0  # prefill: pages sent since the last output

    def __reduce__(self):
        ups = self.updates
        extra = [
            (i, u[2:])
            for i, u in enumerate(ups)
            if u[2] is not None or u[3] or u[4] is not None or u[5] is not None or u[6] is not None
        ]
        columns = ([u[0] for u in ups], [u[1] for u in ups], extra)
        return _step_output, (self.rank, columns, self.stats, self.delayer, self.kv_received, self.kv_pages_sent)


def _step_output(rank: int, columns: tuple, *rest) -> StepOutput:
    rids, tokens, extra = columns
    updates = [
        new_record(TokenUpdate, (rid, ids, None, 0, None, None, None)) for rid, ids in zip(rids, tokens, strict=True)
    ]
    for i, fields in extra:
        updates[i] = TokenUpdate(rids[i], tokens[i], *fields)
    return StepOutput(rank, updates, *rest)


@dataclass(frozen=True)
class Fatal:
    message: str
    rank: int = 0
