#!/usr/bin/env bash
# The project's test command: sets up .venv (idempotent) and runs the whole suite.
# Extra arguments go to pytest, e.g.  bash scripts/test.sh tests/core -x
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh dev
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # many small ranks share few cores
exec python -m pytest "$@"
