"""A scheduler worker process: owns an engine, runs steps, never touches HTTP or text.

It pulls ``AddRequest`` / ``AbortRequest`` / ``Shutdown`` from the front end, drains them before
every step (so an abort lands before the next forward), runs one engine step and pushes the new
tokens and the gauges back. It exits when the front end's process dies.

With ``dp_size > 1`` the workers form a ``torch.distributed`` group (gloo, CPU), used by the
prefill delayer's all_gather; with the delayer on, every worker runs a pass every loop turn,
busy or idle, so each pass negotiates exactly once on every worker.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import os
import pickle
import signal
import traceback

import torch
import zmq

from minengine.config import EngineConfig
from minengine.engine import Engine
from minengine.request import Request
from minengine.scheduler.prefill_delayer import WorkerInfo
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
LOCKSTEP_POLL_MS = 2


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM us when the parent exits (the getppid check in the loop backs it up)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _all_gather(info: WorkerInfo) -> list[WorkerInfo]:
    mine = torch.tensor([int(v) for v in info], dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(everyone, mine)
    return [WorkerInfo(bool(t[0]), bool(t[1]), int(t[2]), int(t[3])) for t in everyone]


def run_scheduler(
    config: EngineConfig,
    requests_addr: str,
    outputs_addr: str,
    parent_pid: int,
    rank: int = 0,
    dist_addr: str | None = None,
) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the front end, which shuts us down
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(requests_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(outputs_addr)
    try:
        gather = None
        if config.dp_size > 1:
            timeout = datetime.timedelta(seconds=60)
            torch.distributed.init_process_group(
                "gloo", init_method=dist_addr, rank=rank, world_size=config.dp_size, timeout=timeout
            )
            gather = _all_gather
        if config.device != "cpu" and torch.cuda.is_available():
            torch.cuda.set_device(config.base_gpu_id + rank)
        engine = Engine(config, detokenize=False, gather=gather)
        ready = Ready(engine.model_config.vocab_size, engine.context_length, engine.kv_capacity_tokens, rank)
        outbox.send_pyobj(ready)
        _loop(engine, inbox, outbox, parent_pid, rank, lockstep=gather is not None and engine.delayer is not None)
    except Exception:
        logger.exception("scheduler %d failed", rank)
        outbox.send_pyobj(Fatal(traceback.format_exc(limit=5), rank))
    finally:
        outbox.close(linger=1000)
        inbox.close(linger=0)
        ctx.term()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _loop(engine: Engine, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int, rank: int, lockstep: bool) -> None:
    live: dict[str, Request] = {}
    while os.getppid() == parent_pid:
        updates: list[TokenUpdate] = []
        busy = engine.has_unfinished()
        timeout = 0 if busy else LOCKSTEP_POLL_MS if lockstep else IDLE_POLL_MS
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
                outbox.send_pyobj(StepOutput(rank, updates, engine.stats()))
                return
        if engine.has_unfinished() or lockstep:
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
            outbox.send_pyobj(StepOutput(rank, updates, engine.stats(), outcomes))
