"""Text and token ids of a target length, for replaying workloads that give only token counts.

Two modes (docs/bench.md, "Synthetic text"):

- **words** (no tokenizer): a deterministic filler of common English words, one word per target token.
  Common short words are one token in the BPE vocabularies of the usual serving models (Llama 3, Qwen,
  GPT-2 style, each word carrying its leading space), so the length is about right, not exact; the
  server's `usage.prompt_tokens` reports the true prompt length.
- **exact** (a tokenizer): text built from a pool of vocabulary tokens that each decode to a space and
  lowercase letters (" the", " and", ...) and encode back to themselves alone. A byte-level BPE
  pre-tokenizer splits such text at every space, so the concatenation of n pool tokens encodes to
  exactly those n ids. Every text is still re-encoded and, if its length is off (tokenizers of another
  kind), trimmed or extended until it matches; texts that never match are counted in `inexact`.
  `ids()` returns the pool ids themselves (for token-id prompts), exact by construction.

Randomness is keyed by (seed, session id, round), so a session's text is the same in every run and
different sessions share no prefix.
"""
from __future__ import annotations

import random
import re
from collections.abc import Sequence

# Very common English words: one token each in the usual BPE vocabularies when preceded by a space.
COMMON_WORDS: tuple[str, ...] = tuple("""
the of and to in is you that it he was for on are as with his they at be this have from or one had by
but not what all were we when your can said there use an each which she do how their if will up other
about out many then them these so some her would make like him into time has look two more write go see
number no way could people my than first water been call who its now find long down day did get come
made may part over new sound take only little work know place year live me back give most very after
thing our just name good sentence man think say great where help through much before line right too mean
old any same tell boy follow came want show also around form three small set put end does another well
large must big even such because turn here why ask went men read need land different home us move try
kind hand picture again change off play spell air away animal house point page letter mother answer found
study still learn should world high every near add food between own below country plant last school father
keep tree never start city earth eye light thought head under story saw left few while along might close
something seem next hard open example begin life always those both paper together got group often run
""".split())

_POOL_LIMIT = 4096          # pool ids kept (the lowest ids that qualify: the most frequent merges)
_FIX_ITERATIONS = 8


class TextSynth:
    """Deterministic synthetic text (or token ids) of a target token count; see the module docstring."""

    def __init__(self, tokenizer=None, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.seed = int(seed)
        self.inexact = 0                       # texts whose encoded length could not be made exact
        self.pool: list[int] = []
        self.pool_exact = False                # pool tokens concatenate without merging (verified)
        if tokenizer is not None:
            self.pool, self.pool_exact = _build_pool(tokenizer)

    @property
    def mode(self) -> str:
        return "exact" if self.tokenizer is not None else "words"

    def _rng(self, key: str, index: int) -> random.Random:
        return random.Random(f"{self.seed}\x1f{key}\x1f{index}")

    def ids(self, n: int, key: str, index: int) -> list[int]:
        """n token ids from the pool (needs a tokenizer)."""
        if self.tokenizer is None:
            raise ValueError("token-id prompts need a tokenizer")
        if n <= 0:
            return []
        return self._rng(key, index).choices(self.pool, k=n)

    def text(self, n: int, key: str, index: int) -> str:
        """Text of n tokens (exact with a tokenizer, n words without), starting with a space."""
        if n <= 0:
            return ""
        if self.tokenizer is None:
            words = self._rng(key, index).choices(COMMON_WORDS, k=n)
            return " " + " ".join(words)
        tok = self.tokenizer
        rng = self._rng(key, index)
        text = tok.decode(rng.choices(self.pool, k=n))
        for _ in range(_FIX_ITERATIONS):
            got = tok.encode(text, add_special_tokens=False)
            if len(got) == n:
                return text
            text = tok.decode(got[:n]) if len(got) > n else text + tok.decode(rng.choices(self.pool, k=n - len(got)))
        self.inexact += 1
        return text

    def count(self, text: str) -> int:
        """Tokens of `text` with the tokenizer (no special tokens), else its words."""
        if self.tokenizer is None:
            return len(text.split())
        return len(self.tokenizer.encode(text, add_special_tokens=False))


def _build_pool(tok) -> tuple[list[int], bool]:
    """Ids whose text is ' ' + lowercase letters and that encode back to themselves alone.

    Falls back to ids decoding to lowercase letters with an optional leading space (SentencePiece-style
    vocabularies, whose decoders strip the leading space of a lone token); such pools are not assumed
    to concatenate exactly, and every text is re-encoded and fixed up.
    """
    strict: list[int] = []
    loose: list[int] = []
    for i in range(tok.vocab_size):
        s = tok.decode([i], skip_special_tokens=True)
        if not s or not re.fullmatch(r" ?[a-z]+", s):
            continue
        if len(loose) < _POOL_LIMIT:
            loose.append(i)
        if s[0] == " " and tok.encode(s, add_special_tokens=False) == [i]:
            strict.append(i)
            if len(strict) >= _POOL_LIMIT:
                break
    if len(strict) >= 8 and _concatenates(tok, strict):
        return strict, True
    if not loose:
        raise ValueError("the tokenizer has no plain-word tokens to build synthetic text from")
    return loose, False


def _concatenates(tok, pool: Sequence[int]) -> bool:
    """Whether a long random sequence of pool tokens decodes and re-encodes to itself."""
    ids = random.Random(0).choices(pool, k=512)
    return tok.encode(tok.decode(ids), add_special_tokens=False) == ids
