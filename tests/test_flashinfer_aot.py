"""benchmarks/flashinfer_aot.py: FlashInfer's modules compiled on the CPU machine and installed on the
GPU machine only where they match. The compile itself needs FlashInfer (optional) and minutes of nvcc:
its discovery runs here where FlashInfer imports; the install, the driver stub and the checks run
everywhere with stand-ins."""

import json
import os
import shutil
import subprocess
import sys
import tarfile
import types
from pathlib import Path

import pytest
from test_bench_smoke import load_bench

ROOT = Path(__file__).resolve().parent.parent


def load_aot():
    return load_bench("flashinfer_aot")


def test_target_names_and_the_bench_baselines_it_compiles_for(capsys):
    aot = load_aot()
    assert aot.target_arch("9.0a") == "90a" and aot.target_arch("8.0") == "80"
    for bad in ("sm_90a", "9", "90a", ""):
        with pytest.raises(ValueError, match=f"--arch {bad!r}: expected a CUDA arch such as 9.0a"):
            aot.target_arch(bad)
    for argv, error in ((["--arch", "sm_90a"], "--arch 'sm_90a': expected a CUDA arch such as 9.0a"),
                        (["--jobs", "0"], "--jobs 0: must be at least 1")):  # fmt: skip
        with pytest.raises(SystemExit) as stopped:
            aot.main(argv)
        assert stopped.value.code == 2
        assert error in capsys.readouterr().err
    env = types.SimpleNamespace(FLASHINFER_CACHE_DIR=Path("/c"), FLASHINFER_WORKSPACE_DIR=Path("/c/0.5.3/90a"))
    assert aot.flashinfer_target(env, "0.5.3") == "90a"
    env.FLASHINFER_WORKSPACE_DIR = Path("/c/0.5.3")  # no GPU seen, no FLASHINFER_CUDA_ARCH_LIST
    assert aot.flashinfer_target(env, "0.5.3") == "none"
    env.FLASHINFER_WORKSPACE_DIR = Path("/elsewhere/90a")  # another layout: its last part
    assert aot.flashinfer_target(env, "0.5.3") == "90a"
    # the bench's cases and its grid's FlashInfer configs: the served model's shape, four baselines;
    # then the engine's FlashInfer tests' shapes, decode and prefill each
    tests = [("float16", hq, hkv, 64, kind, "paged") for hq, hkv in aot.TEST_HEADS for kind in ("decode", "prefill")]
    assert aot.default_builds() == [
        ("bfloat16", 32, 8, 128, "decode", "paged"),
        ("bfloat16", 32, 8, 128, "prefill", "paged"),
        ("bfloat16", 32, 8, 128, "mixed", "paged"),
        ("bfloat16", 32, 8, 128, "mixed", "pod"),
        *tests,
    ]


def test_the_test_shapes_are_those_of_the_engines_flashinfer_tests():
    """TEST_HEADS follows the tests it compiles for: test_cuda_graph.py's FlashInfer graph tests'
    heads (fp16, head dim 64) and test_backend_logits.py's model (fp16; build_checkpoint's default
    4/2 heads at hidden size 256: head dim 64)."""
    import inspect

    import test_backend_logits
    import test_cuda_graph
    from checkpoints import build_checkpoint

    aot = load_aot()
    assert (aot.TEST_DTYPE, aot.TEST_HEAD_DIM) == ("float16", 64)
    test = test_cuda_graph.test_flashinfer_decode_graphs_match_its_eager_run_on_gpu
    (mark,) = [m for m in test.pytestmark if m.name == "parametrize"]
    assert mark.args[0].startswith("heads,")
    assert {params[0] for params in mark.args[1]} == set(aot.TEST_HEADS)
    source = inspect.getsource(test)
    assert "hidden_size=64 * num_heads" in source and 'dtype="float16"' in source
    defaults = inspect.signature(build_checkpoint).parameters
    heads = defaults["num_heads"].default, defaults["num_kv_heads"].default
    assert heads in aot.TEST_HEADS and 256 // heads[0] == aot.TEST_HEAD_DIM
    source = inspect.getsource(test_backend_logits)
    assert 'build_checkpoint(tmp_path_factory.mktemp("llama64"), "llama", hidden_size=256)' in source
    assert 'check_backend(checkpoint, sequences, kernels, "float16", "cuda"' in source


