#!/usr/bin/env bash
# One-GPU check for a GPU machine borrowed for a few minutes (one H100/H200 in mind): six stages, each under its
# own time limit, the limits summing to under 9 minutes (one command may run 10); the summary is rewritten after
# every stage, so a run cut short still brings back what it measured.
#   setup     none when the machine's python3 has CUDA torch and the pins; else scripts/bootstrap.sh, else python3
#   preflight the measured bf16 matmul peak first (several seconds sustained, benchmarks.matmul_peak: MFU's
#             denominator), then the machine (GPU, driver, RAM, disk write speed)
#   tests     pytest tests/cuda -v (the suite's CUDA paths; the rest of the suite is CPU + gloo)
#   dense     1.3B GPT, bf16, one GPU (benchmarks.gpu_peers): first the like-for-like pair, our engine in the
#             peers' loop against FSDP2, then ours through the trainer (pretrain_gpt.py --deepspeed), the
#             Megatron backend (on one GPU the real baseline), DeepSpeed ZeRO-3 if installed
#   offload   the same 1.3B with parameters and optimizer states in pinned host memory: ours against FSDP2's
#             CPUOffloadPolicy, each with a profiled step (copy time hidden under compute)
#   maxscale  the planner's largest model of the hidden-4096 family: planned for the whole machine, trained 3
#             steps for a slice of it with states on GPU, host and SSD (benchmarks.gpu_max_scale)
# Every torchrun job rendezvouses on 127.0.0.1 (a machine without network may not resolve its own hostname).
# A job cut by its time is "incomplete" with the steps it did; a failed job brings back its log's last lines.
#
#   bash benchmarks/gpu_check.sh                      # run everything
#   bash benchmarks/gpu_check.sh --dry-run            # print the plan (commands, caps, budget); touch nothing
#   bash benchmarks/gpu_check.sh --stages tests,dense # only these stages
#   bash benchmarks/gpu_check.sh --rehearse           # the same stages, jobs and record on CPU + gloo, tiny
#                                                     # models, under the same caps (any machine, no GPU)
#
# Environment: OUT (the folder brought back: summary.md, figures.json, logs.txt, tests.txt; default the work
# folder), GPU_CHECK_PYTHON (the python for every stage; no set-up), GPU_CHECK_CAPS (e.g. "tests=120,dense=100":
# other caps in seconds; they must still sum to under 540), GPU_CHECK_DD_MIB (the disk write probe, default 512;
# 0: none), NVME_PATH (the SSD tier's scratch folder; default: the first disk-backed one, see gpu_max_scale.py).
# Raw logs, run folders and traces stay in the work folder, benchmarks/logs/gpu_check-<UTC time>/.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2

USAGE="usage: bash benchmarks/gpu_check.sh [--dry-run] [--rehearse] [--stages \
setup,preflight,tests,dense,offload,maxscale]"
ALL_STAGES=(setup preflight tests dense offload maxscale)
LIMIT_S=540  # one device command may run 600 s: a minute left for start-up jitter and bringing the files back
# Caps from the CPU rehearsal's fixed costs scaled to a 16-core GPU host (docs/gpu.md#the-device-check).
declare -A CAP=([setup]=25 [preflight]=30 [tests]=125 [dense]=165 [offload]=100 [maxscale]=85)
declare -A TITLE=([setup]="0 set-up" [preflight]="1 preflight: matmul peak, machine" [tests]="2 pytest tests/cuda"
                  [dense]="3 dense 1.3B bf16: ours vs FSDP2" [offload]="4 host offload 1.3B bf16: ours vs FSDP2"
                  [maxscale]="5 planner's largest model on GPU + host + SSD, 3 steps")

DRY_RUN=0
REHEARSE=0
ARGS="$*"
SELECTED=("${ALL_STAGES[@]}")
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --rehearse) REHEARSE=1 ;;
    --stages)
      [ $# -ge 2 ] || { echo "$USAGE" >&2; exit 2; }
      IFS=, read -r -a SELECTED <<<"$2"
      for s in "${SELECTED[@]}"; do
        [ -n "${CAP[$s]:-}" ] || { echo "gpu_check.sh: unknown stage '$s'; stages: ${ALL_STAGES[*]}" >&2; exit 2; }
      done
      shift ;;
    -h|--help) echo "$USAGE"; exit 0 ;;
    *) echo "$USAGE" >&2; exit 2 ;;
  esac
  shift
done

