#!/usr/bin/env bash
# Set up .venv on a fresh machine: Python 3.12 where available (the GPU machine's version), the
# pinned CPU packages, and the package itself in editable mode (which builds the native library
# with nvcc when nvcc is present; without nvcc the pure-Python package installs and says so).
set -euo pipefail
cd "$(dirname "$0")/.."

pick_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  for p in python3.12 "$HOME/.pyenv/versions/3.12"*/bin/python /root/.pyenv/versions/3.12*/bin/python; do
    if "$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then echo "$p"; return; fi
  done
  echo python3
}

if [ ! -x .venv/bin/python ]; then
  "$(pick_python)" -m venv .venv
fi
export PATH="$PWD/.venv/bin:/usr/local/cuda/bin:/usr/local/cuda-13.0/bin:$PATH"
stamp=.venv/.mok-requirements
if ! cmp -s requirements/cpu.txt "$stamp" 2>/dev/null; then
  python -m pip install -q --upgrade pip
  python -m pip install -q -r requirements/cpu.txt
  cp requirements/cpu.txt "$stamp"
fi
python -m pip install -q --no-build-isolation -e .
python -c "import mok_jax, jax; from mok_jax._native import native_status; print('mok_jax', mok_jax.__version__, '| jax', jax.__version__, '| native library:', native_status())"
