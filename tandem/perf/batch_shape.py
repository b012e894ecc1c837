"""The shape of one step's batch, as every step timer prices it: prefill chunks, decode rows, diffusion windows.

It lives in perf, below the cores that build it in their step plans, because perf's step timers take it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class BatchShape:
    """Shape of one iteration's batch, as the cost model needs it."""

    prefill_tokens: int = 0           # sum of new (query) tokens of the prefill chunks
    prefill_attn_pairs: float = 0.0   # sum over chunks of l_new*(l_hist + (l_new+1)/2): causal (query, key) pairs
    prefill_kv_read_tokens: int = 0   # sum of l_hist over chunks: history KV the chunks read
    num_prefill: int = 0              # prefill chunks (each samples/logits one row)
    num_decode: int = 0               # decode sequences, one query token each
    decode_ctx_tokens: int = 0        # sum of their context lengths (KV entries each attends to)
    decode_kv_shared: int = 0         # of those, entries a row shares with another row of its sequence (a diffusion
                                      # window's rows attend to the same keys, which a kernel reads once)
    graph: bool = False               # the step replays a captured CUDA graph (LAPS's short-prefill buckets)

    def add_prefill(self, l_hist: int, l_new: int) -> None:
        """Add one prefill chunk of l_new tokens on top of l_hist tokens of resident KV."""
        self.prefill_tokens += l_new
        self.prefill_attn_pairs += l_new * (l_hist + (l_new + 1) / 2)
        self.prefill_kv_read_tokens += l_hist
        self.num_prefill += 1

    def add_decode(self, ctx: int) -> None:
        """Add one decode sequence attending to ctx KV entries."""
        self.num_decode += 1
        self.decode_ctx_tokens += ctx

    def add_window(self, ctx: int, q: int) -> None:
        """Add a diffusion window: q query rows of one sequence, each attending to the ctx cached keys and the q
        window positions (bidirectional), with logits for every row; the keys are read once."""
        self.add_windows(1, ctx, q)

    def add_windows(self, n: int, ctx_total: int, rows: int) -> None:
        """Add n diffusion windows of `rows` rows in all over ctx_total cached keys in all, as n add_window calls of
        the mean window over the mean context (exact when the windows are alike)."""
        if n <= 0:
            return
        q, ctx = rows / n, ctx_total / n
        self.num_decode += rows
        self.decode_ctx_tokens += rows * (ctx + q)
        self.decode_kv_shared += (rows - n) * (ctx + q)


__all__ = ["BatchShape"]