if [ -n "${GPU_CHECK_CAPS:-}" ]; then
  IFS=, read -r -a pairs <<<"$GPU_CHECK_CAPS"
  for kv in "${pairs[@]}"; do
    k="${kv%%=*}" v="${kv#*=}"
    if [ -z "${CAP[$k]:-}" ] || ! [[ "$v" =~ ^[0-9]+$ ]] || [ "$v" -lt 1 ]; then
      echo "gpu_check.sh: GPU_CHECK_CAPS takes stage=seconds pairs (stages: ${ALL_STAGES[*]}), got '$kv'" >&2; exit 2
    fi
    CAP[$k]=$v
  done
fi
selected() { local s; for s in "${SELECTED[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
BUDGET=0
for s in "${ALL_STAGES[@]}"; do selected "$s" && BUDGET=$((BUDGET + CAP[$s])); done
if [ "$BUDGET" -ge "$LIMIT_S" ]; then
  echo "gpu_check.sh: the stage caps sum to ${BUDGET} s, not under the ${LIMIT_S} s limit; lower GPU_CHECK_CAPS" >&2
  exit 2
fi

WORK="$ROOT/benchmarks/logs/gpu_check-$(date -u +%Y%m%d-%H%M%S)"  # git ignores benchmarks/logs/
OUT_DIR="${OUT:-$WORK}"
SYS_PY="$(command -v python3)"  # the machine's python3, resolved before any venv is on PATH; also writes the record
PY="${GPU_CHECK_PYTHON:-python}"
venv_py="${PTM_VENV:-$ROOT/.venv}/bin/python"
if [ "$REHEARSE" = 1 ] && [ -z "${GPU_CHECK_PYTHON:-}" ]; then  # the project's venv where there is one
  if [ -x "$venv_py" ]; then PY="$venv_py"; else PY="$SYS_PY"; fi
fi
DD_MIB="${GPU_CHECK_DD_MIB:-$([ "$REHEARSE" = 1 ] && echo 64 || echo 512)}"
[[ "$DD_MIB" =~ ^[0-9]+$ ]] || { echo "gpu_check.sh: GPU_CHECK_DD_MIB must be a number of MiB (0: no disk probe)" >&2; exit 2; }
START=$SECONDS
DEADLINE=$((START + LIMIT_S - 5))  # no stage runs past this, whatever its cap
HAS_CUDA=1

show() {  # the command as one line, words with spaces quoted
  local w line=""
  for w in "$@"; do
    [[ "$w" =~ [[:space:]] ]] && w="'$w'"
    line+="${line:+ }$w"
  done
  printf '+ %s\n' "$line"
}
report() { "$SYS_PY" -m benchmarks.gpu_check_report --state "$OUT_DIR/figures.json" --summary "$OUT_DIR/summary.md" \
             --logs "$OUT_DIR/logs.txt" "$@"; }

# A stage: begin_stage NAME sets LOG and STAGE_END (its cap, or the deadline if sooner); run_cmd runs one command
# under what is left of it; end_stage records the row and rewrites the summary.
begin_stage() {
  STAGE="$1" LOG="$WORK/$1.log" T0=$SECONDS
  local cap="${CAP[$1]}"
  STAGE_END=$((SECONDS + cap))
  [ "$STAGE_END" -gt "$DEADLINE" ] && STAGE_END=$DEADLINE
  if [ "$DRY_RUN" = 1 ]; then echo; echo "== stage ${TITLE[$1]} (cap ${cap} s) =="; return; fi
  echo "== stage ${TITLE[$1]}: up to $((STAGE_END - SECONDS)) s ($(date -u +%H:%M:%S)) ==" | tee -a "$LOG"
}
left() { local n=$((STAGE_END - SECONDS)); [ "$n" -lt 1 ] && n=1; echo "$n"; }
budget() { local n=$(($(left) - $1)); [ "$n" -lt 1 ] && n=1; echo "$n"; }  # what is left less a reserve
run_cmd() {  # run_cmd CMD...: the command, output appended to the stage's log; its exit code (124: time limit)
  if [ "$DRY_RUN" = 1 ]; then show "$@"; return 0; fi
  show "$@" >>"$LOG"
  timeout --kill-after=3 "$(left)" "$@" >>"$LOG" 2>&1
}
end_stage() {  # end_stage RC [report stage options...]
  local rc="$1"
  shift
  [ "$DRY_RUN" = 1 ] && return 0
  report stage --name "$STAGE" --title "${TITLE[$STAGE]}" --rc "$rc" --seconds $((SECONDS - T0)) \
    --cap "${CAP[$STAGE]}" --log "$LOG" "$@" || echo "gpu_check.sh: could not write the record" >&2
  grep -F "| ${TITLE[$STAGE]} |" "$OUT_DIR/summary.md" 2>/dev/null | cut -c1-400
}
skip_stage() {  # skip_stage WHY: the row says SKIPPED and why
  if [ "$DRY_RUN" = 1 ]; then echo "  (skipped where no GPU is seen)"; return 0; fi
  echo "$1" >>"$LOG"
  report stage --name "$STAGE" --title "${TITLE[$STAGE]}" --rc 0 --seconds $((SECONDS - T0)) \
    --cap "${CAP[$STAGE]}" --status SKIPPED --figures "$1" --log "$LOG" >/dev/null
}
has_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }

