#!/usr/bin/env bash
# Idempotent environment set-up shared by the README commands and CI.
# Creates .venv, installs torch (CPU build here; the machine's own CUDA torch on
# GPU machines) and the pinned requirements, then installs this project editable.
# Source it:  source scripts/bootstrap.sh [dev]
set -euo pipefail
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="${PTM_VENV:-$_root/.venv}"
_want_dev="${1:-}"
_stamp="$_venv/.ptm-installed${_want_dev:+-dev}"
_hash="$(cat "$_root/requirements.txt" "$_root/requirements-dev.txt" "$_root/setup.py" | sha1sum | cut -c1-16)"

if [ ! -f "$_stamp" ] || [ "$(cat "$_stamp")" != "$_hash" ]; then
  echo "[bootstrap] setting up $_venv"
  _sys_torch_cuda=0
  if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    _sys_torch_cuda=1
  fi
  if [ ! -x "$_venv/bin/python" ]; then
    if [ "$_sys_torch_cuda" = 1 ]; then
      # Keep the GPU machine's own torch (never download a second multi-GB build).
      python3 -m venv --system-site-packages "$_venv"
    else
      python3 -m venv "$_venv"
    fi
  fi
  _pip=("$_venv/bin/python" -m pip install -q --disable-pip-version-check)
  if ! "$_venv/bin/python" -c "import torch" 2>/dev/null; then
    # On CPU-only machines this is the CPU build that lies on disk here.
    "${_pip[@]}" torch==2.13.0
  fi
  "${_pip[@]}" -r "$_root/requirements.txt"
  if [ -n "$_want_dev" ]; then "${_pip[@]}" -r "$_root/requirements-dev.txt"; fi
  "${_pip[@]}" --no-deps --no-build-isolation -e "$_root"
  echo "$_hash" > "$_stamp"
fi
export PATH="$_venv/bin:$PATH"
export VIRTUAL_ENV="$_venv"
