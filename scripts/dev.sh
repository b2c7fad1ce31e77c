#!/usr/bin/env bash
# Two commands on a fresh machine; each sets up .venv first if it is missing or older than
# pyproject.toml (scripts/setup.sh, about a minute and a half), then:
#   bash scripts/dev.sh quickstart   # the main job: per-example gradients in JAX and PyTorch,
#                                    # checked against the batch gradient
#   bash scripts/dev.sh test         # the test suite (pytest's arguments may follow)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
STAMP="$VENV/.pergrad-setup"
want=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "Setting up $VENV (first use, or pyproject.toml changed)..."
  VENV="$VENV" bash scripts/setup.sh
  echo "$want" > "$STAMP"
fi
verb=${1:-}
shift || true
case "$verb" in
  quickstart) exec "$VENV/bin/python" examples/quickstart.py "$@" ;;
  test) exec "$VENV/bin/python" -m pytest -q "$@" ;;
  *)
    echo "usage: bash scripts/dev.sh quickstart | test [pytest arguments]" >&2
    exit 2
    ;;
esac