if [ "$DRY_RUN" = 1 ]; then
  echo "gpu_check plan: stages ${SELECTED[*]}; caps sum to ${BUDGET} s (limit ${LIMIT_S} s); brought back: \
$OUT_DIR/{summary.md,figures.json,logs.txt,tests.txt}; raw logs: $WORK"
  [ -z "${GPU_CHECK_PYTHON:-}" ] && [ "$REHEARSE" = 0 ] && \
    echo "('python' below: the interpreter the set-up stage chooses)"
else
  mkdir -p "$WORK" "$OUT_DIR" || exit 2
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  report init --budget "$BUDGET" --limit "$LIMIT_S" --command "bash benchmarks/gpu_check.sh${ARGS:+ $ARGS}" || exit 2
  [ "$REHEARSE" = 1 ] && report note "rehearsal: the GPU stages' programs on CPU + gloo in fp32 with tiny models \
(the same jobs, caps and record); figures are of plumbing and fixed costs, not of a GPU"
fi

# ---- setup: the machine's python3 as it is when it has CUDA torch and the pins; else the project's venv ---------
# (python3 on GPU images is itself a venv: a venv made from it does not see its torch, so bootstrap is the last
# resort, for a machine whose python3 lacks a pin).
pins_ok() { "$1" scripts/check_requirements.py --log "(no pip run)" requirements.txt requirements-dev.txt; }
selected setup && begin_stage setup
setup_fig=""
if [ -n "${GPU_CHECK_PYTHON:-}" ] || [ "$REHEARSE" = 1 ]; then
  setup_fig="$PY ($([ -n "${GPU_CHECK_PYTHON:-}" ] && echo GPU_CHECK_PYTHON || echo "rehearsal, CPU"): no set-up)"
  selected setup && [ "$DRY_RUN" = 1 ] && echo "  ($setup_fig)"
elif selected setup; then
  if [ "$DRY_RUN" = 1 ]; then
    show python3 -c "import torch; torch.cuda.is_available()"
    show python3 scripts/check_requirements.py --log "(no pip run)" requirements.txt requirements-dev.txt
    echo "  (both pass: python3 as it is, no set-up; else:)"
    show env PIP_RETRIES=0 PIP_TIMEOUT=5 bash -c 'source scripts/bootstrap.sh dev'
  elif has_cuda "$SYS_PY" && pins_ok "$SYS_PY" >>"$LOG" 2>&1; then
    PY="$SYS_PY" setup_fig="$SYS_PY (the machine's python3: CUDA torch and every pin installed; no set-up)"
  else
    # A machine with no package index fails the pip step fast instead of retrying.
    run_cmd env PIP_RETRIES=0 PIP_TIMEOUT=5 bash -c 'source scripts/bootstrap.sh dev'
    rc=$?
    if [ "$rc" = 0 ] && has_cuda "$venv_py"; then
      PY="$venv_py" why="the project's venv"
    elif has_cuda "$SYS_PY"; then
      PY="$SYS_PY"
      why="the machine's python3: $([ "$rc" = 0 ] && echo "the venv's torch sees no GPU" || \
        echo "bootstrap exit $rc: $(grep -v -e '^+ ' -e '^== ' "$LOG" | tail -n 1 | cut -c1-160)")"
    elif [ "$rc" = 0 ]; then
      PY="$venv_py" why="the project's venv (no python here sees a GPU)"
    else
      PY="$SYS_PY" why="the machine's python3 (bootstrap exit $rc; no python here sees a GPU)"
    fi
    # The set-up is done when a python is chosen: a failed bootstrap with a working fallback is not a failure.
    setup_fig="$PY ($why)"
  fi
else
  if [ -x "$venv_py" ] && has_cuda "$venv_py"; then PY="$venv_py"; else PY="$SYS_PY"; fi