def test_curand_headers_come_from_the_toolkit_or_out_of_its_wheel(tmp_path):
    """A toolkit with cuRAND's headers needs nothing more; else they are taken out of the cuRAND wheel
    (the headers only, flat), and a second run finds them without downloading again."""
    import zipfile

    aot = load_aot()
    toolkit = tmp_path / "cuda"
    (toolkit / "include").mkdir(parents=True)
    (toolkit / "include" / "curand_kernel.h").write_text("")
    assert aot.curand_include(toolkit, tmp_path / "curand") is None
    wheel = tmp_path / "nvidia_curand-10.4.0.35-py3-none-manylinux_2_27_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name in ("include/curand_kernel.h", "include/curand.h", "lib/libcurand.so.10", "include/other.h"):
            archive.writestr(f"nvidia/cu13/{name}", name)
    aot.curand_headers(wheel, tmp_path / "curand" / "include")
    assert sorted(p.name for p in (tmp_path / "curand" / "include").iterdir()) == ["curand.h", "curand_kernel.h"]
    assert aot.curand_include(tmp_path / "bare", tmp_path / "curand") == tmp_path / "curand" / "include"
    with zipfile.ZipFile(tmp_path / "empty.whl", "w") as archive:
        archive.writestr("nvidia/cu13/include/curand.h", "")
    with pytest.raises(SystemExit, match="empty.whl has no curand_kernel.h"):
        aot.curand_headers(tmp_path / "empty.whl", tmp_path / "other")


@pytest.mark.skipif(not all(shutil.which(t) for t in ("cc", "nm", "readelf")), reason="needs cc, nm, readelf")
def test_the_driver_stub_makes_modules_name_the_driver(tmp_path):
    """A module that calls the driver API, linked against the stub, names libcuda.so.1 as needed (the
    real driver resolves it on the GPU machine); one linked without it is caught before it is carried."""
    aot = load_aot()
    stub = aot.stub_libcuda(tmp_path / "stub")
    readelf = subprocess.run(["readelf", "-d", str(stub / "libcuda.so")], capture_output=True, text=True).stdout
    assert "Library soname: [libcuda.so.1]" in readelf
    (tmp_path / "m.c").write_text("int cuInit(unsigned); int call(void) { return cuInit(0); }\n")
    with_stub, without = tmp_path / "with.so", tmp_path / "without.so"
    base = ["cc", "-shared", "-fPIC", str(tmp_path / "m.c")]
    subprocess.run([*base, f"-L{stub}", "-Wl,--no-as-needed", "-lcuda", "-o", str(with_stub)], check=True)
    subprocess.run([*base, "-o", str(without)], check=True)
    assert aot.needs_driver_but_lacks_it(with_stub) == []
    assert aot.needs_driver_but_lacks_it(without) == ["cuInit"]


def stand_in_flashinfer(monkeypatch, tmp_path, version="0.5.3", tvm="0.1.15.post2", arch="90a") -> Path:
    """flashinfer, flashinfer.jit.env and tvm_ffi as the installed ones would answer; returns the AOT dir."""
    aot_dir = tmp_path / "site" / "flashinfer" / "data" / "aot"
    env = types.ModuleType("flashinfer.jit.env")
    env.FLASHINFER_AOT_DIR = aot_dir
    env.FLASHINFER_CACHE_DIR = tmp_path / "cache"
    env.FLASHINFER_WORKSPACE_DIR = tmp_path / "cache" / version / arch  # (arch "": no GPU seen)
    package = types.ModuleType("flashinfer")
    package.__version__ = version
    package.jit = types.ModuleType("flashinfer.jit")
    package.jit.env = env
    tvm_ffi = types.ModuleType("tvm_ffi")
    tvm_ffi.__version__ = tvm
    tvm_ffi.load_module = lambda path: None
    for name, module in (("flashinfer", package), ("flashinfer.jit", package.jit), ("flashinfer.jit.env", env),
                         ("tvm_ffi", tvm_ffi)):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, module)
    return aot_dir


