"""The scheduler process: owns the engine, runs steps, never touches HTTP or text.

It pulls ``AddRequest`` / ``AbortRequest`` / ``Shutdown`` from the front end, drains them before
every step (so an abort lands before the next forward), runs one engine step and pushes the new
tokens and the gauges back. It exits when the front end's process dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pickle
import signal
import traceback

import zmq

from minengine.config import EngineConfig
from minengine.engine import Engine
from minengine.request import Request
from minengine.server.protocol import (
    AbortRequest,
    AddRequest,
    Fatal,
    Ready,
    Shutdown,
    StepOutput,
    TokenUpdate,
)

logger = logging.getLogger(__name__)
IDLE_POLL_MS = 50


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM us when the parent exits (the getppid check in the loop backs it up)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def run_scheduler(config: EngineConfig, requests_addr: str, outputs_addr: str, parent_pid: int) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the front end, which shuts us down
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(requests_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(outputs_addr)
    try:
        engine = Engine(config, detokenize=False)
        outbox.send_pyobj(Ready(engine.model_config.vocab_size, engine.context_length, engine.kv_capacity_tokens))
        _loop(engine, inbox, outbox, parent_pid)
    except Exception:
        logger.exception("scheduler failed")
        outbox.send_pyobj(Fatal(traceback.format_exc(limit=5)))
    finally:
        outbox.close(linger=1000)
        inbox.close(linger=0)
        ctx.term()


def _loop(engine: Engine, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int) -> None:
    live: dict[str, Request] = {}
    while os.getppid() == parent_pid:
        updates: list[TokenUpdate] = []
        timeout = 0 if engine.has_unfinished() else IDLE_POLL_MS
        while inbox.poll(timeout):
            timeout = 0
            msg = pickle.loads(inbox.recv())
            if isinstance(msg, AddRequest):
                live[msg.rid] = engine.add_request(msg.prompt_ids, msg.params)
            elif isinstance(msg, AbortRequest):
                if (req := live.pop(msg.rid, None)) is not None:
                    engine.abort(req)
                    updates.append(TokenUpdate(msg.rid, [], "abort"))
            elif isinstance(msg, Shutdown):
                for rid, req in live.items():
                    engine.abort(req)
                    updates.append(TokenUpdate(rid, [], "abort"))
                outbox.send_pyobj(StepOutput(updates, engine.stats()))
                return
        if engine.has_unfinished():
            rids = {id(req): rid for rid, req in live.items()}
            for req in engine.step():
                rid = rids[id(req)]
                first = len(req.output_ids) == 1
                updates.append(
                    TokenUpdate(rid, [req.token_ids[-1]], req.finish_reason, req.cached_tokens if first else 0)
                )
                if req.finished:
                    del live[rid]
        outcomes = engine.drain_delayer_outcomes()
        if updates or outcomes:
            outbox.send_pyobj(StepOutput(updates, engine.stats(), outcomes))
