"""Shared fixtures: a byte-level BPE trained on varied Unicode text, and small JSONL corpora."""
from __future__ import annotations

import json
import random

import pytest
from tokenizers import ByteLevelBPETokenizer

MULTILINGUAL = [
    "The quick brown fox jumps over the lazy dog. It's 3:45pm; we'll see what they've done!",
    "Ünïcödé naïve café résumé coöperate — “quoted” ‘text’ … and ellipses",
    "你好，世界！这是一个测试。日本語のテキストも：こんにちは、カタカナ、ひらがな。",
    "안녕하세요 세계. Привет, мир! Γειά σου Κόσμε. שלום עולם. مرحبا بالعالم ١٢٣٤٥",
    "हिन्दी पाठ और संख्याएँ १२३। தமிழ் உரை. ภาษาไทย ไม่มีช่องว่าง",
    "Emoji 🙂👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ and symbols ∑∫√∞ ≠ ≤ ½ ¾ ² ³ ℃ №",
    "Combining: e\u0301 a\u0308 n\u0303; zero width\u200bjoiner\u200d; NBSP\u00a0here; em\u2003space; "
    "ideographic\u3000space",
    "Whitespace\t\ttabs\r\nwindows lines\n\n\nblank lines   trailing spaces   \n  leading",
    "code: def f(x):\n    return x**2 + 1  # comment\nprint(f(3))\n{'a': [1, 2.5e-3, None]}",
    "Numbers 1234567890 3.14159 1,000,000 0xFF 10^9 Ⅻ ⅻ 𝟘𝟙𝟚 and contractions I'm you're he'd 'S 'LL",
    "Old Italic 𐌰𐌱 Gothic 𐍈 Linear B 𐀀 cuneiform 𒀀 math 𝐀𝐁𝐂 musical 𝄞 private \ue000 noncharacter \ufffe",
]


def random_unicode(rng: random.Random, length: int) -> str:
    """Random text over every plane (surrogates excluded), mixed with ASCII words and spaces."""
    out = []
    for _ in range(length):
        kind = rng.random()
        if kind < 0.3:
            out.append(rng.choice([" ", "  ", "\n", "\t", " the", "'s", "123", ".", "\u00a0"]))
        elif kind < 0.6:
            out.append(chr(rng.randrange(0x20, 0x7F)))
        elif kind < 0.85:
            out.append(chr(rng.randrange(0xA0, 0xD800)))
        else:
            c = rng.randrange(0xE000, 0x110000)
            out.append(chr(c))
    return "".join(out)


def varied_corpus(seed: int, n_random: int) -> list[str]:
    rng = random.Random(seed)
    texts = MULTILINGUAL * 3 + [" ".join(rng.sample(MULTILINGUAL, 4)) for _ in range(20)]
    return texts + [random_unicode(rng, rng.randrange(20, 400)) for _ in range(n_random)]


@pytest.fixture(scope="session")
def bpe_files(tmp_path_factory):
    """(vocab.json, merges.txt) of a byte-level BPE trained by HF on the varied corpus."""
    out = tmp_path_factory.mktemp("bpe")
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(varied_corpus(0, 300), vocab_size=1200, min_frequency=2,
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tokenizer.save_model(str(out))
    return str(out / "vocab.json"), str(out / "merges.txt")


def write_jsonl(path, records) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write((record if isinstance(record, str) else json.dumps(record, ensure_ascii=False)) + "\n")
    return str(path)
