"""A scheduler worker process: owns an engine, runs steps, never touches HTTP or text.

It pulls ``AddRequest`` / ``AbortRequest`` / ``Shutdown`` (and a profile's start and stop) from
the front end, drains them before every step (so an abort lands before the next forward), runs one
engine step and pushes the new tokens and the gauges back. It exits when the front end's process dies.

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
import shutil
import signal
import time
import traceback
from concurrent import futures

import torch
import zmq

from minengine.config import EngineConfig
from minengine.engine import Engine, resolve_device
from minengine.request import Request
from minengine.scheduler.prefill_delayer import Outcome, WorkerInfo
from minengine.server.protocol import (
    AbortRequest,
    AddRequest,
    FailRoom,
    Fatal,
    ProfileReply,
    Ready,
    Shutdown,
    StartProfile,
    StepOutput,
    StopProfile,
    TokenUpdate,
    new_record,
)

logger = logging.getLogger(__name__)
IDLE_POLL_MS = 50
LOCKSTEP_POLL_MS = 2
# data-parallel workers: the longest one may start (load, capture graphs) after another, as long as
# the front end waits for them (SchedulerClient.start); and the longest a pass's collective waits
STARTUP_TIMEOUT = datetime.timedelta(seconds=600)
PASS_TIMEOUT = datetime.timedelta(seconds=60)
LATE_SECONDS = 1.0  # after a peer's Shutdown, how long a worker waits for its own (and what came before)
PENDING_POLL_MS = 1
PROFILE_POLL_MS = 10  # while a trace is being written: how soon its stop is answered


IPC_DIR_PREFIX = "minengine-ipc-"  # the front end's folder of ZMQ sockets (server/workers.py)
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # minengine/
ORPHAN_WAIT_S = 0.5  # what a SIGTERM waits for a dying parent (a live one's terminate() waits as long)


def _remove_orphaned_ipc_dir(requests_addr: str, parent_pid: int) -> None:
    """The front end removes its IPC folder when it stops; when it died without stopping (SIGKILL,
    the OOM killer), the workers it leaves behind remove it. Nothing is removed while it lives."""
    if os.getppid() == parent_pid or not requests_addr.startswith("ipc://"):
        return
    folder = os.path.dirname(requests_addr[len("ipc://") :])
    if os.path.basename(folder).startswith(IPC_DIR_PREFIX):
        shutil.rmtree(folder, ignore_errors=True)


def _die_with_parent(requests_addr: str, parent_pid: int) -> None:
    """Ask Linux to SIGTERM us when the parent exits (the getppid check in the loop backs it up).
    That SIGTERM first removes the IPC folder a dead parent left, then ends us as before."""

    def on_sigterm(signum, frame):
        # the signal comes when the parent's thread that started us exits; its other threads (a
        # SIGKILL ends them all) may still be going, and until they are, getppid() is the parent's
        deadline = time.monotonic() + ORPHAN_WAIT_S
        while os.getppid() == parent_pid and time.monotonic() < deadline:
            time.sleep(0.005)
        _remove_orphaned_ipc_dir(requests_addr, parent_pid)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _ours(exc: Exception) -> bool:
    """A ValueError or OSError raised by minengine's own code: a message written for the user (what
    is wrong, what is allowed), not a library's, which keeps its traceback in the log."""
    tb = exc.__traceback__
    if not isinstance(exc, (ValueError, OSError)) or tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    where = os.path.dirname(tb.tb_frame.f_code.co_filename)
    return where == PACKAGE_DIR or where.startswith(PACKAGE_DIR + os.sep)


