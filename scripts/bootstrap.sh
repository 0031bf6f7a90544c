#!/usr/bin/env bash
# Idempotent environment set-up shared by the README commands and CI.
# Creates .venv, installs torch (CPU build here; the machine's own CUDA torch on
# GPU machines) and the pinned requirements, then installs this project editable.
# Source it:  source scripts/bootstrap.sh [dev]
# Settings (environment): PTM_VENV the venv (default .venv), PTM_PYTHON the interpreter that creates it
# (default python3), PTM_TORCH the torch version installed into it (default 2.13.0; a machine's own CUDA
# torch is kept whatever its version).
# Offline (no package index, e.g. a GPU machine): what is installed is used; one line names the pins that
# are missing or at other versions, and only a missing required pin stops it.
set -euo pipefail
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="${PTM_VENV:-$_root/.venv}"
_python="${PTM_PYTHON:-python3}"
_torch_pin="${PTM_TORCH:-2.13.0}"
_want_dev="${1:-}"
_stamp="$_venv/.ptm-installed${_want_dev:+-dev}"
_hash="$( { cat "$_root/requirements.txt" "$_root/requirements-dev.txt" "$_root/setup.py"; echo "torch==$_torch_pin"; } \
  | sha1sum | cut -c1-16)"

if [ ! -f "$_stamp" ] || [ "$(cat "$_stamp")" != "$_hash" ]; then
  echo "[bootstrap] setting up $_venv"
  if [ ! -x "$_venv/bin/python" ]; then
    echo "[bootstrap] creating the virtual environment"
    if ! "$_python" -c "import sys; sys.exit(sys.version_info < (3, 10))" 2>/dev/null; then
      echo "[bootstrap] error: '$_python' is not a Python >= 3.10 that runs here; install one or set PTM_PYTHON" >&2
      return 1 2>/dev/null || exit 1
    fi
    if "$_python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
      # Keep the GPU machine's own torch (never download a second multi-GB build).
      "$_python" -m venv --system-site-packages "$_venv"
    else
      "$_python" -m venv "$_venv"
    fi
  fi
  _log="$_venv/.ptm-pip.log"  # pip's output; errors name it instead of printing pip's report
  : > "$_log"
  _pip=("$_venv/bin/python" -m pip install --disable-pip-version-check)
  # pip's whole output goes to the log; the terminal gets one line per package pip fetches ("Collecting ...").
  _bootstrap_pip() {
    local _line
    "${_pip[@]}" "$@" 2>&1 | tee -a "$_log" | while IFS= read -r _line; do
      case "$_line" in "Collecting "*) _line="${_line#Collecting }"; echo "[bootstrap]   ${_line%% *}" ;; esac
    done
    return "${PIPESTATUS[0]}"
  }
  _complete=1
  # "<version> <True if torch lives in this venv>", empty without torch.
  _torch="$("$_venv/bin/python" -c 'import os, sys, torch
print(torch.__version__.split("+")[0], os.path.realpath(torch.__file__).startswith(os.path.realpath(sys.prefix) + os.sep))' \
    2>/dev/null || true)"
  case "$_torch" in
    "$_torch_pin "* | *" False") ;;  # the pin, or the machine's own torch: kept
    *)
      # On CPU-only machines this is the CPU build that lies on disk here.
      echo "[bootstrap] installing torch==$_torch_pin (the largest download; pip's output: $_log)"
      if ! _bootstrap_pip "torch==$_torch_pin"; then
        if [ -z "$_torch" ]; then
          echo "[bootstrap] error: torch is not installed in $_venv and pip could not install torch==$_torch_pin" \
            "(no package index reachable? pip's output: $_log); install torch, or set PTM_PYTHON to a Python that" \
            "has it" >&2
          return 1 2>/dev/null || exit 1
        fi
        echo "[bootstrap] pip could not install torch==$_torch_pin (pip's output: $_log); going on with torch" \
          "${_torch%% *}" >&2
        _complete=0
      fi
      ;;
  esac
  _reqs=("$_root/requirements.txt")
  if [ -n "$_want_dev" ]; then _reqs+=("$_root/requirements-dev.txt"); fi
  echo "[bootstrap] installing the requirements (${_reqs[*]##*/})"
  if ! _bootstrap_pip "${_reqs[@]/#/--requirement=}"; then
    # Offline or a pin pip cannot get: go on with the installed packages when every required one is there.
    if ! "$_venv/bin/python" "$_root/scripts/check_requirements.py" --log "$_log" "${_reqs[@]}"; then
      return 1 2>/dev/null || exit 1
    fi
    _complete=0
  fi
  echo "[bootstrap] installing this project (editable)"
  if ! _bootstrap_pip --no-deps --no-build-isolation -e "$_root"; then
    echo "[bootstrap] error: could not install this project editable into $_venv (pip's output: $_log); it needs" \
      "setuptools>=64 there, from the machine or a package index" >&2
    return 1 2>/dev/null || exit 1
  fi
  # Not stamped when pins were missing: the next run tries the index again.
  if [ "$_complete" = 1 ]; then echo "$_hash" > "$_stamp"; fi
fi
export PATH="$_venv/bin:$PATH"
export VIRTUAL_ENV="$_venv"