fi
if [ "$DRY_RUN" = 0 ]; then  # one probe of the chosen python (its versions, whether it sees a GPU): set-up's time
  "$PY" -c 'import sys, torch
print(f"python={sys.version.split()[0]}\ntorch={torch.__version__}")
sys.exit(0 if torch.cuda.is_available() else 3)' >>"$WORK/machine.txt" 2>>"$WORK/setup.log"
  case "$?:$REHEARSE" in
    0:*|3:1) ;;  # a rehearsal runs the GPU stages on the CPU
    3:0) HAS_CUDA=0; report note "$PY sees no CUDA device: the GPU stages are skipped" ;;
    *) HAS_CUDA=0; report note "torch does not import in $PY (see setup.log): the GPU stages are skipped" ;;
  esac
  report machine "$WORK/machine.txt"
fi
selected setup && end_stage 0 --figures "$setup_fig"

# What differs in a rehearsal: the device, the precision and the models' sizes; the jobs and caps are the same.
if [ "$REHEARSE" = 1 ]; then
  PEAK=(--device cpu --dtype fp32 --size 512 --warmup-s 0.5 --seconds 2)
  MODEL=(--device cpu --preset tiny --dtype fp32)
  DENSE_STEPS=(--warmup 1 --steps 2)  # CPU steps are seconds: the rehearsal measures the jobs' fixed costs
  OFFLOAD_STEPS=(--warmup 1 --steps 1 --profile-steps 1)
  MAXSCALE=(--device cpu --family 128,4,512 --seq 64 --layers 2 --slice-host-gib 2 --slice-disk-gib 1
            --device-rate 0 --no-whole-machine)
else
  PEAK=(--size 8192 --warmup-s 2 --seconds 6)
  MODEL=(--preset 1.3b --dtype bf16)
  DENSE_STEPS=(--warmup 2 --steps 6)
  OFFLOAD_STEPS=(--warmup 1 --steps 3 --profile-steps 1)
  MAXSCALE=(--family 4096,32,16384 --seq 2048 --slice-device-gib 16 --slice-host-gib 6 --slice-disk-gib 8
            --host-fraction 0.6)
fi

# ---- preflight: the machine's own bf16 matmul peak (MFU's denominator) first, while nothing else runs; then
# what the machine is -------------------------------------------------------------------------------------------
if selected preflight; then
  begin_stage preflight
  peak_rc=0
  if [ "$HAS_CUDA" = 1 ]; then
    run_cmd "$PY" -m benchmarks.matmul_peak "${PEAK[@]}" --json "$WORK/peak.json"
    peak_rc=$?
  fi
  if [ "$DRY_RUN" = 1 ]; then
    echo "  (then the machine: nvidia-smi, nproc, /proc/meminfo, stat -f /tmp, then the disk's write speed)"
    show nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    show dd if=/dev/zero of="$WORK/dd.tmp" bs=1M count="$DD_MIB" oflag=direct conv=fsync
  else
    {
      IFS=, read -r name driver mem < <(timeout 10 nvidia-smi --query-gpu=name,driver_version,memory.total \
        --format=csv,noheader 2>/dev/null | head -n 1)
      echo "gpu_name=$(echo "${name:-}" | xargs)"
      echo "driver=$(echo "${driver:-?}" | xargs)"
      echo "gpu_memory=$(echo "${mem:-}" | xargs)"
      echo "cores=$(nproc)"
      awk '/^MemTotal/ {printf "ram_total_gib=%.0f\n", $2 / 1048576}
           /^MemAvailable/ {printf "ram_available_gib=%.0f\n", $2 / 1048576}' /proc/meminfo
      echo "tmp_fstype=$(stat -f -c %T /tmp 2>/dev/null)"
      if [ "$DD_MIB" -gt 0 ]; then  # the disk the SSD tier uses by default (benchmarks/logs/)
        dd_out="$(timeout "$(budget 2)" dd if=/dev/zero of="$WORK/dd.tmp" bs=1M count="$DD_MIB" oflag=direct \
          conv=fsync 2>&1 | tail -n 1)"
        rm -f "$WORK/dd.tmp"
        echo "disk_write=$(sed -nE 's/.*, ([0-9.,]+ [kMGT]?B\/s)$/\1/p' <<<"$dd_out")"
        echo "disk_write_where=benchmarks/logs ($(stat -f -c %T "$WORK" 2>/dev/null), dd $DD_MIB MiB O_DIRECT)"
      fi
    } >>"$WORK/machine.txt" 2>>"$LOG"
    cat "$WORK/machine.txt" >>"$LOG"
    report machine "$WORK/machine.txt"
  fi
  if [ "$HAS_CUDA" = 1 ]; then
    end_stage "$peak_rc" --result "$WORK/peak.json"
  else
    skip_stage "no CUDA device seen by $PY: no matmul peak"
  fi
