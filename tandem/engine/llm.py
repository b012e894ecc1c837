"""The offline API, like vLLM's: `LLM(path).generate(prompts, SamplingParams(...))` and `.chat(...)`."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.engine.config import EngineConfig, EngineError
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.outputs import RequestOutput
from tandem.engine.sampling_params import SamplingParams


class LLM:
    """Loads a checkpoint once; runs batches of prompts to completion under continuous batching."""

    def __init__(self, model: str, **engine_args: Any) -> None:
        try:
            config = EngineConfig(model=model, **engine_args)
        except TypeError as e:
            raise EngineError(f"unknown engine argument: {e}") from None
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop a tensor-parallel engine's rank processes (they also stop when this process exits). Idempotent."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 session_ids: Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Complete every prompt (text or token ids); results come back in prompt order.

        With `session_ids`, a prompt that extends an earlier one of the same session reuses its KV.
        """
        batch = _as_batch(prompts)
        params = _per_prompt(sampling_params, len(batch), "sampling_params")
        sids = _per_prompt(session_ids, len(batch), "session_ids") if session_ids is not None else [None] * len(batch)
        eng = self.engine
        ids = []
        try:
            for p, sp, sid in zip(batch, params, sids):
                ids.append(eng.add_request(None, p, sp or SamplingParams(), session_id=sid))
            done: dict[str, RequestOutput] = {}
            while len(done) < len(ids):
                for out in eng.step():
                    if out.finished:
                        done[out.request_id] = out
        except BaseException:
            for rid in ids:
                eng.abort_request(rid)
            raise
        return [done[r] for r in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             tools: list[dict] | None = None, add_generation_prompt: bool = True,
             session_ids: Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, tools=tools, add_generation_prompt=add_generation_prompt)
                   for c in convs]
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(ids, sampling_params, session_ids=session_ids)


def _as_batch(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]
        return list(prompts)
    raise EngineError("prompts must be a string, a list of strings, or token-id lists")


def _per_prompt(value, n: int, name: str) -> list:
    if value is None or not isinstance(value, (list, tuple)):
        return [value] * n
    if len(value) != n:
        raise EngineError(f"{name} has {len(value)} entries for {n} prompts")
    return list(value)
