"""Paged-attention microbenchmark: our Triton kernel vs the torch reference vs FlashInfer.

One run measures the device's ceilings (device-to-device copy bandwidth, bf16 matmul peak) and
then, for bf16, Hq=32, Hkv=8, D=128, page 16:

    a  128 decodes at 2k context            (KV-bandwidth bound)
    b  8 decodes at 32k context             (bandwidth bound; needs split-KV to fill the GPU)
    c  one 2048-token chunk over an 8k prefix (matmul bound)
    d  c + 63 decodes at 4k, one launch     (the mixed batch)
    e  d as two launches (chunk, then the decodes)

For each: median time (CUDA events via triton.testing.do_bench), KV bytes read / time as a
fraction of copy bandwidth, attention FLOP/s as a fraction of matmul peak, the error against a
float64 reference, and the time ratios ours/torch and ours/FlashInfer (when importable: its paged
prefill or decode wrapper, and on the mixed batch also its POD-Attention wrapper, which runs the
chunk and the decodes in one launch; the mixed-batch target compares against the faster of the two).
Writes JSON + a markdown table (device, clocks, versions, command) to benchmarks/results/.

    python benchmarks/bench_attention.py                  # on a GPU
    python benchmarks/bench_attention.py --smoke --out /tmp/bench   # tiny shapes, CPU interpreter
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from _common import RESULTS, header, save, stem
from _common import report as make_report
from canary import backends_for, run_canary
from canary import failed as canary_failed

TARGETS = {"a": ("kv_bw_frac", 0.85), "b": ("kv_bw_frac", 0.80), "c": ("tflops_frac", 0.50)}  # triton
# The csrc issue's targets (H100/H200, bf16, 32/8/128, page 16), for the best of our kernels:
# decode >= 90% of copy bandwidth, prefill chunk >= 70% of matmul peak, mixed batch >= 1.2x FlashInfer.
BEST_TARGETS = {"a": ("kv_bw_frac", 0.90), "c": ("tflops_frac", 0.70), "d": ("flashinfer_over_ours", 1.2)}
OURS = {
    "triton": "ms",
    "cuda": "cuda_ms",
    "cuda-wgmma": "cuda_wgmma_ms",
    "cuda-wgmma-tma": "cuda_wgmma_tma_ms",
    "cuda-wgmma-pipe": "cuda_wgmma_pipe_ms",
    "cuda-wgmma-2wg": "cuda_wgmma_2wg_ms",
}
OURS_ERR = {
    "triton": "rel_err_vs_fp64",
    "cuda": "cuda_rel_err_vs_fp64",
    "cuda-wgmma": "cuda_wgmma_rel_err_vs_fp64",
    "cuda-wgmma-tma": "cuda_wgmma_tma_rel_err_vs_fp64",
    "cuda-wgmma-pipe": "cuda_wgmma_pipe_rel_err_vs_fp64",
    "cuda-wgmma-2wg": "cuda_wgmma_2wg_rel_err_vs_fp64",
}
# an output further than this from float64 is wrong, whatever its time (fp16/bf16 rounding alone is
# about 2.3e-3): such a backend meets no target
MAX_REL_ERR_VS_FP64 = 2e-2


def wrong_output(row: dict, backend: str) -> bool:
    """Whether this backend's output on the case was off (or NaN: not ``<=``) against float64."""
    err = row.get(OURS_ERR[backend])
    return err is not None and not err <= MAX_REL_ERR_VS_FP64


@dataclass(frozen=True)
class Case:
    name: str
    label: str
    q_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    split_at: int | None = None  # case e: first launch takes sequences [:split_at]


