"""minengine._C is built wherever nvcc is (CI compiles and links it on the CPU machine), and the
package works without it."""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def nvcc_present() -> bool:
    homes = [os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    return bool(shutil.which("nvcc")) or any(h and (Path(h) / "bin" / "nvcc").exists() for h in homes)


@pytest.mark.skipif(
    not nvcc_present() or os.environ.get("MINENGINE_BUILD_CUDA") == "0", reason="no nvcc: the extension is optional"
)
def test_extension_was_built_and_imports_without_a_gpu():
    from minengine import _C

    assert {"paged_attention", "store_kv", "gather_input_ids"} <= set(dir(_C))


def test_cuda_backend_errors_clearly_without_a_gpu():
    from minengine.ops import cuda

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    q = torch.zeros(1, 4, 32)
    cache = torch.zeros(2, 4, 2, 32)
    args = (q, cache, cache, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))
    with pytest.raises((RuntimeError, ValueError), match="minengine._C|CUDA tensors"):
        cuda.paged_attention(*args, torch.tensor([0, 1], dtype=torch.int32), 1)


@pytest.mark.skipif(
    not nvcc_present() or os.environ.get("MINENGINE_BUILD_CUDA") == "0", reason="no nvcc: the extension is optional"
)
def test_binding_takes_the_wrappers_keywords():
    """The pybind11 module and the emulator take the same keyword set from the Python wrapper
    (attention_impl is a pure host function, so this runs without a GPU)."""
    from minengine import _C
    from minengine.ops import cuda
    from minengine.ops.testing import make_paged_batch

    batch = make_paged_batch(
        [1, 9], [20, 9], num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16
    )
    _, args = cuda._attention_call(*batch.args(), None, batch.q, "auto")
    assert _C.attention_impl(**args) == cuda.IMPLS["mma"]
    assert _C.attention_impl(**(args | {"dtype": 2})) == cuda.IMPLS["simt"]
    with pytest.raises(TypeError):
        _C.attention_impl(**(args | {"extra": 1}))
    with pytest.raises(ValueError, match="attention impl 7; allowed"):
        _C.attention_impl(**(args | {"impl": 7}))
    if "9.0a" in os.environ.get("MINENGINE_CUDA_ARCHS", "8.0;9.0a") and not torch.cuda.is_available():
        # A 9.0a build knows it holds wgmma machine code, so it asks the device (none here) rather
        # than refusing for the build's sake; either way the refusal comes before any launch.
        for impl in cuda.WGMMA_IMPLS:
            with pytest.raises(ValueError, match="wgmma kernel could not read the device's compute capability"):
                _C.paged_attention(**(args | {"impl": cuda.IMPLS[impl]}))


