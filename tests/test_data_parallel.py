"""Data parallelism: two scheduler workers behind one front end, with the prefill delayer."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from test_server import alive, children, metrics, run_cli, start_server, stop_server, wait_for


@pytest.fixture(scope="module")
def dp_server():
    flags = ["--dp-size", "2", "--page-size", "4", "--max-running-requests", "2"]
    flags += ["--enable-prefill-delayer", "--prefill-delayer-max-delay-passes", "3"]
    proc, url = start_server(*flags)
    yield proc, url
    stop_server(proc)


def test_two_workers_serve_and_split_the_load(dp_server):
    _, url = dp_server

    async def run():
        async with httpx.AsyncClient(timeout=120) as http:
            body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
            rs = await asyncio.gather(
                *(http.post(url + "/v1/completions", json={"prompt": f"p{i}", **body}) for i in range(10))
            )
            return [r.json() for r in rs]

    outs = asyncio.run(run())
    assert all(o["usage"]["completion_tokens"] == 6 for o in outs)
    m = metrics(url)
    assert m["minengine:kv_pages_total"] == 2 * 65536 // 4  # gauges sum over the workers
    assert m['minengine:request_success_total{finished_reason="length"}'] >= 10


def test_delayer_delays_and_times_out_across_workers(dp_server):
    """Long decodes fill the running batches; a burst of short prompts is held, then let in."""
    _, url = dp_server

    async def run():
        async with httpx.AsyncClient(timeout=120) as http:
            long = [
                http.post(url + "/v1/completions", json={"prompt": f"long {i}", "max_tokens": 40, "ignore_eos": True})
                for i in range(2)
            ]
            tasks = [asyncio.create_task(c) for c in long]
            await asyncio.sleep(0.5)
            short = [
                http.post(url + "/v1/completions", json={"prompt": f"s{i}", "max_tokens": 3, "ignore_eos": True})
                for i in range(6)
            ]
            # one short prompt alone: one worker can prefill, the other cannot ("mixed"), so it
            # waits the full delay (a burst could reach both workers in one pass: "all", which
            # lets it in as soon as the decodes leave room, and may never time out)
            first = await short[0]
            return [first.json()] + [r.json() for r in await asyncio.gather(*tasks, *short[1:])]

    outs = asyncio.run(run())
    assert all(o["choices"][0]["finish_reason"] == "length" for o in outs)  # every request completes
    m = metrics(url)
    key = 'minengine:prefill_delayer_outcomes_total{actual_execution="%s",output_allow="%s",output_reason="%s"}'
    assert m.get(key % ("false", "false", "delay"), 0) > 0
    assert m.get(key % ("true", "true", "wait_timeout"), 0) > 0
    assert m["minengine:prefill_delayer_wait_forward_passes_count"] > 0
    assert m["minengine:prefill_delayer_wait_seconds_sum"] > 0


def test_disconnects_free_kv_on_every_worker(dp_server):
    _, url = dp_server

    async def leave(http, i):
        body = {"prompt": f"x{i}", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    break

    async def run():
        async with httpx.AsyncClient(timeout=60) as http:
            await asyncio.gather(*(leave(http, i) for i in range(4)))

    asyncio.run(run())
    assert wait_for(
        lambda: (m := metrics(url))["minengine:num_requests_running"] == 0 and m["minengine:kv_pages_in_use"] == 0
    )


def test_a_dead_worker_is_noticed_while_another_is_busy(tmp_path):
    """One worker is killed while the other streams a long decode: the server must notice within a
    second or so (it used to check only when no worker sent anything for 0.5 s), fail the requests,
    end both streams, and exit with code 1 and the reason, its other worker too (as vLLM and
    SGLang exit when their engine dies)."""
    import os
    import signal
    import threading
    import time
    from pathlib import Path

    proc, url = start_server("--dp-size", "2", "--page-size", "4", log=tmp_path / "log")
    try:
        endings: list[str] = []
        started = threading.Semaphore(0)

        def stream(i: int) -> None:
            body = {"prompt": f"long {i}", "max_tokens": 3500, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                last = ""
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        started.release()
                    last = line or last
                endings.append(last)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]  # one per worker
        for t in threads:
            t.start()
        for _ in range(2):
            assert started.acquire(timeout=60)
        workers = [k for k in children(proc.pid) if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGKILL)
        killed = time.monotonic()
        for t in threads:
            t.join(20)
        assert not any(t.is_alive() for t in threads) and time.monotonic() - killed < 20
        assert endings == ["data: [DONE]", "data: [DONE]"]  # after an error event
        assert proc.wait(20) == 1 and "error: a scheduler process exited" in (tmp_path / "log").read_text()
        assert wait_for(lambda: not alive(workers[0]), 10)
    finally:
        stop_server(proc)


def test_dp_server_shuts_down_cleanly():
    proc, _ = start_server("--dp-size", "2", "--enable-prefill-delayer")
    kids = children(proc.pid)
    assert len(kids) >= 2
    stop_server(proc)
    assert proc.returncode == 0
    assert wait_for(lambda: not any(alive(k) for k in kids), 10)


def test_bad_dp_flags():
    import sys

    r = run_cli([sys.executable, "-m", "minengine.serve", "--dp-size", "0"], timeout=60)
    assert r.returncode == 2 and "argument --dp-size: dp_size is 0; allowed: an integer >= 1" in r.stderr


def test_requests_are_checked_against_the_smallest_worker_pool(tmp_path):
    """On GPUs each worker sizes its KV pool from its own free memory; the front end must check a
    request against the smallest, since any worker may get it."""
    import pickle

    import zmq

    from minengine.server.frontend import SchedulerClient
    from minengine.server.metrics import Metrics
    from minengine.server.protocol import Ready

    async def run():
        outputs = f"ipc://{tmp_path}/outputs"
        client = SchedulerClient([f"ipc://{tmp_path}/r0", f"ipc://{tmp_path}/r1"], outputs, Metrics())
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(outputs)
        for rank, capacity in ((0, 4096), (1, 1024)):
            push.send(pickle.dumps(Ready(vocab_size=260, context_length=4096, kv_capacity_tokens=capacity, rank=rank)))
        try:
            return await client.start(lambda: True, timeout=10)
        finally:
            client.close()
            push.close(linger=0)
            ctx.term()

    ready = asyncio.run(run())
    assert ready.kv_capacity_tokens == 1024 and ready.context_length == 4096


def test_gauges_a_worker_sent_before_the_others_were_ready_are_kept(tmp_path):
    """A worker that is ready first sends its gauges while the front end still waits for the
    others; an idle worker sends them only when they change, so they must not be dropped."""
    import pickle

    import zmq
    from prometheus_client import generate_latest

    from minengine.server.frontend import SchedulerClient
    from minengine.server.metrics import Metrics
    from minengine.server.protocol import Ready, StepOutput

    stats = {"kv_pages_total": 100, "kv_pages_in_use": 0}
    rank_stats = [stats, stats | {"kv_pages_total": 60}]

    async def run() -> str:
        m = Metrics()
        client = SchedulerClient([f"ipc://{tmp_path}/r0", f"ipc://{tmp_path}/r1"], f"ipc://{tmp_path}/out", m)
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(f"ipc://{tmp_path}/out")
        try:
            for rank in (0, 1):  # each worker: Ready, then its first step's gauges
                push.send(pickle.dumps(Ready(260, 4096, 4096, rank)))
                push.send(pickle.dumps(StepOutput(rank, [], rank_stats[rank])))
            await client.start(lambda: True, timeout=10)
            for _ in range(100):
                if client.stats[1]:
                    break
                await asyncio.sleep(0.01)
            return generate_latest(m.registry).decode()
        finally:
            client.close()
            push.close(0)
            ctx.term()

    text = asyncio.run(run())
    assert "minengine:kv_pages_total 160.0" in text, [line for line in text.splitlines() if "pages_total" in line]


def test_cpu_workers_split_the_cores(monkeypatch):
    """On CPU each of N workers takes 1/N of torch's threads (all of them each: 2 workers on 2
    cores decoded several times slower than one); OMP_NUM_THREADS, when set, is left to rule."""
    import torch

    from minengine.config import EngineConfig
    from minengine.server.scheduler_process import _share_cores

    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        torch.set_num_threads(4)
        _share_cores(EngineConfig.from_kwargs(device="cpu", dp_size=1))
        assert torch.get_num_threads() == 4
        _share_cores(EngineConfig.from_kwargs(device="cpu", dp_size=3))
        assert torch.get_num_threads() == 1
        torch.set_num_threads(4)
        monkeypatch.setenv("OMP_NUM_THREADS", "4")
        _share_cores(EngineConfig.from_kwargs(device="cpu", dp_size=2))
        assert torch.get_num_threads() == 4
        monkeypatch.delenv("OMP_NUM_THREADS")
        _share_cores(EngineConfig.from_kwargs(device="cpu", dp_size=2))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_lockstep_workers_are_quiet_when_idle_and_leave_together(tmp_path):
    """Two real workers with the delayer (a collective every pass), the test as their front end.
    Idle, they pass every 2 ms but send nothing: those passes are counted and go with the next
    output (a message each flooded the front end, and blocked on a full socket where nothing read).
    A Shutdown that reaches one worker first: it still runs that turn's pass, so the other is not
    left in the collective (it failed with a gloo error, and its aborts were lost); both abort what
    they hold, report it, and exit after the same pass. A request that reached the other worker
    before its own Shutdown is answered too (as aborted), not left for the front end to wait on."""
    import multiprocessing
    import os
    import pickle
    import time

    import zmq

    from minengine import SamplingParams
    from minengine.config import EngineConfig
    from minengine.server.protocol import AddRequest, Fatal, Ready, Shutdown
    from minengine.server.scheduler_process import rendezvous_store, run_scheduler

    cfg = EngineConfig(model="tiny", dp_size=2, enable_prefill_delayer=True, page_size=4)
    ctx = zmq.Context()
    requests = [f"ipc://{tmp_path}/r{i}" for i in range(2)]
    outboxes = []
    for addr in requests:
        outboxes.append(ctx.socket(zmq.PUSH))
        outboxes[-1].setsockopt(zmq.SNDTIMEO, 5000)  # a worker gone: zmq.Again, not a hang
        outboxes[-1].bind(addr)
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(f"ipc://{tmp_path}/out")
    store = rendezvous_store()
    port = store.port
    spawn = multiprocessing.get_context("spawn")
    procs = [
        spawn.Process(target=run_scheduler, args=(cfg, requests[i], f"ipc://{tmp_path}/out", os.getpid(), i, port))
        for i in range(2)
    ]
    for p in procs:
        p.start()
    try:

        def receive(seconds: float) -> list:
            got, end = [], time.monotonic() + seconds
            while time.monotonic() < end:
                if inbox.poll(50):
                    got.append(pickle.loads(inbox.recv()))
            return got

        ready = []
        while len(ready) < 2:
            assert inbox.poll(120_000), "the workers did not start"
            msg = pickle.loads(inbox.recv())
            assert not isinstance(msg, Fatal), msg.message
            ready += [msg] if isinstance(msg, Ready) else []
        receive(0.5)  # their first gauges
        assert len(receive(1.5)) <= 2  # idle: hundreds of passes each, no messages
        slow = SamplingParams(max_tokens=400, ignore_eos=True)
        for i, box in enumerate(outboxes):
            box.send(pickle.dumps(AddRequest(f"r{i}", [i + 1] * 8, slow)))
        counted = receive(0.5)
        passes = sum(o.passes for m in counted for o in m.delayer)
        assert passes > 20 and all(not o.idle or o.passes >= 1 for m in counted for o in m.delayer)
        outboxes[0].send(pickle.dumps(Shutdown()))
        time.sleep(0.2)  # worker 1 left with worker 0; what the front end sent it before its Shutdown:
        outboxes[1].send(pickle.dumps(AddRequest("late", [5] * 8, slow)))
        outboxes[1].send(pickle.dumps(Shutdown()))
        last = {}
        for msg in receive(10):
            assert not isinstance(msg, Fatal), msg.message
            last[msg.rank] = msg
        aborted = {u.rid for m in last.values() for u in m.updates if u.finish_reason == "abort"}
        assert aborted == {"r0", "r1", "late"}  # every request answered
        for p in procs:
            p.join(10)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        ctx.destroy(linger=0)
