"""Cutting an input laid end to end into ``--partitions`` contiguous parts of about equal size."""
from __future__ import annotations

import bisect


def split_evenly(sizes: list[int], divisible: list[bool], parts: int) -> list[list[tuple[int, int, int]]]:
    """Items of ``sizes`` bytes, in order, cut into ``parts`` parts; part k ends near ``total * (k + 1) / parts``.

    A divisible item (a plain JSONL file) is cut at those boundaries; any other (a compressed stream, a
    Parquet row group, an Arrow record batch) cannot be entered in the middle and goes whole to the part
    where its middle falls, so some parts may be empty. Returns, per part, ``(item, start, end)`` byte
    ranges within the items, in input order.
    """
    total = sum(sizes)
    cuts = [total * k // parts for k in range(1, parts)]
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(parts)]
    offset = 0
    for item, (size, cuttable) in enumerate(zip(sizes, divisible)):
        if cuttable:
            start = offset
            for part, cut in enumerate(cuts + [total + 1]):
                stop = min(cut, offset + size)
                if stop > start:
                    out[part].append((item, start - offset, stop - offset))
                    start = stop
        else:
            out[bisect.bisect_right(cuts, offset + size // 2)].append((item, 0, size))
        offset += size
    return out
