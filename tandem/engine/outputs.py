"""What the engine hands back per request, shaped like vLLM's RequestOutput / CompletionOutput."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Per-request timestamps (seconds, the engine's clock) and token counts."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0        # prompt tokens whose KV was reused (session history or prefix cache)
    num_computed_tokens: int = 0      # prompt tokens this request prefilled (recompute after preemption included)
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        """Arrival to last token."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None      # "stop", "length", "abort", or None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it


@dataclass
class RequestOutput:
    """A request's prompt, its completion so far, and whether it finished."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    session_id: str | None = None
    error: str | None = None              # why the request failed (it is finished with finish_reason "abort")
    num_cached_tokens: int = field(default=0)
    prompt_logprobs: list[dict[int, float] | None] | None = None   # vLLM's: None, then {token: logprob} per position
    dllm_chunk: str | None = None         # block diffusion: the chunk its round decoded with (auto resolved: block,
                                          # elastic or N); None for other models and for dLLM-Serve phases

    @property
    def text(self) -> str:
        """The completion's text (outputs[0].text)."""
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        """The completion's token ids (outputs[0].token_ids)."""
        return self.outputs[0].token_ids
