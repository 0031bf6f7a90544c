#!/usr/bin/env bash
# Build the bundled sample corpus end to end (idempotent; nothing is downloaded):
#   Python's own documentation text -> JSONL -> byte-level BPE tokenizer -> Megatron .bin/.idx
# Output: data/sample/{corpus.jsonl, vocab.json, merges.txt, corpus_text_document.{bin,idx}}
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=data/sample
VOCAB_SIZE="${SAMPLE_VOCAB_SIZE:-8192}"
mkdir -p "$OUT"
[ -f "$OUT/corpus.jsonl" ] || python tools/make_sample_corpus.py --output "$OUT/corpus.jsonl"
[ -f "$OUT/merges.txt" ] || python tools/train_tokenizer.py --input "$OUT/corpus.jsonl" --type bpe \
  --vocab-size "$VOCAB_SIZE" --output-dir "$OUT"
if [ ! -f "$OUT/corpus_text_document.idx" ]; then
  python tools/preprocess_data.py --input "$OUT/corpus.jsonl" --json-keys text --output-prefix "$OUT/corpus" \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$OUT/vocab.json" --merge-file "$OUT/merges.txt" \
    --append-eod --workers 2
fi
