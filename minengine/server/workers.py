"""Start, watch and stop the data-parallel scheduler worker processes (server and offline LLM)."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import socket
import tempfile
import time

import zmq

from minengine.config import EngineConfig
from minengine.server.frontend import SchedulerClient
from minengine.server.metrics import Metrics
from minengine.server.scheduler_process import IPC_DIR_PREFIX, rendezvous_store, run_scheduler


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ipc_folder(dp_size: int) -> str:
    """A new folder for the front end's ZMQ sockets: in the temporary folder (``TMPDIR``) when its
    socket paths fit the system's limit on them (``zmq.IPC_PATH_MAX_LEN``: 107 characters on
    Linux), else in /tmp or /var/tmp, as Python's multiprocessing picks a folder for its sockets."""
    limit = getattr(zmq, "IPC_PATH_MAX_LEN", 0) or 103  # (103: macOS's, the smallest)
    # <base>/<prefix><mkdtemp's 8 random characters>/requests-<rank>, the longest path in it
    tail = len(f"/{IPC_DIR_PREFIX}xxxxxxxx/requests-{dp_size - 1}")
    base = tempfile.gettempdir()
    for folder in (base, "/tmp", "/var/tmp"):
        if len(os.path.abspath(folder)) + tail <= limit and os.access(folder, os.W_OK | os.X_OK):
            return tempfile.mkdtemp(prefix=IPC_DIR_PREFIX, dir=folder)
    raise ValueError(
        f"no folder for the scheduler's sockets: the temporary folder {base!r} is {len(base)} characters long, "
        f"and a socket path may have at most {limit} characters ({limit - tail} for the folder), and /tmp and "
        "/var/tmp are not writable: set TMPDIR to a shorter writable folder"
    )


class Workers:
    """``config.dp_size`` scheduler processes (one model replica and KV pool each) and the client
    that talks to them. Create the client's sockets (``client``) before awaiting ``start``."""

    def __init__(self, config: EngineConfig, metrics: Metrics):
        self.ipc_dir = ipc_folder(config.dp_size)
        self.processes: list = []
        self._hurry = False  # set by ``hurry``
        self.client = None
        self._store = None  # the workers' rendezvous store (dp > 1), served here while they run
        try:
            requests = [f"ipc://{self.ipc_dir}/requests-{i}" for i in range(config.dp_size)]
            outputs = f"ipc://{self.ipc_dir}/outputs"
            self.client = SchedulerClient(requests, outputs, metrics, config.load_balance_method)
            if config.dp_size > 1:
                self._store = rendezvous_store()
            dist_port = self._store.port if self._store is not None else None
            spawn = multiprocessing.get_context("spawn")
            for i in range(config.dp_size):
                p = spawn.Process(
                    target=run_scheduler,
                    args=(config, requests[i], outputs, os.getpid(), i, dist_port),
                    daemon=True,
                    name=f"scheduler-{i}",
                )
                p.start()  # (raises in a spawned child that re-runs an unguarded script, ...)
                self.processes.append(p)
        except BaseException:  # the workers started so far, the sockets and the folder go
            self._hurry = True
            if self.client is not None:
                self.client.close()
            self.stop()
            raise

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    async def start(self):
        return await self.client.start(self.alive)

    def hurry(self) -> None:
        """Make a ``stop`` under way terminate the workers now (safe in a signal handler)."""
        self._hurry = True

    def stop(self, grace: float = 5.0) -> None:
        """Wait up to ``grace`` seconds for the workers to exit (after a Shutdown; a worker still
        loading the model reads none), then make sure they did. The folder of sockets goes in
        any case. After a worker died (or failed) the others heard no Shutdown: no wait."""
        if self.client is not None and self.client.dead is not None:
            grace = 0.0
        try:
            deadline = time.monotonic() + grace
            for p in self.processes:
                while p.is_alive() and not self._hurry and time.monotonic() < deadline:
                    p.join(0.05)
            for p in self.processes:
                if p.is_alive():
                    p.terminate()  # its handler waits ORPHAN_WAIT_S for a reparent, then exits
                    p.join(2)
                if p.is_alive():
                    p.kill()
        finally:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            self._store = None
