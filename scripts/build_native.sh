#!/usr/bin/env bash
# Build the native library (CUDA kernels + XLA FFI handlers) into build/native/libmok_ffi.so with
# the CMake of this repository. This is the build that travels to the GPU machine (carry build/native);
# `pip install -e .` runs the same CMake through scikit-build-core.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PATH=/usr/local/cuda/bin:/usr/local/cuda-13.0/bin:$PATH
cmake -S . -B build/native -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a -DPython_EXECUTABLE="$("$PY" -c 'import sys; print(sys.executable)')" >/dev/null
cmake --build build/native -j "${MOK_BUILD_JOBS:-2}"
ls -la build/native/libmok_ffi.so
