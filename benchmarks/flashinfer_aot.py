"""FlashInfer's JIT modules for the GPU phases, compiled on this machine (nvcc needs no GPU) and
carried to the GPU machine as FlashInfer's AOT directory, where they load instead of compiling: the
`kernels` phase's FlashInfer warm-up took 159 s of device time on the H100 (stop 41) for the five
modules of its four baselines, and a fresh machine compiles them again for `serving backends`,
whose last step (the engine's FlashInfer tests, fp16 at head dim 64) needs three more.

  bash benchmarks/gpu_wheels.sh flashinfer      # .whl/: the FlashInfer wheel the GPU machine installs
  python3 benchmarks/flashinfer_aot.py          # .flashinfer_aot/: those modules for sm_90a (minutes)
  # the device call carries both: carry [".whl", ".flashinfer_aot"]; gpu_session.sh installs them

Which modules: those FlashInfer's wrappers ask for when bench_attention's warm-up builds the
baselines of its cases and of its grid's FlashInfer configs (the served model's shape too: bf16,
32/8/128), and at the shapes of the engine's FlashInfer GPU tests (fp16, head dim 64), which run
at the end of `serving backends`. They are found by running that same code (``build_baseline``)
here on CPU tensors in a child process, with FlashInfer's module loader replaced by a recorder that
hands back a stand-in module, and an sm_90a device standing in where the wrappers ask CUDA, so the
list follows the bench and FlashInfer's own naming instead of copying either. Then FlashInfer's
``build_jit_specs`` compiles them in one ninja run with this machine's nvcc for the GPU machine's
target (FlashInfer's link line asks for the driver library, which this machine lacks: a stub stands
in; a module that calls the driver API and does not name it is refused).

On the GPU machine ``--install`` copies them into FlashInfer's AOT directory
(``flashinfer/data/aot/<name>/<name>.so``, which FlashInfer loads before looking at its JIT cache)
only when the manifest's FlashInfer and tvm-ffi versions and target match what is installed there;
otherwise it says why and installs nothing, and the warm-up compiles as before. Each installed
module is checked against the manifest's sha256 and loaded once; one that does not load is removed
again (FlashInfer would not fall back to compiling it), so a bad carry costs a phase only the
install's seconds. The bench's report says how many modules loaded prebuilt and which compiled
(``flashinfer_jit``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import types
import zipfile
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / ".flashinfer_aot"
MANIFEST = "manifest.json"
ARCHIVE = "modules.tar.xz"
MODULE_NAME = re.compile(r"[A-Za-z0-9_]+")  # FlashInfer's module names (a manifest's are paths below its AOT dir)
CARRY_LIMIT = 64 * 2**20  # the device call's carry, working tree included
TREE_ALLOWANCE = 8 * 2**20  # the working tree's part of it (about 3 MB now)
# FlashInfer's settings for debug builds and nvcc's verbosity: not carried into the modules
DEBUG_SETTINGS = ("FLASHINFER_JIT_DEBUG", "FLASHINFER_JIT_VERBOSE", "FLASHINFER_JIT_LINEINFO")


def flashinfer_target(jit_env: types.ModuleType, version: str) -> str:
    """FlashInfer's name for the targets it compiles for (its workspace directory's, "90a" on an H100
    or with FLASHINFER_CUDA_ARCH_LIST=9.0a), or "none" where it sees no GPU and was given none."""
    workspace = Path(jit_env.FLASHINFER_WORKSPACE_DIR)
    try:
        name = workspace.relative_to(Path(jit_env.FLASHINFER_CACHE_DIR) / version).as_posix()
    except ValueError:  # another FlashInfer's layout: its last part, which a manifest then has to match
        name = workspace.name
    return "none" if name == "." else name


def member(name: str) -> str:
    """A module's path in the archive and in FlashInfer's AOT directory."""
    return f"{name}/{name}.so"


def target_arch(cuda_arch: str) -> str:
    """FlashInfer's name for a target (its workspace directory's): "9.0a" -> "90a"."""
    if not re.fullmatch(r"\d+\.\d+a?", cuda_arch):
        raise ValueError(f"--arch {cuda_arch!r}: expected a CUDA arch such as 9.0a (the H100's and H200's)")
    return cuda_arch.replace(".", "")


# (Hq, Hkv) of the engine's FlashInfer GPU tests, all fp16 at head dim 64 (the last step of
# gpu_session.sh's `serving backends`): test_backend_logits.py's model (4/2) and
# test_cuda_graph.py's FlashInfer graph tests (4/2; 8/1, FlashInfer's tensor-core decode; 8/8)
TEST_HEADS = ((4, 2), (8, 1), (8, 8))
TEST_DTYPE, TEST_HEAD_DIM = "float16", 64


def _bench_importable() -> None:
    """bench_attention importable (once on the path, however often asked)."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))


