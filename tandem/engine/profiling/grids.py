"""The steps `tandem profile` measures: the Point of one step, the training grid and the held-out grid."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from tandem.perf.batch_shape import BatchShape


@dataclass(frozen=True)
class Point:
    """One step to measure: prefill chunks as (l_hist, l_new) and decodes as KV length before the step."""

    kind: str                                       # prefill | decode | mixed
    prefills: tuple[tuple[int, int], ...] = ()
    decodes: tuple[int, ...] = ()

    def shape(self) -> BatchShape:
        """The BatchShape the worker core would give this step (decode context = KV length after it)."""
        s = BatchShape()
        for c in self.decodes:
            s.add_decode(c + 1)
        for h, n in self.prefills:
            s.add_prefill(h, n)
        return s

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.prefills) + len(self.decodes)

    def blocks(self, block_size: int) -> int:
        """KV blocks the step's block tables need (every sequence rounds up to whole blocks)."""
        return sum(-(-(h + n) // block_size) for h, n in self.prefills) + sum(-(-(c + 1) // block_size)
                                                                            for c in self.decodes)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "prefills": [list(p) for p in self.prefills], "decodes": list(self.decodes)}


def _fits(p: Point, capacity: int, block_size: int) -> bool:
    """Whether the step's sequences fit the KV pool of `capacity` tokens in blocks of `block_size`."""
    return p.blocks(block_size) * block_size <= capacity


def _geom(lo: int, hi: int, per_octave: float) -> list[int]:
    """Integers from lo to hi (both included), `per_octave` per doubling, log-spaced."""
    if hi < lo:
        return []
    k = max(1, int(round(math.log2(max(hi / lo, 1)) * per_octave)) + 1)
    return sorted({int(round(lo * (hi / lo) ** (i / max(k - 1, 1)))) for i in range(k)})


def train_grid(budget: int, max_len: int, max_seqs: int, capacity: int, quick: bool = False,
               block_size: int = 16) -> list[Point]:
    """The fitting grid: prefill-only (lengths x histories), decode-only (batch x context), mixed steps.

    budget: the engine's max_num_batched_tokens (no step has more query tokens); max_len: longest
    sequence; capacity: KV pool tokens (no step holds more).
    """
    budget = max(1, min(budget, max_len - 1 if max_len > 1 else 1))
    pts: list[Point] = []

    def add(p: Point) -> None:
        if p.tokens <= budget and _fits(p, capacity, block_size) and all(h + n <= max_len for h, n in p.prefills) \
                and all(c + 1 <= max_len for c in p.decodes) and len(p.decodes) + len(p.prefills) <= max(max_seqs, 1):
            pts.append(p)

    lens0 = _geom(1, budget, 1 if quick else 2)                    # history 0: dense in length
    lens = _geom(1, budget, 1) if not quick else _geom(1, budget, 0.5)
    hists = [h for h in ([max_len // 4, max_len // 2] if quick else [64, max_len // 8, max_len // 2, max_len - budget])
             if 0 < h < max_len]
    for n in lens0:
        add(Point("prefill", ((0, n),)))
    for h in sorted(set(hists)):
        for n in lens:
            add(Point("prefill", ((h, n),)))

    batches = _geom(1, max_seqs, 0.5 if quick else 1)
    ctxs = sorted({c for c in ([16, 256, max_len // 2] if quick else [16, 128, 512, max_len // 4, max_len // 2, max_len - 1])
                   if 1 <= c < max_len})
    for c in ctxs:
        for b in batches:
            add(Point("decode", decodes=(c,) * b))

    # Mixed steps: decodes riding along one prefill chunk (the chunk small, medium, or filling the budget;
    # with history only at a medium size), and several prefill chunks batched together.
    mix_b = [1, 8, 32] if quick else [1, 8, 64]
    mix_c = [max_len // 4] if quick else [128, max_len // 4]
    for b in mix_b:
        for c in mix_c:
            for n in ([16, budget // 2, budget - b] if quick else [16, 256, budget - b]):
                if 1 <= n <= budget - b:
                    add(Point("mixed", ((0, n),), (c,) * b))
            if not quick and 256 <= budget - b:
                add(Point("mixed", ((max_len // 4, 256),), (c,) * b))
    for k in ([2, 4] if quick else [2, 4, 8]):
        for n in ([16, budget // k] if quick else [16, 128, budget // k]):
            if n >= 1:
                add(Point("mixed", ((0, n),) * k, ()))
            if not quick and n <= 128:
                add(Point("mixed", ((max_len // 8, n),) * k, ()))
    return list(dict.fromkeys(pts))                                  # drop duplicates, keep order


def heldout_grid(count: int, budget: int, max_len: int, max_seqs: int, capacity: int,
                 rng: random.Random, block_size: int = 16) -> list[Point]:
    """Random realistic steps, none on the training grid: single prefills with random history, decode
    batches whose contexts spread over a factor of 4, decodes riding a chunk, several chunks together."""
    budget = max(1, min(budget, max_len - 1 if max_len > 1 else 1))

    def logu(lo: float, hi: float) -> int:
        return int(round(math.exp(rng.uniform(math.log(lo), math.log(max(hi, lo))))))

    def ctxs(b: int) -> tuple[int, ...]:
        c0 = logu(16, max_len / 2)
        return tuple(min(max_len - 1, max(1, logu(c0 / 2, c0 * 2))) for _ in range(b))

    def hist(n: int) -> int:
        return 0 if rng.random() < 0.3 or max_len - n < 2 else logu(1, max_len - n)

    out: list[Point] = []
    kinds = ["prefill", "decode", "mixed", "multi"]
    tries = 0
    while len(out) < count and tries < 100 * count:
        tries += 1
        kind = kinds[len(out) % len(kinds)]
        if kind == "prefill":
            n = logu(1, budget)
            p = Point("prefill", ((hist(n), n),))
        elif kind == "decode":
            p = Point("decode", decodes=ctxs(logu(1, max_seqs)))
        elif kind == "mixed":
            b = logu(1, min(max_seqs, max(1, budget // 2)))
            n = logu(1, max(1, budget - b))
            p = Point("mixed", ((hist(n), n),), ctxs(b))
        else:
            k = rng.randint(2, 6)
            chunks = []
            for _ in range(k):
                n = logu(1, max(1, budget // k))
                chunks.append((hist(n), n))
            p = Point("mixed", tuple(chunks), ctxs(rng.randint(0, 8)) if rng.random() < 0.5 else ())
        if p.tokens <= budget and _fits(p, capacity, block_size) and all(h + n <= max_len for h, n in p.prefills) \
                and len(p.prefills) + len(p.decodes) <= max(max_seqs, 1):
            out.append(p)
    return out


def block_aligned(points: list[Point], block: int, budget: int, max_len: int, capacity: int,
                  block_size: int = 16) -> list[Point]:
    """A block-diffusion model's AR-shaped steps: the prefill chunks only (it decodes in windows, timed apart), each
    chunk's history and length rounded to whole diffusion blocks (its prefill writes whole blocks), duplicates
    dropped."""
    out: list[Point] = []
    for p in points:
        if p.decodes:
            continue
        q = Point(p.kind, tuple((h // block * block, max(block, n // block * block)) for h, n in p.prefills))
        if q.tokens <= budget and _fits(q, capacity, block_size) and all(h + n <= max_len for h, n in q.prefills):
            out.append(q)
    return list(dict.fromkeys(out))
