"""What every step timer of the simulator offers on top of `step_time_args`: prefill and decode conveniences.

The roofline and the measured model both derive from `StepTimer`, so AMPD's cost fits, LAPS's boundary and the
planner read either through the same calls.
"""
from __future__ import annotations


class StepTimer:
    """Base of step-time models: subclasses define `step_time_args` (BatchShape's fields, in order)."""

    __slots__ = ()

    def step_time_args(self, prefill_tokens: float, prefill_attn_pairs: float, prefill_kv_read_tokens: float,
                       num_prefill: float, num_decode: float, decode_ctx_tokens: float, graph: bool = False,
                       decode_kv_shared: float = 0) -> float:
        raise NotImplementedError

    def step_time(self, shape) -> float:
        """Seconds of one iteration over a BatchShape (0 for an empty batch)."""
        return self.step_time_args(shape.prefill_tokens, shape.prefill_attn_pairs, shape.prefill_kv_read_tokens,
                                   shape.num_prefill, shape.num_decode, shape.decode_ctx_tokens, shape.graph,
                                   shape.decode_kv_shared)

    def prefill_time(self, l_hist: int, l_incr: int, chunk_tokens: int | None = None) -> float:
        """Prefill of l_incr new tokens after l_hist resident tokens, alone on the worker; in
        chunks of `chunk_tokens` (one iteration each) when given, else one iteration."""
        if l_incr <= 0:
            return 0.0
        if not chunk_tokens or l_incr <= chunk_tokens:
            return self.step_time_args(l_incr, l_incr * (l_hist + (l_incr + 1) / 2), l_hist, 1, 0, 0)
        total, done = 0.0, 0
        while done < l_incr:
            n = min(chunk_tokens, l_incr - done)
            h = l_hist + done
            total += self.step_time_args(n, n * (h + (n + 1) / 2), h, 1, 0, 0)
            done += n
        return total

    def decode_time(self, batch: int, ctx_tokens_total: int) -> float:
        """One decode iteration of `batch` sequences whose contexts sum to ctx_tokens_total."""
        return self.step_time_args(0, 0.0, 0, 0, batch, ctx_tokens_total)
