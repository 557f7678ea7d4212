"""Start, watch and stop the data-parallel scheduler worker processes (server and offline LLM)."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import socket
import tempfile

from minengine.config import EngineConfig
from minengine.server.frontend import SchedulerClient
from minengine.server.metrics import Metrics
from minengine.server.scheduler_process import IPC_DIR_PREFIX, run_scheduler


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Workers:
    """``config.dp_size`` scheduler processes (one model replica and KV pool each) and the client
    that talks to them. Create the client's sockets (``client``) before awaiting ``start``."""

    def __init__(self, config: EngineConfig, metrics: Metrics):
        self.ipc_dir = tempfile.mkdtemp(prefix=IPC_DIR_PREFIX)
        requests = [f"ipc://{self.ipc_dir}/requests-{i}" for i in range(config.dp_size)]
        outputs = f"ipc://{self.ipc_dir}/outputs"
        self.client = SchedulerClient(requests, outputs, metrics, config.load_balance_method)
        dist_addr = f"tcp://127.0.0.1:{free_port()}" if config.dp_size > 1 else None
        spawn = multiprocessing.get_context("spawn")
        self.processes = [
            spawn.Process(
                target=run_scheduler,
                args=(config, requests[i], outputs, os.getpid(), i, dist_addr),
                daemon=True,
                name=f"scheduler-{i}",
            )
            for i in range(config.dp_size)
        ]
        for p in self.processes:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    async def start(self):
        return await self.client.start(self.alive)

    def stop(self) -> None:
        """Wait for the workers to exit (after a Shutdown), then make sure they did."""
        for p in self.processes:
            p.join(5)
        for p in self.processes:
            if p.is_alive():
                p.terminate()
                p.join(2)
            if p.is_alive():
                p.kill()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
