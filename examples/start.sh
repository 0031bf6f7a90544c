#!/usr/bin/env bash
# Train a GPT. The user's main entry.
#
#   bash examples/start.sh            # embedded default: a small GPT on the bundled sample corpus (CPU ok)
#   bash examples/start.sh 1.3b       # a named size from the table below
#   bash examples/start.sh list       # print the table
#
# Environment overrides (Megatron example-script style):
#   NPROC (processes on this node; default: GPUs, else 2)   HOSTFILE (multi-node, `host slots=N` lines;
#   LAUNCH_ARGS passes ptm-launch options, e.g. "--master_port 6000")
#   TP, PP (parallel sizes)   MBS, GBS (micro / global batch)   SEQ_LEN   TRAIN_ITERS   LR
#   DATA_PATH (preprocessed prefix; default: build the sample corpus)   SAVE_DIR (checkpoints; also resumes)
#   DS_CONFIG (DeepSpeed-style JSON: trains through the zero_cache engine)   EXTRA_ARGS (appended flags)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

SIZE="${1:-default}"
# name: layers hidden heads ffn micro-batch   (the table users pick from)
read -r -d '' TABLE <<'TAB' || true
default   6    256   8     1024   4
125m      12   768   12    3072   8
350m      24   1024  16    4096   8
760m      24   1536  16    6144   4
1.3b      24   2048  16    8192   4
2.7b      32   2560  32    10240  2
6.7b      32   4096  32    16384  1
13b       40   5120  40    20480  1
28        26   8192  128   32768  38
55        68   8192  64    32768  10
TAB

print_table() {
  echo "sizes (layers hidden heads ffn micro-batch):"
  echo "$TABLE" | sed 's/^/  /'
}
if [ "$SIZE" = "list" ] || [ "$SIZE" = "-h" ] || [ "$SIZE" = "--help" ]; then print_table; exit 0; fi
ROW="$(echo "$TABLE" | awk -v s="$SIZE" '$1==s')"
if [ -z "$ROW" ]; then echo "unknown SIZE '$SIZE'"; print_table; exit 2; fi
read -r _ LAYERS HIDDEN HEADS FFN TABLE_MBS <<<"$ROW"

source scripts/bootstrap.sh

if [ -n "${HOSTFILE:-}" ]; then
  # All slots of all hosts take part: the data-parallel size follows from their sum.
  NPROC="${NPROC:-$(awk '{sub(/#.*/, "")} /slots/ {sub(/.*slots[ \t]*=[ \t]*/, ""); n += $1} END {print n}' "$HOSTFILE")}"
fi
if python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  NPROC="${NPROC:-$(python -c 'import torch; print(torch.cuda.device_count())')}"; BACKEND=nccl; PREC="--bf16"
else
  NPROC="${NPROC:-2}"; BACKEND=gloo; PREC=""  # fp32 on CPU: bf16 matmuls are 20-50x slower there
fi
TP="${TP:-1}"; PP="${PP:-1}"
MBS="${MBS:-$TABLE_MBS}"
DP=$(( NPROC / (TP * PP) ))
GBS="${GBS:-$(( MBS * DP * 2 ))}"
SEQ_LEN="${SEQ_LEN:-256}"
if [ "$SIZE" = default ]; then TRAIN_ITERS="${TRAIN_ITERS:-100}"; LR="${LR:-1e-3}"; else TRAIN_ITERS="${TRAIN_ITERS:-1000}"; LR="${LR:-3e-4}"; fi

# Data: the bundled sample corpus unless DATA_PATH is given.
DATA_ARGS=()
if [ -z "${DATA_PATH:-}" ]; then
  bash examples/prepare_sample_data.sh
  DATA_PATH="data/sample/corpus_text_document"
  DATA_ARGS=(--tokenizer-type GPT2BPETokenizer --vocab-file data/sample/vocab.json --merge-file data/sample/merges.txt)
else
  DATA_ARGS=(${TOKENIZER_ARGS:---tokenizer-type GPT2BPETokenizer --vocab-file ${VOCAB_FILE:-vocab.json} --merge-file ${MERGE_FILE:-merges.txt}})
fi

ARGS=(
  --num-layers "$LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS" --ffn-hidden-size "$FFN"
  --seq-length "$SEQ_LEN" --max-position-embeddings "$SEQ_LEN"
  --micro-batch-size "$MBS" --global-batch-size "$GBS"
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
  --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr "$(python -c "print($LR/10)")" --lr-decay-style cosine
  --lr-warmup-fraction 0.05 --weight-decay 0.1 --clip-grad 1.0
  --data-path "$DATA_PATH" --split 98,2,0 "${DATA_ARGS[@]}"
  --log-interval "${LOG_INTERVAL:-10}" --eval-interval "${EVAL_INTERVAL:-100}" --eval-iters "${EVAL_ITERS:-5}"
  --distributed-backend "$BACKEND" --seed 1234 $PREC
)
if [ -n "${SAVE_DIR:-}" ]; then ARGS+=(--save "$SAVE_DIR" --load "$SAVE_DIR" --save-interval "${SAVE_INTERVAL:-100}"); fi
if [ -n "${DS_CONFIG:-}" ]; then ARGS+=(--deepspeed --deepspeed_config "$DS_CONFIG"); fi
if [ -n "${TENSORBOARD_DIR:-}" ]; then ARGS+=(--tensorboard-dir "$TENSORBOARD_DIR"); fi
# shellcheck disable=SC2206
ARGS+=(${EXTRA_ARGS:-})

echo "[start.sh] size=$SIZE layers=$LAYERS hidden=$HIDDEN heads=$HEADS ffn=$FFN nproc=$NPROC TP=$TP PP=$PP DP=$DP mbs=$MBS gbs=$GBS seq=$SEQ_LEN"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}"
if [ -n "${HOSTFILE:-}" ]; then
  # LAUNCH_ARGS: extra ptm-launch options, shell-quoted, e.g. "--master_port 6000 --launcher_args '-F ~/.ssh/cluster'"
  mapfile -t LAUNCH < <(python -c 'import os, shlex; [print(a) for a in shlex.split(os.environ.get("LAUNCH_ARGS", ""))]')
  exec ptm-launch --hostfile "$HOSTFILE" "${LAUNCH[@]}" pretrain_gpt.py "${ARGS[@]}"
fi
exec torchrun --standalone --nproc-per-node "$NPROC" pretrain_gpt.py "${ARGS[@]}"
