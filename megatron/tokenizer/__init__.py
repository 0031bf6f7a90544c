"""The tokenizers of Megatron's --tokenizer-type: GPT-2 byte-level BPE, SentencePiece, HF tokenizer.json, Null."""
from megatron.tokenizer.base import MegatronTokenizer
from megatron.tokenizer.config import TOKENIZER_TYPES, TokenizerConfig, build_tokenizer
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.tokenizer.hf_tokenizer import HFTokenizer
from megatron.tokenizer.null_tokenizer import NullTokenizer
from megatron.tokenizer.sentencepiece_tokenizer import GPTSentencePieceTokenizer, SentencePieceTokenizer

__all__ = ["MegatronTokenizer", "TOKENIZER_TYPES", "TokenizerConfig", "build_tokenizer", "GPT2BPETokenizer",
           "HFTokenizer", "NullTokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer"]
