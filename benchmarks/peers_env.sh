#!/usr/bin/env bash
# The peer systems' own environment for python -m benchmarks.zero3_vs_peers, benchmarks.max_scale and
# benchmarks.bench_ssd (DeepSpeed is never a project dependency). Idempotent; source it or run it:
#
#   source benchmarks/peers_env.sh      # creates/uses benchmarks/.venv-peers, exports PEERS_PYTHON
#
# The venv holds the same torch as the project's (the CPU build on disk here), DeepSpeed and what the
# benchmark's workers import. The project itself is put on the path by the benchmark (PYTHONPATH), not
# installed, so both environments run the same source tree.
set -euo pipefail
_peers_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_peers_venv="${PEERS_VENV:-$_peers_root/benchmarks/.venv-peers}"
_peers_pkgs=(torch==2.13.0 deepspeed==0.19.8 psutil==7.2.2 numpy==2.4.6 xxhash==4.0.1)
_peers_stamp="$_peers_venv/.peers-installed"
_peers_want="$(printf '%s\n' "${_peers_pkgs[@]}" | sha1sum | cut -c1-16)"

if [ ! -f "$_peers_stamp" ] || [ "$(cat "$_peers_stamp")" != "$_peers_want" ]; then
  echo "[peers_env] setting up $_peers_venv"
  [ -x "$_peers_venv/bin/python" ] || python3 -m venv "$_peers_venv"
  "$_peers_venv/bin/python" -m pip install -q --disable-pip-version-check "${_peers_pkgs[@]}"
  echo "$_peers_want" > "$_peers_stamp"
fi
export PEERS_PYTHON="$_peers_venv/bin/python"
# DeepSpeed on a CPU-only host: its CPU accelerator, and a persistent cache for the JIT-built cpu_adam op.
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$HOME/.cache/ptm/torch_extensions}"
# DeepSpeed's NVMe offload (benchmarks.max_scale) JIT-builds its async_io op against libaio.
if ! ldconfig -p 2>/dev/null | grep -q libaio.so || [ ! -f /usr/include/libaio.h ]; then
  echo "[peers_env] libaio headers missing: DeepSpeed's NVMe offload needs them (apt-get install libaio-dev)" >&2
fi