class Lockstep:
    """The data-parallel workers' all_gather of the prefill delayer's four ints (one per pass on
    every worker), with a fifth: whether this worker is stopping. A worker that reads its Shutdown
    still runs that turn's pass, so the others are not left in the collective, and every worker
    leaves after the first pass in which one was stopping: all after the same pass."""

    def __init__(self, group=None):
        self.group = group  # the workers' group with the pass timeout (None: the default group)
        self.stopping = False
        self.peer_stopping = False

    def __call__(self, info: WorkerInfo) -> list[WorkerInfo]:
        mine = torch.tensor([*(int(v) for v in info), int(self.stopping)], dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(everyone, mine, group=self.group)
        self.peer_stopping = any(bool(t[4]) for t in everyone)
        return [WorkerInfo(bool(t[0]), bool(t[1]), int(t[2]), int(t[3])) for t in everyone]


def _share_cores(config: EngineConfig) -> None:
    """On CPU, data-parallel workers split torch's threads (one per physical core by default)
    between them: each taking them all, they contend for the cores (2 workers on 2 cores decoded
    4 x 300 tokens in 3.2-4.2 s, against 0.42 s split). ``OMP_NUM_THREADS`` set by the user wins."""
    if config.dp_size > 1 and resolve_device(config.device).type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, torch.get_num_threads() // config.dp_size))


def rendezvous_store() -> torch.distributed.TCPStore:
    """The data-parallel workers' rendezvous store, served by the process that starts them on a
    port the system picks as it binds (``.port``): a port found free first and bound later by a
    worker could be taken in between (a CI run's dp-2 start once failed with EADDRINUSE)."""
    return torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def run_scheduler(
    config: EngineConfig,
    requests_addr: str,
    outputs_addr: str,
    parent_pid: int,
    rank: int = 0,
    dist_port: int | None = None,
) -> None:
    _die_with_parent(requests_addr, parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the front end, which shuts us down
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(requests_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(outputs_addr)
    engine = driver = None
    started = False  # Ready sent
    try:
        gather = None
        if config.dp_size > 1:
            # the default group waits as long as a start may take (its barrier below); the passes'
            # collectives run on a group of their own with a short timeout, which finds a stuck peer
            # (the rendezvous_store the parent serves on dist_port)
            store = torch.distributed.TCPStore("127.0.0.1", dist_port, is_master=False, timeout=STARTUP_TIMEOUT)
            torch.distributed.init_process_group(
                "gloo", store=store, rank=rank, world_size=config.dp_size, timeout=STARTUP_TIMEOUT
            )
            gather = Lockstep(torch.distributed.new_group(backend="gloo", timeout=PASS_TIMEOUT))
        if config.device != "cpu" and torch.cuda.is_available():
            torch.cuda.set_device(config.base_gpu_id + rank)
        _share_cores(config)
        engine = Engine(config, detokenize=False, gather=gather, rank=rank)
        # before Ready: a disaggregation driver binds its bootstrap port and starts its transfer
        # agent, and a failure there (a port in use) must end the start-up, not the serving
        driver = make_driver(engine)
        if gather is not None:
            # every worker loaded (and captured its CUDA graphs) before the first pass's collective:
            # one slower by more than the pass timeout would otherwise time the others out
            torch.distributed.barrier()
        ready = Ready(
            engine.model_config.vocab_size,
            engine.context_length,
            engine.kv_capacity_tokens,
            rank,
            frozenset(engine.eos_token_ids),
        )
        outbox.send_pyobj(ready)
        started = True
        _serve(engine, driver, inbox, outbox, parent_pid, rank, lockstep=gather if engine.delayer is not None else None)
    except Exception as exc:
        if not started and _ours(exc):
            # a config the model cannot take (context_length over its max_position_embeddings): the
            # message names the value and the allowed range, and the front end reports it
            logger.debug("scheduler %d failed to start", rank, exc_info=True)
            outbox.send_pyobj(Fatal(str(exc), rank))
        else:
            logger.exception("scheduler %d failed", rank)
            outbox.send_pyobj(Fatal(traceback.format_exc(limit=5), rank))
    finally:
        if engine is not None:  # (shutdown, or a failure) a running profile is written, and those being written
            engine.profiler.close()
        if driver is not None:
            try:
                driver.close()
            except Exception:  # (a transfer agent's own error): the rest below must still run
                logger.exception("scheduler %d: closing its disaggregation driver failed", rank)
        outbox.close(linger=1000)
        inbox.close(linger=0)
        ctx.term()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        _remove_orphaned_ipc_dir(requests_addr, parent_pid)


class LocalDriver:
    """A server that runs whole requests itself (``disaggregation_mode`` null)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.live: dict[str, Request] = {}

    def add(self, msg: AddRequest) -> list[TokenUpdate]:
        try:
            self.live[msg.rid] = self.engine.add_request(msg.prompt_ids, msg.params)
        except ValueError as exc:  # the front end checks requests first; this one still fails alone
            return [TokenUpdate(msg.rid, [], "abort", error=f"rejected by the scheduler: {exc}")]
        return []

    def abort(self, rid: str) -> list[TokenUpdate]:
        if (req := self.live.pop(rid, None)) is None:
            return []
        self.engine.abort(req)
        return [TokenUpdate(rid, [], "abort")]

    def abort_all(self) -> list[TokenUpdate]:
        return [u for rid in list(self.live) for u in self.abort(rid)]

    def fail_room(self, msg: FailRoom) -> None:
        pass

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def pending(self) -> bool:
        """Waiting on something outside the engine (a KV transfer): poll often."""
        return False

    def queued(self) -> int:
        """Requests the driver holds outside the engine's queues (disaggregation)."""
        return 0

    def sockets(self) -> list[zmq.Socket]:
        """Sockets whose messages need a pass (a disaggregation peer's), beside the front end's."""
        return []

    def step(self) -> list[TokenUpdate]:
        return engine_updates(self.engine, self.live)

    def drain_transfer_stats(self) -> tuple[list, int]:
        return [], 0

    def close(self) -> None:
        pass


def engine_updates(engine: Engine, live: dict[str, Request]) -> list[TokenUpdate]:
    """Run one engine pass; a token update for every request that got a token."""
    rids = {id(req): rid for rid, req in live.items()}
    updates = []
    for req in engine.step():
        rid = rids[id(req)]
        first = len(req.token_ids) == len(req.prompt_ids) + 1  # its first output token
        cached = req.cached_tokens if first else 0
        logprobs = prompt_logprobs = None
        if req.output_logprobs is not None:  # sent once: the front end keeps them, not the scheduler
            logprobs, req.output_logprobs = req.output_logprobs, []
        if first and req.prompt_logprobs is not None:  # complete once the first token is sampled
            prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, []
        record = (rid, [req.token_ids[-1]], req.finish_reason, cached, None, logprobs, prompt_logprobs)
        updates.append(new_record(TokenUpdate, record))
        if req.finished:
            del live[rid]
    return updates


def _until_shutdown(inbox: zmq.Socket, driver, seconds: float = LATE_SECONDS) -> list[TokenUpdate]:
    """After a peer's Shutdown: what the front end sent this worker before its own Shutdown (at
    most ``seconds`` of waiting for it). A request it will not run is answered as aborted, so the
    front end does not wait for it."""
    updates: list[TokenUpdate] = []
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0 and inbox.poll(int(left * 1000) + 1):
        msg = pickle.loads(inbox.recv())
        if isinstance(msg, Shutdown):
            break
        if isinstance(msg, AddRequest):
            updates.append(TokenUpdate(msg.rid, [], "abort"))
        elif isinstance(msg, AbortRequest):
            updates += driver.abort(msg.rid)
    return updates


def profile_reply(engine: Engine, msg: StartProfile | StopProfile, rank: int) -> futures.Future:
    """Start or stop the engine's profile; the answer for the front end, done at once for a start
    and once the trace is written for a stop. A profile that fails (torch.profiler's error, a
    folder that cannot be written) is reported, never the worker's end."""
    answer: futures.Future = futures.Future()
    try:
        if isinstance(msg, StartProfile):
            answer.set_result(ProfileReply(rank, msg.call, engine.profiler.start(msg.spec)))
            return answer
        written = engine.profiler.stop(discard=msg.discard)
    except Exception as exc:
        if isinstance(exc, ValueError) and _ours(exc):  # (what the request asked cannot be done)
            answer.set_result(ProfileReply(rank, msg.call, error=str(exc)))
            return answer
        logger.exception("scheduler %d: %s failed", rank, type(msg).__name__)
        answer.set_result(ProfileReply(rank, msg.call, error=f"{type(exc).__name__}: {exc}", user_error=False))
        return answer

    def reply(f: futures.Future) -> None:
        if (exc := f.exception()) is None:
            answer.set_result(ProfileReply(rank, msg.call, f.result()))
        else:
            error = f"writing the trace failed: {type(exc).__name__}: {exc}"
            answer.set_result(ProfileReply(rank, msg.call, error=error, user_error=False))

    written.add_done_callback(reply)
    return answer


def make_driver(engine: Engine):
    mode = engine.config.disaggregation_mode
    if mode == "null":
        return LocalDriver(engine)
    from minengine.disagg.servers import DecodeDriver, PrefillDriver

    return (PrefillDriver if mode == "prefill" else DecodeDriver)(engine)


def _serve(
    engine: Engine, driver, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int, rank: int, lockstep: Lockstep | None
):
    """The worker's loop. With ``lockstep`` (data-parallel workers with the prefill delayer) every
    turn runs a pass, busy or not, since each pass joins the workers' collective."""
    last_stats: dict[str, int] = {}
    outcomes: list[Outcome] = []  # the delayer's passes not sent yet
    idle_passes = 0  # passes where no worker could prefill: counted, and sent with the next output
    poller, watched = zmq.Poller(), set()
    poller.register(inbox, zmq.POLLIN)
    profiling: list[futures.Future] = []  # answers to profile calls, sent once done (a stop: its trace written)
    while os.getppid() == parent_pid:
        updates: list[TokenUpdate] = []
        current = set(driver.sockets())  # a peer's message wakes an idle loop too
        for sock in current - watched:
            poller.register(sock, zmq.POLLIN)
        for sock in watched - current:  # closed by the driver (an idle connection)
            poller.unregister(sock)
        watched = current
        if driver.has_work():
            timeout = 0
        else:
            idle_ms = IDLE_POLL_MS if lockstep is None else LOCKSTEP_POLL_MS
            timeout = PENDING_POLL_MS if driver.pending() else idle_ms
            if profiling:
                timeout = min(timeout, PROFILE_POLL_MS)
        poller.poll(timeout)
        shutdown = False
        while inbox.poll(0):
            msg = pickle.loads(inbox.recv())
            if isinstance(msg, AddRequest):
                updates += driver.add(msg)
            elif isinstance(msg, AbortRequest):
                updates += driver.abort(msg.rid)
            elif isinstance(msg, FailRoom):
                driver.fail_room(msg)
            elif isinstance(msg, (StartProfile, StopProfile)):
                profiling.append(profile_reply(engine, msg, rank))
            elif isinstance(msg, Shutdown):
                updates += driver.abort_all()
                shutdown = True
                break
        if lockstep is not None:  # this turn's pass still runs: the others are in its collective
            lockstep.stopping = lockstep.stopping or shutdown
            updates += driver.step()
        elif not shutdown and (driver.has_work() or driver.pending() or watched):  # a peer may have written
            updates += driver.step()
        stopping = shutdown if lockstep is None else lockstep.peer_stopping
        if stopping and not shutdown:  # a peer read its Shutdown a turn before this worker
            updates += _until_shutdown(inbox, driver)
            updates += driver.abort_all()
        while profiling and profiling[0].done():  # (in the order the calls came)
            outbox.send_pyobj(profiling.pop(0).result())
        for outcome in engine.drain_delayer_outcomes():  # (the aborts may have ended a wait)
            if outcome.idle:
                idle_passes += 1
            else:
                outcomes.append(outcome)
        received, sent = driver.drain_transfer_stats()
        stats = engine.stats()
        stats["num_requests_waiting"] += driver.queued()  # the gauge counts every request not yet running
        # gauges also move without tokens; idle passes alone send nothing (an idle lockstep worker
        # passes every 2 ms: a message each would flood the front end, or block on a full socket
        # where nothing reads, as between an offline LLM's calls)
        if updates or outcomes or received or sent or stats != last_stats or stopping:
            if idle_passes:
                outcomes.append(Outcome(True, "", False, None, None, passes=idle_passes))
            outbox.send_pyobj(StepOutput(rank, updates, stats, outcomes, received, sent))
            last_stats, outcomes, idle_passes = stats, [], 0
        if stopping:  # every worker leaves after this same pass
            return
