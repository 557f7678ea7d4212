"""`auto`'s per-call-shape choice among triton, cuda and cuda-wgmma from a device's tuning table."""

from __future__ import annotations

import json

import pytest
import torch

from minengine import ops
from minengine.ops import tuning


def test_call_kinds():
    assert tuning.call_kind(num_tokens=128, num_seqs=128, max_seqlen_q=1) == "decode"
    assert tuning.call_kind(num_tokens=2048, num_seqs=1, max_seqlen_q=2048) == "prefill"
    assert tuning.call_kind(num_tokens=2048, num_seqs=4, max_seqlen_q=512) == "prefill"
    assert tuning.call_kind(num_tokens=1087, num_seqs=64, max_seqlen_q=1024) == "mixed"
    assert tuning.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def grid_row(kind, backend, ms, shape="llama3-8b", page=16, dtype="bfloat16", head_dim=128, err=1e-3):
    return dict(
        kind=kind, backend=backend, ms=ms, shape=shape, page=page, dtype=dtype, head_dim=head_dim, rel_err_vs_triton=err
    )


def test_pick_from_rows_totals_cases_both_backends_ran():
    rows = [
        grid_row("decode", "triton", 1.0),
        grid_row("decode", "cuda", 0.5),
        grid_row("long-decode", "triton", 1.0),
        grid_row("long-decode", "cuda", 2.0),  # decode total: triton 2.0, cuda 2.5
        grid_row("mixed", "triton", 3.0),
        grid_row("mixed", "cuda", 2.0),
        grid_row("mixed", "flashinfer", 0.1),  # not ours: not a choice
        grid_row("prefill", "cuda", 0.1, page=1),  # triton did not run this case: no comparison
        grid_row("prefill", "triton", 1.0),
        grid_row("prefill", "cuda", 1.5),
    ]
    picked = tuning.pick_from_rows(rows)
    assert {k: v["backend"] for k, v in picked.items()} == {
        "decode/bfloat16/128": "triton",
        "mixed/bfloat16/128": "cuda",
        "prefill/bfloat16/128": "triton",
    }
    assert picked["decode/bfloat16/128"]["total_ms"] == {"triton": 2.0, "cuda": 2.5}


def test_pick_from_rows_drops_a_backend_that_was_wrong_once():
    rows = [
        grid_row("prefill", "triton", 1.0),
        grid_row("prefill", "cuda", 0.9),
        grid_row("prefill", "cuda-wgmma", 0.5),
        grid_row("prefill", "triton", 1.0, page=64),
        grid_row("prefill", "cuda", 0.9, page=64),
        grid_row("prefill", "cuda-wgmma", 0.5, page=64),
        grid_row("mixed", "triton", 1.0),
        grid_row("mixed", "cuda", 0.9),
        grid_row("mixed", "cuda-wgmma", 0.5),
        grid_row("mixed", "triton", 1.0, page=64),
        grid_row("mixed", "cuda", 0.9, page=64),
        grid_row("mixed", "cuda-wgmma", 0.5, page=64, err=0.3),  # fast and wrong: out for mixed
        grid_row("decode", "triton", 1.0, head_dim=256),  # cuda-wgmma never ran d256
        grid_row("decode", "cuda", 2.0, head_dim=256),
    ]
    picked = tuning.pick_from_rows(rows)
    assert {k: v["backend"] for k, v in picked.items()} == {
        "decode/bfloat16/256": "triton",
        "mixed/bfloat16/128": "cuda",
        "prefill/bfloat16/128": "cuda-wgmma",
    }
    assert picked["mixed/bfloat16/128"]["total_ms"] == {"triton": 2.0, "cuda": 1.8}


def test_pick_from_rows_drops_a_backend_whose_output_was_nan():
    """The grid poisons each backend's output with NaN before checking it: a kernel that writes
    nothing has a NaN error, which must not pass as "not above MAX_REL_ERR" (and then win)."""
    rows = [grid_row("prefill", "triton", 1.0), grid_row("prefill", "cuda", 0.01, err=float("nan"))]
    rows += [grid_row("decode", "triton", 1.0), grid_row("decode", "cuda", 0.5)]
    picked = tuning.pick_from_rows(rows)
    assert {k: v["backend"] for k, v in picked.items()} == {"decode/bfloat16/128": "cuda"}


def test_every_cuda_choice_names_an_impl_of_the_cuda_backend():
    """The tuned backend runs ``cuda-<impl>`` as the cuda kernel with that impl forced, and the
    grid times every wgmma impl: the two lists are the same."""
    from minengine.ops import cuda

    impls = [name.removeprefix("cuda-") for name in tuning.CHOICES if name.startswith("cuda-")]
    assert impls == list(cuda.WGMMA_IMPLS)
    assert set(cuda.TMA_IMPLS) <= set(cuda.WGMMA_IMPLS) <= set(cuda.IMPLS)


