"""The tokenizer a run trained with, as Hugging Face tokenizer files beside the exported model.

The trainer stores its flags in the checkpoint's ``args``, the tokenizer's among them (``--tokenizer-type``,
``--vocab-file``, ``--merge-file``, ``--tokenizer-model``, ``--vocab-size``); the export's flags of the same names
replace them, for files that moved. A relative path is looked up from the working directory, then from the
repository root (where examples/start.sh trains). Each of our tokenizers becomes a fast tokenizer that gives the
same ids: GPT-2 BPE from vocab.json + merges.txt, a tokenizer.json as it is, a SentencePiece model converted with
its normalizer (Megatron's SentencePieceTokenizer adds its special tokens after the model's pieces, as ours does).
The end-of-document token is the eos token; NullTokenizer has no text, so only its eos id is known.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

from megatron.tokenizer import GPT2BPETokenizer, HFTokenizer, MegatronTokenizer, NullTokenizer, SentencePieceTokenizer
from megatron.tokenizer.config import TokenizerConfig, build_tokenizer
from megatron.training.arguments.tokenizer import tokenizer_config_from_args
from zero_cache.checkpoint import CheckpointError

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATH_FIELDS = ("vocab_file", "merge_file", "tokenizer_model")
# the export's flags that name each tokenizer's files
FILE_FLAGS = {"GPT2BPETokenizer": "--vocab-file and --merge-file", "HFTokenizer": "--tokenizer-model",
              "SentencePieceTokenizer": "--tokenizer-model", "GPTSentencePieceTokenizer": "--tokenizer-model"}


@dataclass(frozen=True)
class ExportedTokenizer:
    hf: object | None  # a transformers fast tokenizer, None when the tokenizer has no text form (NullTokenizer)
    token_ids: dict[str, int | None]  # bos_token_id / eos_token_id / pad_token_id for config.json


def _located(path: str | None) -> str | None:
    if path is None or os.path.isabs(path) or os.path.exists(path):
        return path
    in_repository = os.path.join(REPOSITORY, path)
    return in_repository if os.path.exists(in_repository) else path


def tokenizer_config(args: dict, overrides: TokenizerConfig) -> TokenizerConfig:
    """The tokenizer recorded in the checkpoint's ``args``, with the fields ``overrides`` sets replaced."""
    recorded = {f.name: args.get(f.name) for f in dataclasses.fields(TokenizerConfig)}
    recorded.update({k: _located(v) for k, v in recorded.items() if k in PATH_FIELDS})
    given = {k: v for k, v in dataclasses.asdict(overrides).items() if v is not None}
    # the trainer's rule: --vocab-file with --merge-file and no type is GPT-2's BPE
    return tokenizer_config_from_args(argparse.Namespace(**{**recorded, **given}))


def _hint(kind: str | None) -> str:
    flags = FILE_FLAGS.get(kind, "--tokenizer-type with --vocab-file and --merge-file (GPT2BPETokenizer) or "
                                 "--tokenizer-model (the others)")
    return f"pass the export {flags} with the files the run trained with"


def _fast_tokenizer(ours: MegatronTokenizer, cfg: TokenizerConfig):
    from transformers import AddedToken, GPT2Tokenizer, PreTrainedTokenizerFast
    if isinstance(ours, GPT2BPETokenizer):
        eod = ours.decoder[ours.eod]
        # like plain SentencePiece below, it reads "<|endoftext|>" in text as characters, as the trainer did
        return GPT2Tokenizer(vocab=cfg.vocab_file, merges=cfg.merge_file, unk_token=eod, bos_token=eod, eos_token=eod,
                             split_special_tokens=True)
    if isinstance(ours, HFTokenizer):
        return PreTrainedTokenizerFast(tokenizer_object=ours.tokenizer, eos_token=ours.tokenizer.id_to_token(ours.eod))
    # SentencePiece: built from the model's proto, so its normalizer and byte fallback carry over
    hf = PreTrainedTokenizerFast(**PreTrainedTokenizerFast.convert_to_native_format(vocab_file=cfg.tokenizer_model),
                                 split_special_tokens=not isinstance(ours, SentencePieceTokenizer))
    if isinstance(ours, SentencePieceTokenizer):
        hf.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True, normalized=False)
                                                             for t in ours.special_tokens]})
    if ours.sp.pad_id() >= 0:
        hf.pad_token = ours.sp.id_to_piece(ours.sp.pad_id())
    hf.eos_token = hf.convert_ids_to_tokens(ours.eod)
    return hf


def export_tokenizer(args: dict, overrides: TokenizerConfig, vocab_size: int, max_length: int,
                     warn) -> ExportedTokenizer | None:
    """The run's tokenizer as a fast tokenizer and its special ids; None (after one ``warn`` line saying what to
    pass) when it cannot be built. A tokenizer with more ids than the model's ``vocab_size``, or other than the run
    recorded, is an error."""
    cfg = tokenizer_config(args, overrides)
    try:
        ours = build_tokenizer(cfg)
    except (OSError, ValueError) as e:  # no type, a flag or file missing, or a file that does not parse
        warn(f"no tokenizer exported: {e}; {_hint(cfg.tokenizer_type)}; the weights are written without it")
        return None
    if ours.vocab_size > vocab_size or args.get("true_vocab_size") not in (None, ours.vocab_size):
        raise CheckpointError(f"the tokenizer {ours!r} does not fit the model, whose vocabulary has {vocab_size} "
                              f"ids; {_hint(cfg.tokenizer_type)}")
    if isinstance(ours, NullTokenizer):
        warn(f"{ours!r} has no text vocabulary: no tokenizer files written, only eos_token_id {ours.eod}")
        return ExportedTokenizer(None, {"eos_token_id": ours.eod})
    hf = _fast_tokenizer(ours, cfg)
    hf.model_max_length = max_length
    return ExportedTokenizer(hf, {"bos_token_id": hf.bos_token_id, "eos_token_id": hf.eos_token_id,
                                  "pad_token_id": hf.pad_token_id})
