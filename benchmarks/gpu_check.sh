#!/usr/bin/env bash
# One-GPU check for a freshly lent machine (written for one H200; under 10 minutes), then a summary table:
#   1. pytest tests/cuda                       (CUDA-only paths: pinned shards, NCCL, SSD tier, copy streams, trainer)
#   2. dense 1.3B, bf16, no offload, 20 iters  (tokens/s, TFLOP/s, MFU against PEAK_TFLOPS)
#   3. torch.profiler trace of 3 steps with host offload: copy kernels concurrent with compute kernels
#                                              (the share of copy time hidden)
#   4. the planner's largest model of the hidden-8192 family on this GPU + host + disk, 3 steps
#                                              (s/step, peak memory per tier)
#
#   bash benchmarks/gpu_check.sh              # run; logs, plans, plots and summary.txt go to $OUT
#   bash benchmarks/gpu_check.sh --dry-run    # print the commands and exit
#
# Each stage has its own time limit and all of it fits GPU_CHECK_BUDGET_S (default 555 s; stage 4 gets
# what the others leave); a failed or timed-out stage is reported in the table and the next one still
# runs. Environment: OUT (where everything goes; default a new benchmarks/logs/gpu_check-<UTC time>/, which
# git ignores), PEAK_TFLOPS (bf16 dense peak of the GPU for MFU, default 989: the H200 SXM datasheet
# figure), NVME_PATH (SSD tier, default /tmp/zc_nvme).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2

DRY_RUN=0
case "${1:-}" in
  --dry-run) DRY_RUN=1 ;;
  "") ;;
  *) echo "usage: bash benchmarks/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac

PEAK_TFLOPS="${PEAK_TFLOPS:-989}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-555}"
T_BOOT=60     # stage caps, seconds; stage 4 gets whatever is left of BUDGET_S
T_TESTS=170
T_DENSE=140
T_PLAN=45
T_OVERLAP=90
NVME_PATH="${NVME_PATH:-/tmp/zc_nvme}"
WORK="${OUT:-$ROOT/benchmarks/logs/gpu_check-$(date -u +%Y%m%d-%H%M%S)}"  # created only when not a dry run
PY=python
SYS_PY="$(command -v python3)"  # the machine's own python3, resolved before the venv is on PATH
NOTES=()
START=$SECONDS

show() { printf '+ %s\n' "$*"; }  # the command, words joined by spaces

# ---- environment: the project's venv (keeps the machine's CUDA torch), else the machine's python3 ----
if [ "$DRY_RUN" = 1 ]; then
  echo "+ source scripts/bootstrap.sh dev"
else
  mkdir -p "$WORK" "$NVME_PATH"
  boot_log="$WORK/bootstrap.log"
  # A machine with no package index fails the pip step quickly instead of retrying.
  if PIP_RETRIES=0 PIP_TIMEOUT=5 timeout "$T_BOOT" bash -c 'source scripts/bootstrap.sh dev' >"$boot_log" 2>&1; then
    # shellcheck disable=SC1091
    source scripts/bootstrap.sh dev
    set +e  # bootstrap sets -e; this script reports failures itself
  else
    PY="$SYS_PY"
    NOTES+=("bootstrap failed (see $boot_log: $(tail -n 1 "$boot_log" | cut -c1-100)); using the machine's python3")
  fi
  has_cuda='import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'
  if [ "$PY" != "$SYS_PY" ] && ! "$PY" -c "$has_cuda" 2>/dev/null && "$SYS_PY" -c "$has_cuda" 2>/dev/null; then
    PY="$SYS_PY"
    NOTES+=("the venv's torch sees no GPU; using the machine's python3")
  fi
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  "$PY" -c 'import sys, torch
ok = torch.cuda.is_available()
name = torch.cuda.get_device_name(0) if ok else "no CUDA device"
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {name}")' || NOTES+=("torch does not import")
fi
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node 1)  # torchrun, with this python

