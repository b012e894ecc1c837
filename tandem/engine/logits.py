"""Logit decomposition (dLLM-Serve's `max_num_logits`): the LM head over at most N rows at a time.

A step that needs logits for many rows (a large decode batch, prompt logprobs, a diffusion window with every position
scored) would otherwise hold a rows x vocabulary float32 tensor, plus the sampler's temporaries of the same shape:
with a 152K vocabulary, 256 rows are 156 MB of logits and about eight times that through top-k/top-p and penalties.
Here hidden rows are projected in chunks of at most `max_rows`, each chunk is reduced at once to what decoding needs
(a token, its probability, logprobs) by a caller's reducer, and its logits are dropped before the next chunk is
projected, so the transient peak scales with `max_rows`, not with the number of rows.

Every reduction used here is row-wise, so the result does not depend on the chunking as long as the LM head's GEMM
gives each row the same bits whatever the number of rows (true of the oneDNN CPU linear, tests/test_engine_logits.py;
cuBLAS may pick another kernel for another row count and differ in the last bit).

API, for the AR sampler (sampler.Sampler.sample_hidden), prompt logprobs (ModelRunner) and a diffusion decoder:

- `logit_chunks(n, max_rows)`: the row slices;
- `iter_logit_chunks(hidden, max_rows)`: (slice, hidden rows) pairs;
- `reduce_logits(compute_logits, hidden, max_rows, reduce)`: project each chunk, reduce it, free it; the reductions
  in row order;
- `token_confidence(logits)`: a ready reducer, (argmax token, its softmax probability) per row;
  `decode_confidence(compute_logits, hidden, max_rows)` applies it to every row (a diffusion window's candidates);
- `target_logprobs(...)`: raw logprob of a target token per row plus the top k (prompt logprobs).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch
from torch import Tensor

R = TypeVar("R")
LogitsFn = Callable[[Tensor], Tensor]       # hidden rows [n, H] -> float32 logits [n, V] (the model's LM head)


def check_max_rows(max_rows: int | None, name: str = "max_num_logits") -> int | None:
    """`max_rows` checked: None (no cap) or an integer >= 1; ValueError naming `name` otherwise."""
    if max_rows is None:
        return None
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
        raise ValueError(f"{name} must be None or an integer >= 1, got {max_rows!r}")
    return max_rows


def logit_chunks(n_rows: int, max_rows: int | None) -> list[slice]:
    """Consecutive row slices covering [0, n_rows), each at most max_rows long (one slice when max_rows is None)."""
    check_max_rows(max_rows)
    if n_rows <= 0:
        return []
    step = n_rows if max_rows is None else max_rows
    return [slice(a, min(a + step, n_rows)) for a in range(0, n_rows, step)]


def iter_logit_chunks(hidden: Tensor, max_rows: int | None) -> Iterator[tuple[slice, Tensor]]:
    """(rows, hidden[rows]) for consecutive chunks of at most max_rows rows of hidden [n, H] (views, no copy)."""
    for rows in logit_chunks(hidden.shape[0], max_rows):
        yield rows, hidden[rows]


def reduce_logits(compute_logits: LogitsFn, hidden: Tensor, max_rows: int | None,
                  reduce: Callable[[slice, Tensor], R]) -> list[R]:
    """reduce(rows, logits of hidden[rows]) for each chunk, in row order; a chunk's logits are dropped before the next
    chunk is projected, so at most max_rows x vocab logits (plus what `reduce` makes of them) live at once."""
    out: list[R] = []
    for rows, h in iter_logit_chunks(hidden, max_rows):
        logits = compute_logits(h)
        out.append(reduce(rows, logits))
        del logits
    return out


def token_confidence(logits: Tensor) -> tuple[Tensor, Tensor]:
    """Per row of logits [n, V]: the argmax token (ties to the lowest id) and its softmax probability (float32)."""
    x = logits.float()
    tokens = x.argmax(dim=-1)
    # p(argmax) = 1 / sum(exp(x - max)): no [n, V] probability tensor beyond the exp's temporary
    top = x.gather(1, tokens[:, None])
    conf = torch.exp(x - top).sum(dim=-1).reciprocal()
    return tokens, conf


def decode_confidence(compute_logits: LogitsFn, hidden: Tensor,
                      max_rows: int | None) -> tuple[Tensor, Tensor]:
    """(token [n], confidence [n]) for every row of hidden [n, H], the LM head run on at most max_rows rows at once
    (a diffusion step's candidates and their unmasking scores without materialising n x vocab)."""
    parts = reduce_logits(compute_logits, hidden, max_rows, lambda _rows, logits: token_confidence(logits))
    if not parts:
        empty = hidden.new_empty(0)
        return empty.long(), empty.float()
    return torch.cat([t for t, _ in parts]), torch.cat([c for _, c in parts])


def target_logprobs(compute_logits: LogitsFn, hidden: Tensor, targets: Sequence[int], ks: Sequence[int],
                    max_rows: int | None) -> list[dict[int, float]]:
    """Per row i of hidden [n, H]: {targets[i]: its raw logprob, plus the top ks[i] tokens: theirs} (vLLM's prompt
    logprobs), the log-softmax over the full vocabulary, computed chunk by chunk.

    Every chunk takes the top max(ks) and keeps each row's first ks[i], so a row's entries do not depend on which
    other rows share its chunk."""
    n = hidden.shape[0]
    if len(targets) != n or len(ks) != n:
        raise ValueError(f"need one target and one k per row: {len(targets)} targets, {len(ks)} ks for {n} rows")
    kmax = max(ks, default=0)

    def reduce(rows: slice, logits: Tensor) -> list[dict[int, float]]:
        lp = torch.log_softmax(logits.float(), dim=-1)
        tgt = torch.tensor(targets[rows], dtype=torch.long, device=lp.device)
        chosen = lp.gather(1, tgt[:, None]).squeeze(1).tolist()
        if kmax > 0:
            vals, idx = lp.topk(min(kmax, lp.shape[1]), dim=-1)
            vals, idx = vals.tolist(), idx.tolist()
            tops = [dict(zip(i[:k], v[:k])) for i, v, k in zip(idx, vals, ks[rows])]
        else:
            tops = [{} for _ in chosen]
        return [{t: c, **top} for t, c, top in zip(targets[rows], chosen, tops)]

    return [e for part in reduce_logits(compute_logits, hidden, max_rows, reduce) for e in part]
