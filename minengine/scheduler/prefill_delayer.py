"""Prefill delayer: hold new prefills for a few passes so decode batches fill (SGLang-style).

Each scheduling pass, every worker negotiates exactly once, contributing four ints: whether it
could run a prefill, whether its KV usage is under the low watermark, its running batch size,
and the prefill batch it could admit. With several data-parallel workers they are all-gathered
on the CPU group; with one worker there is no collective.

The decision is a pure function of (previous state, gathered infos, config):

- status ``all`` (every worker could prefill): delay while ``max_running_requests - max(running)
  < max(max_prefill_bs)`` (the decode batches have not drained enough to admit a full prefill
  batch), except the first time after start, which is allowed (``no_wait``; as SGLang's
  ``skip_first_delayer``, a one-shot: on the first pass itself nothing runs, so the rule could
  never hold there); otherwise allow (``no_wait``, or ``wait_success`` after delays).
- status ``mixed``: allow at once if some worker's KV usage is under the watermark
  (``token_watermark``); otherwise delay.
- status ``none``: allow (nothing to hold).

A delay lasts at most ``max_delay_passes - 1`` passes, then the prefill is allowed
(``wait_timeout``), in ``all`` as in ``mixed``: no request waits forever. The state (delay count,
start time) is a frozen dataclass, replaced and never mutated.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass(frozen=True)
class DelayerConfig:
    max_running_requests: int
    max_delay_passes: int = 30
    token_usage_low_watermark: float | None = None


@dataclass(frozen=True)
class DelayState:
    delayed_count: int = 0
    start_time: float = field(default_factory=time.perf_counter)


class WorkerInfo(NamedTuple):
    prefillable: bool
    token_watermark_force_allow: bool
    running_bs: int
    max_prefill_bs: int


class Decision(NamedTuple):
    next_state: DelayState | None
    allow: bool
    reason: str  # "", "no_wait", "wait_success", "token_watermark", "wait_timeout", "delay"
    status: str  # "all", "mixed", "none"
    first_used: bool = False  # this decision spent the one delay skipped after start


def decide(prev: DelayState | None, infos: Sequence[WorkerInfo], cfg: DelayerConfig, first_pass: bool) -> Decision:
    """``first_pass``: the delay skipped after start is still unused (``first_used`` spends it)."""
    prefillable = [i.prefillable for i in infos]
    if not any(prefillable):
        return Decision(None, True, "", "none")
    if all(prefillable):
        drained = cfg.max_running_requests - max(i.running_bs for i in infos)
        if drained < max(i.max_prefill_bs for i in infos):
            if first_pass:
                return Decision(None, True, "no_wait", "all", first_used=True)
            return _delay_or_timeout(prev, cfg, "all")
        return Decision(None, True, "wait_success" if prev is not None else "no_wait", "all")
    if any(i.token_watermark_force_allow for i in infos):
        return Decision(None, True, "token_watermark", "mixed")
    return _delay_or_timeout(prev, cfg, "mixed")


def _delay_or_timeout(prev: DelayState | None, cfg: DelayerConfig, status: str) -> Decision:
    count = prev.delayed_count if prev is not None else 0
    if count >= cfg.max_delay_passes - 1:
        return Decision(None, True, "wait_timeout", status)
    state = DelayState(1) if prev is None else dataclasses.replace(prev, delayed_count=count + 1)
    return Decision(state, False, "delay", status)


class Outcome(NamedTuple):
    """One pass, for the metrics: the decision, whether a prefill ran, and a wait that ended."""

    allow: bool
    reason: str
    actual_prefill: bool
    waited_passes: int | None  # set when this pass ended a wait
    waited_seconds: float | None
    passes: int = 1  # how many such passes (a worker sends its idle passes as one count)

    @property
    def idle(self) -> bool:
        """A pass where no worker could prefill, and that ended no wait: only counted."""
        return self.reason == "" and not self.actual_prefill and self.waited_passes is None


class PrefillDelayer:
    """Holds the state across passes; ``begin_pass()`` gives the single-pass executor."""

    def __init__(self, cfg: DelayerConfig, gather: Callable[[WorkerInfo], list[WorkerInfo]] | None = None):
        self.cfg = cfg
        self.gather = gather or (lambda info: [info])  # one worker: no collective
        self.local = gather is None
        self.state: DelayState | None = None
        self.first_pass = True  # the first delay after start is skipped
        self.outcomes: list[Outcome] = []  # drained by whoever reports metrics

    def begin_pass(self) -> SinglePass:
        return SinglePass(self)

    def requests_left(self) -> None:
        """The worker's last request left between passes (aborted): a wait in progress ends now,
        as a pass with nothing to prefill would end it, instead of running on into the next
        request's first pass (its passes and idle seconds counted as a wait, its label
        ``wait_success``). One worker only: a data-parallel worker runs a pass every turn anyway, and
        a pass outside the turn would misalign the collectives."""
        if self.local and self.state is not None:
            self.begin_pass().finalize(actual_prefill=False)


class SinglePass:
    """Exactly one negotiation per pass on every worker: ``negotiate`` at most once, and
    ``finalize`` negotiates with ``prefillable=False`` if the pass did not, so collectives stay
    aligned across workers."""

    def __init__(self, delayer: PrefillDelayer):
        self._delayer = delayer
        self._decision: Decision | None = None
        self._prev: DelayState | None = None

    def negotiate(self, info: WorkerInfo) -> bool:
        if self._decision is None:
            d = self._delayer
            self._prev = d.state
            self._decision = decide(d.state, d.gather(info), d.cfg, d.first_pass)
            d.state = self._decision.next_state
            d.first_pass = d.first_pass and not self._decision.first_used
        return self._decision.allow

    def finalize(self, actual_prefill: bool) -> None:
        if self._decision is None:
            self.negotiate(WorkerInfo(False, False, 0, 0))
        decision, prev = self._decision, self._prev
        ended = prev is not None and decision.next_state is None
        self._delayer.outcomes.append(
            Outcome(
                decision.allow,
                decision.reason,
                actual_prefill,
                prev.delayed_count if ended else None,
                time.perf_counter() - prev.start_time if ended else None,
            )
        )