ROWS=()
add_row() { ROWS+=("$(printf '%-26s %-12s %6s  %s' "$1" "$2" "$3" "$4")"); }

# run_stage LOG LIMIT_S CMD...: runs CMD under a time limit with its output in LOG; sets RC and SECS.
run_stage() {
  local log="$1" limit="$2"
  shift 2
  if [ "$DRY_RUN" = 1 ]; then show "$@"; RC=0; SECS=0; return; fi
  show "$@" | tee -a "$log"
  local t0=$SECONDS
  timeout --kill-after=20 "$limit" "$@" >>"$log" 2>&1
  RC=$?
  SECS=$((SECONDS - t0))
}

status_of() {  # status_of RC
  case "$1" in 0) echo PASS ;; 124|137) echo TIMEOUT ;; *) echo "FAIL(rc=$1)" ;; esac
}

last_error() {  # the most telling line of a failed run's log
  grep -E "Error|error:|Traceback|Killed|out of memory|FAILED" "$1" 2>/dev/null | tail -n 1 | cut -c1-140
}

# figures LOG KIND: the stage's numbers from its training log (tools/plot_run.py --summary).
figures() {
  "$PY" - "$1" "$2" "$PEAK_TFLOPS" <<'PYEOF'
import json, re, subprocess, sys
log, kind, peak = sys.argv[1], sys.argv[2], float(sys.argv[3])
out = subprocess.run([sys.executable, "tools/plot_run.py", log, "--summary"], capture_output=True, text=True)
if out.returncode:
    print(out.stderr.strip().splitlines()[-1][:140] if out.stderr.strip() else "no log lines")
    sys.exit(0)
s = json.loads(out.stdout.splitlines()[-1])
model = re.search(r"> model: ([0-9.]+)M parameters", open(log, errors="replace").read())
millions = float(model.group(1)) if model else 0.0
size = (f"{millions / 1e3:.2f}B params, " if millions >= 1e3 else f"{millions:.1f}M params, ") if model else ""
if kind == "dense":
    print(f"{size}{s['step_time_s']:.3f} s/step, {s['tokens_per_s']:,.0f} tokens/s, {s['tflops']:.1f} TFLOP/s, "
          f"MFU {100 * s['tflops'] / peak:.1f}% of {peak:.0f} TFLOP/s bf16 dense peak")
else:
    peaks = ", ".join(f"{k} {v:.1f}" for k, v in sorted(s["peak_memory_gib"].items()))
    print(f"{size}{s['step_time_s']:.1f} s/step (after iteration {s['first_iteration']}); "
          f"peak GiB: {peaks}")
PYEOF
}

plot() {  # plot LOG PNG
  [ "$DRY_RUN" = 1 ] && { show "$PY" tools/plot_run.py "$1" -o "$2"; return; }
  "$PY" tools/plot_run.py "$1" -o "$2" >/dev/null 2>&1 || NOTES+=("no plot for $1")
}

report_train() {  # report_train LOG NAME LABEL SECONDS: plot the run and add its row (figures, or the error)
  plot "$1" "$WORK/$2.png"
  [ "$DRY_RUN" = 0 ] || return 0
  local fig
  fig="$(figures "$1" "$2")"
  [ "$RC" = 0 ] || fig="$(last_error "$1") | $fig"
  add_row "$3" "$(status_of "$RC")" "$4" "$fig"
}

# ---- 1. CUDA-only tests ------------------------------------------------------------------------------
log="$WORK/tests.log"
run_stage "$log" "$T_TESTS" "$PY" -m pytest tests/cuda -q -rs
if [ "$DRY_RUN" = 0 ]; then
  result="$(grep -E '[0-9]+ (passed|failed|skipped|errors?)' "$log" | tail -n 1 | tr -d '=' | sed 's/^ *//')"
  status="$(status_of "$RC")"
  if [ "$RC" = 0 ] && ! grep -q ' passed' <<<"$result"; then status=SKIPPED; fi  # no GPU seen
  add_row "1 pytest tests/cuda" "$status" "${SECS}s" "${result:-$(last_error "$log")}"