def carried(tmp_path, names=("mod_a", "mod_b"), extra=(), **manifest) -> Path:
    """A carry as flashinfer_aot.py writes it: the modules in an xz tar, and the manifest with their
    sha256 (each module's content is its path)."""
    import hashlib

    source = tmp_path / ".flashinfer_aot"
    (source / "build").mkdir(parents=True)
    with tarfile.open(source / "modules.tar.xz", "w:xz") as archive:
        for path in [f"{name}/{name}.so" for name in names] + list(extra):
            (source / "build" / path).parent.mkdir(parents=True, exist_ok=True)
            (source / "build" / path).write_bytes(path.encode())
            archive.add(source / "build" / path, arcname=path)
    shutil.rmtree(source / "build")
    modules = {n: {"bytes": 5, "sha256": hashlib.sha256(f"{n}/{n}.so".encode()).hexdigest()} for n in names}
    fields = {"flashinfer": "0.5.3", "tvm_ffi": "0.1.15.post2", "arch": "90a", "modules": modules}
    (source / "manifest.json").write_text(json.dumps(fields | manifest))
    return source


def test_install_copies_matching_modules_into_flashinfers_aot_directory(monkeypatch, tmp_path, capsys):
    aot = load_aot()
    aot_dir = stand_in_flashinfer(monkeypatch, tmp_path)
    source = carried(tmp_path, extra=["../outside.so", "mod_c/mod_c.so"])  # not the manifest's: not written
    loads = []
    monkeypatch.setattr(sys.modules["tvm_ffi"], "load_module", loads.append, raising=False)
    assert aot.main(["--install", str(source)]) == 0
    assert capsys.readouterr().out == (
        f"flashinfer aot: installed 2 of 2 modules into {aot_dir} (FlashInfer 0.5.3, 90a)\n"
    )
    assert loads == [str(aot_dir / "mod_a" / "mod_a.so"), str(aot_dir / "mod_b" / "mod_b.so")]  # each loaded once
    for name in ("mod_a", "mod_b"):
        assert (aot_dir / name / f"{name}.so").read_bytes() == f"{name}/{name}.so".encode()
    assert sorted(p.name for p in aot_dir.rglob("*")) == ["mod_a", "mod_a.so", "mod_b", "mod_b.so"]
    assert not (aot_dir.parent / "outside.so").exists()


@pytest.mark.parametrize(
    ("installed", "manifest", "why"),
    [
        ({"version": "0.6.0"}, {}, "flashinfer 0.5.3 built, 0.6.0 here"),
        ({"tvm": "0.1.16"}, {}, "tvm_ffi 0.1.15.post2 built, 0.1.16 here"),
        ({"arch": "100a"}, {}, "arch 90a built, 100a here"),
        ({"arch": ""}, {}, "arch 90a built, none here"),
        ({"version": "0.6.0", "arch": "80"}, {}, "flashinfer 0.5.3 built, 0.6.0 here; arch 90a built, 80 here"),
        ({}, {"modules": {"mod_a": {}, "mod_c": {}}}, "the manifest's mod_c not in modules.tar.xz"),
        ({}, {"modules": {"../../x": {}, "a/b": {}}}, "the manifest names '../../x', 'a/b', not module names"),
    ],
)
def test_install_refuses_modules_not_built_for_what_is_installed(monkeypatch, tmp_path, installed, manifest, why):
    """Another FlashInfer, tvm-ffi or target, or a module missing: nothing is installed (the warm-up
    then compiles, as without the carry), and the line says why."""
    aot = load_aot()
    aot_dir = stand_in_flashinfer(monkeypatch, tmp_path, **installed)
    assert aot.install(carried(tmp_path, **manifest)) == f"nothing installed: {why}"
    assert not aot_dir.exists()


def test_install_without_a_carry_or_without_flashinfer(monkeypatch, tmp_path):
    aot = load_aot()
    assert aot.install(tmp_path / "absent") == f"nothing installed: no {tmp_path / 'absent' / 'manifest.json'}"
    stand_in_flashinfer(monkeypatch, tmp_path)
    (carried(tmp_path) / "modules.tar.xz").unlink()
    archive = tmp_path / ".flashinfer_aot" / "modules.tar.xz"
    assert aot.install(tmp_path / ".flashinfer_aot") == f"nothing installed: no {archive}"
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # an import that fails
    assert aot.install(carried(tmp_path)).startswith(
        "nothing installed: FlashInfer does not import (ModuleNotFoundError: "
    )
    broken = types.ModuleType("flashinfer")
    broken.__getattr__ = lambda name: 1 / 0  # a dependency failing inside FlashInfer's own import
    monkeypatch.setitem(sys.modules, "flashinfer", broken)
    monkeypatch.delitem(sys.modules, "flashinfer.jit", raising=False)
    monkeypatch.delitem(sys.modules, "flashinfer.jit.env", raising=False)
    assert "FlashInfer does not import (" in aot.install(tmp_path / ".flashinfer_aot")


