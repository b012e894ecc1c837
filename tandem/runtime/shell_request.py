"""One live request as the coordinator's shell tracks it: its round, where it runs, and the cumulative output its
consumer reads, merged from the workers' deltas."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.core.types import PrefillTask
from tandem.engine.outputs import RequestOutput
from tandem.engine.sampling_params import SamplingParams
from tandem.runtime import messages as m

if TYPE_CHECKING:    # an annotation only: the CLI imports this module and starts without asyncio
    import asyncio


@dataclass
class ShellRequest:
    """One HTTP request = one round of a session."""

    request_id: str
    session_id: str
    prompt: list[int]
    params: SamplingParams
    keep_session: bool
    ready: asyncio.Event                # set when `out` changed since the consumer last read it
    out: RequestOutput                  # cumulative, updated in place; the consumer reads snapshots of it
    worker: int = -1                    # the session's decode/co-located worker
    task: PrefillTask | None = None
    prefill_worker: int = -1            # remote prefill worker, -1 when local
    sent_to_decode: bool = False
    kv_arrived: bool = False            # its remote prefill's KV reached the decode worker (KVArrived sent)
    transfers: dict = field(default_factory=dict)    # purpose -> Transfer in flight (the core times it)
    done: bool = False
    unread: int = 0                     # outputs (deltas) coalesced into `out` since the consumer last read
    tool_s: float | None = None         # the client's expected tool time after this round (host tiers)

    def snapshot(self) -> RequestOutput:
        """A copy of the cumulative output the shell may go on updating (what one generate() step yields)."""
        o = self.out
        c = o.outputs[0]
        return dataclasses.replace(o, outputs=[dataclasses.replace(
            c, token_ids=list(c.token_ids), logprobs=list(c.logprobs) if c.logprobs else c.logprobs)],
            metrics=dataclasses.replace(o.metrics))

    def mark_scheduled(self, now: float, ago_s: float | None) -> None:
        """Date the first scheduling by a worker's report (`ago_s` before `now`, never before its arrival here):
        the earliest report wins, so a remote prefill's counts, not the decode worker's later step."""
        metrics = self.out.metrics
        if ago_s is not None and metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = max(metrics.arrival_time, now - ago_s)

    def merge(self, d: m.Delta, now: float) -> None:
        """Fold a worker's delta into the cumulative output (tokens, text, logprobs, counts, timings)."""
        out = self.out
        comp = out.outputs[0]
        self.mark_scheduled(now, d.scheduled_ago_s)
        if d.token_ids:
            if out.metrics.first_token_time is None:
                out.metrics.first_token_time = now
            out.metrics.last_token_time = now
        comp.token_ids.extend(d.token_ids)                    # in place: consumers get copies (snapshot)
        comp.text = d.text if d.reset else comp.text + d.text
        if d.logprobs is not None:
            if comp.logprobs is None:
                comp.logprobs = []
            comp.logprobs.extend(d.logprobs)
            comp.cumulative_logprob = d.cumulative_logprob
        if d.prompt_logprobs is not None:
            out.prompt_logprobs = d.prompt_logprobs
        cached = d.num_cached_tokens                          # the decode worker's history; what a remote prefill
        if self.task is not None and self.task.hist_compute:  # recomputed (vllm-pd) was not reused
            cached = max(0, cached - self.task.hist_compute)
        out.num_cached_tokens = out.metrics.num_cached_tokens = cached
        out.metrics.num_preemptions = d.num_preemptions       # vllm:num_preemptions_total counts finished requests'
        if d.dllm_chunk is not None:                          # block diffusion: the chunk the worker's core chose
            out.dllm_chunk = d.dllm_chunk
        if d.finished:
            comp.finish_reason, comp.stop_reason = d.finish_reason, d.stop_reason
            out.error = d.error

    def holders(self) -> list[int]:
        """The workers that must hold this request now, by the messages sent them: its decode worker from
        AddRequest to its last output, its prefill worker from AddPrefill until Delivered (sent with KVArrived) or
        RunLocal."""
        out = [self.worker] if self.sent_to_decode and self.worker >= 0 else []
        if self.prefill_worker >= 0 and not self.kv_arrived:
            out.append(self.prefill_worker)
        return out
