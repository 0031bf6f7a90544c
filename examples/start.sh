#!/usr/bin/env bash
# Train a GPT. The user's main entry.
#
#   bash examples/start.sh            # embedded default: a small GPT on the bundled sample corpus (CPU ok)
#   bash examples/start.sh 1.3b       # a named size from the table below
#   EP=2 bash examples/start.sh moe-tiny   # a mixture of experts (moe-* sizes), experts split over 2 ranks
#   CP=8 bash examples/start.sh 1.3b-32k   # 32K-token sequences, each split over 8 ranks (context parallelism)
#   bash examples/start.sh list       # print the table
#
# Environment overrides (Megatron example-script style):
#   NPROC (processes on this node; default: GPUs, else 2)   HOSTFILE (multi-node, `host slots=N` lines;
#   LAUNCH_ARGS passes ptm-launch options, e.g. "--master_port 6000")
#   MAX_RESTARTS (restart every rank up to N times after a rank or node failure, resuming from SAVE_DIR)
#   MIN_NODES (with HOSTFILE and MAX_RESTARTS: a host lost for good leaves the job and the others go on, same
#   global batch, while MIN_NODES remain: ptm-launch --nnodes MIN_NODES:hosts; every smaller mesh is checked)
#   TP, PP, EP (tensor, pipeline, expert parallel sizes; EP divides the data-parallel size, moe-* sizes only)
#   CP (context-parallel size: ranks that split every sequence; with TP > 1 sequence parallelism is on too)
#   CP_COMM_TYPE (context-parallel attention with CP > 1: p2p, a2a or allgather; p2p and allgather train
#   without attention dropout, which start.sh then sets to 0)
#   MBS, GBS (micro / global batch)   SEQ_LEN   TRAIN_ITERS   LR
#   DATA_PATH (preprocessed prefix; default: build the sample corpus)   SAVE_DIR (checkpoints; also resumes)
#   DS_CONFIG (DeepSpeed-style JSON: trains through the zero_cache engine)   EXTRA_ARGS (appended flags)
#   PLAN_ARGS (extra memory-planner flags, e.g. "--host-memory-gib 24 --nvme-path /local_nvme")
#   LOG_DIR (where this run's whole output is kept; default SAVE_DIR/logs, else runs/logs in the checkout)
#   LOG_INTERVAL EVAL_INTERVAL EVAL_ITERS SAVE_INTERVAL TENSORBOARD_DIR VOCAB_FILE MERGE_FILE TOKENIZER_ARGS
#   SAMPLE_VOCAB_SIZE OMP_NUM_THREADS; the full table: docs/training.md#examplesstartsh
# Relative paths in these variables are taken from the directory you run start.sh in (it then works in the
# checkout); flags inside EXTRA_ARGS, PLAN_ARGS, TOKENIZER_ARGS and LAUNCH_ARGS are passed on as written.
#
# Before anything else the variables are checked (a mesh that does not divide, a missing file: one line naming
# the variable, exit 2) and the memory planner (ptm_planner) checks that SIZE fits this machine: a size that
# does not is refused with the planner's message (exit 3). Every size but `default` then trains through
# zero_cache ZeRO-3 with the planner's config and its micro-batch / recompute choice (DS_CONFIG replaces the
# config); `default` trains with Megatron DDP as given. The run ends with a summary: what ran, the trainer's
# result, where the log is and how to save or resume.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Paths given in the environment are the caller's: resolve them before moving into the checkout.
CALLER_DIR="$PWD"
for var in DATA_PATH SAVE_DIR DS_CONFIG HOSTFILE TENSORBOARD_DIR VOCAB_FILE MERGE_FILE PTM_VENV LOG_DIR; do
  case "${!var:-/}" in /*) ;; *) printf -v "$var" '%s/%s' "$CALLER_DIR" "${!var}" ;; esac
done
case "${PTM_PYTHON:-}" in */*) [[ "$PTM_PYTHON" = /* ]] || PTM_PYTHON="$CALLER_DIR/$PTM_PYTHON" ;; esac
cd "$ROOT"

SIZE="${1:-default}"
# Sizes (layers hidden heads ffn micro-batch, and the mixture-of-experts flags of moe-* sizes) live in
# ptm_planner/sizes.py, shared with the memory planner; it needs only the standard library, so the system python3
# reads it before the project's environment exists.
SIZE_TABLE=(python3 -m ptm_planner.sizes)
if [ "$SIZE" = "list" ] || [ "$SIZE" = "-h" ] || [ "$SIZE" = "--help" ]; then "${SIZE_TABLE[@]}" list; exit 0; fi
if ! ROW="$("${SIZE_TABLE[@]}" row "$SIZE" 2>/dev/null)"; then
  echo "unknown SIZE '$SIZE'"; "${SIZE_TABLE[@]}" list; exit 2
fi
read -r LAYERS HIDDEN HEADS FFN TABLE_MBS <<<"$ROW"
read -r -a MOE_ARGS <<<"$("${SIZE_TABLE[@]}" moe-args "$SIZE")"  # empty for a dense size

say() { echo "[start.sh] $*"; }
# Bad input: one line naming the variable to change, exit 2, before anything starts.
refuse() { echo "[start.sh] error: $*" >&2; exit 2; }

# Everything from the set-up to the last rank's line goes to the terminal and to this log.
LOG_DIR="${LOG_DIR:-${SAVE_DIR:+$SAVE_DIR/logs}}"
LOG_DIR="${LOG_DIR:-$ROOT/runs/logs}"
mkdir -p "$LOG_DIR" 2>/dev/null || refuse "LOG_DIR=$LOG_DIR cannot be created; set LOG_DIR (or SAVE_DIR) to a writable directory"
LOG="$LOG_DIR/start-$(date -u +%Y%m%dT%H%M%SZ).log"
[ ! -e "$LOG" ] || LOG="${LOG%.log}-$$.log"

# The vocabulary size of the tokenizer flags given as arguments (the trainer's tokenizer, so the plan's model is the
# trained one); a flag or file it cannot use is one line on stdout and exit 1.
tokenizer_vocab_size() {
  python - "$@" <<'PY'
import argparse
import sys

from megatron.tokenizer.config import build_tokenizer
from megatron.training.arguments.tokenizer import add_tokenizer_args, tokenizer_config_from_args

parser = add_tokenizer_args(argparse.ArgumentParser(prog="TOKENIZER_ARGS", usage=argparse.SUPPRESS, add_help=False))
try:
    print(build_tokenizer(tokenizer_config_from_args(parser.parse_known_args(sys.argv[1:])[0])).vocab_size)
except (OSError, ValueError) as e:
    print(e)
    sys.exit(1)
PY
}

# The run itself, from the checks to the last rank's line; the end of this file sends its output through the log.
train() {
set -euo pipefail  # a pipeline stage does not inherit the caller's -e
export PYTHONUNBUFFERED=1  # the tools' and ranks' lines reach the log as they are printed

# Files named by the variables, checked before anything is set up.
[ -z "${HOSTFILE:-}" ] || [ -f "$HOSTFILE" ] || refuse "HOSTFILE=$HOSTFILE does not exist; give a file of \`host slots=N\` lines"
[ -z "${DS_CONFIG:-}" ] || [ -f "$DS_CONFIG" ] || refuse "DS_CONFIG=$DS_CONFIG does not exist; give a DeepSpeed-style JSON (e.g. examples/ds_config_zero3.json)"
if [ -n "${DATA_PATH:-}" ]; then
  for ext in bin idx; do
    [ -f "$DATA_PATH.$ext" ] || refuse "DATA_PATH=$DATA_PATH: $DATA_PATH.$ext does not exist; give the prefix tools/preprocess_data.py wrote (e.g. my_corpus_text_document, without .bin/.idx)"
  done
  if [ -z "${TOKENIZER_ARGS:-}" ]; then
    VOCAB_FILE="${VOCAB_FILE:-$CALLER_DIR/vocab.json}"; MERGE_FILE="${MERGE_FILE:-$CALLER_DIR/merges.txt}"
    [ -f "$VOCAB_FILE" ] || refuse "VOCAB_FILE=$VOCAB_FILE does not exist; give the vocab.json of DATA_PATH's tokenizer (or TOKENIZER_ARGS for another kind of tokenizer)"
    [ -f "$MERGE_FILE" ] || refuse "MERGE_FILE=$MERGE_FILE does not exist; give the merges.txt of DATA_PATH's tokenizer (or TOKENIZER_ARGS for another kind of tokenizer)"
  fi
fi

source scripts/bootstrap.sh ""  # "": not the dev set (a bare `source` would pass on SIZE as its argument)

# GPUs here (0 without CUDA), asked once and only when needed: settings that do not divide are refused before
# torch is even imported.
GPUS=""
have_gpus() {
  [ -n "$GPUS" ] || GPUS="$(python -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
  [ "$GPUS" != 0 ]
}
NPROC_FROM=""  # where a default NPROC came from, for the lines below
if [ -z "${NPROC:-}" ]; then
  if [ -n "${HOSTFILE:-}" ]; then
    # All slots of all hosts take part: the data-parallel size follows from their sum.
    NPROC="$(awk '{sub(/#.*/, "")} /slots/ {sub(/.*slots[ \t]*=[ \t]*/, ""); n += $1} END {print n}' "$HOSTFILE")"
    NPROC_FROM=" (the slots of HOSTFILE)"
  elif have_gpus; then
    NPROC="$GPUS"; NPROC_FROM=" (the GPUs here)"
  else
    NPROC=2; NPROC_FROM=" (the default without GPUs)"
  fi
