"""A HF ``tokenizers`` tokenizer from ``tokenizer.json`` (``--tokenizer-model`` names the file or its folder)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer

from megatron.tokenizer.base import MegatronTokenizer

# End-of-document tokens looked for, in order, when no tokenizer_config.json names the eos token.
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")


class HFTokenizer(MegatronTokenizer):
    """Encodes without the tokenizer's post-processor specials (no BOS); eod is the eos token."""

    name = "HFTokenizer"

    def __init__(self, path: str | Path):
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        self.tokenizer = Tokenizer.from_file(str(file))
        eos = self._configured_eos(file.parent / "tokenizer_config.json")
        candidates = (eos,) if eos else EOD_CANDIDATES
        for token in candidates:
            token_id = self.tokenizer.token_to_id(token)
            if token_id is not None:
                self._eod = token_id
                break
        else:
            raise ValueError(f"{file}: no end-of-document token found (looked for {', '.join(candidates)}); "
                             f"add one of them to the tokenizer or name it as eos_token in "
                             f"{file.parent / 'tokenizer_config.json'}")

    @staticmethod
    def _configured_eos(config_file: Path) -> str | None:
        if not config_file.is_file():
            return None
        eos = json.loads(config_file.read_text(encoding="utf-8")).get("eos_token")
        return eos.get("content") if isinstance(eos, dict) else eos

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
