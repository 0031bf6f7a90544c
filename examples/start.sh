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
#   TP, PP, EP (tensor, pipeline, expert parallel sizes; EP divides the data-parallel size, moe-* sizes only)
#   CP (context-parallel size: ranks that split every sequence; with TP > 1 sequence parallelism is on too)
#   MBS, GBS (micro / global batch)   SEQ_LEN   TRAIN_ITERS   LR
#   DATA_PATH (preprocessed prefix; default: build the sample corpus)   SAVE_DIR (checkpoints; also resumes)
#   DS_CONFIG (DeepSpeed-style JSON: trains through the zero_cache engine)   EXTRA_ARGS (appended flags)
#   PLAN_ARGS (extra memory-planner flags, e.g. "--host-memory-gib 24 --nvme-path /local_nvme")
#   LOG_INTERVAL EVAL_INTERVAL EVAL_ITERS SAVE_INTERVAL TENSORBOARD_DIR VOCAB_FILE MERGE_FILE TOKENIZER_ARGS
#   SAMPLE_VOCAB_SIZE OMP_NUM_THREADS; the full table: docs/training.md#examplesstartsh
# Relative paths in these variables are taken from the directory you run start.sh in (it then works in the
# checkout); flags inside EXTRA_ARGS, PLAN_ARGS, TOKENIZER_ARGS and LAUNCH_ARGS are passed on as written.
#
# Before anything else the memory planner (ptm_planner) checks that SIZE fits this machine: a
# size that does not is refused with the planner's message (exit 3). Every size but `default` then trains
# through zero_cache ZeRO-3 with the planner's config and its micro-batch / recompute choice (DS_CONFIG
# replaces the config); `default` trains with Megatron DDP as given.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Paths given in the environment are the caller's: resolve them before moving into the checkout.
CALLER_DIR="$PWD"
for var in DATA_PATH SAVE_DIR DS_CONFIG HOSTFILE TENSORBOARD_DIR VOCAB_FILE MERGE_FILE PTM_VENV; do
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

source scripts/bootstrap.sh ""  # "": not the dev set (a bare `source` would pass on SIZE as its argument)

if [ -n "${HOSTFILE:-}" ]; then
  # All slots of all hosts take part: the data-parallel size follows from their sum.
  NPROC="${NPROC:-$(awk '{sub(/#.*/, "")} /slots/ {sub(/.*slots[ \t]*=[ \t]*/, ""); n += $1} END {print n}' "$HOSTFILE")}"
fi
if python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  NPROC="${NPROC:-$(python -c 'import torch; print(torch.cuda.device_count())')}"; BACKEND=nccl; PREC="--bf16"
else
  NPROC="${NPROC:-2}"; BACKEND=gloo; PREC=""  # fp32 on CPU: bf16 matmuls are 20-50x slower there
fi
TP="${TP:-1}"; PP="${PP:-1}"; EP="${EP:-1}"; CP="${CP:-1}"
MBS="${MBS:-$TABLE_MBS}"
DP=$(( NPROC / (TP * PP * CP) ))
SEQ_LEN="${SEQ_LEN:-$("${SIZE_TABLE[@]}" seq-length "$SIZE")}"
# Sequence parallelism costs nothing over tensor parallelism and divides the norms' activations by TP.
SPLIT_ARGS=(--context-parallel-size "$CP")
if [ "$TP" -gt 1 ]; then SPLIT_ARGS+=(--sequence-parallel); fi
if [ "$SIZE" = default ]; then TRAIN_ITERS="${TRAIN_ITERS:-100}"; LR="${LR:-1e-3}"; else TRAIN_ITERS="${TRAIN_ITERS:-1000}"; LR="${LR:-3e-4}"; fi

# Memory plan: refuse a size that cannot fit before preparing data or starting processes.
if [ -n "${HOSTFILE:-}" ]; then NNODES="$(awk '{sub(/#.*/, "")} /slots/ {n++} END {print n}' "$HOSTFILE")"; else NNODES=1; fi
if [ "$BACKEND" = nccl ]; then PLAN_DEVICE=cuda; else PLAN_DEVICE=cpu; fi
if [ -z "${DATA_PATH:-}" ]; then PLAN_VOCAB="${SAMPLE_VOCAB_SIZE:-8192}"; else PLAN_VOCAB=50257; fi
# With SAVE_DIR the plan is kept next to the checkpoints and reused on resume (the chunk layout must not
# change between runs); delete $SAVE_DIR/plan to plan again.
if [ -n "${SAVE_DIR:-}" ]; then PLAN_DIR="$SAVE_DIR/plan"; mkdir -p "$PLAN_DIR"; else PLAN_DIR="$(mktemp -d "${TMPDIR:-/tmp}/ptm_plan.XXXXXX")"; fi
if [ -f "$PLAN_DIR/model_args.txt" ] && [ -f "$PLAN_DIR/ds_config.json" ]; then
  echo "[start.sh] reusing the memory plan in $PLAN_DIR"