fi
TP="${TP:-1}"; PP="${PP:-1}"; EP="${EP:-1}"; CP="${CP:-1}"
MBS="${MBS:-$TABLE_MBS}"
SEQ_LEN="${SEQ_LEN:-$("${SIZE_TABLE[@]}" seq-length "$SIZE")}"
if [ "$SIZE" = default ]; then TRAIN_ITERS="${TRAIN_ITERS:-100}"; LR="${LR:-1e-3}"; else TRAIN_ITERS="${TRAIN_ITERS:-1000}"; LR="${LR:-3e-4}"; fi

# The mesh, in the variables' names (the planner and the trainer would name their flags).
for var in NPROC TP PP EP CP MBS SEQ_LEN TRAIN_ITERS ${GBS:+GBS}; do
  [[ "${!var}" =~ ^[1-9][0-9]*$ ]] || refuse "$var=${!var} is not a positive whole number"
done
SPLIT=$(( TP * PP * CP ))
if (( NPROC % SPLIT )); then
  PARTS=(); for var in TP PP CP; do [ "${!var}" = 1 ] || PARTS+=("$var=${!var}"); done
  MESH="${PARTS[*]}"; MESH="${MESH// / x }"; [ "${#PARTS[@]}" = 1 ] || MESH="$MESH = $SPLIT"
  refuse "$MESH does not divide NPROC=$NPROC$NPROC_FROM: every data-parallel replica takes TP x PP x CP processes; set NPROC to a multiple of $SPLIT or change TP, PP, CP"