def cases(scale: int) -> list[Case]:
    """The issue's cases; ``scale`` divides every length (1 on a GPU, large for --smoke)."""

    def s(n: int) -> int:
        return max(1, n // scale)

    chunk = ((s(2048),), (s(8192) + s(2048),))
    mixed_q, mixed_kv = chunk[0] + (1,) * 63, chunk[1] + (s(4096),) * 63
    return [
        Case("a", "128 decodes @ 2k", (1,) * 128, (s(2048),) * 128),
        Case("b", "8 decodes @ 32k", (1,) * 8, (s(32768),) * 8),
        Case("c", "2048 chunk over 8k prefix", *chunk),
        Case("d", "c + 63 decodes @ 4k, one launch", mixed_q, mixed_kv),
        Case("e", "d as two launches", mixed_q, mixed_kv, split_at=1),
    ]


def attention_flops(q_lens: tuple[int, ...], seq_lens: tuple[int, ...], num_q_heads: int, head_dim: int) -> int:
    """QK^T and PV over the causally visible keys: 4 * D FLOPs per (query head, visible key)."""
    visible = 0
    for q_len, seq_len in zip(q_lens, seq_lens, strict=True):
        first = seq_len - q_len + 1  # keys seen by the first query of the chunk
        visible += q_len * first + q_len * (q_len - 1) // 2
    return 4 * head_dim * num_q_heads * visible


def kv_bytes(seq_lens: tuple[int, ...], num_kv_heads: int, head_dim: int, elem: int) -> int:
    return 2 * sum(seq_lens) * num_kv_heads * head_dim * elem


def timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds of fn: CUDA events on a GPU, perf_counter on CPU (smoke runs)."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn: float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))

    def cpu(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[1]

    return cpu


def measure_ceilings(device: torch.device, bench: Callable, smoke: bool) -> dict[str, float]:
    """Copy bandwidth (bytes read + written) and bf16 matmul peak, on random data."""
    n_bytes = (1 << 20) if smoke else (2 << 30)
    src = torch.randint(0, 255, (n_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = bench(lambda: dst.copy_(src))
    n = 256 if smoke else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm_ms = bench(lambda: a @ b)
    return {"copy_gbps": 2 * n_bytes / copy_ms / 1e6, "matmul_tflops": 2 * n**3 / mm_ms / 1e9}


def run_case(
    case: Case, args: argparse.Namespace, device: torch.device, bench: Callable, ceilings: dict, later=None
) -> dict:
    """One case's row: ours, the torch reference, FlashInfer, the CUDA kernels. With
    --triton-variants, a one-launch case also leaves its inputs in ``later`` (case name -> batch,
    output buffer, our call, its fp64 error, the tile configs to time) for ``time_variants``."""
    import triton_kernels
    from minengine.ops import cuda as cuda_backend
    from minengine.ops import reference
    from minengine.ops.testing import make_paged_batch, relative_error

    shape = dict(num_q_heads=args.num_q_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim)
    make = lambda q, kv: make_paged_batch(  # noqa: E731
        list(q), list(kv), **shape, page_size=args.page_size, dtype=torch.bfloat16, device=device, poison=False
    )
    row: dict[str, object] = {"case": case.name, "label": case.label}
    if case.split_at is None:
        batch = make(case.q_lens, case.seq_lens)
        out = torch.empty_like(batch.q)
        ours = lambda: triton_kernels.paged_attention(*batch.args(), out=out)  # noqa: E731
        row["ms"] = bench(ours)
        ref = reference.paged_attention(*batch.to_float64())

        def fp64_error(run: Callable) -> float:
            """run's output against float64, ``out`` poisoned first: every backend here writes into
            it, and one that writes nothing must not be scored on the last one's output."""
            out.fill_(float("nan"))
            return relative_error(run(), ref)

        row["rel_err_vs_fp64"] = fp64_error(ours)
        # the float64 answer rounded to bf16: no kernel that outputs bf16 gets below this error
        row["rel_err_floor"] = relative_error(ref.to(torch.bfloat16), ref)
        if not args.no_torch:
            row["torch_ms"] = bench(lambda: reference.paged_attention(*batch.args(), out=out))
        for which, make_baseline in flashinfer_baselines(args, torch.bfloat16, *shape.values(), case.q_lens).items():
            key = "flashinfer_pod" if which == "pod" else "flashinfer"
            try:  # a FlashInfer JIT or plan failure is a skip, not the end of the run
                fi = make_baseline(*batch.args()[:6])
                row[f"rel_err_vs_{key}"] = relative_error(ours(), getattr(fi, "output", fi.run)())
                row[f"{key}_ms"] = bench(fi.run)
            except Exception as exc:  # noqa: BLE001
                row[f"{key}_error"] = f"{type(exc).__name__}: {exc}"[:300]
                print(f"skip {key} (case {case.name}): {row[f'{key}_error']}", flush=True)
        if args.triton_variants and later is not None:  # timed after every case's own row: time_variants
            picked, variants = triton_variants(batch, args.num_q_heads // args.num_kv_heads)
            row["triton_config"] = picked._asdict()
            later[case.name] = (batch, out, ours, fp64_error, variants)
        left_out = getattr(args, "canary_failed", {})  # backends whose canary run failed: not launched
        if cuda_backend.available() and "cuda" not in left_out:
            theirs = lambda: cuda_backend.paged_attention(*batch.args(), out=out)  # noqa: E731
            row["cuda_ms"] = bench(theirs)
            row["cuda_rel_err_vs_fp64"] = fp64_error(theirs)
            row["cuda_kernel"] = cuda_backend.chosen_kernel(*batch.args())
        if cuda_backend.available() and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0):
            # the prefill tiles' K/V by cp.async, then by TMA, then by TMA and pipelined, then
            # those with two warpgroups (128-row tiles)
            for impl in cuda_backend.WGMMA_IMPLS:
                if f"cuda-{impl}" in left_out:
                    continue
                run = functools.partial(cuda_backend.paged_attention, *batch.args(), out=out, impl=impl)
                key = "cuda_" + impl.replace("-", "_")
                with contextlib.suppress(ValueError):  # a build without 9.0a
                    row[f"{key}_kernel"] = cuda_backend.chosen_kernel(*batch.args(), impl=impl)
                    row[f"{key}_rel_err_vs_fp64"] = fp64_error(run)
                    row[f"{key}_ms"] = bench(run)
    else:
        first = make(case.q_lens[: case.split_at], case.seq_lens[: case.split_at])
        second = make(case.q_lens[case.split_at :], case.seq_lens[case.split_at :])
        outs = torch.empty_like(first.q), torch.empty_like(second.q)

        def two_launches() -> None:
            triton_kernels.paged_attention(*first.args(), out=outs[0])
            triton_kernels.paged_attention(*second.args(), out=outs[1])

        row["ms"] = bench(two_launches)
    seconds = row["ms"] / 1e3
    nbytes = kv_bytes(case.seq_lens, args.num_kv_heads, args.head_dim, 2)
    flops = attention_flops(case.q_lens, case.seq_lens, args.num_q_heads, args.head_dim)
    row["kv_gbps"] = nbytes / seconds / 1e9
    row["kv_bw_frac"] = row["kv_gbps"] / ceilings["copy_gbps"]
    row["tflops"] = flops / seconds / 1e12
    row["tflops_frac"] = row["tflops"] / ceilings["matmul_tflops"]
    for key in ("torch_ms", "flashinfer_ms", "flashinfer_pod_ms", *OURS.values()):
        if key != "ms" and key in row:
            row[f"speedup_vs_{key.removesuffix('_ms')}"] = row[key] / row["ms"]
    return row


def time_block_orders(row: dict, kept: tuple, bench: Callable) -> None:
    """Each of our backends that has a time in the row, in its default block order (heavy-first,
    timed again) and in-order (the order before it), side by side, into ``row["block_orders"]``."""
    from minengine import ops
    from triton_kernels.contract import BLOCK_ORDERS

    batch, out, _, fp64_error, _ = kept
    row["block_orders"] = {}
    for backend in OURS:
        if OURS[backend] not in row:
            continue
        call = ops.attention_of(backend)
        times = row["block_orders"][backend] = {}
        for order in BLOCK_ORDERS:
            run = functools.partial(call, *batch.args(), out=out, block_order=order)
            key = order.replace("-", "_")
            try:  # a failure is reported (what was measured stays); the rest goes on
                times[f"{key}_err"] = fp64_error(run)
                times[f"{key}_ms"] = bench(run)
            except Exception as exc:  # noqa: BLE001
                times["error"] = f"{order}: {type(exc).__name__}: {exc}"[:300]
                break


def time_variants(row: dict, kept: tuple, bench: Callable) -> None:
    """The Triton tile configs of ``triton_variants`` on a case's inputs, beside the picked one timed
    again (``variants_pick_ms``), into ``row["variants"]``. Run after every case's own row, so a
    time limit cuts variants, not the cases, the CUDA columns or FlashInfer's."""
    import triton_kernels

    batch, out, ours, fp64_error, variants = kept
    row["variants"] = {}
    row["variants_pick_ms"] = bench(ours)
    for name, cfg in variants.items():
        run = lambda c=cfg: triton_kernels.paged_attention(*batch.args(), out=out, config=c)  # noqa: E731
        try:  # a variant that fails (compile, resources) is reported; the others go on
            err = fp64_error(run)
            row["variants"][name] = dict(config=cfg._asdict(), ms=bench(run), rel_err_vs_fp64=err)
        except Exception as exc:  # noqa: BLE001
            row["variants"][name] = dict(config=cfg._asdict(), error=f"{type(exc).__name__}: {exc}"[:300])
            print(f"skip triton variant {name} (case {row['case']}): {row['variants'][name]['error']}")


def triton_variants(batch, group: int) -> tuple:
    """The tile config pick_config chooses for a batch, and the ones timed beside it with
    --triton-variants (``attention.tile_variants``)."""
    from triton_kernels import attention
    from triton_kernels._common import interpreting, max_shared_memory

    head_dim, dtype, shared = batch.q.shape[-1], batch.q.dtype, max_shared_memory(batch.q.device)
    picked = attention.pick_config(batch.max_seqlen_q, group, head_dim, dtype, interpreting(), shared)
    return picked, attention.tile_variants(picked)


# in the grid's order: qwen3-0.6b last, since its keys in the tuning table (kind, dtype, head dim) are
# llama3-8b's, so a grid cut short by its time budget still leaves every key measured
GRID_SHAPES = {"llama3-8b": (32, 8, 128), "d64": (32, 8, 64), "d256": (16, 4, 256), "qwen3-0.6b": (16, 8, 128)}
GRID_KINDS = {  # name: (q_lens, seq_lens)
    "decode": ((1,) * 128, (2048,) * 128),
    "prefill": ((2048,), (2048,)),
    "mixed": ((1024,) + (1,) * 63, (5120,) + (4096,) * 63),
    "long-decode": ((1,) * 4, (32768,) * 4),
}


def pod_applies(q_lens: tuple[int, ...]) -> bool:
    """FlashInfer's POD wrapper takes a batch with a chunk of several tokens and a decode."""
    return any(n > 1 for n in q_lens) and any(n == 1 for n in q_lens)


def use_flashinfer(args: argparse.Namespace) -> bool:
    from minengine.ops import flashinfer_ref

    return not args.no_flashinfer and flashinfer_ref.available()


def flashinfer_baselines(args: argparse.Namespace, dtype: torch.dtype, hq: int, hkv: int, d: int, q_lens) -> dict:
    """FlashInfer's baselines for a batch: its paged wrapper, and POD on a mixed batch ({"paged": cls,
    "pod": cls}); none whose warm-up build failed (each try would compile for minutes and fail again)."""
    from minengine.ops import flashinfer_ref

    if not use_flashinfer(args):
        return {}
    kind = batch_kind(q_lens)
    makers = {"paged": flashinfer_ref.FlashInferPagedAttention, "pod": flashinfer_ref.FlashInferPOD}
    failed = getattr(args, "flashinfer_failed", ())
    name = lambda b: build_name((str(dtype).split(".")[-1], hq, hkv, d, kind, b))  # noqa: E731
    return {b: makers[b] for b in baseline_names(kind) if name(b) not in failed}


def baseline_names(kind: str) -> tuple[str, ...]:
    return ("paged", "pod") if kind == "mixed" else ("paged",)


def flashinfer_in_grid(args: argparse.Namespace, shape: str, page: int, dtype: torch.dtype) -> bool:
    """Whether FlashInfer runs on a grid config (--flashinfer-grid target: the targets' configs only)."""
    target = shape == "llama3-8b" and page == 16 and dtype == torch.bfloat16
    return page in (16, 64) and (args.flashinfer_grid == "all" or target)


# A small batch of each kind: building a baseline on it JIT-compiles the modules the kind needs
# (FlashInfer's modules depend on dtype, head dims and wrapper, not on lengths or page size)
WARMUP_BATCHES = {"decode": ((1, 1), (40, 33)), "prefill": ((24,), (40,)), "mixed": ((24, 1), (40, 33))}


def batch_kind(q_lens: tuple[int, ...]) -> str:
    if all(n == 1 for n in q_lens):
        return "decode"
    return "mixed" if pod_applies(q_lens) else "prefill"


def flashinfer_builds(args: argparse.Namespace, selected: list[Case]) -> list[tuple]:
    """(dtype, Hq, Hkv, D, kind, baseline) of every FlashInfer baseline this run builds, each once."""
    wanted = [("bfloat16", args.num_q_heads, args.num_kv_heads, args.head_dim, c.q_lens) for c in selected
              if c.split_at is None]  # fmt: skip
    if args.suite == "full":
        for shape, page, dtype, kind in grid_configs(args.smoke):
            if flashinfer_in_grid(args, shape, page, dtype):
                wanted.append((str(dtype).split(".")[-1], *GRID_SHAPES[shape], GRID_KINDS[kind][0]))
    builds = []
    for dtype, hq, hkv, d, q_lens in wanted:
        kind = batch_kind(q_lens)
        for baseline in baseline_names(kind):
            if (item := (dtype, hq, hkv, d, kind, baseline)) not in builds:
                builds.append(item)
    return builds


def build_baseline(item: tuple | list, device: torch.device) -> None:
    """Build one FlashInfer baseline on a small batch and run it once (its JIT modules land in
    FlashInfer's on-disk cache, where the timed run finds them)."""
    from minengine.ops import flashinfer_ref
    from minengine.ops.testing import make_paged_batch

    dtype, hq, hkv, d, kind, baseline = item
    q_lens, kv_lens = WARMUP_BATCHES[kind]
    batch = make_paged_batch(list(q_lens), list(kv_lens), num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                             page_size=16, dtype=getattr(torch, dtype), device=device, poison=False)  # fmt: skip
    make = flashinfer_ref.FlashInferPOD if baseline == "pod" else flashinfer_ref.FlashInferPagedAttention
    make(*batch.args()[:6]).run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


BUILT_MARK = "FLASHINFER_BUILT "  # the warm-up process's line for each baseline it built
WARMUP_MARK = "FLASHINFER_WARMUP_FAILED "  # its last line: JSON of the builds that failed
COMPILE_MARK = "FLASHINFER_COMPILING "  # a round's modules compiled together, comma-separated
PREBUILT_MARK = "FLASHINFER_PREBUILT "  # a module loaded from FlashInfer's AOT directory (flashinfer_aot.py)


def build_name(item: tuple | list) -> str:
    return " ".join(map(str, item))


def failure_reason(exc: BaseException) -> str:
    """An exception's first line and its error lines (FlashInfer's "Ninja build failed" carries the
    whole ninja output, whose last line only says a subcommand failed)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines[1:] if "error" in line.lower()][:5]
    return " | ".join(line[:200] for line in [f"{type(exc).__name__}: {lines[0] if lines else ''}", *errors])


class _Collected(Exception):
    """A module the warm-up compiles with the round's others: the baseline asking for it waits."""


def warm_in_process(builds: list, device: torch.device, build: Callable | None = None) -> dict[str, str]:
    """Build every baseline, FlashInfer's modules compiled together. In rounds: each baseline still
    pending is built, loading the modules compiled so far and stopping at the first that is not
    (collected); then one ninja compiles every module the round collected (FlashInfer's
    ``build_jit_specs``: parallel jobs over one deps log; separate ninja processes in FlashInfer's
    one build directory would corrupt that log, and the next build would compile everything
    again). A module asks for the next one only once it runs (the prefill wrapper's page module,
    POD's batch module), hence rounds. A module that does not compile is not tried again. Prints a
    line per baseline built; returns the builds that failed, with why."""
    build = build or build_baseline
    try:
        from flashinfer.jit import core
    except ImportError:  # another FlashInfer layout: each build compiles its own modules, in turn
        core = None
    failed, pending = {}, list(builds)
    if core is not None:
        real, compiled, broken, collected, prebuilt = core.JitSpec.build_and_load, set(), {}, {}, set()

        def build_and_load(spec):
            if spec.name in broken:
                raise broken[spec.name]  # its compile error, not a second compile
            if spec.name in compiled or getattr(spec, "is_compiled", False):
                module = real(spec)
                if getattr(spec, "is_aot", False) and spec.name not in prebuilt:  # named once it has loaded
                    prebuilt.add(spec.name)
                    print(PREBUILT_MARK + spec.name, flush=True)
                return module
            collected.setdefault(spec.name, spec)
            raise _Collected

        core.JitSpec.build_and_load = build_and_load
    try:
        while pending:
            collected = {} if core is not None else None
            for item in list(pending):
                try:
                    build(item, device)
                except _Collected:
                    continue  # built once its module is
                except Exception as exc:  # noqa: BLE001
                    failed[build_name(item)] = failure_reason(exc)
                else:
                    print(BUILT_MARK + build_name(item), flush=True)
                pending.remove(item)
            if not collected:
                break
            print(COMPILE_MARK + ", ".join(collected), flush=True)
            try:
                core.build_jit_specs(list(collected.values()))
            except Exception as exc:  # noqa: BLE001  (one that does not compile stops ninja: the rest one by one)
                print(f"build_jit_specs: {failure_reason(exc)}", flush=True)
                for name, spec in collected.items():
                    try:
                        real(spec)
                    except Exception as one:  # noqa: BLE001
                        broken[name] = one
            compiled.update(collected)
    finally:
        if core is not None:
            core.JitSpec.build_and_load = real
    return failed


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid``: ninja starts each job in a process group of its
    own, so killing the warm-up's group would leave its nvcc jobs compiling."""
    for _ in range(5):  # a process may start one more between the scan and its kill
        alive = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, IndexError, ValueError):  # gone while read
                state_ppid_pgrp_session = stat.read_text().rsplit(")", 1)[1].split()[:4]  # the fields after comm
                if int(state_ppid_pgrp_session[3]) == sid:
                    alive.append(int(stat.parent.name))
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if not alive:
            return
        time.sleep(0.05)


def warm_flashinfer(builds: list, seconds: float, log: Path, command: list[str] | None = None) -> dict:
    """``warm_in_process`` in a process of its own, in a session of its own: killed whole (nvcc jobs
    too) after ``seconds`` or on a stop. Its output goes to ``log``. Returns the baselines built,
    those that failed, and whether it finished in time (a baseline not built is left out of the run)."""
    command = command or [sys.executable, __file__, "--build-flashinfer", json.dumps(builds)]
    start = time.monotonic()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        # a stop (SIGTERM) waits until the process is inside the try that kills it (the process
        # inherits the block, and lifts it itself)
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            proc = subprocess.Popen(command, start_new_session=True, stdout=out, stderr=subprocess.STDOUT)
        except BaseException:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            raise
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            pass
        finally:
            kill_session(proc.pid)  # its pid is its session's id
            proc.wait()
    lines = log.read_text().splitlines()
    marks = [line for line in lines if line.startswith(WARMUP_MARK)]
    result = {"seconds": round(time.monotonic() - start, 1), "finished": bool(marks), "log": str(log)}
    result["built"] = [line[len(BUILT_MARK) :] for line in lines if line.startswith(BUILT_MARK)]
    result["prebuilt"] = [line[len(PREBUILT_MARK) :] for line in lines if line.startswith(PREBUILT_MARK)]
    result["compiled"] = [name for line in lines if line.startswith(COMPILE_MARK)
                          for name in line[len(COMPILE_MARK) :].split(", ")]  # fmt: skip
    result["failed"] = json.loads(marks[-1][len(WARMUP_MARK) :]) if marks else {}
    if proc.returncode not in (0, -signal.SIGKILL) and not marks:  # it died: say how
        result["failed"] = {"warm-up process": (lines or [f"exit {proc.returncode}"])[-1][:300]}
    return result


def sdpa_on_gathered(batch):
    """torch SDPA per sequence on K/V gathered out of the pages (a common baseline). The returned
    function writes its output in our layout and returns it, so that it is checked like every other
    backend; the query offsets are read once here, not synced inside every timed call."""
    import torch.nn.functional as F

    cu = batch.cu_seqlens_q.tolist()
    ps = batch.k_cache.shape[1]
    group = batch.q.shape[1] // batch.k_cache.shape[2]
    out = torch.empty_like(batch.q)

    def run() -> torch.Tensor:
        for b, seq_len in enumerate(batch.seq_lens_host):
            pages = batch.block_tables[b, : -(-seq_len // ps)].long()
            k = batch.k_cache[pages].flatten(0, 1)[:seq_len].transpose(0, 1).repeat_interleave(group, 0)
            v = batch.v_cache[pages].flatten(0, 1)[:seq_len].transpose(0, 1).repeat_interleave(group, 0)
            q = batch.q[cu[b] : cu[b + 1]].transpose(0, 1)
            n = q.shape[1]
            mask = torch.ones(n, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - n)
            out[cu[b] : cu[b + 1]] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1)
        return out

    return run


def grid_configs(smoke: bool) -> list[tuple[str, int, torch.dtype, str]]:
    """(shape, page, dtype, kind) in the order the grid runs them: page 16 first over every shape,
    dtype and kind (every key of the tuning table), then pages 64 and 1."""
    shapes = list(GRID_SHAPES)[:1] if smoke else list(GRID_SHAPES)  # smoke: interpreter-sized
    dtypes = (torch.bfloat16,) if smoke else (torch.bfloat16, torch.float16)
    return [(s, p, dt, k) for p in (16, 64, 1) for s in shapes for dt in dtypes for k in GRID_KINDS]


def measure_config(
    args: argparse.Namespace, device: torch.device, bench: Callable, ceilings: dict, config: tuple
) -> list[dict]:
    """One grid config (shape, page, dtype, kind): a row per backend that ran it."""
    import triton_kernels
    from minengine.ops import cuda as cuda_backend
    from minengine.ops.testing import make_paged_batch, relative_error

    shape_name, page, dtype, kind = config
    scale = 64 if args.smoke else 1
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
    rows = []
    hq, hkv, d = (4, 2, GRID_SHAPES[shape_name][2]) if args.smoke else GRID_SHAPES[shape_name]
    q_lens, kv_lens = GRID_KINDS[kind]
    q_lens = tuple(max(1, q // scale) for q in q_lens[: 4 if args.smoke else None])
    kv_lens = tuple(max(q, kv // scale) for q, kv in zip(q_lens, kv_lens, strict=False))
    batch = make_paged_batch(
        list(q_lens), list(kv_lens), num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
        page_size=page, dtype=dtype, device=device, poison=False,
    )  # fmt: skip
    out = torch.empty_like(batch.q)
    runs = {"triton": lambda b=batch, o=out: triton_kernels.paged_attention(*b.args(), out=o)}
    if cuda_backend.available():
        for impl in ("auto", "simt") + (cuda_backend.WGMMA_IMPLS if hopper and d <= 128 else ()):
            name = "cuda" if impl == "auto" else f"cuda-{impl}"
            if name not in getattr(args, "canary_failed", {}):  # (a backend whose canary run failed)
                runs[name] = lambda b=batch, o=out, i=impl: cuda_backend.paged_attention(*b.args(), out=o, impl=i)
    checks = {}  # backends whose timed run does not return our layout: what to check instead
    if flashinfer_in_grid(args, shape_name, page, dtype):
        baselines = flashinfer_baselines(args, dtype, hq, hkv, d, q_lens)
        for which, make_baseline in baselines.items():
            name = "flashinfer-pod" if which == "pod" else "flashinfer"
            try:  # a shape FlashInfer does not take, or a JIT failure, is a skip
                fi = make_baseline(*batch.args()[:6])
                runs[name], checks[name] = fi.run, getattr(fi, "output", fi.run)
            except Exception as exc:  # noqa: BLE001
                print(f"skip {name} ({shape_name}, page {page}, {kind}): {exc}", flush=True)
    if not args.no_torch and device.type == "cuda":  # checked and timed as the others are
        runs["torch_sdpa"] = sdpa_on_gathered(batch)
    expected = runs["triton"]().clone()
    times, errors = {}, {}
    for backend, run in runs.items():
        out.fill_(float("nan"))  # poisoned: a backend that writes nothing is not shown the last one's output
        try:  # every output is checked against triton's before it is timed
            errors[backend] = relative_error(checks.get(backend, run)(), expected)
        except Exception as exc:  # noqa: BLE001  (a build without 9.0a, a FlashInfer JIT failure)
            print(f"skip {backend} ({shape_name}, page {page}, {kind}): {exc}", flush=True)
            continue
        times[backend] = bench(run)
    nbytes = kv_bytes(kv_lens, hkv, d, 2)
    flops = attention_flops(q_lens, kv_lens, hq, d)
    for backend, ms in times.items():
        row = dict(shape=shape_name, page=page, dtype=str(dtype).split(".")[-1], kind=kind, head_dim=d)
        row |= dict(backend=backend, ms=ms, kv_bw_frac=nbytes / (ms / 1e3) / 1e9 / ceilings["copy_gbps"])
        row["rel_err_vs_triton"] = errors[backend]
        row["tflops_frac"] = flops / (ms / 1e3) / 1e12 / ceilings["matmul_tflops"]
        if "flashinfer" in times:
            row["flashinfer_over_this"] = times["flashinfer"] / ms
        if "flashinfer-pod" in times:
            row["flashinfer_pod_over_this"] = times["flashinfer-pod"] / ms
        rows.append(row)
        print(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()}),
              flush=True)  # fmt: skip
    return rows


class Stopped(BaseException):
    """SIGTERM from the caller's time limit: stop measuring and write what was measured (a
    BaseException, so the ``except Exception`` skips around backends do not swallow it)."""


def _stop(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop; the report is written next
    raise Stopped


def run_grid(
    args: argparse.Namespace, device: torch.device, bench: Callable, ceilings: dict, deadline: float | None
) -> tuple[list[dict], list[str]]:
    """Every backend on shapes x head dims x page sizes x dtypes x batch kinds, and the configs left
    out: none starts after ``deadline``, and SIGTERM (with --time-budget) stops the one running."""
    configs = grid_configs(args.smoke)
    name = lambda c: f"{c[0]} page {c[1]} {str(c[2]).split('.')[-1]} {c[3]}"  # noqa: E731
    rows, left_out = [], []
    for i, config in enumerate(configs):
        if deadline is not None and time.monotonic() > deadline:
            left_out.append(name(config))
            continue
        try:
            rows += measure_config(args, device, bench, ceilings, config)
        except Stopped:
            left_out += [name(c) for c in configs[i:]]
            print(f"stopped by SIGTERM during {name(config)}", flush=True)
            break
        except Exception as exc:  # noqa: BLE001  (one config's failure is reported, the grid goes on)
            left_out.append(f"{name(config)} (failed: {type(exc).__name__}: {str(exc)[:200]})")
            print(f"failed: {left_out[-1]}", flush=True)
    if left_out:
        print(f"{len(left_out)} grid configs left out (time budget, or failed)", flush=True)
    return rows, left_out


def plot_grid(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(GRID_KINDS)
    backends = sorted({r["backend"] for r in rows})
    fig, axes = plt.subplots(1, len(kinds), figsize=(4 * len(kinds), 3.5))
    for ax, kind in zip(axes, kinds, strict=True):
        sel = [r for r in rows if r["kind"] == kind and r["shape"] == "llama3-8b" and r["page"] == 16
               and r["dtype"] == "bfloat16"]  # fmt: skip
        metric = "kv_bw_frac" if "decode" in kind else "tflops_frac"
        vals = [max((r[metric] for r in sel if r["backend"] == b), default=0) for b in backends]
        ax.bar(backends, vals)
        ylabel = "fraction of " + ("copy BW" if "decode" in kind else "peak")
        ax.set(title=f"{kind} (32/8/128, bf16, page 16)", ylabel=ylabel)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(report: dict) -> str:
    ceil = report["ceilings"]
    lines = [*header("bench_attention", report)]
    if report.get("stopped_during"):
        lines.append(f"- STOPPED by the time limit during {report['stopped_during']}: the rest was not measured")
    if jit := report.get("flashinfer_jit"):
        state = "done" if jit["finished"] else "NOT finished in time"
        failed = "".join(f"; failed: {k}: {v}" for k, v in jit["failed"].items())
        modules = ""
        if "compiled" in jit:  # (reports before the AOT modules have no such keys)
            modules = f"; {len(jit['prebuilt'])} modules loaded prebuilt, {len(jit['compiled'])} compiled here"
        lines.append(
            f"- FlashInfer JIT builds (modules compiled together): {state} after {jit['seconds']} s, "
            f"{len(jit['built'])} of {jit['builds']} baselines built (the others are left out){modules}{failed}"
        )
    if (canary := report.get("canary")) is not None:
        bad = {b: why for b, why in canary.items() if why != "ok"}
        lines.append(f"- canary runs (each of ours once, small batches, a child process): {len(canary) - len(bad)} of "
                     f"{len(canary)} passed" + (": " + ", ".join(canary) if not bad else ""))  # fmt: skip
        lines += [f"- LEFT OUT of this run, {b} did not pass its canary run: {why}" for b, why in bad.items()]
    for name, why in report.get("failed_cases", {}).items():
        lines.append(f"- case {name} FAILED: {why}")
    if ceil:
        lines.append(
            f"- ceilings: copy {ceil['copy_gbps']:.0f} GB/s (read + write), "
            f"bf16 matmul {ceil['matmul_tflops']:.0f} TFLOP/s"
        )
    if floors := [r["rel_err_floor"] for r in report["rows"] if "rel_err_floor" in r]:
        lines.append(
            f"- err vs fp64 is ||out - ref|| / ||ref||; the float64 answer rounded to bf16 alone has "
            f"{min(floors):.1e}-{max(floors):.1e} (a floor: errors near it are rounding, not the kernel)"
        )
    lines += [
        "",
        "| case | shape | triton ms | KV GB/s | of copy BW | TFLOP/s | of matmul peak "
        "| torch/triton | FlashInfer/triton | FlashInfer POD/triton | err vs fp64 | cuda ms | cuda err "
        "| cuda wgmma ms | wgmma err | wgmma TMA ms | TMA err | wgmma pipe ms | pipe err | wgmma 2wg ms | 2wg err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(row: dict, key: str, spec: str) -> str:
        return format(row[key], spec) if key in row else "-"

    for r in report["rows"]:
        lines.append(
            f"| {r['case']} | {r['label']} | {r['ms']:.4f} | {r['kv_gbps']:.0f} | {r['kv_bw_frac']:.0%} | "
            f"{r['tflops']:.1f} | {r['tflops_frac']:.0%} | {fmt(r, 'speedup_vs_torch', '.1f')} | "
            f"{fmt(r, 'speedup_vs_flashinfer', '.2f')} | {fmt(r, 'speedup_vs_flashinfer_pod', '.2f')} | "
            f"{fmt(r, 'rel_err_vs_fp64', '.1e')} | "
            f"{fmt(r, 'cuda_ms', '.4f')} | {fmt(r, 'cuda_rel_err_vs_fp64', '.1e')} | "
            f"{fmt(r, 'cuda_wgmma_ms', '.4f')} | {fmt(r, 'cuda_wgmma_rel_err_vs_fp64', '.1e')} | "
            f"{fmt(r, 'cuda_wgmma_tma_ms', '.4f')} | {fmt(r, 'cuda_wgmma_tma_rel_err_vs_fp64', '.1e')} | "
            f"{fmt(r, 'cuda_wgmma_pipe_ms', '.4f')} | {fmt(r, 'cuda_wgmma_pipe_rel_err_vs_fp64', '.1e')} | "
            f"{fmt(r, 'cuda_wgmma_2wg_ms', '.4f')} | {fmt(r, 'cuda_wgmma_2wg_rel_err_vs_fp64', '.1e')} |"
        )
    if any("variants" in r or "variants_error" in r for r in report["rows"]):
        lines += [
            "",
            "Triton tile configs side by side (--triton-variants; block_m/small_m/tile_n/warps/stages):",
            "",
            "| case | config | tile | ms | picked/this | err vs fp64 |",
            "|---|---|---|---|---|---|",
        ]
        for r in report["rows"]:
            if "variants" not in r and "variants_error" not in r:
                continue
            pick_ms = r.get("variants_pick_ms", r["ms"])  # timed again just before its variants
            lines.append(f"| {r['case']} | picked | {tile(r['triton_config'])} | {pick_ms:.4f} | 1.00 | "
                         f"{r['rel_err_vs_fp64']:.1e} |")  # fmt: skip
            for name, v in r.get("variants", {}).items():
                if "error" in v:
                    lines.append(f"| {r['case']} | {name} | {tile(v['config'])} | failed: {v['error'][:80]} | - | - |")
                    continue
                lines.append(
                    f"| {r['case']} | {name} | {tile(v['config'])} | {v['ms']:.4f} | {pick_ms / v['ms']:.2f} | "
                    f"{v['rel_err_vs_fp64']:.1e} |"
                )
            if "variants_error" in r:
                lines.append(f"| {r['case']} | (the rest) | - | failed: {r['variants_error'][:80]} | - | - |")
    if any(r.get("block_orders") for r in report["rows"]):
        lines += [
            "",
            "Block orders side by side (--triton-variants): heavy-first (the default: a sequence's tiles last first, "
            "KV heads interleaved) against in-order (the order before it):",
            "",
            "| case | backend | heavy-first ms | in-order ms | in-order/heavy-first | err (heavy-first, in-order) |",
            "|---|---|---|---|---|---|",
        ]
        for r in report["rows"]:
            for backend, v in r.get("block_orders", {}).items():
                if "in_order_ms" not in v:
                    heavy = f"{v['heavy_first_ms']:.4f}" if "heavy_first_ms" in v else "-"
                    lines.append(f"| {r['case']} | {backend} | {heavy} | failed: {v['error'][:80]} | - | - |")
                    continue
                heavy, before = v["heavy_first_ms"], v["in_order_ms"]
                lines.append(
                    f"| {r['case']} | {backend} | {heavy:.4f} | {before:.4f} | {before / heavy:.2f} | "
                    f"{v['heavy_first_err']:.1e}, {v['in_order_err']:.1e} |"
                )
    lines += ["", "Targets:"] + [f"- {t}" for t in report["targets"]]
    if report.get("tuning"):
        lines += ["", f"Tuning table: {report['tuning']}"]
    if report.get("grid"):
        lines += [
            "",
            "| shape | page | dtype | kind | backend | ms | of copy BW | of peak | FlashInfer/this "
            "| FlashInfer POD/this | err vs triton |",
        ]
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in report["grid"]:
            fi, pod = (f"{r[k]:.2f}" if k in r else "-" for k in ("flashinfer_over_this", "flashinfer_pod_over_this"))
            lines.append(
                f"| {r['shape']} | {r['page']} | {r['dtype']} | {r['kind']} | {r['backend']} | {r['ms']:.4f} "
                f"| {r['kv_bw_frac']:.0%} | {r['tflops_frac']:.0%} | {fi} | {pod} | {r['rel_err_vs_triton']:.1e} |"
            )
    if report.get("grid_left_out"):
        left = report["grid_left_out"]
        lines += [
            "",
            f"Left out ({len(left)} grid configs; by --time-budget unless it says failed): " + "; ".join(left),
        ]
    return "\n".join(lines) + "\n"


def tile(cfg: dict) -> str:
    return "/".join(str(cfg[k]) for k in ("block_m", "small_m", "tile_n", "num_warps", "num_stages"))


def check_targets(rows: list[dict]) -> list[str]:
    by_case = {r["case"]: r for r in rows}
    verdicts = []
    for name, (key, goal) in TARGETS.items():
        got = by_case[name][key]
        verdict = "met" if got >= goal else "MISSED"
        verdict = "MISSED (wrong output)" if wrong_output(by_case[name], "triton") else verdict
        verdicts.append(f"({name}) {key} {got:.0%} vs target {goal:.0%}: {verdict}")
    d, e = by_case["d"]["ms"], by_case["e"]["ms"]
    verdict = "MISSED (wrong output)" if wrong_output(by_case["d"], "triton") else ("met" if d < e else "MISSED")
    verdicts.append(f"(d) one launch {d:.4f} ms vs (e) two launches {e:.4f} ms: {verdict}")
    for name, (key, goal) in BEST_TARGETS.items():
        row = by_case[name]
        values = {}  # key for each of our backends timed on the case, with a right output
        wrong = [b for b in OURS if OURS[b] in row and wrong_output(row, b)]
        # FlashInfer's faster wrapper on the case (paged prefill / decode, or POD)
        timed = [(row[k], k.removesuffix("_ms")) for k in ("flashinfer_ms", "flashinfer_pod_ms") if k in row]
        theirs = min(timed) if timed else None
        for backend, ms_key in OURS.items():
            if ms_key not in row or backend in wrong:
                continue
            if key == "flashinfer_over_ours":
                if theirs is not None:
                    values[backend] = theirs[0] / row[ms_key]
            else:  # fractions scale with 1 / time
                values[backend] = row[key] * row["ms"] / row[ms_key]
        excluded = f"; left out, wrong output: {', '.join(wrong)}" if wrong else ""
        if not values:
            why = "every backend's output was wrong" if wrong else "FlashInfer not importable"
            verdicts.append(f"({name}) best of ours, {key}: not measured ({why}){excluded}")
            continue
        best = max(values, key=values.get)
        got = f"{values[best]:.2f}x" if key == "flashinfer_over_ours" else f"{values[best]:.0%}"
        want = f"{goal:.1f}x" if key == "flashinfer_over_ours" else f"{goal:.0%}"
        verdict = "met" if values[best] >= goal else "MISSED"
        against = f" (against {theirs[1]})" if key == "flashinfer_over_ours" else ""
        verdicts.append(f"({name}) best of ours ({best}), {key} {got}{against} vs target {want}: {verdict}{excluded}")
    return verdicts


def write_tuning(grid: list[dict], report: dict, device: torch.device) -> str:
    """The table `auto` reads on this device: per (kind, dtype, head dim), the faster of ours.
    Returns the path written, or why none was (the report is saved either way)."""
    from minengine.ops import tuning

    if device.type != "cuda":
        return "not written: --write-tuning needs a CUDA GPU (the table is per device)"
    choices = tuning.pick_from_rows(grid)
    if not choices:
        return "not written: no grid config has both the triton and cuda backends timed (needs --suite full)"
    name = torch.cuda.get_device_name(device)
    path = tuning.table_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device_name": name, "command": report["command"], "date": report["date"], "info": report["info"]}
    path.write_text(json.dumps({**meta, "choices": choices}, indent=1) + "\n")
    print(f"wrote {path}")
    return str(path)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU under TRITON_INTERPRET=1")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON and markdown results")
    parser.add_argument("--cases", default="abcde", help="which cases to run, e.g. 'ad'")
    parser.add_argument("--no-torch", action="store_true", help="skip timing the (slow) torch reference")
    parser.add_argument("--no-flashinfer", action="store_true", help="skip FlashInfer even where it is importable")
    parser.add_argument(
        "--canary",
        choices=["auto", "on", "off"],
        default="auto",
        help="first run each of our backends once in a child process (benchmarks/canary.py), and leave out of the "
        "run those that fault, hang or are wrong; auto: on a GPU",
    )
    parser.add_argument(
        "--flashinfer-warmup",
        type=float,
        default=360,
        metavar="SECONDS",
        help="on a GPU, first build every FlashInfer baseline the run uses, its JIT modules compiled together "
        "(minutes each, one after another otherwise); baselines not built within SECONDS are left out",
    )
    parser.add_argument(
        "--warmup-only",
        action="store_true",
        help="only build FlashInfer's modules for the selected cases (for an engine with --attention-backend "
        "flashinfer at the same shape: its server then starts without minutes of JIT compiles)",
    )
    parser.add_argument("--build-flashinfer", default=None, help=argparse.SUPPRESS)  # the warm-up process's builds
    parser.add_argument(
        "--triton-variants",
        action="store_true",
        help="on each one-launch case, also time our backends with block_order in-order beside heavy-first, then "
        "the Triton tile configs of triton_variants() beside the picked one (timed again), once every case has its "
        "own row",
    )
    parser.add_argument("--num-q-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--suite", choices=["core", "full"], default="core", help="full: the backend x shape grid too")
    parser.add_argument(
        "--flashinfer-grid",
        choices=["all", "target"],
        default="all",
        help="grid configs FlashInfer runs on: all (pages 16 and 64), or only the targets' (llama3-8b, "
        "bf16, page 16), which bounds its JIT compiles (tens of seconds for each dtype x head dim x kind)",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --suite full: start no grid config after this many seconds of the run (the rest is "
        "listed as left out), so a time-limited machine still gets the report and the tuning table",
    )
    parser.add_argument(
        "--write-tuning",
        action="store_true",
        help="with --suite full: write minengine/ops/tuning/<device>.json, the per-shape choice of `auto`",
    )
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.build_flashinfer is not None:  # the process of warm_flashinfer
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        failed = warm_in_process(json.loads(args.build_flashinfer), torch.device("cuda"))
        print(WARMUP_MARK + json.dumps(failed), flush=True)
        return {}
    # SIGTERM (a caller's time limit) ends what is being measured, and the report is still written
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        return run(args, argv, parser)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace, argv: list[str] | None, parser: argparse.ArgumentParser) -> dict:
    deadline = None if args.time_budget is None else time.monotonic() + args.time_budget

    if args.smoke and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --smoke for a tiny CPU run)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.num_q_heads, args.num_kv_heads, args.head_dim = 4, 2, 32
    bench = timer(device)
    torch.manual_seed(0)
    selected = [c for c in cases(256 if args.smoke else 1) if c.name in args.cases]
    if args.smoke:
        selected = [Case(c.name, c.label, c.q_lens[:3], c.seq_lens[:3], c.split_at) for c in selected]
    rows, ceilings, grid, left_out, stopped, failed, jit, canary = [], {}, [], [], None, {}, None, None
    # a grid-only run (--cases '') has files of its own, beside the cases' report of another run
    prefix = "attention" if selected or args.suite != "full" else "attention_grid"

    def write() -> dict:
        targets = check_targets(rows) if {r["case"] for r in rows} >= set("abcde") else []
        report = make_report(
            argv, "bench_attention", device, args, rows, ceilings=ceilings, targets=targets, grid=grid,
            grid_left_out=left_out, stopped_during=stopped, failed_cases=failed, flashinfer_jit=jit, canary=canary,
        )  # fmt: skip
        save(args.out, stem(prefix, report), report, markdown(report))
        return report

    builds = flashinfer_builds(args, selected) if device.type == "cuda" and use_flashinfer(args) else []

    def warm() -> dict:
        log = args.out / "flashinfer_jit.log"
        return {"builds": len(builds)} | warm_flashinfer(builds, args.flashinfer_warmup, log)

    if args.warmup_only:  # writes no report
        try:
            jit = warm() if builds else None
        except Stopped:
            print("stopped by SIGTERM during FlashInfer's JIT builds", flush=True)
            return {"flashinfer_jit": None}
        print(f"FlashInfer JIT builds: {jit or 'none to make (no GPU, or FlashInfer not importable)'}", flush=True)
        return {"flashinfer_jit": jit}
    try:  # a stop here still writes the report: what was measured, and where it stopped
        if args.canary == "on" or (args.canary == "auto" and device.type == "cuda"):
            # each of ours once, in a child process: one that faults, hangs or is wrong is left out
            # (a sticky CUDA error or a hang here would end the run, every backend's rows after it)
            stopped = "the canary runs"
            canary = run_canary(backends_for(device.type), device=device.type)
            args.canary_failed = canary_failed(canary)
            print(f"canary: {canary}", flush=True)
        if builds:
            stopped = "FlashInfer's JIT builds"
            jit = warm()
            print(f"FlashInfer JIT builds: {jit}", flush=True)
            # a baseline that failed or was still compiling is left out: each try compiles for minutes
            args.flashinfer_failed = sorted({build_name(b) for b in builds} - set(jit["built"]))
        stopped = "the ceilings"
        ceilings = measure_ceilings(device, bench, args.smoke)
        later: dict[str, tuple] = {}
        no_triton = getattr(args, "canary_failed", {}).get("triton")  # every row's base: no case, no grid
        for case in selected:
            stopped = f"case {case.name}"
            if no_triton:
                failed[case.name] = f"not run: triton did not pass its canary run ({no_triton})"
                continue
            try:
                rows.append(run_case(case, args, device, bench, ceilings, later))
            except Exception as exc:  # noqa: BLE001  (reported; the other cases and the grid go on)
                later.pop(case.name, None)  # (inputs left before it failed: no variants without a row)
                failed[case.name] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(f"case {case.name} failed: {failed[case.name]}", flush=True)
                continue
            print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in rows[-1].items()}),
                  flush=True)  # fmt: skip
        for row in rows:
            if row["case"] not in later:
                continue
            stopped = f"the block orders and Triton variants of case {row['case']}"
            try:
                kept = later.pop(row["case"])
                time_block_orders(row, kept, bench)
                time_variants(row, kept, bench)
            except Exception as exc:  # noqa: BLE001  (reported; the other cases' variants go on)
                row["variants_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(f"variants of case {row['case']} failed: {row['variants_error']}", flush=True)
            print(json.dumps({k: row.get(k) for k in ("case", "block_orders", "variants")}), flush=True)
        stopped = None
    except Stopped:
        print(f"stopped by SIGTERM during {stopped}", flush=True)
    write()  # the cases' report before the grid: kept if the grid is cut off harder than SIGTERM
    if args.suite == "full" and not stopped and not getattr(args, "canary_failed", {}).get("triton"):
        grid, left_out = run_grid(args, device, bench, ceilings, deadline)
    report = write()
    if args.write_tuning:
        report["tuning"] = write_tuning(grid, report, device)
        print(f"tuning table: {report['tuning']}", flush=True)
        save(args.out, stem(prefix, report), report, markdown(report))
    if grid:
        plot_grid(grid, args.out / f"{stem(prefix, report)}_grid.png")
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