else
  # shellcheck disable=SC2086
  python -m ptm_planner --size "$SIZE" --seq-length "$SEQ_LEN" --micro-batch-size "$MBS" \
    --nproc-per-node "$(( NPROC / NNODES ))" --nnodes "$NNODES" --tensor-model-parallel-size "$TP" \
    --pipeline-model-parallel-size "$PP" --expert-model-parallel-size "$EP" "${SPLIT_ARGS[@]}" --device "$PLAN_DEVICE" \
    --vocab-size "$PLAN_VOCAB" $PREC \
    --write-ds-config "$PLAN_DIR/ds_config.json" --write-args "$PLAN_DIR/model_args.txt" ${PLAN_ARGS:-} \
    > "$PLAN_DIR/plan.txt" && PLAN_RC=0 || PLAN_RC=$?
  if [ "$PLAN_RC" != 0 ]; then
    cat "$PLAN_DIR/plan.txt"
    echo "[start.sh] size $SIZE cannot be trained here (memory planner exit $PLAN_RC); nothing was started"
    exit "$PLAN_RC"
  fi
  echo "[start.sh] $(tail -n 1 "$PLAN_DIR/plan.txt") (plan: $PLAN_DIR)"
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
GBS="${GBS:-$(( MBS * DP * 2 ))}"

# Data: the bundled sample corpus unless DATA_PATH is given.
DATA_ARGS=()
if [ -z "${DATA_PATH:-}" ]; then
  bash examples/prepare_sample_data.sh
  DATA_PATH="data/sample/corpus_text_document"
  DATA_ARGS=(--tokenizer-type GPT2BPETokenizer --vocab-file data/sample/vocab.json --merge-file data/sample/merges.txt)
elif [ -n "${TOKENIZER_ARGS:-}" ]; then
  # shellcheck disable=SC2206
  DATA_ARGS=($TOKENIZER_ARGS)
else
  DATA_ARGS=(--tokenizer-type GPT2BPETokenizer --vocab-file "${VOCAB_FILE:-$CALLER_DIR/vocab.json}"
             --merge-file "${MERGE_FILE:-$CALLER_DIR/merges.txt}")
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

echo "[start.sh] size=$SIZE layers=$LAYERS hidden=$HIDDEN heads=$HEADS ffn=$FFN${MOE_ARGS[*]:+ moe: ${MOE_ARGS[*]}} nproc=$NPROC TP=$TP PP=$PP EP=$EP CP=$CP DP=$DP mbs=$MBS gbs=$GBS seq=$SEQ_LEN"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}"
RESTARTS=()
if [ "${MAX_RESTARTS:-0}" != 0 ]; then
  RESTARTS=(--max_restarts "$MAX_RESTARTS")
  [ -n "${SAVE_DIR:-}" ] || echo "[start.sh] MAX_RESTARTS without SAVE_DIR: a restarted run starts over from iteration 0"
fi
# LAUNCH_ARGS: extra ptm-launch options, shell-quoted, e.g. "--master_port 6000 --launcher_args '-F ~/.ssh/cluster'"
mapfile -t LAUNCH < <(python -c 'import os, shlex; [print(a) for a in shlex.split(os.environ.get("LAUNCH_ARGS", ""))]')
if [ -n "${HOSTFILE:-}" ]; then
  exec ptm-launch --hostfile "$HOSTFILE" "${RESTARTS[@]}" "${LAUNCH[@]}" pretrain_gpt.py "${ARGS[@]}"
fi
# On this machine too ptm-launch (torchrun underneath): a failure is the failing rank's one line and exit code
# rather than torchrun's report, and restarts are logged.
exec ptm-launch --num_gpus "$NPROC" "${RESTARTS[@]}" "${LAUNCH[@]}" pretrain_gpt.py "${ARGS[@]}"
