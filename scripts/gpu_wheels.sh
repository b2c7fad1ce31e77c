#!/usr/bin/env bash
# Download the wheels scripts/gpu_check.sh needs on a GPU machine that cannot reach PyPI, into
# .whl/ (ignored by git; the device tool carries it: carry [".whl"]). The machine has torch, JAX,
# transformers, optax, flax, hypothesis and pytest; these are the peers and the DP accounting it
# lacks, for its Python 3.12 on x86-64. About 10 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
WHEELS=(
  opacus==1.6.0
  dp-accounting==0.6.0
  dm-tree==0.1.9
  jax-privacy==2.0.0
  pydantic==2.12.5
  pydantic-core==2.41.5
  annotated-types==0.7.0
  typing-inspection==0.4.2
)
mkdir -p .whl
for spec in "${WHEELS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux1_x86_64 -d .whl "$spec"
done
ls -la .whl
