"""Test set-up: Triton's interpreter on CPU-only machines, GPU tests skipped without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

# Must happen before anything imports triton_kernels: @triton.jit reads it at decoration time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


@pytest.hookimpl(trylast=True)  # after -k / -m deselected: the canary runs for the tests that run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        if not config.option.collectonly:
            canary_guard(items)
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# On a GPU, the CUDA attention kernels that the selected kernel tests launch run once first in a
# child process (benchmarks/canary.py). An illegal address is a sticky CUDA error: a broken kernel
# would fail every test after its own in this process, and a hang would hold the run. A test of a
# kernel that faulted, hung or was wrong there fails at set-up with that reason, without launching
# it. The tests: test_cuda_kernels.py's on its `dev` fixture (its `impl` param; without one, `cuda`'s),
# test_backend_logits.py's `backend` param, and test_paged_attention.py's `kernels` param `cuda`;
# engine tests that reach the kernel through a model are not guarded. (MINENGINE_TEST_CANARY=0
# turns this off.)
_CANARY = pytest.StashKey[tuple[str, str]]()


def cuda_backend_of(item: pytest.Item) -> str | None:
    """The CUDA attention backend a test launches, as canary.py names it (None: none, or not known)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if item.path.name == "test_paged_attention.py":  # (store_kv and the gather: other kernels)
        return "cuda" if params.get("kernels") == "cuda" else None
    if item.path.name == "test_backend_logits.py":  # (its `impl` tests are the emulator's)
        backend = params.get("backend")
        return backend if isinstance(backend, str) and backend.startswith("cuda") else None
    if item.path.name == "test_cuda_kernels.py" and "dev" in item.fixturenames:  # (the others launch nothing)
        impl = params.get("impl", "auto")
        return "cuda" if impl == "auto" else f"cuda-{impl}"
    return None


def canary_guard(items: list[pytest.Item], run=None) -> dict[str, str]:
    """Runs the canary for the tests' CUDA backends and marks the tests of those that failed it
    (not of those whose calls were refused: their tests skip or check the refusal)."""
    import sys
    from pathlib import Path

    from minengine.ops import cuda

    wanted = sorted({b for item in items if (b := cuda_backend_of(item))})
    if not wanted or os.environ.get("MINENGINE_TEST_CANARY") == "0" or (run is None and not cuda.available()):
        return {}
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import canary
    finally:
        sys.path.pop(0)
    failures = canary.failed((run or canary.run_canary)(wanted), refused=False)
    for item in items:
        if (backend := cuda_backend_of(item)) in failures:
            item.stash[_CANARY] = (backend, failures[backend])
    return failures


def pytest_runtest_setup(item: pytest.Item) -> None:
    if (failed := item.stash.get(_CANARY, None)) is not None:
        backend, why = failed
        pytest.fail(f"not launched: {backend} failed its canary run (benchmarks/canary.py): {why}", pytrace=False)


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """On a GPU, free what a test left behind (an LLM's KV pool takes most of the device) before
    the next test sizes its own."""
    yield
    if HAS_CUDA:
        import gc

        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def batches_as_prepare_reads_them(monkeypatch):
    """Every batch the engine prepares, in every test: prefill chunks first, then decodes of one
    token each, the last sampled (``ModelRunner.prepare`` builds decode inputs on that without
    looking; the engine does not pay for the check)."""
    from minengine.runner import ModelRunner

    real = ModelRunner.prepare

    def prepare(self, batch):
        prefilling = [req.prefilling for req, _ in batch]
        assert prefilling == sorted(prefilling, reverse=True), "prefill chunks come first"
        for req, n in batch:
            assert req.prefilling or (n == 1 and req.num_computed + 1 == req.num_tokens), (req.rid, n)
        return real(self, batch)

    monkeypatch.setattr(ModelRunner, "prepare", prepare)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture
def kv_checked_steps(monkeypatch):
    """Assert after every engine step: pages = free + held by requests + held only by the cache, and
    each running request's page-table row holds its pages.

    Yields the list of per-step accounting dicts (with the waiting-queue length added).
    """
    from minengine.engine import Engine

    real_step = Engine.step
    steps = []

    def step(self):
        done = real_step(self)
        acc = self.scheduler.accounting()
        assert acc["free"] + acc["held_by_requests"] + acc["held_only_by_cache"] == acc["total"], acc
        sched = self.scheduler
        shared = {p for r in sched.running for p in r.pages[: r.cached_pages]}
        assert len(shared) == (sched.cache.protected_pages if sched.cache else 0)  # what accounting() relies on
        table = sched.page_table
        for r in sched.running:  # each request's row of the page table (with the writes queued) is its pages
            row = table.table[r.slot, : len(r.pages)].tolist()
            for (slot, col), page in table._pending.items():
                if slot == r.slot and col < len(row):
                    row[col] = page
            assert row == r.pages, (r.rid, row, r.pages)
        steps.append(acc | {"waiting": len(self.scheduler.waiting)})
        return done

    monkeypatch.setattr(Engine, "step", step)
    return steps


# The contract tests run against every kernel backend: the same parametrization for all.
# "cuda-emu" is the cuda backend's kernels compiled for the CPU and run by the warp-level emulator
# (minengine/ops/cuda_emulator.py): it covers csrc/ where there is no GPU.
KERNEL_BACKENDS = [
    pytest.param("triton", id="triton"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
    pytest.param("cuda-emu", id="cuda-emu"),
]


def use_cuda_emulator() -> None:
    """Route CPU tensors of the cuda backend through the emulator, or skip the test."""
    from minengine.ops import cuda, cuda_emulator

    if HAS_CUDA:
        pytest.skip("a GPU is present: the cuda params run the real kernels")
    reason = cuda_emulator.unavailable_reason()
    if reason:
        pytest.skip(f"the CUDA kernel emulator cannot be built: {reason}")
    cuda.use_emulator()


@pytest.fixture(params=KERNEL_BACKENDS)
def kernels(request):
    """The backend's KernelSet (paged_attention, store_kv, gather_input_ids)."""
    from minengine import ops

    if request.param == "cuda":
        from minengine.ops import cuda

        if not cuda.available():
            pytest.skip("the cuda backend needs minengine._C (built with nvcc) and a CUDA GPU")
    if request.param == "cuda-emu":
        from minengine.ops import cuda

        use_cuda_emulator()
        yield ops.get_kernels("cuda", "cpu")
        cuda.use_emulator(False)
        return
    yield ops.get_kernels(request.param, "cuda" if HAS_CUDA else "cpu")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random-weight Qwen3 checkpoint, one per test module (a module may define its own)."""
    from checkpoints import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    """``checkpoint`` in transformers, in float64: the reference."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def server():
    """A server of the tiny model (``test_server.start_server``), one per test module."""
    from test_server import start_server, stop_server

    proc, url = start_server("--page-size", "4")
    yield url
    stop_server(proc)


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