def test_a_module_that_does_not_match_or_load_is_removed_so_flashinfer_compiles_it(monkeypatch, tmp_path):
    """FlashInfer loads a module in its AOT directory without falling back to compiling it: a module
    whose bytes are not the manifest's, or that does not load, is taken out again (the others stay)."""
    aot = load_aot()
    aot_dir = stand_in_flashinfer(monkeypatch, tmp_path)
    source = carried(tmp_path, names=("mod_a", "mod_b", "mod_c"))
    manifest = json.loads((source / "manifest.json").read_text())
    manifest["modules"]["mod_b"]["sha256"] = "0" * 64
    (source / "manifest.json").write_text(json.dumps(manifest))

    def load(path):
        if path.endswith("mod_c.so"):
            raise RuntimeError("libcudart.so.13: cannot open shared object file\nmore")

    assert aot.install(source, load=load) == (
        f"installed 1 of 3 modules into {aot_dir} (FlashInfer 0.5.3, 90a); "
        "removed, to be compiled: mod_b: its sha256 is not the manifest's; "
        "removed, to be compiled: mod_c: does not load (RuntimeError: libcudart.so.13: cannot open shared object file)"
    )
    assert sorted(p.relative_to(aot_dir).as_posix() for p in aot_dir.rglob("*")) == ["mod_a", "mod_a/mod_a.so"]


def test_a_compile_run_puts_its_carry_in_place_only_when_it_succeeds(monkeypatch, tmp_path, capsys):
    """The compiling child gets the target, a workspace, the stub's directory and release settings; its
    output replaces --out only when it succeeds (a failed run keeps the last good carry); an --out
    that is not empty and holds no manifest is refused."""
    aot = load_aot()
    toolkit = tmp_path / "cuda"
    (toolkit / "include").mkdir(parents=True)
    (toolkit / "include" / "curand_kernel.h").write_text("")
    monkeypatch.setenv("CUDA_HOME", str(toolkit))
    monkeypatch.setenv("FLASHINFER_JIT_DEBUG", "1")
    monkeypatch.setattr(aot, "find_spec", lambda name: True)
    monkeypatch.setattr(aot, "stub_libcuda", lambda directory: directory)
    children, rc = [], [0]

    def run(command, env=None, **kwargs):
        if "--child" in command:
            children.append(env)
            out = Path(command[command.index("--out") + 1])
            (out / "manifest.json").write_text(f"run {len(children)}")
        elif "pip" in command:
            Path(command[command.index("--target") + 1]).mkdir(parents=True)
        return subprocess.CompletedProcess(command, rc[0])

    monkeypatch.setattr(aot.subprocess, "run", run)
    out, work, wheel = tmp_path / "carry", tmp_path / "work", tmp_path / "flashinfer_python-0.5.3-py3-none-any.whl"
    wheel.write_bytes(b"wheel")
    argv = ["--out", str(out), "--workspace", str(work), "--wheel", str(wheel), "--jobs", "3"]
    assert aot.main(argv) == 0
    assert (out / "manifest.json").read_text() == "run 1" and not out.with_name("carry.part").exists()
    env = children[0]
    assert env["FLASHINFER_CUDA_ARCH_LIST"] == "9.0a" and env["CUDA_HOME"] == str(toolkit)
    assert env["FLASHINFER_WORKSPACE_BASE"] == str(work / "workspace")
    assert env["FLASHINFER_EXTRA_LDFLAGS"] == f"-L{work / 'stub'}" and "FLASHINFER_EXTRA_CUDAFLAGS" not in env
    assert "FLASHINFER_JIT_DEBUG" not in env and env["PYTHONPATH"].startswith(str(work / "site"))
    assert aot.main(argv) == 0 and (out / "manifest.json").read_text() == "run 2"  # the wheel installed once
    rc[0] = 1
    assert aot.main(argv) == 1
    assert (out / "manifest.json").read_text() == "run 2" and not out.with_name("carry.part").exists()
    assert "failed (exit 1)" in capsys.readouterr().err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("")
    with pytest.raises(SystemExit):
        aot.main(["--out", str(tmp_path / "other"), "--workspace", str(work), "--wheel", str(wheel)])
    assert "not empty and holds no manifest.json" in capsys.readouterr().err
    assert (tmp_path / "other" / "notes.txt").exists()


