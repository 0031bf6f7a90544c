#!/usr/bin/env bash
# Build the bundled sample corpus end to end (idempotent; nothing is downloaded):
#   Python's own documentation text -> JSONL -> byte-level BPE tokenizer -> Megatron .bin/.idx
# Output: data/sample/{corpus.jsonl, vocab.json, merges.txt, corpus_text_document.{bin,idx}}
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=data/sample
VOCAB_SIZE="${SAMPLE_VOCAB_SIZE:-8192}"
mkdir -p "$OUT"
if [ ! -f "$OUT/corpus.jsonl" ]; then
  echo "[sample data] 1/3 collecting English text from the Python standard library's documentation into $OUT/corpus.jsonl"
  python tools/make_sample_corpus.py --output "$OUT/corpus.jsonl"
fi
if [ ! -f "$OUT/merges.txt" ]; then
  echo "[sample data] 2/3 training a $VOCAB_SIZE-token byte-level BPE tokenizer on it"
  python tools/train_tokenizer.py --input "$OUT/corpus.jsonl" --type bpe --vocab-size "$VOCAB_SIZE" --output-dir "$OUT"
fi
if [ ! -f "$OUT/corpus_text_document.idx" ]; then
  echo "[sample data] 3/3 tokenizing it into $OUT/corpus_text_document.{bin,idx}"
  python tools/preprocess_data.py --input "$OUT/corpus.jsonl" --json-keys text --output-prefix "$OUT/corpus" \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$OUT/vocab.json" --merge-file "$OUT/merges.txt" \
    --append-eod --workers 2
fi