fi
DP=$(( NPROC / SPLIT ))
(( HEADS % TP == 0 )) || refuse "TP=$TP does not divide the $HEADS attention heads of size $SIZE; choose a TP that divides $HEADS"
(( LAYERS % PP == 0 )) || refuse "PP=$PP does not divide the $LAYERS layers of size $SIZE; choose a PP that divides $LAYERS"
if [ "${#MOE_ARGS[@]}" = 0 ]; then
  [ "$EP" = 1 ] || refuse "EP=$EP splits the experts of a mixture of experts, and size $SIZE has none; use a moe-* size (bash examples/start.sh list) or EP=1"
else
  [ "$CP" = 1 ] || refuse "CP=$CP with a mixture-of-experts size ($SIZE) is not supported; use CP=1, or a dense size"
  (( DP % EP == 0 )) || refuse "EP=$EP does not divide the data-parallel size DP=$DP (NPROC=$NPROC / (TP x PP x CP)); choose an EP that divides $DP"
fi
PIECES=$(( (CP > 1 ? 2 * CP : 1) * TP ))
(( SEQ_LEN % PIECES == 0 )) || refuse "SEQ_LEN=$SEQ_LEN is not a multiple of $PIECES: every sequence is cut into 2 x CP pieces (with CP > 1), each into TP (with TP > 1); use a multiple of $PIECES"

