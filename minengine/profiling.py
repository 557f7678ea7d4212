"""Named ranges around the parts of an engine step: NVTX (for Nsight) on CUDA, and
``torch.profiler.record_function`` (for torch-profiler traces) everywhere; and the profiles a
running engine takes on request (a server's ``/start_profile``, ``LLM.start_profile``)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gzip
import logging
import os
import shutil
import threading
import time
import weakref
from concurrent import futures

import torch

logger = logging.getLogger(__name__)


@functools.cache
def _nvtx() -> bool:
    return torch.cuda.is_available()


@contextlib.contextmanager
def step_range(name: str):
    if _nvtx():
        torch.cuda.nvtx.range_push(name)
    try:
        with torch.profiler.record_function(name):
            yield
    finally:
        if _nvtx():
            torch.cuda.nvtx.range_pop()


# what a profile records, as SGLang's /start_profile names them: "CPU" and "GPU" (torch.profiler's
# host and CUDA activities, in a Chrome trace), "CUDA_PROFILER" (cudaProfilerStart / Stop: the range
# that ``nsys profile --capture-range=cudaProfilerApi`` records)
ACTIVITIES = ("CPU", "GPU", "CUDA_PROFILER")
MAX_PROFILE_STEPS = 1_000_000


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class ProfileSpec:
    """One profile, as a server's ``/start_profile`` or ``LLM.start_profile`` asks for it. ``name``
    is the traces' file stem, shared by the data-parallel workers (each adds its rank)."""

    output_dir: str | None  # None: CUDA_PROFILER alone writes no file
    name: str
    activities: tuple[str, ...] | None = None  # None: CPU, and GPU on a CUDA device
    num_steps: int | None = None  # each worker stops after this many of its forward passes (None: at stop)
    record_shapes: bool = False
    with_stack: bool = True  # (SGLang's and vLLM's default)

    def __post_init__(self):
        given = self.activities
        if given is not None and (
            not isinstance(given, tuple)
            or not given
            or not all(isinstance(a, str) for a in given)
            or len(set(given)) != len(given)
            or not set(given) <= set(ACTIVITIES)
        ):
            shown = list(given) if isinstance(given, tuple) else repr(given)
            raise ValueError(
                f"activities is {shown}; allowed: a non-empty list of distinct names from {list(ACTIVITIES)}"
            )
        if self.num_steps is not None and not (_is_int(self.num_steps) and 1 <= self.num_steps <= MAX_PROFILE_STEPS):
            raise ValueError(
                f"num_steps is {self.num_steps!r}; allowed: an integer 1..{MAX_PROFILE_STEPS}, or null (until stopped)"
            )
        for name in ("record_shapes", "with_stack"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} is {getattr(self, name)!r}; allowed: true or false")
        if self.output_dir is None and (given is None or {"CPU", "GPU"} & set(given)):
            shown = list(given) if given else "by default (CPU, and GPU on CUDA)"
            raise ValueError(f"activities {shown} write a trace file: an output directory is needed")


def new_profile_name() -> str:
    """A trace file stem that sorts by time: ``profile-20261125-031502-123``."""
    now = time.time()
    return f"profile-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}-{int(now * 1000) % 1000:03d}"


def _done(value) -> futures.Future:
    f: futures.Future = futures.Future()
    f.set_result(value)
    return f


