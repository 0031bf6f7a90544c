"""``--split-sentences`` with nltk's Punkt, never downloading at run time.

The installed ``punkt_tab`` model for ``--lang`` is used when nltk can find it; otherwise Punkt is trained
(unsupervised) on the first megabytes of the input itself, and the tool says so. ``--keep-newlines``
keeps the whitespace after a sentence end inside the sentence, as Megatron's preprocessing does.
"""
from __future__ import annotations

import pickle
from typing import Iterable

from nltk.tokenize import punkt

PUNKT_TRAINING_BYTES = 1 << 20
MAX_SPLIT_CHARS = 1_000_000  # Megatron splits very long texts in pieces of this size first


class KeepNewlinesLanguageVars(punkt.PunktLanguageVars):
    """Punkt's period context with ``\\s*`` after the sentence end, so newlines stay with the sentence."""

    _period_context_fmt = r"""
        \S*                          # some word material
        %(SentEndChars)s             # a potential sentence ending
        \s*                          # keep the whitespace (and newlines) in the sentence
        (?=(?P<after_tok>
            %(NonWord)s              # either other punctuation
            |
            (?P<next_tok>\S+)        # or the next word
        ))"""


def installed_punkt_params(lang: str) -> punkt.PunktParameters | None:
    """The installed pretrained Punkt parameters for ``lang``, or None when nltk has no punkt_tab data."""
    try:
        return punkt.PunktTokenizer(lang)._params
    except LookupError:
        return None


def train_punkt_params(texts: Iterable[str],
                       max_bytes: int = PUNKT_TRAINING_BYTES) -> tuple[punkt.PunktParameters, int]:
    """Punkt parameters learned from the first ``max_bytes`` of ``texts``; also returns the bytes used."""
    sample, used = [], 0
    for text in texts:
        sample.append(text)
        used += len(text.encode("utf-8"))
        if used >= max_bytes:
            break
    trainer = punkt.PunktTrainer()
    trainer.train("\n\n".join(sample), finalize=True)
    return trainer.get_params(), used


def punkt_params_blob(params: punkt.PunktParameters) -> bytes:
    """Parameters as bytes (hashable and cheap to ship to worker processes)."""
    return pickle.dumps(params)


class SentenceSplitter:
    def __init__(self, params_blob: bytes, keep_newlines: bool):
        params = pickle.loads(params_blob)
        lang_vars = KeepNewlinesLanguageVars() if keep_newlines else punkt.PunktLanguageVars()
        self._punkt = punkt.PunktSentenceTokenizer(params, lang_vars=lang_vars)

    def split(self, text: str) -> list[str]:
        return [sentence for start in range(0, len(text), MAX_SPLIT_CHARS)
                for sentence in self._punkt.tokenize(text[start:start + MAX_SPLIT_CHARS])]
