#!/usr/bin/env bash
# The wheels the offline GPU machine lacks (its image has torch, triton, transformers, tokenizers,
# httpx, anyio, h11, click, prometheus-client, nvidia-ml-py, pybind11, ninja, pytest; not the HTTP
# server stack, pyzmq, openai, FlashInfer or NIXL), downloaded here for CPython 3.12 on x86-64 into
# .whl/, which gpu_session.sh installs. Run it on a machine with a package index, then name .whl in
# the device call's `carry` (64 MiB a call, working tree included).
#
#   bash benchmarks/gpu_wheels.sh            # server stack + pyzmq + openai + xgrammar (about 10 MB): tests, engine, serving
#   bash benchmarks/gpu_wheels.sh flashinfer # + flashinfer-python and its runtime needs (kernels, serving backends)
#   bash benchmarks/gpu_wheels.sh disagg     # server stack + pyzmq + nixl (about 60 MB; no openai, no flashinfer)
#
# WHEELS_PYTHON (default 3.12, the GPU image's) and WHEELS_DIR (default .whl) take the same set for
# another Python into another folder: .ci/gpu-image uses them to try the set on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .gitignore .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
PYVER=${WHEELS_PYTHON:-3.12}
DIR=${WHEELS_DIR:-.whl}
# each package's Requires-Dist, less what the image has (checked with `unzip -p W '*/METADATA'`)
SERVER="fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.13.4 pydantic_core==2.46.4
  annotated-types==0.7.0 typing-inspection==0.4.2 opentelemetry-api==1.45.2 pyzmq==27.3.0"
OPENAI="openai==3.52.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 idna==3.20 distro==1.9.0
  jiter==0.19.0 sniffio==1.3.1"
# structured outputs (the tests' extra): xgrammar needs tvm-ffi; its other needs are in the image
STRUCTURED="xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2"
# flashinfer imports without nvidia-cutlass-dsl (only its cute_dsl modules need it) and without
# nvidia-cudnn-frontend (its cudnn path is optional): both left out
FLASHINFER="flashinfer-python==0.5.3"  # (and tvm-ffi, in STRUCTURED)
NIXL="nixl==1.5.1 nixl-cu13==1.5.1"
case ${1:-base} in
  base) pkgs="$SERVER $OPENAI $STRUCTURED" ;;
  flashinfer) pkgs="$SERVER $OPENAI $STRUCTURED $FLASHINFER" ;;
  disagg) pkgs="$SERVER $NIXL" ;;
  *) echo "unknown set $1; allowed: base flashinfer disagg" >&2; exit 2 ;;
esac
rm -rf "$DIR" && mkdir -p "$DIR"  # only once the set is known: a typo keeps the wheels there
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$DIR" $pkgs
ls "$DIR"
du -sh "$DIR"