fi

# ---- tests: the suite's CUDA-only paths, each test's outcome on its own line (a cut run still has them) ---------
if selected tests; then
  begin_stage tests
  PLUGINS=()
  # Four workers on the one GPU: most of the tests' time is process start-up and NCCL set-up. A per-test limit
  # under the stage's, so that one hung test leaves the others their time.
  if [ "$DRY_RUN" = 1 ] || "$PY" -c 'import xdist' >/dev/null 2>&1; then PLUGINS+=(-n 4); fi
  if [ "$DRY_RUN" = 1 ] || "$PY" -c 'import pytest_timeout' >/dev/null 2>&1; then PLUGINS+=(--timeout 100); fi
  run_cmd "$PY" -m pytest tests/cuda -v --tb=short -rs -p no:cacheprovider "${PLUGINS[@]}" \
    --junitxml "$WORK/junit.xml"
  rc=$?
  [ "$DRY_RUN" = 0 ] && cp "$LOG" "$OUT_DIR/tests.txt"  # pytest's whole output comes back
  end_stage "$rc"
fi

# ---- dense and offload: ours against FSDP2 (and DeepSpeed where installed) on the same model and batches ----------
# The like-for-like pair first: the later jobs are the ones the stage's time may leave out.
PEAK_ARGS=()
if [ "$DRY_RUN" = 1 ] || [ -s "$WORK/peak.json" ]; then PEAK_ARGS=(--peak-json "$WORK/peak.json"); fi
if selected dense; then
  begin_stage dense
  if [ "$HAS_CUDA" = 1 ]; then
    # The driver shares its budget among its jobs; 8 s of the cap are its own start-up, the plan and the record.
    run_cmd "$PY" -m benchmarks.gpu_peers "${MODEL[@]}" --systems ours fsdp2 ours-trainer megatron deepspeed \
      "${DENSE_STEPS[@]}" --budget-s "$(budget 8)" --job-timeout-s 55 --min-job-s 25 "${PEAK_ARGS[@]}" \
      --run-dir "$WORK/dense" --json "$WORK/dense.json"
    end_stage $? --result "$WORK/dense.json"
  else
    skip_stage "no CUDA device seen by $PY"
  fi
fi
if selected offload; then
  begin_stage offload
  REF_ARGS=()
  if [ "$DRY_RUN" = 1 ] || [ -s "$WORK/dense.json" ]; then REF_ARGS=(--reference-from "$WORK/dense.json"); fi
  if [ "$HAS_CUDA" = 1 ]; then
    run_cmd "$PY" -m benchmarks.gpu_peers "${MODEL[@]}" --systems ours-offload fsdp2-offload deepspeed-offload \
      "${OFFLOAD_STEPS[@]}" --budget-s "$(budget 8)" --job-timeout-s 50 --min-job-s 25 \
      "${PEAK_ARGS[@]}" "${REF_ARGS[@]}" --run-dir "$WORK/offload" --json "$WORK/offload.json"
    end_stage $? --result "$WORK/offload.json"
  else
    skip_stage "no CUDA device seen by $PY"
  fi
fi

# ---- maxscale: the planner's largest model on GPU + host + SSD ---------------------------------------------------
if selected maxscale; then
  begin_stage maxscale
  NVME_ARGS=()
  [ -n "${NVME_PATH:-}" ] && NVME_ARGS=(--nvme-path "$NVME_PATH")
  if [ "$HAS_CUDA" = 1 ]; then
    run_cmd "$PY" -m benchmarks.gpu_max_scale "${MAXSCALE[@]}" --offload nvme --steps 3 "${NVME_ARGS[@]}" \
      "${PEAK_ARGS[@]}" --budget-s "$(budget 10)" --json "$WORK/maxscale.json"
    end_stage $? --result "$WORK/maxscale.json"
  else
    skip_stage "no CUDA device seen by $PY"
  fi
fi

if [ "$DRY_RUN" = 1 ]; then
  echo
  echo "total: caps sum to ${BUDGET} s of the ${LIMIT_S} s limit; the summary is rewritten after every stage"
  exit 0
fi
report note "raw logs, run folders and profiler traces (not brought back): $WORK"
echo
cat "$OUT_DIR/summary.md"