if have_gpus; then BACKEND=nccl; PREC="--bf16"; else BACKEND=gloo; PREC=""; fi  # fp32 on CPU: bf16 matmuls are 20-50x slower there
# Sequence parallelism costs nothing over tensor parallelism and divides the norms' activations by TP.
SPLIT_ARGS=(--context-parallel-size "$CP")
if [ "$TP" -gt 1 ]; then SPLIT_ARGS+=(--sequence-parallel); fi
if [ "$CP" -gt 1 ]; then
  # The context-parallel attention kinds and those without attention dropout are the model config's constants.
  CP_INFO="$(python -c 'from megatron.core import transformer_config as t
print(t.TransformerConfig.cp_comm_type, " ".join(t.CP_COMM_TYPES), " ".join(t.CP_COMM_TYPES_WITHOUT_DROPOUT), sep=";")')"
  IFS=';' read -r CP_DEFAULT CP_KINDS CP_NO_DROPOUT <<<"$CP_INFO"
  CP_COMM_TYPE="${CP_COMM_TYPE:-$CP_DEFAULT}"
  [[ " $CP_KINDS " = *" $CP_COMM_TYPE "* ]] || refuse "CP_COMM_TYPE=$CP_COMM_TYPE is not one of: $CP_KINDS"
  SPLIT_ARGS+=(--cp-comm-type "$CP_COMM_TYPE")
  # The planner and the trainer both need it; a value the user gave in EXTRA_ARGS or PLAN_ARGS is theirs.
  if [[ " $CP_NO_DROPOUT " = *" $CP_COMM_TYPE "* && " ${EXTRA_ARGS:-} ${PLAN_ARGS:-} " != *" --attention-dropout"* ]]; then
    SPLIT_ARGS+=(--attention-dropout 0)
    say "CP=$CP with $CP_COMM_TYPE attention, which takes no attention dropout: training with --attention-dropout 0 (CP_COMM_TYPE=a2a keeps it)"
  fi
fi

# Data and tokenizer: the bundled sample corpus (built after the plan) unless DATA_PATH is given.
if [ -z "${DATA_PATH:-}" ]; then
  DATA_ARGS=(--tokenizer-type GPT2BPETokenizer --vocab-file data/sample/vocab.json --merge-file data/sample/merges.txt)
  TOKENIZER_FROM="the sample corpus's tokenizer (data/sample)"
elif [ -n "${TOKENIZER_ARGS:-}" ]; then
  # shellcheck disable=SC2206
  DATA_ARGS=($TOKENIZER_ARGS)
  TOKENIZER_FROM="TOKENIZER_ARGS=$TOKENIZER_ARGS"