def default_builds() -> list[tuple]:
    """The bench's FlashInfer baselines for its cases a-e and its grid's FlashInfer configs (the run
    gpu_session.sh's kernels and grid phases make; serving's model has the cases' shape), then the
    same wrappers at the engine's FlashInfer tests' shapes (decode and prefill each)."""
    _bench_importable()
    import bench_attention

    args = bench_attention.make_parser().parse_args(["--suite", "full", "--flashinfer-grid", "target"])
    builds = bench_attention.flashinfer_builds(args, bench_attention.cases(1))
    for hq, hkv in TEST_HEADS:
        for kind in ("decode", "prefill"):
            if (item := (TEST_DTYPE, hq, hkv, TEST_HEAD_DIM, kind, "paged")) not in builds:
                builds.append(item)
    return builds


def cuda_home() -> Path:
    if os.environ.get("CUDA_HOME"):
        return Path(os.environ["CUDA_HOME"])
    nvcc = shutil.which("nvcc")
    for home in (Path("/usr/local/cuda"), *([Path(nvcc).resolve().parent.parent] if nvcc else [])):
        if (home / "bin" / "nvcc").exists():
            return home
    raise SystemExit("no CUDA toolkit found (nvcc): set CUDA_HOME")


# The FA3 prefill includes CUTLASS's device fill helpers, which include curand_kernel.h: a toolkit
# without cuRAND (this machine's) takes the headers from the cuRAND wheel CUDA 13.0's torch pins
CURAND_WHEEL = "nvidia-curand==10.4.0.35"


def curand_include(home: Path, directory: Path) -> Path | None:
    """None where the toolkit has cuRAND's headers; else a directory with them, taken out of the
    cuRAND wheel (downloaded once into ``directory``; the headers only, not its 60 MB of library)."""
    if (home / "include" / "curand_kernel.h").exists():
        return None
    include = directory / "include"
    if (include / "curand_kernel.h").exists():
        return include
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--platform", "manylinux_2_27_x86_64", "-d", str(directory), CURAND_WHEEL], check=True)  # fmt: skip
    wheel = next(directory.glob("nvidia_curand-*.whl"))
    curand_headers(wheel, include)
    wheel.unlink()
    return include


def curand_headers(wheel: Path, include: Path) -> None:
    """cuRAND's headers out of its wheel into ``include`` (flat, as a toolkit's include directory)."""
    with zipfile.ZipFile(wheel) as archive:
        headers = [n for n in archive.namelist() if re.fullmatch(r"nvidia/[^/]+/include/curand[^/]*\.h", n)]
        if not any(n.endswith("/curand_kernel.h") for n in headers):
            raise SystemExit(f"{wheel.name} has no curand_kernel.h")
        include.mkdir(parents=True, exist_ok=True)
        for name in headers:
            (include / Path(name).name).write_bytes(archive.read(name))


