#!/usr/bin/env bash
# The project's test command: sets up .venv (idempotent) and runs the whole suite.
# Extra arguments go to pytest, e.g.  bash scripts/test.sh tests/core -x
# Test files run in PTM_TEST_WORKERS pytest-xdist workers (default 2; 0 runs them in this process): most
# multi-process tests wait on restarts, timeouts and rendezvous more than they compute. One file stays on one
# worker (--dist loadfile), so a module's fixtures (the network-namespace hosts, the Slurm cluster) are never
# shared by two workers.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh dev
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # many small ranks share few cores
exec python -m pytest -n "${PTM_TEST_WORKERS:-2}" --dist loadfile "$@"
