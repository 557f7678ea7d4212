"""Build and install minengine and triton_kernels.

``pip install -e .`` installs both packages; ``pip install -e ".[test]"`` adds the test tools.

The CUDA C++ kernels in csrc/ are built into ``minengine._C`` with nvcc through ninja:
- ``MINENGINE_BUILD_CUDA=1``: required (fails loudly without nvcc); ``=0``: skipped; unset: built
  when nvcc is found (``$CUDA_HOME/bin/nvcc``, ``/usr/local/cuda/bin/nvcc`` or on ``PATH``).
- ``MINENGINE_CUDA_ARCHS``: target architectures, default ``8.0;9.0a`` (``9.0a`` enables Hopper's
  wgmma / TMA instructions).
The extension links the CUDA runtime statically and takes raw pointers (pybind11, no torch C++
ABI), so one build works across torch versions; the package imports and runs without it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"


def find_cuda_home() -> Path | None:
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for c in candidates:
        if c and (Path(c) / "bin" / "nvcc").exists():
            return Path(c)
    nvcc = shutil.which("nvcc")
    if nvcc:
        home = Path(os.path.realpath(nvcc)).parent.parent
        if (home / "include" / "cuda_runtime.h").exists():
            return home
    return None


def parse_archs(archs: str) -> list[str]:
    """'8.0;9.0a' -> ['80', '90a']; exits naming the bad entry (the kernels need sm_80 or newer:
    cp.async, mma.sync m16n8k16 with bf16)."""
    nums = []
    for entry in (a.strip() for a in archs.split(";")):
        if not entry:
            continue
        m = re.fullmatch(r"([89]|1\d)\.?(\d)([af]?)", entry)
        # a: arch-specific targets from 9.0 (sm_90a), f: family targets from 10.0 (sm_100f)
        if m is None or (m[3], int(m[1])) in {("a", 8), ("f", 8), ("f", 9)}:
            sys.exit(
                f"MINENGINE_CUDA_ARCHS entry {entry!r} (in {archs!r}) is not supported; allowed: compute "
                "capabilities 8.0 or newer separated by ';', each optionally with an 'a' or 'f' suffix, "
                "e.g. '8.0;8.6;9.0a'"
            )
        nums.append(m[1] + m[2] + m[3])
    if not nums:
        sys.exit(f"MINENGINE_CUDA_ARCHS is {archs!r}; it needs at least one architecture, e.g. '8.0;9.0a'")
    return nums


def gencode_flags(archs: str) -> list[str]:
    """Machine code for each arch, plus PTX of the first (portable) one for newer GPUs; with 9.0a,
    MINENGINE_SM90A tells the host code that sm_90a machine code (wgmma) is in the build."""
    nums = parse_archs(archs)
    flags = []
    for num in nums:
        flags += ["-gencode", f"arch=compute_{num},code=sm_{num}"]
    portable = next((n for n in nums if not n[-1].isalpha()), None)
    if portable:
        flags += ["-gencode", f"arch=compute_{portable},code=compute_{portable}"]
    if "90a" in nums:  # the host side may then launch the wgmma kernels on sm_90 devices
        flags += ["-DMINENGINE_SM90A=1"]
    return flags


def want_cuda() -> Path | None:
    mode = os.environ.get("MINENGINE_BUILD_CUDA", "").strip()
    if mode not in ("", "0", "1"):
        sys.exit(
            f"MINENGINE_BUILD_CUDA is {mode!r}; allowed: 1 (build, nvcc required), 0 (skip), unset (build if nvcc "
            "is found)"
        )
    if mode == "0":
        return None
    home = find_cuda_home()
    if home is None and mode == "1":
        sys.exit("MINENGINE_BUILD_CUDA=1 but nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
    if home is not None:  # a bad arch list stops here, before any compile
        parse_archs(cuda_archs())
    return home


def cuda_archs() -> str:
    return os.environ.get("MINENGINE_CUDA_ARCHS", "8.0;9.0a")


class NinjaCudaBuild(build_ext):
    """Writes a build.ninja for csrc/ and runs it: nvcc for .cu, the C++ compiler for bindings."""

    def build_extension(self, ext: Extension) -> None:
        import pybind11

        cuda = want_cuda()
        build = Path(self.build_temp) / "csrc"
        build.mkdir(parents=True, exist_ok=True)
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        target.parent.mkdir(parents=True, exist_ok=True)
        archs = cuda_archs()
        includes = f"-I{CSRC} -I{pybind11.get_include()} -I{sysconfig.get_paths()['include']} -I{cuda / 'include'}"
        cxx = os.environ.get("CXX", "c++")
        objs = []
        lines = [
            f"nvcc = {cuda / 'bin' / 'nvcc'}",
            f"cuflags = -std=c++17 -O3 -Xcompiler -fPIC {' '.join(gencode_flags(archs))} {includes}",
            f"cxxflags = -std=c++17 -O2 -fPIC -fvisibility=hidden {includes}",
            f"ldflags = -shared -L{cuda / 'lib64'} -lcudart_static -ldl -lrt -lpthread",
            # depfiles: an edit of a header (common.cuh, kernels.h) rebuilds the objects that include it
            "rule nvcc",
            "  command = $nvcc $cuflags -MD -MF $out.d -c $in -o $out",
            "  depfile = $out.d",
            "  deps = gcc",
            "rule cxx",
            f"  command = {cxx} $cxxflags -MMD -MF $out.d -c $in -o $out",
            "  depfile = $out.d",
            "  deps = gcc",
            "rule link",
            f"  command = {cxx} $in $ldflags -o $out",
        ]
        # emulate_capi.cpp belongs to the CPU emulator (minengine/ops/cuda_emulator.py), not to _C.
        for src in sorted(CSRC.glob("*.cu")) + [CSRC / "bindings.cpp"]:
            obj = build / (src.name + ".o")
            objs.append(str(obj))
            lines.append(f"build {obj}: {'nvcc' if src.suffix == '.cu' else 'cxx'} {src}")
        lines.append(f"build {target}: link {' '.join(objs)}")
        (build / "build.ninja").write_text("\n".join(lines) + "\n")
        ninja = shutil.which("ninja") or "ninja"
        subprocess.run([ninja, "-C", str(build)], check=True)


ext_modules = [Extension("minengine._C", sources=[])] if want_cuda() is not None else []

setup(
    name="minengine",
    version="0.1.0",
    description="Hand-written paged-attention kernels with a minimal LLM serving engine on top",
    python_requires=">=3.10",
    packages=find_packages(include=["minengine", "minengine.*", "triton_kernels", "triton_kernels.*"]),
    ext_modules=ext_modules,
    cmdclass={"build_ext": NinjaCudaBuild},
    install_requires=[
        "torch>=2.11",
        "triton>=3.6",
        "numpy",
        "safetensors",
        "tokenizers>=0.19",
        "jinja2>=3.1.6",  # chat templates, rendered as transformers renders them (sandbox fixes up to 3.1.6)
        "tqdm",
        "fastapi",
        "uvicorn",
        "pyzmq",
        "prometheus-client",
        "httpx",  # the router's client
        "nixl",  # KV transfer between prefill and decode servers (UCX; host or device memory)
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "ruff>=0.6",
            "transformers>=5",  # the tokenizer tests compare with transformers 5's loading
            "openai>=1.40",
            "httpx",
            "matplotlib",
            "xgrammar>=0.2.8",
        ],
        "structured": ["xgrammar>=0.2.8"],  # structured outputs (response_format, tool_choice "required", ...)
        "bench": ["nvidia-ml-py", "httpx", "matplotlib"],
    },
)