def stub_libcuda(directory: Path) -> Path:
    """An empty ``libcuda.so`` named ``libcuda.so.1``, to link against as the toolkit's stubs are: a
    module that uses the driver API names it as needed and finds the real one on the GPU machine (one
    that does not drops it where the linker links as needed)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "stub.c").write_text("void minengine_libcuda_stub(void) {}\n")
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(directory / "libcuda.so"),
                    str(directory / "stub.c")], check=True)  # fmt: skip
    return directory


def needs_driver_but_lacks_it(so: Path) -> list[str]:
    """The driver API symbols a module leaves undefined when it does not name libcuda.so.1 as needed
    (it would fail to load on the GPU machine)."""
    undefined = subprocess.run(["nm", "-D", "--undefined-only", str(so)], capture_output=True, text=True, check=True)
    driver = [line.split()[-1] for line in undefined.stdout.splitlines() if re.search(r"\bcu[A-Z]\w*$", line)]
    dynamic = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, check=True).stdout
    return [] if "[libcuda.so.1]" in dynamic else driver


# --- the child process: FlashInfer imported with this run's environment ------------------------


def discover(builds: list[tuple], cuda_arch: str = "9.0a") -> list:
    """The JitSpecs FlashInfer's wrappers ask for while the bench builds these baselines, in order,
    each once, run here on CPU tensors: the loader records each spec and returns a stand-in module
    (whose plan and run return stand-ins too), pinned buffers are plain ones, and the device checks
    see a GPU of that arch with 132 SMs (the H100's)."""
    import functools
    import unittest.mock

    import bench_attention
    import flashinfer.utils
    import torch
    from flashinfer.jit import core

    seen: dict[str, object] = {}

    def record(spec):
        seen.setdefault(spec.name, spec)
        return unittest.mock.MagicMock(name=spec.name)

    def unpinned(make):
        @functools.wraps(make)
        def call(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return make(*args, **kwargs)

        return call

    major, minor = (int(part.rstrip("a")) for part in cuda_arch.split("."))
    props = types.SimpleNamespace(multi_processor_count=132, major=major, minor=minor, name=f"stand-in {cuda_arch}")
    sm90a = cuda_arch == "9.0a"  # FlashInfer's FA3 prefill: on sm_90a only
    with contextlib.ExitStack() as stack:
        patch = stack.enter_context
        patch(unittest.mock.patch.object(core.JitSpec, "build_and_load", record))
        patch(unittest.mock.patch.object(flashinfer.utils, "is_sm90a_supported", lambda device: sm90a))
        patch(unittest.mock.patch.object(torch.cuda, "get_device_properties", lambda device=None: props))
        patch(unittest.mock.patch.object(torch.Tensor, "pin_memory", lambda self, *a, **k: self))
        for name in ("empty", "zeros", "tensor", "full", "arange"):
            patch(unittest.mock.patch.object(torch, name, unpinned(getattr(torch, name))))
        try:
            for item in builds:
                bench_attention.build_baseline(tuple(item), torch.device("cpu"))
        finally:  # FlashInfer's module getters cache what they loaded: the stand-ins must not stay
            for module in (flashinfer.prefill, flashinfer.decode, flashinfer.page, flashinfer.pod):
                for getter in vars(module).values():
                    if callable(getattr(getter, "cache_clear", None)):
                        getter.cache_clear()
    return list(seen.values())


def child(builds: list[tuple], out: Path, jobs: int, cuda_arch: str) -> None:
    """Find the modules, compile them together, copy each .so into ``out`` and write the manifest."""
    import flashinfer
    import tvm_ffi
    from flashinfer.jit import core
    from flashinfer.jit import env as jit_env

    specs = discover(builds, cuda_arch)
    print(f"{len(specs)} modules: " + ", ".join(s.name for s in specs), flush=True)
    for spec in specs:  # FlashInfer writes a module's build file only where there is none: a kept
        spec.write_ninja()  # workspace's would keep its old flags (rewritten only where they differ)
    start = time.monotonic()
    os.environ["MAX_JOBS"] = str(jobs)
    core.build_jit_specs(specs, verbose=False)
    seconds = time.monotonic() - start
    modules = {}
    # xz: the modules are mostly SASS, about a seventh of their size compressed (POD's 16 mask
    # instantiations alone are about 70 MB, more than the device call's whole carry)
    with tarfile.open(out / ARCHIVE, "w:xz", preset=6) as archive:
        for spec in specs:
            so = spec.jit_library_path
            if missing := needs_driver_but_lacks_it(so):
                uses = ", ".join(missing[:3])
                raise SystemExit(f"{so.name} uses the driver API ({uses}) but does not name libcuda.so.1")
            archive.add(so, arcname=member(spec.name))
            modules[spec.name] = {"bytes": so.stat().st_size, "sha256": sha256(so)}
    manifest = {
        "flashinfer": flashinfer.__version__,
        "tvm_ffi": tvm_ffi.__version__,
        "arch": flashinfer_target(jit_env, flashinfer.__version__),
        "nvcc": nvcc_version(),
        "builds": [list(b) for b in builds],
        "modules": modules,
        "compile_seconds": round(seconds, 1),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    raw = sum(m["bytes"] for m in modules.values())
    print(f"compiled in {seconds:.0f} s: {raw / 2**20:.1f} MiB of modules", flush=True)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as data:
        while chunk := data.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def nvcc_version() -> str:
    text = subprocess.run([str(cuda_home() / "bin" / "nvcc"), "--version"], capture_output=True, text=True).stdout
    found = re.search(r"release (\S+),", text)
    return found.group(1) if found else "unknown"


# --- the GPU machine: install ---------------------------------------------------------------------


def install(source: Path, load: Callable[[str], object] | None = None) -> str:
    """Copy the carried modules into the installed FlashInfer's AOT directory when they are for it,
    each checked against the manifest's sha256 and loaded once (``tvm_ffi.load_module``, as FlashInfer
    loads them): one that does not load is removed, so that FlashInfer compiles it as without the
    carry. Returns what was done, or why nothing was."""
    manifest_path = source / MANIFEST
    if not manifest_path.exists():
        return f"nothing installed: no {manifest_path}"
    manifest = json.loads(manifest_path.read_text())
    try:
        import flashinfer
        import tvm_ffi
        from flashinfer.jit import env as jit_env
    except Exception as exc:  # noqa: BLE001  (an import error or a missing dependency's own failure)
        return f"nothing installed: FlashInfer does not import ({type(exc).__name__}: {exc})"
    here = {"flashinfer": flashinfer.__version__, "tvm_ffi": tvm_ffi.__version__,
            "arch": flashinfer_target(jit_env, flashinfer.__version__)}  # fmt: skip
    built = {key: manifest.get(key) for key in here}
    wrong = [f"{key} {built[key]} built, {value} here" for key, value in here.items() if built[key] != value]
    if wrong:
        return "nothing installed: " + "; ".join(wrong)
    modules = manifest.get("modules") or {}
    if bad := [name for name in modules if not MODULE_NAME.fullmatch(name)]:
        return f"nothing installed: the manifest names {', '.join(map(repr, bad))}, not module names"
    if not (source / ARCHIVE).exists():
        return f"nothing installed: no {source / ARCHIVE}"
    target, load = Path(jit_env.FLASHINFER_AOT_DIR), load or tvm_ffi.load_module
    installed, failed = [], {}
    with tarfile.open(source / ARCHIVE, "r:xz") as archive:
        members = {m.name: m for m in archive.getmembers() if m.isfile()}
        if missing := [name for name in modules if member(name) not in members]:
            return f"nothing installed: the manifest's {', '.join(missing)} not in {ARCHIVE}"
        for name, want in modules.items():  # only the manifest's paths, each a plain file: nothing else is written
            (target / name).mkdir(parents=True, exist_ok=True)
            part = target / f"{member(name)}.part"  # renamed once whole and checked: FlashInfer never loads a torn one
            with archive.extractfile(members[member(name)]) as data, open(part, "wb") as so:
                shutil.copyfileobj(data, so)
            if sha256(part) != want.get("sha256"):
                shutil.rmtree(target / name)
                failed[name] = "its sha256 is not the manifest's"
                continue
            os.replace(part, target / member(name))
            try:
                load(str(target / member(name)))
            except Exception as exc:  # noqa: BLE001  (whatever stops it loading: FlashInfer would stop there too)
                shutil.rmtree(target / name)
                failed[name] = f"does not load ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]})"
                continue
            installed.append(name)
    where = f"{target} (FlashInfer {here['flashinfer']}, {here['arch']})"
    done = f"installed {len(installed)} of {len(modules)} modules into {where}"
    return done + "".join(f"; removed, to be compiled: {name}: {why}" for name, why in failed.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="where the modules and manifest go (carried); replaced only by a run that succeeds, "
                        "and only if it is empty or holds a manifest")  # fmt: skip
    parser.add_argument("--arch", default="9.0a", help="the GPU machine's target (H100, H200: 9.0a)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="nvcc jobs at once")
    parser.add_argument("--wheel", type=Path, default=None,
                        help="the FlashInfer wheel to compile from (default: the one in .whl/, else the "
                        "importable FlashInfer)")  # fmt: skip
    parser.add_argument("--workspace", type=Path, default=None,
                        help="keep FlashInfer's JIT workspace here (default: a temporary one), so that a "
                        "second run compiles only what changed")  # fmt: skip
    parser.add_argument("--install", type=Path, default=None, metavar="DIR",
                        help="on the GPU machine: install DIR's modules into the importable FlashInfer")  # fmt: skip
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # the compiling process's builds
    args = parser.parse_args(argv)
    if args.install is not None:
        print("flashinfer aot: " + install(args.install), flush=True)
        return 0
    if args.child is not None:
        _bench_importable()
        child(json.loads(args.child), args.out, args.jobs, args.arch)
        return 0
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: must be at least 1")
    try:
        arch = target_arch(args.arch)
    except ValueError as exc:
        parser.error(str(exc))
    # what FlashInfer imports besides torch, which its wheel does not bring (installed --no-deps)
    if missing := [pkg for m, pkg in (("tvm_ffi", "apache-tvm-ffi"), ("pynvml", "nvidia-ml-py")) if not find_spec(m)]:
        parser.error(f"FlashInfer imports what these install, missing here: pip install {' '.join(missing)}")
    if args.out.exists() and any(args.out.iterdir()) and not (args.out / MANIFEST).exists():
        parser.error(f"--out {args.out}: not empty and holds no {MANIFEST}; name an empty or a new directory")
    builds = default_builds()
    wheel = args.wheel or next(iter(sorted((ROOT / ".whl").glob("flashinfer_python-*.whl"))), None)
    with tempfile.TemporaryDirectory(prefix="flashinfer-aot-") as tmp:
        env, work = dict(os.environ), args.workspace or Path(tmp)
        if wheel is not None:  # the carried wheel, not whatever this machine has installed
            site = work / "site"
            installed = site / "installed-from"
            # installed once per workspace: its headers' times are what ninja compares the objects with
            if not installed.exists() or installed.read_text() != f"{wheel.resolve()} {wheel.stat().st_size}":
                shutil.rmtree(site, ignore_errors=True)
                subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                                str(site), str(wheel)], check=True)  # fmt: skip
                installed.write_text(f"{wheel.resolve()} {wheel.stat().st_size}")
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), str(ROOT), env.get("PYTHONPATH")]))
        else:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        home = cuda_home()
        if (curand := curand_include(home, work / "curand")) is not None:
            env["FLASHINFER_EXTRA_CUDAFLAGS"] = f"-isystem {curand}"
        for name in DEBUG_SETTINGS:  # release builds, as FlashInfer's JIT makes them on the GPU machine
            env.pop(name, None)
        env.update(
            CUDA_HOME=str(home),
            FLASHINFER_CUDA_ARCH_LIST=args.arch,
            FLASHINFER_WORKSPACE_BASE=str(work / "workspace"),
            # (kept with the workspace: a new path on the link lines would relink every module)
            FLASHINFER_EXTRA_LDFLAGS=f"-L{stub_libcuda(work / 'stub')}",
        )
        # built beside, then put in place: a failed run keeps the last good carry
        part = args.out.with_name(args.out.name + ".part")
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        command = [sys.executable, __file__, "--child", json.dumps(builds), "--out", str(part),
                   "--jobs", str(args.jobs), "--arch", args.arch]  # fmt: skip
        print(f"FlashInfer modules for {len(builds)} baselines, target {args.arch} ({arch}), {home}", flush=True)
        rc = subprocess.run(command, env=env).returncode
    if rc != 0:
        shutil.rmtree(part, ignore_errors=True)
        print(f"failed (exit {rc}); {args.out} left as it was", file=sys.stderr)
        return rc
    shutil.rmtree(args.out, ignore_errors=True)
    part.rename(args.out)
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    wheels = sum(f.stat().st_size for f in (ROOT / ".whl").glob("*.whl"))
    print(f"{args.out}: {size / 2**20:.1f} MiB to carry, {wheels / 2**20:.1f} MiB in .whl/ (a device call "
          f"carries {CARRY_LIMIT // 2**20} MiB in all, the working tree included)")  # fmt: skip
    if size + wheels > CARRY_LIMIT - TREE_ALLOWANCE:
        print("WARNING: with the working tree that may be over the carry limit", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
