#!/usr/bin/env bash
# One-command set-up: a virtual environment in .venv with pergrad, JAX, PyTorch (CPU) and the
# test tools. Usage: bash scripts/setup.sh   (then use .venv/bin/python, or source .venv/bin/activate)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# The pinned CPU build first: an unpinned torch would pull the newest CUDA build (several GB).
"$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
"$VENV/bin/python" -m pip install --quiet -e ".[dev]"
echo "pergrad is installed in $VENV. Try: $VENV/bin/python examples/quickstart.py"