fi

# ---- 2. dense 1.3B, bf16, no offload ------------------------------------------------------------------
DENSE=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192
       --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 4 --global-batch-size 4
       --train-iters 20 --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2
       --weight-decay 0.1 --clip-grad 1.0 --bf16 --hidden-dropout 0 --attention-dropout 0
       --mock-data --tokenizer-type NullTokenizer --vocab-size 32000
       --log-interval 5 --eval-iters 0 --num-workers 2)
log="$WORK/dense.log"
run_stage "$log" "$T_DENSE" "${TORCHRUN[@]}" pretrain_gpt.py "${DENSE[@]}"
report_train "$log" dense "2 dense 1.3B bf16 x20" "${SECS}s"

# ---- 3. copies concurrent with compute: a profiler trace of 3 steps with host offload ---------------------
log="$WORK/overlap.log"
run_stage "$log" "$T_OVERLAP" "$PY" -m benchmarks.profile_overlap --out "$WORK/overlap"
if [ "$DRY_RUN" = 0 ]; then
  fig="$(grep -E '^overlap: [0-9]' "$log" | tail -n 1 | cut -c10-150)"
  [ "$RC" = 0 ] || fig="$(grep -E 'FAIL|Error|error' "$log" | tail -n 1 | cut -c1-140) | $fig"
  add_row "3 copy/compute overlap" "$(status_of "$RC")" "${SECS}s" "$fig"
fi

# ---- 4. the planner's largest model on this GPU + host + disk, 3 steps -------------------------------
log="$WORK/maxscale.log"
PLAN=(tools/plan_memory.py --device cuda --num-layers 1 --hidden-size 8192 --num-attention-heads 64
      --ffn-hidden-size 32768 --seq-length 2048 --vocab-size 32000 --largest --nproc-per-node 1
      --nvme-path "$NVME_PATH" --write-ds-config "$WORK/maxscale.json" --write-args "$WORK/maxscale.args")
run_stage "$log" "$T_PLAN" "$PY" "${PLAN[@]}"
plan_rc=$RC plan_secs=$SECS
MAX_ARGS=()
if [ "$DRY_RUN" = 1 ]; then
  MAX_ARGS=("\$(cat $WORK/maxscale.args)")
elif [ "$plan_rc" = 0 ] && [ -s "$WORK/maxscale.args" ]; then
  mapfile -t MAX_ARGS <"$WORK/maxscale.args"
fi
if [ "$DRY_RUN" = 1 ] || [ ${#MAX_ARGS[@]} -gt 0 ]; then
  left=$((BUDGET_S - (SECONDS - START)))
  [ "$left" -lt 60 ] && left=60
  MAXSCALE=("${MAX_ARGS[@]}" --train-iters 3 --deepspeed --deepspeed_config "$WORK/maxscale.json"
            --lr 1e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 32000
            --log-interval 1 --eval-iters 0 --num-workers 2)
  run_stage "$log" "$left" "${TORCHRUN[@]}" pretrain_gpt.py "${MAXSCALE[@]}"
  report_train "$log" maxscale "4 planner max-scale x3" "$((plan_secs + SECS))s"
else
  add_row "4 planner max-scale x3" "$(status_of "$plan_rc")" "${plan_secs}s" "planner: $(tail -n 1 "$log" | cut -c1-140)"
fi

[ "$DRY_RUN" = 1 ] && exit 0

# ---- summary -------------------------------------------------------------------------------------------
{
  echo
  echo "==================== gpu_check summary ($((SECONDS - START))s; MFU against ${PEAK_TFLOPS} TFLOP/s) ===================="
  printf '%-26s %-12s %6s  %s\n' stage status time result
  printf '%s\n' "${ROWS[@]}"
  for n in "${NOTES[@]}"; do echo "note: $n"; done
  echo "logs: $WORK"
} | tee "$WORK/summary.txt"
