"""Named ranges around the parts of an engine step: NVTX (for Nsight) on CUDA, and
``torch.profiler.record_function`` (for torch-profiler traces) everywhere; and the profiles a
running engine takes on request (a server's ``/start_profile``, ``LLM.start_profile``)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import time

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


@dataclasses.dataclass(frozen=True)
class ProfileSpec:
    """One profile, as a server's ``/start_profile`` or ``LLM.start_profile`` asks for it. ``name``
    is the traces' file stem, shared by the data-parallel workers (each adds its rank)."""

    output_dir: str | None  # None: CUDA_PROFILER alone writes no file
    name: str
    activities: tuple[str, ...] | None = None  # None: CPU, and GPU on a CUDA device
    num_steps: int | None = None  # stop after this many forward passes (None: at stop_profile)
    record_shapes: bool = False
    with_stack: bool = False

    def __post_init__(self):
        given = self.activities
        if given is not None and (not given or len(set(given)) != len(given) or not set(given) <= set(ACTIVITIES)):
            raise ValueError(
                f"activities is {list(given)}; allowed: a non-empty list of distinct names from {list(ACTIVITIES)}"
            )
        if self.num_steps is not None and not 1 <= self.num_steps <= MAX_PROFILE_STEPS:
            raise ValueError(f"num_steps is {self.num_steps}; allowed: 1..{MAX_PROFILE_STEPS}, or null (until stopped)")
        if self.output_dir is None and (given is None or {"CPU", "GPU"} & set(given)):
            shown = list(given) if given else "by default (CPU, and GPU on CUDA)"
            raise ValueError(f"activities {shown} write a trace file: an output directory is needed")


def new_profile_name() -> str:
    """A trace file stem that sorts by time: ``profile-20261125-031502-123``."""
    now = time.time()
    return f"profile-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}-{int(now * 1000) % 1000:03d}"


class StepProfiler:
    """One engine's profile: torch.profiler (with the step ranges above in its trace) and the CUDA
    profiler range, from ``start`` to ``stop`` or to the spec's ``num_steps`` forward passes. One
    at a time."""

    def __init__(self, device: torch.device, rank: int = 0):
        self.device, self.rank = device, rank
        self.spec: ProfileSpec | None = None
        self.path: str | None = None
        self._prof = None
        self._steps = 0

    @property
    def active(self) -> bool:
        return self.spec is not None

    def start(self, spec: ProfileSpec) -> str | None:
        """Start recording; the trace file ``stop`` will write (None: none). A ValueError names
        what is wrong (one running already, an activity this device has not, a file there)."""
        if self.spec is not None:
            raise ValueError(f"a profile is running already (its trace: {self.path}); stop it first")
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
        self.spec, self.path, self._prof, self._steps = spec, path, prof, 0
        logger.info("profiling %s%s", list(activities), f" into {path}" if path else "")
        return path

    def forward_pass(self) -> None:
        """After each forward pass: the stop at ``num_steps``."""
        if self.spec is None:
            return
        self._steps += 1
        if self.spec.num_steps is not None and self._steps >= self.spec.num_steps:
            try:
                self.stop()
            except Exception:  # (a full disk): the engine's step goes on; the log says why
                logger.exception("writing the profile of %d forward passes failed", self._steps)

    def stop(self) -> str | None:
        """Stop recording and write the trace; its path (None: no file). A ValueError when no
        profile runs."""
        if self.spec is None:
            raise ValueError("no profile is running; start one first")
        spec, path, prof, steps = self.spec, self.path, self._prof, self._steps
        self.spec, self.path, self._prof = None, None, None
        if "CUDA_PROFILER" in spec.activities:
            torch.cuda.synchronize(self.device)
            torch.cuda.profiler.stop()
        if prof is not None:
            prof.stop()
            prof.export_chrome_trace(path)
        logger.info("profile of %d forward passes written%s", steps, f" to {path}" if path else "")
        return path