class StepProfiler:
    """One engine's profile: torch.profiler (with the step ranges above in its trace) and the CUDA
    profiler range, from ``start`` to ``stop`` or to the spec's ``num_steps`` forward passes. One
    at a time. A trace is written in a thread of its own (the engine's loop goes on meanwhile: a
    long trace takes seconds), under a temporary name and then renamed, so a trace file that exists
    is whole. It records the thread that started it (where an offline ``LLM`` must generate)."""

    def __init__(self, device: torch.device, rank: int = 0):
        self.device, self.rank = device, rank
        self.spec: ProfileSpec | None = None
        self.path: str | None = None
        self._prof = None
        self._steps = 0
        self._ended: futures.Future | None = None  # the write of a profile num_steps ended, not yet claimed
        self._writes: dict[futures.Future, str] = {}  # the traces being written, by their writes
        self._writer: futures.ThreadPoolExecutor | None = None
        self._abandon = None  # stops a running torch.profiler if this object goes without stop()
        self._thread: int | None = None  # the thread that started it: torch.profiler records that one

    @property
    def active(self) -> bool:
        return self.spec is not None

    def start(self, spec: ProfileSpec) -> str | None:
        """Start recording; the trace file ``stop`` will write (None: none). A ValueError names
        what is wrong (one running already, an activity this device has not, a file there)."""
        if self.spec is not None:
            raise ValueError(f"a profile is running already (its trace: {self.path}); stop it first")
        if torch.autograd._profiler_enabled():  # (a second one would end the first: no trace, or a crash)
            raise ValueError("another torch.profiler is running in this process; allowed: one at a time")
        if writing := [path for f, path in list(self._writes.items()) if not f.done()]:
            # (a profile would record the writer thread's work: a trace with stacks, ten times the events)
            raise ValueError(
                f"the last profile's trace is still being written ({', '.join(writing)}); start again once it is "
                "(its stop answers then)"
            )
        cuda = self.device.type == "cuda"
        activities = spec.activities or (("CPU", "GPU") if cuda else ("CPU",))
        if not cuda and ("GPU" in activities or "CUDA_PROFILER" in activities):
            raise ValueError(
                f"activities is {list(activities)}, but this engine runs on {self.device.type}; allowed here: ['CPU']"
            )
        spec = dataclasses.replace(spec, activities=activities)
        path = prof = None
        if "CPU" in activities or "GPU" in activities:
            path = os.path.join(spec.output_dir, f"{spec.name}-rank{self.rank}.trace.json.gz")
            if os.path.exists(path):
                raise ValueError(f"the trace {path} exists already; allowed: a new name")
            os.makedirs(spec.output_dir, exist_ok=True)
            kinds = [torch.profiler.ProfilerActivity.CPU] if "CPU" in activities else []
            if "GPU" in activities:
                kinds.append(torch.profiler.ProfilerActivity.CUDA)
            # (not acc_events=True, which would silence torch's warning that a profile keeps one cycle
            # (it has one): its events are then parsed at stop, which failed on a stack's bytes)
            prof = torch.profiler.profile(
                activities=kinds, record_shapes=spec.record_shapes, with_stack=spec.with_stack
            )
            prof.start()
        if "CUDA_PROFILER" in activities:
            try:
                torch.cuda.synchronize(self.device)  # (the range starts with the work that follows)
                torch.cuda.profiler.start()
            except BaseException:
                if prof is not None:
                    prof.stop()
                raise
        self.spec, self.path, self._prof, self._steps, self._ended = spec, path, prof, 0, None
        self._thread = threading.get_ident()
        self._abandon = None if prof is None else weakref.finalize(self, _abandon, prof)
        logger.info("profiling %s%s", list(activities), f" into {path}" if path else "")
        return path

    def forward_pass(self) -> None:
        """After each forward pass: the stop at ``num_steps`` (passes of another thread than the
        one that started it are not recorded, nor counted)."""
        if self.spec is None or threading.get_ident() != self._thread:
            return
        self._steps += 1
        if self.spec.num_steps is not None and self._steps >= self.spec.num_steps:
            steps = self._steps
            try:
                self._ended = self.stop()
            except Exception:  # (the engine's step goes on; the log says why)
                logger.exception("stopping the profile of %d forward passes failed", steps)
                return
            self._ended.add_done_callback(lambda f: _log_write(f, steps))

    def stop(self, discard: bool = False) -> futures.Future:
        """Stop recording now; the trace is written in the background. The future's result is the
        trace's path (None: no file, or ``discard``), its exception why none was written. After a
        profile that ``num_steps`` ended, the write of that one. A ValueError when none runs."""
        if self.spec is None:
            if self._ended is not None and not discard:
                ended, self._ended = self._ended, None
                return ended
            raise ValueError("no profile is running; start one first")
        if threading.get_ident() != self._thread:  # (torch's profiler state is the starting thread's)
            raise ValueError(
                "the profile was started on another thread; allowed: stop it on that thread (where an offline "
                "LLM records, and generates)"
            )
        spec, path, prof = self.spec, self.path, self._prof
        self.spec, self.path, self._prof = None, None, None
        if self._abandon is not None:
            self._abandon.detach()
            self._abandon = None
        if "CUDA_PROFILER" in spec.activities or "GPU" in spec.activities:
            torch.cuda.synchronize(self.device)  # (the kernels of the last pass, still running with overlap)
        if "CUDA_PROFILER" in spec.activities:
            torch.cuda.profiler.stop()
        if prof is None or discard:
            if prof is not None:
                prof.stop()
            return _done(None)
        if not torch.autograd._profiler_enabled():
            # another torch.profiler in this process started and ended since: it took the session
            # over, and torch would crash on writing this one
            raise ValueError("another torch.profiler in this process ended this profile; it has no trace")
        prof.stop()
        if self._writer is None:
            self._writer = futures.ThreadPoolExecutor(1, thread_name_prefix="minengine-profile")
        write = self._writer.submit(_write_trace, prof, path)
        self._writes[write] = path
        write.add_done_callback(lambda f: self._writes.pop(f, None))
        return write

    def wait_for_writes(self, timeout: float | None = None) -> None:
        """Wait (up to ``timeout`` s) for the traces being written (their failures are the stops')."""
        futures.wait(list(self._writes), timeout)

    def close(self, timeout: float | None = None) -> None:
        """Stop a running profile, then wait (up to ``timeout`` s) for the traces being written."""
        writes = set(self._writes)
        if self.spec is not None:
            try:
                writes.add(self.stop())
            except Exception:
                logger.exception("stopping the running profile failed")
        done, pending = futures.wait(writes, timeout)
        for f in done:
            if f.exception() is not None:
                logger.error("writing a profile failed: %s", f.exception())
        if pending:
            logger.warning("%d profile trace(s) still being written after %s s", len(pending), timeout)
        if self._writer is not None:
            self._writer.shutdown(wait=False)  # (its thread ends once what is left is written)
            self._writer = None


def _abandon(prof) -> None:
    with contextlib.suppress(Exception):
        prof.stop()


def _write_trace(prof, path: str) -> str:
    """The Chrome trace, gzipped, under a temporary name in the same folder, then renamed. torch
    writes the JSON (holding the GIL); gzip here, in 1 MiB pieces, mostly without it (torch's own
    ``.gz`` path makes a Python call per line: 4.0 s against 0.6 s for 200k events with stacks)."""
    folder, name = os.path.split(path)
    raw = os.path.join(folder, f".{name[: -len('.gz')]}.partial")
    partial = raw + ".gz"
    try:
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(partial, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(partial)
        raise
    finally:
        with contextlib.suppress(OSError):
            os.remove(raw)
    return path


def _log_write(f: futures.Future, steps: int) -> None:
    if f.exception() is not None:
        logger.error("writing the profile of %d forward passes failed: %s", steps, f.exception())
    else:
        logger.info("profile of %d forward passes written to %s", steps, f.result())