def test_tuned_attention_dispatches_per_call_shape():
    calls = []
    kernels = {name: (lambda *a, _n=name, **k: calls.append(_n)) for name in tuning.CHOICES}
    table = {"decode/float16/64": "cuda", "mixed/float16/64": "triton"}
    attention = tuning.tuned_attention(table, kernels)
    q = torch.zeros(3, 4, 64, dtype=torch.float16)
    cache = torch.zeros(1, 1, 1, 64, dtype=torch.float16)

    def call(q, cu, max_q):
        attention(q, cache, cache, None, None, torch.tensor(cu), max_q)

    call(q, [0, 1, 2, 3], 1)  # decode: listed as cuda
    call(q, [0, 2, 3], 2)  # 2 * 3 >= 2 * 2: prefill, unlisted: triton
    call(torch.zeros(3, 4, 128, dtype=torch.float16), [0, 1, 2, 3], 1)  # other head dim: unlisted
    assert calls == ["cuda", "triton", "triton"]


def test_table_files_are_valid(tmp_path, monkeypatch):
    """Committed tables parse and name only our backends; a bad one fails with the file named."""
    for path in tuning.TABLE_DIR.glob("*.json"):
        assert tuning.load_table.__wrapped__(json.loads(path.read_text())["device_name"])
    monkeypatch.setattr(tuning, "TABLE_DIR", tmp_path)
    (tmp_path / "fake-gpu.json").write_text(json.dumps({"choices": {"decode/bfloat16/128": {"backend": "tvm"}}}))
    with pytest.raises(ValueError, match=r"fake-gpu.json: backends \['tvm'\]; allowed: triton, cuda"):
        tuning.load_table.__wrapped__("Fake GPU")
    assert tuning.load_table.__wrapped__("Other GPU") is None
    for text, message in [
        ("{", "malformed tuning table .JSONDecodeError"),
        ("{}", "malformed tuning table .KeyError: 'choices'"),
        ('{"choices": []}', "malformed tuning table .AttributeError"),
        ('{"choices": {"decode/bfloat16/128": "cuda"}}', "malformed tuning table .TypeError"),
        ('{"choices": {"decode/bfloat16/128": {"backend": ["cuda"]}}}', r"backends \[\['cuda'\]\]; allowed"),
        ('{"choices": {"decode/bf16/128": {"backend": "cuda"}}}', r"keys \['decode/bf16/128'\] are not <kind>"),
        ('{"choices": {"long-decode/float16/64": {"backend": "cuda"}}}', r"keys .*; kinds: decode, prefill, mixed;"),
    ]:
        (tmp_path / "fake-gpu.json").write_text(text)
        with pytest.raises(ValueError, match="fake-gpu.json: " + message):
            tuning.load_table.__wrapped__("Fake GPU")


def test_auto_is_torch_on_cpu():
    assert ops.resolve_backend("auto", "cpu") == "torch"


def test_attention_kernels_name_what_each_backend_runs(monkeypatch):
    """What a server's --attention-backend launches of ours (the serving runs' canary): ``auto``
    on CUDA runs triton without a table, and with one triton (its unlisted calls) and the table's."""
    assert ops.attention_kernels("auto", "cpu") == ()
    assert ops.attention_kernels("triton", "cpu") == ("triton",)
    assert ops.attention_kernels("cuda", "cuda") == ("cuda",)
    assert ops.attention_kernels("flashinfer", "cuda") == ops.attention_kernels("torch", "cuda") == ()
    monkeypatch.setattr(ops, "_tuning_table", lambda device: None)
    assert ops.attention_kernels("auto", "cuda") == ("triton",)
    table = {"decode/bfloat16/128": "cuda-wgmma-2wg", "mixed/bfloat16/128": "cuda", "prefill/float16/64": "cuda"}
    monkeypatch.setattr(ops, "_tuning_table", lambda device: table)
    assert ops.attention_kernels("auto", "cuda") == ("triton", "cuda", "cuda-wgmma-2wg")
    # a model's calls only: its dtype and head dim
    assert ops.attention_kernels("auto", "cuda", torch.bfloat16, 128) == ("triton", "cuda", "cuda-wgmma-2wg")
    assert ops.attention_kernels("auto", "cuda", torch.float16, 64) == ("triton", "cuda")
    assert ops.attention_kernels("auto", "cuda", torch.float16, 128) == ("triton",)
    # each a name attention_of takes, and every kernel the tuned attention dispatches to among them
    for name in tuning.CHOICES:
        ops.attention_of(name)
    dispatched = []
    kernels = {name: (lambda *a, _n=name, **k: dispatched.append(_n)) for name in tuning.CHOICES}
    attention = tuning.tuned_attention(table, kernels)
    for dtype, head_dim in ((torch.bfloat16, 128), (torch.float16, 64), (torch.float16, 128)):
        cache = torch.zeros(1, 1, 1, head_dim, dtype=dtype)
        kinds, dispatched[:] = [], []
        for cu, max_q in (([0, 1, 2, 3], 1), ([0, 3], 3), ([0, 5, 6, 7], 5)):  # decode, prefill, mixed
            kinds.append(tuning.call_kind(cu[-1], len(cu) - 1, max_q))
            q = torch.zeros(cu[-1], 4, head_dim, dtype=dtype)
            attention(q, cache, cache, None, None, torch.tensor(cu), max_q)
        assert kinds == list(tuning.KINDS)
        assert set(dispatched) <= set(ops.attention_kernels("auto", "cuda", dtype, head_dim)), (dtype, dispatched)
    with pytest.raises(ValueError, match="unknown attention backend 'tvm'; allowed: auto, torch, triton"):
        ops.attention_kernels("tvm", "cuda")
