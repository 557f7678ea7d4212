"""Each of our attention backends launched once on small batches, in a child process with time
limits, before a GPU phase times them.

A kernel's first run on a GPU can fault (an illegal address is a sticky CUDA error: every later
call in the process fails with it), hang (an mbarrier phase that never completes: a blocked
``synchronize`` ignores SIGTERM) or write wrong values. Any of the three would end a benchmark's
run and lose the rows of every backend after it. The child runs the backends one at a time; one
that fails, hangs or dies is reported with the reason and left out, and a new child goes on with
the rest.

    python benchmarks/canary.py                       # ours on this GPU; a JSON line {backend: "ok" | reason}
    python benchmarks/canary.py --backends triton cuda-wgmma-2wg --passed   # also the passing names, on stdout
    python benchmarks/canary.py --served auto --model DIR --failed   # our attention kernels a server of
        # that checkpoint runs with --attention-backend auto, at its shape; a line "name: why" per failure

Run by ``bench_attention.py`` (the backends that do not pass are left out of its cases and grid,
and the report says why), ``profiles/ncu_kernels.sh``, ``benchmarks/run_ablations.sh`` (a server
whose attention kernels did not pass is not started: ``--served``), and on a GPU by ``tests/conftest.py`` (the
tests of a kernel that faulted, hung or was wrong fail without launching it; a call our own checks
refuse, reported as ``refused: ...``, is not a failure there). ``--device cpu`` runs the same
batches through the Triton interpreter and the CUDA kernels' emulator, at smaller shapes (tests).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

MARK = "CANARY "
REFUSED = "refused: "  # how a reason starts where the call raised ValueError: it does not apply here
# an output further than this from float64 is wrong (bf16 rounding alone is about 2.3e-3); the
# same bound as bench_attention's MAX_REL_ERR_VS_FP64
MAX_REL_ERR = 2e-2


def backends_for(device: str = "cuda") -> list[str]:
    """Our attention backends on this machine: triton; the cuda kernel (auto, simt) where
    ``minengine._C`` is built or, on CPU, where its emulator can be; the Hopper impls on sm_90."""
    import torch

    from minengine.ops import cuda as cuda_backend

    names = ["triton"]
    if device == "cpu":
        from minengine.ops import cuda_emulator

        if not cuda_emulator.unavailable_reason():
            names += ["cuda", "cuda-simt", *(f"cuda-{impl}" for impl in cuda_backend.WGMMA_IMPLS)]
        return names
    if cuda_backend.available():
        names += ["cuda", "cuda-simt"]
        if torch.cuda.get_device_capability() == (9, 0):
            names += [f"cuda-{impl}" for impl in cuda_backend.WGMMA_IMPLS]
    return names


def _attention(backend: str) -> Callable:
    from minengine import ops

    return ops.attention_of(backend)


def parse_shape(text: str) -> tuple[str, int, int, int]:
    """``DTYPE:HQ:HKV:D`` (as ``--shape`` and the child's command line write it)."""
    dtype, *heads = text.split(":")
    return (dtype, *map(int, heads))


def batches(
    device: str, shape: tuple[str, int, int, int] | None = None
) -> list[tuple[str, object, Callable[[str], bool]]]:
    """Small batches that reach each kernel's paths, with the backends each is for: prefill tiles
    over a prefix (whole, partial and masked stages; on a GPU, a 280-row chunk's last 128-row tile is
    partly empty), decodes short and long (split KV on the CUDA kernels), 16-token pages (where the
    TMA tiles apply) and 1-token pages (their fallback); then, for the CUDA kernels, the grid's other
    instantiations: fp16 at head dim 64, and head dim 256 (not the wgmma tiles', up to 128).
    ``shape`` (dtype name, Hq, Hkv, D: a served model's): the first two at that shape, on every
    device, and not the grid's others."""
    import dataclasses

    import torch

    from minengine.ops.testing import aligned_rows, make_paged_batch

    gpu = device != "cpu"
    # 16 sequences and 117 tokens: Triton specializes integer arguments on divisibility by 16, as
    # for case d's 64 sequences and 2111 tokens
    decodes = [4100, 70, 17, 1, 2, 15, 16, 63, 64, 65, 127, 128, 129, 300]
    mixed = ([70] + [1] * 14 + [33], [1100, *decodes, 33]) if gpu else ([70, 1, 1, 9], [200, 300, 17, 9])
    other = ([40, 1, 1], [300, 2100, 17]) if gpu else ([20, 1, 1], [90, 300, 17])
    bf16, fp16 = torch.bfloat16, torch.float16

    def every(backend: str) -> bool:
        return True

    def cuda(backend: str) -> bool:
        return backend.startswith("cuda")

    def not_wgmma(backend: str) -> bool:
        return cuda(backend) and "wgmma" not in backend

    specs = (  # name, (q_lens, seq_lens), page, dtype, (Hq, Hkv, D) on a GPU and on CPU, for
        ("mixed, page 16", mixed, 16, bf16, (32, 8, 128), (4, 2, 64), every),
        ("prefill + decode, page 1", ([37, 1], [90, 70]), 1, bf16, (32, 8, 128), (4, 2, 64), cuda),
        ("fp16, head dim 64", other, 16, fp16, (32, 8, 64), (4, 2, 64), cuda),
        ("head dim 256", other, 16, bf16, (16, 4, 256), (4, 2, 256), not_wgmma),
    )
    if shape is not None:
        dtype, *heads = shape
        specs = tuple((f"{name}, the model's {dtype} {'/'.join(map(str, heads))}", lens, page, getattr(torch, dtype),
                       tuple(heads), tuple(heads), runs) for name, lens, page, _, _, _, runs in specs[:2])  # fmt: skip
    out = []
    for name, (q_lens, seq_lens), page, dtype, gpu_shape, cpu_shape, runs in specs:
        hq, hkv, d = gpu_shape if gpu else cpu_shape
        batch = make_paged_batch(
            q_lens, seq_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page, dtype=dtype,
            device=device, generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        if not gpu and page == 16:  # CPU tensors are 64-byte aligned: the TMA tiles need 128
            k, v = aligned_rows(batch.k_cache), aligned_rows(batch.v_cache)
            batch = dataclasses.replace(batch, k_cache=k, v_cache=v)
        out.append((name, batch, runs))
    return out


def worst_sequence_error(out, ref, q_lens: list[int]) -> float:
    """The largest of the sequences' relative errors (NaN if any is): one norm over the batch
    would let the short sequences' rows hide a long decode written as zeros."""
    from minengine.ops.testing import relative_error

    worst, start = 0.0, 0
    for n in q_lens:
        err = relative_error(out[start : start + n], ref[start : start + n])
        if not err <= worst:  # (NaN wins)
            worst = err
        start += n
    return worst


def child(backends: list[str], device: str, shape: tuple[str, int, int, int] | None = None) -> None:
    """Each backend on each batch, output poisoned first and checked against float64; a line
    ``CANARY start|ok|bad <backend> [reason]`` each, flushed, so the parent knows which one a
    fault or a hang belongs to. Imports, CUDA's start and the references come before the first
    line (the parent's start-up limit); after it, a backend's own time is its launches."""
    if device == "cpu":  # (before Triton is imported: its kernels read it when they are defined)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    import triton_kernels  # noqa: F401  (imported here, not in a backend's time)
    from minengine.ops import cuda as cuda_backend
    from minengine.ops import reference

    if device == "cpu" and any(b.startswith("cuda") for b in backends):
        cuda_backend.use_emulator()
    cases = batches(device, shape)
    expected = [reference.paged_attention(*batch.to_float64()) for _, batch, _ in cases]
    for backend in backends:
        print(f"{MARK}start {backend}", flush=True)
        reason = None
        try:
            attention = _attention(backend)
            # Triton: the first batch only, unsplit. On a GPU its tile config and constexprs are then
            # those of the bench's cases c and d, so its compile (tens of seconds) lands in the cache
            # the bench reads instead of adding one; the other batches are the CUDA kernels'. At a
            # served model's shape, split as a server's calls are (its long decodes: split KV).
            unsplit = backend == "triton" and shape is None
            for (name, batch, runs), ref in zip(cases, expected, strict=True):
                if not runs(backend):
                    continue
                out = torch.full_like(batch.q, float("nan"))
                attention(*batch.args(), out=out, **({"num_splits": 1} if unsplit else {}))
                if device != "cpu":
                    torch.cuda.synchronize()
                err = worst_sequence_error(out, ref, batch.q_lens)
                if not err <= MAX_REL_ERR:  # (NaN: not <=)
                    reason = f"{name}: relative error {err:.3g} against float64 (a sequence's; at most {MAX_REL_ERR})"
                    break
        except ValueError as exc:  # the call was refused (our checks: it does not apply here), nothing launched
            reason = f"{REFUSED}ValueError: {exc}"
        except Exception as exc:  # noqa: BLE001  (a CUDA error: reported, the next one runs)
            reason = f"{type(exc).__name__}: {exc}"
        reason = None if reason is None else " / ".join(reason.split("\n"))[:400]  # one line
        print(f"{MARK}ok {backend}" if reason is None else f"{MARK}bad {backend} {reason}", flush=True)
        if reason is not None and not reason.startswith(REFUSED) and device != "cpu":
            # a CUDA error may be sticky: the rest go on in a fresh process
            return


def die_with_parent(parent: int) -> None:
    """In the child (Linux): SIGKILL when the parent dies, however it dies (a SIGTERM without a
    handler, a SIGKILL), so a hung kernel's process does not outlive the canary; an exit at once
    if it is already gone."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        sys.exit("the canary's parent process is gone")


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: a compile it started goes too
    proc.wait()


def _pump(stream, lines: queue.Queue) -> None:
    """The child's output lines into ``lines``, then None at its end."""
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)


def run_canary(
    backends: list[str],
    seconds: float = 30.0,
    startup_seconds: float = 240.0,
    device: str = "cuda",
    command: Callable[[list[str]], list[str]] | None = None,
    shape: tuple[str, int, int, int] | None = None,
) -> dict[str, str]:
    """``{backend: "ok" | reason}`` for each of ``backends``, run in child processes: a child gets
    ``startup_seconds`` to its first line (imports, CUDA's start), a backend ``seconds`` from its
    start line (Triton's gets ``startup_seconds``: it compiles); one that hangs or whose child dies
    is marked with why, and a new child runs those left. ``command(backends)`` (tests) is the
    child's command line; ``shape``: ``batches``'."""
    here = [sys.executable, str(Path(__file__).resolve()), "--parent", str(os.getpid())]
    if shape is not None:
        here += ["--shape", ":".join(map(str, shape))]
    command = command or (lambda names: [*here, "--child", device, *names])
    startup_seconds = max(startup_seconds, seconds)
    results: dict[str, str] = {}
    left = list(backends)
    while left:
        proc, current, last, limit, since = None, None, None, startup_seconds, time.monotonic()
        tail: deque[str] = deque(maxlen=3)
        try:
            proc = subprocess.Popen(
                command(left), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                start_new_session=True,
            )  # fmt: skip
            lines: queue.Queue[str | None] = queue.Queue()
            threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
            while True:
                try:
                    line = lines.get(timeout=max(0.0, since + limit - time.monotonic()))
                except queue.Empty:
                    what = f"{current}'s start" if current else f"{last}'s result" if last else "the process's start"
                    reason = f"no result within {limit:g} s of {what} (a hang?)"
                    break
                if line is None:
                    code = proc.wait()
                    reason = f"its process ended (exit {code})" + (f": {tail[-1][:300]}" if tail else "")
                    break
                at = line.find(MARK)  # (a native library's unfinished line may come before it)
                if at < 0:
                    if line.strip():
                        tail.append(line)
                    continue
                verb, _, rest = line[at + len(MARK) :].partition(" ")
                name, _, why = rest.partition(" ")
                if verb == "start":
                    limit = startup_seconds if name == "triton" else seconds
                    current, since = name, time.monotonic()
                    tail.clear()  # (a crash is told by its own backend's output)
                elif verb in ("ok", "bad") and name == current:
                    results[name] = "ok" if verb == "ok" else why or "failed"
                    current, last, limit, since = None, name, seconds, time.monotonic()
        finally:
            if proc is not None:
                _kill(proc)
        done = [b for b in left if b in results]
        if current is not None and current not in results:
            results[current] = reason
        elif not done:  # it ended before any backend's result: the same reason for all
            results.update({b: reason for b in left})
        left = [b for b in left if b not in results]
    return {b: results[b] for b in backends}


def failed(results: dict[str, str], refused: bool = True) -> dict[str, str]:
    """The backends that did not pass, with why; ``refused=False``: only those that faulted, hung or
    were wrong, not those whose call was refused (a build without 9.0a, a GPU that is not sm_90)."""
    return {b: why for b, why in results.items() if why != "ok" and (refused or not why.startswith(REFUSED))}


def served_shape(model: str, dtype: str, device: str, parser: argparse.ArgumentParser) -> tuple[str, int, int, int]:
    """(dtype name, Hq, Hkv, D) of a server of ``model`` (a checkpoint directory, or ``tiny``) with
    ``--dtype dtype`` on ``device``: the config read as the server reads it."""
    import torch

    from minengine.config import DTYPES
    from minengine.engine import resolve_dtype
    from minengine.models import load_model_config

    if dtype not in DTYPES:
        parser.error(f"--dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    try:
        cfg = load_model_config(model)
    except (OSError, ValueError, KeyError) as exc:
        parser.error(f"--model {model}: no usable config.json ({type(exc).__name__}: {exc})")
    name = str(resolve_dtype(dtype, torch.device(device))).removeprefix("torch.")
    return name, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim


def main(argv: list[str] | None = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--backends", nargs="*", default=None, help="default: ours on this machine (backends_for)")
    which.add_argument(
        "--served",
        metavar="ATTENTION_BACKEND",
        default=None,
        help="our attention kernels that a server started with --attention-backend ATTENTION_BACKEND runs here "
        "(minengine.ops.attention_kernels)",
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--seconds", type=float, default=30.0, help="a backend's time limit (CUDA's kernels)")
    parser.add_argument(
        "--startup-seconds",
        type=float,
        default=240.0,
        help="the time limit to the child's first line (imports, CUDA's start), and Triton's (it compiles)",
    )
    report = parser.add_mutually_exclusive_group()
    report.add_argument(
        "--passed", action="store_true", help="print the backends that passed on stdout, the JSON on stderr"
    )
    report.add_argument(
        "--failed",
        action="store_true",
        help="print a line 'backend: why' for each that did not pass (refused calls too) on stdout, the JSON on "
        "stderr: nothing when all passed",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="with --served: the served model, a checkpoint directory (its config.json) or tiny: the batches at "
        "its head counts and head dim, and of auto's table only the entries for its calls",
    )
    parser.add_argument("--dtype", default="auto", help="with --model: the server's --dtype (auto: as the engine)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--parent", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--shape", type=parse_shape, default=None, help=argparse.SUPPRESS)  # the child's batches
    args, rest = parser.parse_known_args(argv)
    if args.child is not None:  # the child process: --parent PID [--shape S] --child DEVICE BACKEND...
        if args.parent is not None:
            die_with_parent(args.parent)
        child(rest, args.child, args.shape)
        return {}
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.model is not None and args.served is None:
        parser.error("--model goes with --served (the kernels a server of that model runs)")
    shape = None
    if args.served is not None:
        from minengine import ops

        dtype = head_dim = None
        if args.model is not None:
            shape = served_shape(args.model, args.dtype, args.device, parser)
            dtype, head_dim = shape[0], shape[3]
        try:
            backends = list(ops.attention_kernels(args.served, args.device, dtype, head_dim))
        except ValueError as exc:  # an unknown name: the message lists the allowed ones
            parser.error(f"--served: {exc}")
    else:
        backends = args.backends if args.backends is not None else backends_for(args.device)
    # a caller's time limit (SIGTERM) ends the run through run_canary's clean-up: its child goes too
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        results = run_canary(backends, args.seconds, args.startup_seconds, args.device, shape=shape)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(json.dumps(results), file=sys.stderr if args.passed or args.failed else sys.stdout, flush=True)
    if args.passed:
        print(" ".join(b for b, why in results.items() if why == "ok"), flush=True)
    if args.failed:
        for backend, why in failed(results).items():
            print(f"{backend}: {why}", flush=True)
    return results


if __name__ == "__main__":
    main()
