"""Chained block hashes of a token sequence: equal hashes mean equal prefixes (prefix caching, session lookup)."""
from __future__ import annotations

from collections.abc import Sequence

ROOT_HASH = 0x7A4D3E11


def extend_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int) -> list[int]:
    """Append to `hashes` the chained hash of every full block of `token_ids` it does not cover yet.

    Block i's hash folds in block i-1's, so it names the whole prefix; the same tokens hash the same in
    every process (tuples of ints are not salted by PYTHONHASHSEED).
    """
    h = hashes[-1] if hashes else ROOT_HASH
    for i in range(len(hashes), len(token_ids) // block_size):
        h = hash((h, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        hashes.append(h)
    return hashes