def test_the_bench_report_counts_prebuilt_and_compiled_modules():
    bench_attention = load_bench()
    jit = {"builds": 4, "seconds": 3.2, "finished": True, "built": ["a", "b", "c", "d"], "failed": {},
           "prebuilt": ["m1", "m2", "m3", "m4"], "compiled": ["m5"]}  # fmt: skip
    line = next(line for line in bench_attention.markdown(minimal_report(jit)).splitlines() if "JIT" in line)
    assert line == (
        "- FlashInfer JIT builds (modules compiled together): done after 3.2 s, 4 of 4 baselines built "
        "(the others are left out); 4 modules loaded prebuilt, 1 compiled here"
    )
    old = {k: v for k, v in jit.items() if k not in ("prebuilt", "compiled")}  # stop 41's report
    line = next(line for line in bench_attention.markdown(minimal_report(old)).splitlines() if "JIT" in line)
    assert line.endswith("4 of 4 baselines built (the others are left out)")


def minimal_report(jit: dict) -> dict:
    return {"command": "c", "date": "d", "info": {"device": "cpu"}, "config": {}, "ceilings": {}, "rows": [],
            "targets": [], "grid": [], "flashinfer_jit": jit}  # fmt: skip


def test_discovery_finds_the_modules_the_wrappers_ask_for(tmp_path):
    """With FlashInfer importable (an optional dependency, not installed by CI), in a process of its
    own with FlashInfer imported for sm_90a: running the bench's baselines on CPU with the loader
    recorded finds exactly the five modules FlashInfer's generators name for them (decode on CUDA
    cores at group 4, the FA3 prefill, its page helper, POD's FA2 prefill and POD), then the three of
    the tests' fp16 head-dim-64 shapes (decode on CUDA cores; the FA3 prefill; the FA2 prefill,
    which FlashInfer's tensor-core decode at group 8 runs), leaves no stand-in
    in FlashInfer's module caches, and a module put where ``member`` says is one FlashInfer loads
    ahead of compiling (``is_aot``)."""
    pytest.importorskip("flashinfer.jit.core", reason="FlashInfer is not installed (optional)")
    code = f"""
import json, sys
sys.path[:0] = [{str(ROOT / "benchmarks")!r}, {str(ROOT)!r}]
import torch, flashinfer, flashinfer_aot as a
from flashinfer.jit import env
from flashinfer.jit.attention import modules as m
from flashinfer.jit.page import gen_page_module
names = [s.name for s in a.discover(a.default_builds())]
b, h, i = torch.bfloat16, torch.float16, torch.int32
expected = [m.gen_batch_decode_module(b, b, b, i, 128, 128, 0, False, False).name,
            m.gen_batch_prefill_module("fa3", b, b, b, i, 128, 128, 0, False, False, False).name,
            gen_page_module().name,
            m.gen_batch_prefill_module("fa2", b, b, b, i, 128, 128, 0, False, False, False).name,
            m.gen_batch_pod_module(b, b, b, 128, 0, False, False, False, i, 0, False, False).name,
            m.gen_batch_decode_module(h, h, h, i, 64, 64, 0, False, False).name,
            m.gen_batch_prefill_module("fa3", h, h, h, i, 64, 64, 0, False, False, False).name,
            m.gen_batch_prefill_module("fa2", h, h, h, i, 64, 64, 0, False, False, False).name]
cached = sum(f.cache_info().currsize for mod in (flashinfer.prefill, flashinfer.decode, flashinfer.page, flashinfer.pod)
             for f in vars(mod).values() if hasattr(f, "cache_info"))
env.FLASHINFER_AOT_DIR = __import__("pathlib").Path({str(tmp_path)!r})
(env.FLASHINFER_AOT_DIR / a.member("page")).parent.mkdir(parents=True)
(env.FLASHINFER_AOT_DIR / a.member("page")).write_bytes(b"")
print(json.dumps([names, expected, cached, gen_page_module().is_aot, a.flashinfer_target(env, flashinfer.__version__)]))
"""
    env = dict(os.environ, FLASHINFER_CUDA_ARCH_LIST="9.0a")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    names, expected, cached, is_aot, target = json.loads(done.stdout.splitlines()[-1])
    assert names == expected and names[2] == "page" and names[1].endswith("_sm90"), names
    assert cached == 0 and is_aot and target == "90a"