else
  DATA_ARGS=(--tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE")
  TOKENIZER_FROM="VOCAB_FILE=$VOCAB_FILE with MERGE_FILE=$MERGE_FILE"
fi
# The plan is of the trained model: the vocabulary of its tokenizer (the sample's is trained to SAMPLE_VOCAB_SIZE).
if [ -z "${DATA_PATH:-}" ] && [ ! -f data/sample/merges.txt ]; then
  PLAN_VOCAB="${SAMPLE_VOCAB_SIZE:-8192}"
elif ! PLAN_VOCAB="$(tokenizer_vocab_size "${DATA_ARGS[@]}")"; then
  refuse "$TOKENIZER_FROM cannot be loaded: $PLAN_VOCAB"
fi

# Memory plan: refuse a size that cannot fit before preparing data or starting processes.
if [ -n "${HOSTFILE:-}" ]; then NNODES="$(awk '{sub(/#.*/, "")} /slots/ {n++} END {print n}' "$HOSTFILE")"; else NNODES=1; fi
if [ "$BACKEND" = nccl ]; then PLAN_DEVICE=cuda; else PLAN_DEVICE=cpu; fi
USER_DS_CONFIG="${DS_CONFIG:-}"
# The planner plans its own zero_cache config; it cannot read the user's.
NOT_PLANNED=""
[ -z "$USER_DS_CONFIG" ] || NOT_PLANNED="; planned with the planner's zero_cache config, not DS_CONFIG=$USER_DS_CONFIG, whose memory is not checked"
# With SAVE_DIR the plan is kept next to the checkpoints and reused on resume (the chunk layout must not
# change between runs); delete $SAVE_DIR/plan to plan again.
if [ -n "${SAVE_DIR:-}" ]; then PLAN_DIR="$SAVE_DIR/plan"; mkdir -p "$PLAN_DIR"; else PLAN_DIR="$(mktemp -d "${TMPDIR:-/tmp}/ptm_plan.XXXXXX")"; fi
if [ -f "$PLAN_DIR/model_args.txt" ] && [ -f "$PLAN_DIR/ds_config.json" ]; then
  say "reusing the memory plan in $PLAN_DIR$NOT_PLANNED"
else
  # shellcheck disable=SC2086
  python -m ptm_planner --size "$SIZE" --seq-length "$SEQ_LEN" --micro-batch-size "$MBS" \
    --nproc-per-node "$(( NPROC / NNODES ))" --nnodes "$NNODES" --tensor-model-parallel-size "$TP" \
    --pipeline-model-parallel-size "$PP" --expert-model-parallel-size "$EP" "${SPLIT_ARGS[@]}" --device "$PLAN_DEVICE" \
    --vocab-size "$PLAN_VOCAB" $PREC \
    --write-ds-config "$PLAN_DIR/ds_config.json" --write-args "$PLAN_DIR/model_args.txt" ${PLAN_ARGS:-} \
    > "$PLAN_DIR/plan.txt" 2> "$PLAN_DIR/plan.err" && PLAN_RC=0 || PLAN_RC=$?
  if [ "$PLAN_RC" = 2 ]; then  # bad input: the planner's own reason, in the last line of its stderr
    sed '$d' "$PLAN_DIR/plan.err" >&2
    REASON="$(tail -n 1 "$PLAN_DIR/plan.err")"
    refuse "the memory planner refused size $SIZE with these settings (PLAN_ARGS passes it flags): ${REASON#plan_memory.py: error: }; nothing was started"
  fi
  cat "$PLAN_DIR/plan.err" >&2
  if [ "$PLAN_RC" != 0 ]; then
    cat "$PLAN_DIR/plan.txt"
    say "size $SIZE cannot be trained here (memory planner exit $PLAN_RC); nothing was started"
    exit "$PLAN_RC"
  fi
  say "$(tail -n 1 "$PLAN_DIR/plan.txt") (plan: $PLAN_DIR$NOT_PLANNED)"
fi
if [ "$SIZE" = default ]; then
  MODEL_ARGS=(--num-layers "$LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS" --ffn-hidden-size "$FFN"
              --seq-length "$SEQ_LEN" --max-position-embeddings "$SEQ_LEN" --micro-batch-size "$MBS" "${MOE_ARGS[@]}")
else
  # The planned model flags: micro-batch possibly lowered, recompute when needed; a mixture of experts' flags
  # (the size's MOE_ARGS and --expert-model-parallel-size) are among them.
  mapfile -t MODEL_ARGS < "$PLAN_DIR/model_args.txt"
  for i in "${!MODEL_ARGS[@]}"; do [ "${MODEL_ARGS[$i]}" = --micro-batch-size ] && MBS="${MODEL_ARGS[$((i + 1))]}"; done
  DS_CONFIG="${DS_CONFIG:-$PLAN_DIR/ds_config.json}"
fi
if [ -n "${GBS:-}" ]; then
  (( GBS % (MBS * DP) == 0 )) || refuse "GBS=$GBS is not a multiple of MBS x DP = $MBS x $DP = $(( MBS * DP )) (MBS$([ "$SIZE" = default ] || echo " from the memory plan"), DP = NPROC / (TP x PP x CP)); use a multiple of $(( MBS * DP ))"
fi
GBS="${GBS:-$(( MBS * DP * 2 ))}"
# An elastic range: each node count it allows must still split into the mesh and the global batch.
if [ -n "${MIN_NODES:-}" ]; then
  [[ "$MIN_NODES" =~ ^[1-9][0-9]*$ ]] && (( MIN_NODES <= NNODES )) || refuse "MIN_NODES=$MIN_NODES: give a number of hosts from 1 to the $NNODES of HOSTFILE"
  [ -n "${HOSTFILE:-}" ] && [ "${MAX_RESTARTS:-0}" != 0 ] || refuse "MIN_NODES=$MIN_NODES needs HOSTFILE and MAX_RESTARTS (going on without a host is a restart of every rank)"
  for (( n = MIN_NODES; n < NNODES; n++ )); do
    WORLD=$(( NPROC / NNODES * n ))
    (( WORLD % SPLIT == 0 )) && DP_N=$(( WORLD / SPLIT )) && (( DP_N % EP == 0 && GBS % (MBS * DP_N) == 0 )) || refuse "MIN_NODES=$MIN_NODES: on $n of the $NNODES hosts ($WORLD processes) TP x PP x CP = $SPLIT, EP=$EP and GBS=$GBS (MBS=$MBS) do not divide the data-parallel ranks that remain; raise MIN_NODES or choose sizes that divide"
  done
fi
if [ -n "$USER_DS_CONFIG" ]; then TRAINS_WITH="zero_cache with DS_CONFIG=$USER_DS_CONFIG"
elif [ -n "${DS_CONFIG:-}" ]; then TRAINS_WITH="zero_cache with the plan's config"
else TRAINS_WITH="Megatron DDP"; fi

if [ -z "${DATA_PATH:-}" ]; then
  bash examples/prepare_sample_data.sh
  DATA_PATH="data/sample/corpus_text_document"
fi

ARGS=(
  "${MODEL_ARGS[@]}" --global-batch-size "$GBS"
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --expert-model-parallel-size "$EP"
  "${SPLIT_ARGS[@]}"
  --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr "$(python -c "print($LR/10)")" --lr-decay-style cosine
  --lr-warmup-fraction 0.05 --weight-decay 0.1 --clip-grad 1.0
  --data-path "$DATA_PATH" --split 98,2,0 "${DATA_ARGS[@]}"
  --log-interval "${LOG_INTERVAL:-10}" --eval-interval "${EVAL_INTERVAL:-100}" --eval-iters "${EVAL_ITERS:-5}"
  --distributed-backend "$BACKEND" --seed 1234 $PREC
)
# A resumed run follows this script's schedule: rerunning with a larger TRAIN_ITERS extends the decay (Megatron-DeepSpeed's
# scripts pass the same flag).
if [ -n "${SAVE_DIR:-}" ]; then
  ARGS+=(--save "$SAVE_DIR" --load "$SAVE_DIR" --save-interval "${SAVE_INTERVAL:-100}" --override-opt_param-scheduler)
fi
if [ -n "${DS_CONFIG:-}" ]; then ARGS+=(--deepspeed --deepspeed_config "$DS_CONFIG"); fi
if [ -n "${TENSORBOARD_DIR:-}" ]; then ARGS+=(--tensorboard-dir "$TENSORBOARD_DIR"); fi
# shellcheck disable=SC2206
ARGS+=(${EXTRA_ARGS:-})

# This line marks the launch: the summary below reads the mesh from it.
say "size=$SIZE layers=$LAYERS hidden=$HIDDEN heads=$HEADS ffn=$FFN${MOE_ARGS[*]:+ moe: ${MOE_ARGS[*]}} nproc=$NPROC TP=$TP PP=$PP EP=$EP CP=$CP DP=$DP mbs=$MBS gbs=$GBS seq=$SEQ_LEN; $TRAINS_WITH"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}"
RESTARTS=()
if [ "${MAX_RESTARTS:-0}" != 0 ]; then
  RESTARTS=(--max_restarts "$MAX_RESTARTS" ${MIN_NODES:+--nnodes "$MIN_NODES:$NNODES"})
  [ -n "${SAVE_DIR:-}" ] || say "MAX_RESTARTS without SAVE_DIR: a restarted run starts over from iteration 0"
