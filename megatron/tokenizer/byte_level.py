"""GPT-2 byte-level pieces: the byte <-> printable-character table and the pre-tokenisation regex.

The regex is GPT-2's. Its character classes (``\\p{L}``, ``\\p{N}``) follow the Unicode tables of the
``regex`` package, which (2026.11.19) implements Unicode 17.0, whereas HF ``tokenizers`` 0.23 matches
with Oniguruma's Unicode 16.0 tables. To give the same ids as HF on any text, the letters and numbers
first assigned in Unicode 17.0 are moved to the "other symbols" class, exactly as Unicode 16 sees them.
Matching with those set operations is ~2.5x slower, so ``Gpt2PreTokenizer`` uses the plain pattern for the
(usual) text that contains none of those characters, where both patterns split identically.
``tests/data/test_tokenizers.py`` compares every code point with HF, so a version change on either side
is caught.
"""
from __future__ import annotations

import regex

# Letters (L) and numbers (N) new in Unicode 17.0, as inclusive code point ranges.
UNICODE_17_NEW_LETTERS_AND_NUMBERS: tuple[tuple[int, int], ...] = (
    (0x00558, 0x00558), (0x0058B, 0x0058C), (0x0088F, 0x0088F), (0x00C5C, 0x00C5C), (0x00CDC, 0x00CDC),
    (0x0208F, 0x0208F), (0x0209D, 0x0209F), (0x0A7CE, 0x0A7CF), (0x0A7D2, 0x0A7D2), (0x0A7D4, 0x0A7D4),
    (0x0A7DD, 0x0A7DD), (0x0A7E2, 0x0A7E2), (0x0A7F1, 0x0A7F1), (0x0AB6C, 0x0AB6D), (0x107BB, 0x107BF),
    (0x10940, 0x10959), (0x10EC5, 0x10EC7), (0x10ED9, 0x10EEE), (0x11B0A, 0x11B0A), (0x11DB0, 0x11DDB),
    (0x11DE0, 0x11DE9), (0x11DF1, 0x11DF1), (0x1246F, 0x1246F), (0x12475, 0x1247F), (0x12550, 0x12686),
    (0x16EA0, 0x16EB8), (0x16EBB, 0x16ED3), (0x16FF2, 0x16FF6), (0x187F8, 0x187FF), (0x18CD6, 0x18CDA),
    (0x18D09, 0x18D20), (0x18D80, 0x18DF2), (0x18E00, 0x19191), (0x191A0, 0x191D2), (0x1B123, 0x1B128),
    (0x1B168, 0x1B168), (0x1D6A6, 0x1D6A6), (0x1DF1F, 0x1DF24), (0x1DF2B, 0x1DF81), (0x1DF90, 0x1DF96),
    (0x1DFCD, 0x1DFFF), (0x1E6C0, 0x1E6DE), (0x1E6E0, 0x1E6E2), (0x1E6E4, 0x1E6E5), (0x1E6E7, 0x1E6ED),
    (0x1E6F0, 0x1E6F4), (0x1E6FE, 0x1E6FF), (0x2B73A, 0x2B73F), (0x2B81E, 0x2B81E), (0x2CEA2, 0x2CEAD),
    (0x323B0, 0x33479), (0x3D000, 0x3FC3F),
)


def _class_body(ranges: tuple[tuple[int, int], ...]) -> str:
    return "".join(rf"\U{a:08x}-\U{b:08x}" for a, b in ranges)


GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


_NEW = f"[{_class_body(UNICODE_17_NEW_LETTERS_AND_NUMBERS)}]"
# character classes as HF's Unicode 16 tables define them (regex VERSION1 set syntax)
LETTER_CLASS = rf"[\p{{L}}--{_NEW}]"
NUMBER_CLASS = rf"[\p{{N}}--{_NEW}]"
OTHER_CLASS = rf"[[^\s\p{{L}}\p{{N}}]{_NEW}]"


def unicode16_pattern() -> regex.Pattern:
    """GPT-2's split pattern with the Unicode 16 letter / number / other classes."""
    return regex.compile(
        rf"""'s|'t|'re|'ve|'m|'ll|'d| ?{LETTER_CLASS}+| ?{NUMBER_CLASS}+| ?{OTHER_CLASS}+|\s+(?!\S)|\s+""",
        flags=regex.VERSION1)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


class Gpt2PreTokenizer:
    """Splits text into GPT-2 pre-tokens exactly as HF ``tokenizers``' ByteLevel pre-tokenizer does."""

    def __init__(self):
        self._fast = regex.compile(GPT2_PATTERN)
        self._exact = unicode16_pattern()
        self._new_chars = frozenset(chr(c) for a, b in UNICODE_17_NEW_LETTERS_AND_NUMBERS for c in range(a, b + 1))

    def split(self, text: str) -> list[str]:
        if text.isascii() or self._new_chars.isdisjoint(text):
            return self._fast.findall(text)
        return self._exact.findall(text)
