#!/usr/bin/env bash
# Creates .venv in the checkout and installs ptdp into it. Safe to run again:
# what is already installed is kept.
#
# torch is installed first and pinned (PTDP_TORCH, default torch==2.13.0):
# a bare "torch" requirement could pull a multi-GB CUDA build onto a CPU
# machine. A torch >= 2.5 already in .venv is kept, so a GPU user can install
# their CUDA build into .venv first (or set PTDP_TORCH) and keep it.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
has_torch() {
    .venv/bin/python - <<'PY' 2>/dev/null
import sys
import torch
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 5) else 1)
PY
}
if ! has_torch; then
    .venv/bin/python -m pip install --quiet "${PTDP_TORCH:-torch==2.13.0}"
fi
.venv/bin/python -m pip install --quiet --editable ".[test]"