def _setup_py(**env: str):
    """Runs setup.py far enough to read its build variables (``--name`` builds nothing)."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MINENGINE_")} | env
    return subprocess.run(
        [sys.executable, "setup.py", "--name"], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("value", ["false", "off", "yes", "2"])
def test_a_bad_build_switch_is_named(value):
    done = _setup_py(MINENGINE_BUILD_CUDA=value)
    assert done.returncode != 0
    assert f"MINENGINE_BUILD_CUDA is '{value}'; allowed: 1" in done.stderr


@pytest.mark.skipif(not nvcc_present(), reason="the arch list is read only when nvcc builds the extension")
@pytest.mark.parametrize(
    ("archs", "message"),
    [
        ("7.5", "entry '7.5' (in '7.5') is not supported; allowed: compute capabilities 8.0 or newer"),
        ("8.0;8.6+PTX", "entry '8.6+PTX' (in '8.0;8.6+PTX') is not supported"),
        ("8.0 9.0", "entry '8.0 9.0'"),
        ("8.0a", "entry '8.0a'"),  # arch-specific targets begin at 9.0, family (f) ones at 10.0
        ("9.0f", "entry '9.0f'"),
        ("800", "entry '800'"),
        (" ; ", "it needs at least one architecture"),
    ],
)
def test_a_bad_arch_list_is_named_before_any_compile(archs, message):
    done = _setup_py(MINENGINE_CUDA_ARCHS=archs)
    assert done.returncode != 0
    assert message in done.stderr


def test_arch_lists_we_take():
    """parse_archs and gencode_flags, taken out of setup.py (importing it would run setup())."""
    tree = ast.parse((Path(__file__).resolve().parents[1] / "setup.py").read_text())
    wanted = [
        n
        for n in tree.body
        if isinstance(n, (ast.Import, ast.ImportFrom))
        or (isinstance(n, ast.FunctionDef) and n.name in ("parse_archs", "gencode_flags"))
    ]
    ns: dict = {}
    exec(compile(ast.Module(wanted, type_ignores=[]), "setup.py", "exec"), ns)
    assert ns["parse_archs"]("8.0;86; 9.0a;10.0f;12.0;") == ["80", "86", "90a", "100f", "120"]
    flags = " ".join(ns["gencode_flags"]("9.0a"))  # no PTX: an arch-specific target is not portable
    assert "arch=compute_90a,code=sm_90a" in flags and "code=compute_" not in flags
    assert "arch=compute_80,code=compute_80" in " ".join(ns["gencode_flags"]("8.0;9.0a"))


def _compile_report():
    spec = importlib.util.spec_from_file_location(
        "compile_report", Path(__file__).resolve().parents[1] / "profiles" / "compile_report.py"
    )
    compile_report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compile_report)
    return compile_report


@pytest.mark.skipif(
    not nvcc_present() or os.environ.get("MINENGINE_BUILD_CUDA") == "0", reason="no nvcc: the extension is optional"
)
def test_hopper_tiles_keep_three_blocks_per_sm():
    """ptxas -v of csrc/paged_attention.cu for sm_90a: no kernel spills or has a wgmma serialized,
    and the D <= 128 tensor-core kernels stay within 168 registers, so three 128-thread blocks share
    an SM (65536 / 384 = 170, allocated in steps of 8). Their shared memory fits three too: 70 KB
    each (the decode tiles' two stages and the key offsets; the TMA tiles' page ids and mbarriers
    add 80 bytes), of 227. A change that looks cheaper by
    its instruction count can still cost a block per SM here (the unmasked-stage branch did, in the
    64-row mma.sync tile: 180 registers). The pipelined tiles hold the previous stage's P beside S and
    take a third stage buffer: two blocks an SM at D 128 (at most 255 registers, 99 KB), three at D 64 (168
    registers, 51 KB). The two-warpgroup tiles (256 threads) run one block an SM: at most 255."""
    rows = _compile_report().csrc_report(["90a"])
    names = {"wgmma bf16 D128", "wgmma-tma bf16 D128", "wgmma-pipe bf16 D128", "wgmma-pipe fp16 D64", "mma fp16 D128"}
    assert names | {"mma bf16 D256", "wgmma-2wg bf16 D128", "wgmma-2wg fp16 D64"} <= {r["kernel"] for r in rows}
    for r in rows:
        assert r["spill"] == 0 and r["arrive"] == 0, r
        if r["kernel"].startswith("wgmma-2wg") or r["kernel"] in ("wgmma-pipe bf16 D128", "wgmma-pipe fp16 D128"):
            assert r["regs"] <= 255, r
        elif r["kernel"].startswith(("wgmma", "mma")) and not r["kernel"].endswith("D256"):
            assert r["regs"] <= 168, r


@pytest.mark.skipif(
    not nvcc_present() or os.environ.get("MINENGINE_BUILD_CUDA") == "0", reason="no nvcc: the extension is optional"
)
def test_pipelined_tile_keeps_its_p_v_in_flight_through_the_softmax(tmp_path):
    """The SASS of the wgmma-pipe and wgmma-2wg kernels (sm_90a): after issuing a stage's S and the previous
    stage's P V, the tile waits with one wgmma group still pending (`WARPGROUP.DEPBAR.LE gsb0, 0x1`),
    so the P V runs through the softmax. The emulator cannot see this (a wait for both groups gives
    the same results, only slower): a `wgmma_wait<0>` there, or ptxas serializing the groups, fails
    here. The serial wgmma-tma kernels never wait that way."""
    from triton_kernels.aot import cuobjdump

    cubin = tmp_path / "paged_attention.cubin"
    cmd = [_compile_report().nvcc(), "-std=c++17", "-O3", "-arch=sm_90a", "-DMINENGINE_SM90A=1", "-cubin"]
    cmd += ["-I", str(Path(__file__).resolve().parents[1] / "csrc"), "-o", str(cubin)]
    subprocess.run(cmd + [str(Path(__file__).resolve().parents[1] / "csrc" / "paged_attention.cu")], check=True)
    sass = subprocess.run([cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    functions = {f.split("\n", 1)[0].strip(): f for f in sass.split("Function : ")[1:]}
    pipe = [body for name, body in functions.items() if "attention_mma_kernel" in name and "ELb1ELb1ELb1E" in name]
    serial = [body for name, body in functions.items() if "attention_mma_kernel" in name and "ELb1ELb1ELb0E" in name]
    assert len(pipe) == 8 and len(serial) == 4  # fp16 / bf16 x D 64 / 128 (x one or two warpgroups, pipelined)
    for body in pipe:
        assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in body
    for body in serial:
        assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" not in body
