#!/usr/bin/env bash
# The suite under the GPU image's versions, Python 3.12 and torch 2.11.0 (the oldest torch supported), on this
# machine, CPU included: scripts/test.sh with the venv .venv-py312-torch211/ (set up once by
# scripts/bootstrap.sh: torch==2.11.0, requirements.txt, requirements-dev.txt, this project editable).
# Extra arguments go to pytest, e.g.  bash scripts/test_py312_torch211.sh -m "not multiprocess"
set -euo pipefail
cd "$(dirname "$0")/.."
export PTM_VENV="$PWD/.venv-py312-torch211" PTM_TORCH=2.11.0

# A Python 3.12 to create the venv with: PTM_PYTHON, python3.12 on PATH, or one pyenv installed.
_find_python312() {
  local candidate
  for candidate in "${PTM_PYTHON:-}" python3.12 "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.12*/bin/python3.12; do
    if [ -n "$candidate" ] && "$candidate" -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))" 2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}
if [ ! -x "$PTM_VENV/bin/python" ]; then
  if ! PTM_PYTHON="$(_find_python312)"; then
    echo "test_py312_torch211.sh: error: no Python 3.12 found (tried PTM_PYTHON, python3.12 on PATH, pyenv's" \
      "versions); install Python 3.12 or set PTM_PYTHON to one" >&2
    exit 1
  fi
  export PTM_PYTHON
fi
exec bash scripts/test.sh "$@"
