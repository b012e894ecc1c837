"""The rules a session's round and a deployment must satisfy, in one place for every shell: which deployment a
policy serves on, how many tokens a round may generate in the model's context (a diffusion canvas in whole blocks),
whether a round continues its session's conversation or rewrites it, and one round per session at a time. The
server, the runtime, the engine, the simulator, the CLI and the planner call these; none restates them."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from tandem.core.deploy import Deployment, DeploymentError
from tandem.policy.dllm_serve import canvas_max_tokens
from tandem.policy.presets import PolicySpec


class ContextFault(Enum):
    """Why a round does not fit the model's context."""

    PROMPT_FILLS = "prompt_fills"          # the prompt alone leaves no room to generate
    REQUEST_EXCEEDS = "request_exceeds"    # prompt + max_tokens is over the context
    CANVAS = "canvas"                      # a diffusion canvas of whole blocks does not fit


@dataclass(frozen=True)
class ContextError(ValueError):
    """A round that does not fit the model's context; the shells word it for their callers."""

    fault: ContextFault
    prompt_len: int
    max_tokens: int | None
    max_model_len: int
    detail: str = ""

    def __str__(self) -> str:
        if self.fault is ContextFault.PROMPT_FILLS:
            return (f"prompt of {self.prompt_len} tokens leaves no room to generate: the model's context "
                    f"(max_model_len) is {self.max_model_len} tokens")
        if self.fault is ContextFault.REQUEST_EXCEEDS:
            return (f"prompt of {self.prompt_len} tokens and max_tokens {self.max_tokens} exceed the model's context "
                    f"(max_model_len) of {self.max_model_len} tokens")
        return self.detail


class SessionBusyError(ValueError):
    """A session's next round arrived while its previous one is still running."""

    def __init__(self, session_id: str, running: str | None = None) -> None:
        which = f" ({running!r})" if running else ""
        super().__init__(f"session {session_id!r} already has a request running{which}; send its rounds one at a "
                         f"time")
        self.session_id = session_id


def check_deployment(policy: PolicySpec, dep: Deployment) -> None:
    """A policy runs on the deployment kind it was written for: prefill and decode workers, or co-located ones."""
    if policy.disaggregated and not dep.disaggregated:
        raise DeploymentError(f"policy {policy.name} needs prefill and decode workers, e.g. 'P:tp4x1,D:tp4x1', "
                              f"not {str(dep)!r}")
    if not policy.disaggregated and dep.disaggregated:
        raise DeploymentError(f"policy {policy.name} serves co-located workers; give a deployment like 'C:tp4x2', "
                              f"not {str(dep)!r}")


def check_worker_counts(policy: PolicySpec, prefill: int, decode: int, colocated: int) -> None:
    """The worker counts of a live server (--prefill-workers/--decode-workers or --colocated) against the policy."""
    if policy.disaggregated:
        if colocated or prefill < 1 or decode < 1:
            raise DeploymentError(f"policy {policy.name} needs --prefill-workers >= 1 and --decode-workers >= 1 "
                                  "(and no --colocated)")
    elif colocated < 1:
        raise DeploymentError(f"policy {policy.name} serves co-located workers: give --colocated N (N >= 1)")


def generation_budget(prompt_len: int, max_tokens: int | None, max_model_len: int, canvas_block: int = 0,
                      clamp: bool = True) -> int:
    """The most tokens a round may generate: the context left after its prompt, at most max_tokens; a diffusion
    canvas (canvas_block > 0, LLaDA) holds its generation in whole blocks. Over-asking is clamped, or refused when
    `clamp` is False (the HTTP API's contract, as vLLM's); ContextError says why a round cannot run."""
    if prompt_len >= max_model_len:
        raise ContextError(ContextFault.PROMPT_FILLS, prompt_len, max_tokens, max_model_len)
    room = max_model_len - prompt_len
    if max_tokens is not None:
        if not clamp and max_tokens > room:
            raise ContextError(ContextFault.REQUEST_EXCEEDS, prompt_len, max_tokens, max_model_len)
        room = min(room, max_tokens)
    if canvas_block:
        try:
            room = canvas_max_tokens(prompt_len, max_tokens, canvas_block, max_model_len)
        except ValueError as e:
            raise ContextError(ContextFault.CANVAS, prompt_len, max_tokens, max_model_len, str(e)) from None
    return room


def continues(history: Sequence[int] | None, prompt: Sequence[int]) -> bool:
    """Whether a round's prompt extends its session's conversation so far by new tokens (its resident KV stays
    valid); False when the conversation was rewritten (edited, truncated, repeated) and the session starts afresh."""
    return history is not None and len(prompt) > len(history) and list(prompt[:len(history)]) == list(history)


def check_one_round(session_id: str, running: str | None) -> None:
    """A session runs one round at a time: its next round waits for the previous one's end (SessionBusyError)."""
    if running is not None:
        raise SessionBusyError(session_id, running)
