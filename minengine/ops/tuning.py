"""Which of our GPU attention kernels ``auto`` runs, per call shape: ``triton``, ``cuda``,
``cuda-wgmma`` (the cuda kernel with Hopper wgmma prefill tiles, sm_90 only), ``cuda-wgmma-tma``
(those tiles with their K/V loaded by TMA where the page size allows), ``cuda-wgmma-pipe`` (the
TMA tiles pipelined) or ``cuda-wgmma-2wg`` (those with two warpgroups a block, 128-row tiles).

The choice comes from a table measured on the device and committed under
``minengine/ops/tuning/<device>.json``: ``python benchmarks/bench_attention.py --suite full
--write-tuning`` times our backends over the grid of shapes, page sizes, dtypes and batch kinds,
checks each output against triton's, and keeps, per (batch kind, dtype, head dim), the backend with
the lower total time among those that were right on every case. Without a table for the device,
``auto`` runs ``triton``.

The call shape is read from host values only (token count, sequence count, ``max_seqlen_q``), so
picking adds no device sync and works under CUDA graph capture.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from pathlib import Path

import torch

from triton_kernels.contract import FLOAT_DTYPES

TABLE_DIR = Path(__file__).resolve().parent / "tuning"
CHOICES = ("triton", "cuda", "cuda-wgmma", "cuda-wgmma-tma", "cuda-wgmma-pipe", "cuda-wgmma-2wg")
MAX_REL_ERR = 2e-2  # a grid row further than this from triton's output disqualifies its backend
KINDS = ("decode", "prefill", "mixed")


def device_slug(name: str) -> str:
    """File name of a device's table: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def call_kind(num_tokens: int, num_seqs: int, max_seqlen_q: int) -> str:
    """decode: one query token per sequence; prefill: the tokens are mostly long chunks; mixed:
    a few chunks among many decodes."""
    if max_seqlen_q <= 1:
        return "decode"
    if num_seqs <= 1 or 2 * num_tokens >= max_seqlen_q * num_seqs:
        return "prefill"
    return "mixed"


def table_key(kind: str, dtype: torch.dtype | str, head_dim: int) -> str:
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    return f"{kind}/{name}/{head_dim}"


_DTYPES = tuple(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)  # the contract's, as table_key names them
_KEY = re.compile(rf"({'|'.join(KINDS)})/({'|'.join(_DTYPES)})/[1-9][0-9]*")


def pick_from_rows(rows: list[dict]) -> dict[str, dict]:
    """Per table key, the fastest of our backends, totalled over the cases all its candidates ran.

    rows: bench_attention grid rows (``kind``, ``dtype``, ``head_dim``, ``backend``, ``ms``, the
    identifying ``shape`` and ``page``, and ``rel_err_vs_triton``); grid kind ``long-decode``
    counts as ``decode``. A key's candidates are the backends with a row for it and no row above
    ``MAX_REL_ERR`` (or NaN); it needs triton and one more.
    """
    by_key: dict[str, dict[tuple, dict[str, float]]] = {}
    wrong: set[tuple[str, str]] = set()
    for r in rows:
        if r["backend"] not in CHOICES:
            continue
        kind = "decode" if r["kind"] == "long-decode" else r["kind"]
        key = table_key(kind, r["dtype"], r["head_dim"])
        if not r.get("rel_err_vs_triton", 0.0) <= MAX_REL_ERR:  # NaN (an output never written) is wrong too
            wrong.add((key, r["backend"]))
        by_key.setdefault(key, {}).setdefault((r["shape"], r["page"], r["kind"]), {})[r["backend"]] = r["ms"]
    picked = {}
    for key, cases in sorted(by_key.items()):
        candidates = {b for times in cases.values() for b in times if (key, b) not in wrong}
        if "triton" not in candidates or len(candidates) < 2:
            continue
        totals = dict.fromkeys(sorted(candidates, key=CHOICES.index), 0.0)
        for times in cases.values():
            if candidates <= set(times):  # only cases every candidate ran compare
                for backend in totals:
                    totals[backend] += times[backend]
        picked[key] = {"backend": min(totals, key=totals.get), "total_ms": totals}
    return picked


def table_path(device_name: str) -> Path:
    return TABLE_DIR / f"{device_slug(device_name)}.json"


@functools.cache
def load_table(device_name: str) -> dict[str, str] | None:
    """``{table key: backend}`` for this device, or None when no table was committed for it."""
    path = table_path(device_name)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        entries = data["choices"]
        choices = {key: entry["backend"] for key, entry in entries.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(
            f"{path}: malformed tuning table ({type(e).__name__}: {e}); expected "
            '{"choices": {"<kind>/<dtype>/<head_dim>": {"backend": "<name>"}, ...}}'
        ) from None
    bad = [b for b in choices.values() if not isinstance(b, str) or b not in CHOICES]
    if bad:
        raise ValueError(f"{path}: backends {bad}; allowed: {', '.join(CHOICES)}")
    keys = [key for key in choices if not _KEY.fullmatch(key)]
    if keys:
        raise ValueError(
            f"{path}: keys {keys} are not <kind>/<dtype>/<head_dim>; kinds: {', '.join(KINDS)}; dtypes: "
            f"{', '.join(_DTYPES)}"
        )
    return choices


def tuned_attention(table: dict[str, str], kernels: dict[str, Callable]) -> Callable[..., torch.Tensor]:
    """A ``paged_attention`` that runs ``kernels[table[key of the call]]`` (``triton`` if unlisted)."""

    def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, *args, **kwargs):
        kind = call_kind(q.shape[0], cu_seqlens_q.shape[0] - 1, max_seqlen_q)
        backend = table.get(table_key(kind, q.dtype, q.shape[-1]), "triton")
        fn = kernels[backend]
        return fn(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, *args, **kwargs)

    return paged_attention
