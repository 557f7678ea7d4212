"""Which of our GPU attention kernels (``triton`` or ``cuda``) ``auto`` runs, per call shape.

The choice comes from a table measured on the device and committed under
``minengine/ops/tuning/<device>.json``: ``python benchmarks/bench_attention.py --suite full
--write-tuning`` times both backends over the grid of shapes, page sizes, dtypes and batch kinds
and keeps, per (batch kind, dtype, head dim), the backend with the lower total time. Without a
table for the device, ``auto`` runs ``triton``.

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

TABLE_DIR = Path(__file__).resolve().parent / "tuning"
CHOICES = ("triton", "cuda")
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


def pick_from_rows(rows: list[dict]) -> dict[str, dict]:
    """Per table key, the backend with the lower total time over the rows both backends ran.

    rows: bench_attention grid rows (``kind``, ``dtype``, ``head_dim``, ``backend``, ``ms`` and the
    identifying ``shape`` and ``page``); grid kind ``long-decode`` counts as ``decode``.
    """
    cases: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r["backend"] in CHOICES:
            kind = "decode" if r["kind"] == "long-decode" else r["kind"]
            case = (table_key(kind, r["dtype"], r["head_dim"]), r["shape"], r["page"], r["kind"])
            cases.setdefault(case, {})[r["backend"]] = r["ms"]
    totals: dict[str, dict[str, float]] = {}
    for (key, *_), times in cases.items():
        if set(times) == set(CHOICES):  # only cases both ran compare
            for backend, ms in times.items():
                totals.setdefault(key, dict.fromkeys(CHOICES, 0.0))[backend] += ms
    return {key: {"backend": min(t, key=t.get), "total_ms": t} for key, t in sorted(totals.items())}


def table_path(device_name: str) -> Path:
    return TABLE_DIR / f"{device_slug(device_name)}.json"


@functools.cache
def load_table(device_name: str) -> dict[str, str] | None:
    """``{table key: backend}`` for this device, or None when no table was committed for it."""
    path = table_path(device_name)
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    choices = {key: entry["backend"] for key, entry in data["choices"].items()}
    bad = {b for b in choices.values() if b not in CHOICES}
    if bad:
        raise ValueError(f"{path}: backends {sorted(bad)}; allowed: {', '.join(CHOICES)}")
    return choices


def tuned_attention(table: dict[str, str], kernels: dict[str, Callable]) -> Callable[..., torch.Tensor]:
    """A ``paged_attention`` that runs ``kernels[table[key of the call]]`` (``triton`` if unlisted)."""

    def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, *args, **kwargs):
        kind = call_kind(q.shape[0], cu_seqlens_q.shape[0] - 1, max_seqlen_q)
        backend = table.get(table_key(kind, q.dtype, q.shape[-1]), "triton")
        fn = kernels[backend]
        return fn(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, *args, **kwargs)

    return paged_attention