fi
# LAUNCH_ARGS: extra ptm-launch options, shell-quoted, e.g. "--master_port 6000 --launcher_args '-F ~/.ssh/cluster'"
mapfile -t LAUNCH < <(python -c 'import os, shlex; [print(a) for a in shlex.split(os.environ.get("LAUNCH_ARGS", ""))]')
if [ -n "${HOSTFILE:-}" ]; then
  ptm-launch --hostfile "$HOSTFILE" "${RESTARTS[@]}" "${LAUNCH[@]}" pretrain_gpt.py "${ARGS[@]}"
else
  # On this machine too ptm-launch (torchrun underneath): a failure is the failing rank's one line and exit code
  # rather than torchrun's report, and restarts are logged.
  ptm-launch --num_gpus "$NPROC" "${RESTARTS[@]}" "${LAUNCH[@]}" pretrain_gpt.py "${ARGS[@]}"
fi
}

# What ran and how it ended, from the log: the launch line above and the trainer's last line,
#   run summary: iterations A-B (N this run) | final lm loss X | tokens/s T | elapsed H:MM:SS |
#                checkpoint PATH at iteration B (or: not saved: --save not set) | log PATH (or: log stdout only)
# Nothing when the run stopped before the launch: its one line says why.
summary() {
  local rc="$1" launched line field fields=() result=() saved="" trainer_log=""
  launched="$(grep '^\[start.sh\] size=' "$LOG" | tail -n 1)" || return 0
  local mesh='nproc=([0-9]+) TP=([0-9]+) PP=([0-9]+) EP=([0-9]+) CP=([0-9]+) DP=([0-9]+).*; (.*)$'
  [[ "$launched" =~ $mesh ]] || return 0
  local m=("${BASH_REMATCH[@]}")
  echo "[start.sh] ---- summary ----"
  say "ran: size $SIZE on ${m[1]} processes (TP=${m[2]} PP=${m[3]} EP=${m[4]} CP=${m[5]} DP=${m[6]}), ${m[7]}"
  line="$(grep -o 'run summary: .*' "$LOG" | tail -n 1)" || line=""
  if [ -n "$line" ]; then
    IFS='|' read -r -a fields <<<"${line#run summary: }"
    for field in "${fields[@]}"; do
      field="${field#"${field%%[![:space:]]*}"}"; field="${field%"${field##*[![:space:]]}"}"
      case "$field" in
        "checkpoint "*) saved="${field#checkpoint }" ;;
        "not saved"*) saved="" ;;
        "log stdout only") ;;
        "log "*) trainer_log="${field#log }" ;;
        *) result+=("$field") ;;
      esac
    done
    local joined; joined="$(printf '%s, ' "${result[@]}")"
    say "${joined%, }"
    if [ -n "$saved" ]; then
      say "checkpoint: $saved; the same SAVE_DIR resumes from it (a larger TRAIN_ITERS trains on)"
    else
      say "nothing was saved: SAVE_DIR is not set; SAVE_DIR=checkpoints/$SIZE bash examples/start.sh $SIZE saves every SAVE_INTERVAL (${SAVE_INTERVAL:-100}) iterations there and resumes from it when run again"
    fi
    [ -z "$trainer_log" ] || say "trainer's log: $trainer_log"
    [ "$rc" = 0 ] || say "exit code $rc"
  elif [ "$rc" = 0 ]; then
    say "the trainer printed no run summary line; see the log below"
  else
    say "the run failed (exit $rc) before its summary: the cause is the error line above; the whole output is in the log below"
  fi
  say "log of this run (all of the above): $LOG"
}

set +e
train 2>&1 | tee -i "$LOG"  # -i: after a Ctrl-C the launcher's last lines still reach the log
RC="${PIPESTATUS[0]}"
set -e
summary "$RC" | tee -ia "$LOG"
exit "$RC"
