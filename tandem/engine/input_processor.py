"""Requests in: a prompt and its sampling parameters checked against the model, and the engine's request record built
(stop rules, generator, grammar, metrics)."""
from __future__ import annotations

from typing import Callable

import torch

from tandem.core.types import PrefillTask
from tandem.engine.config import EngineError
from tandem.engine.diffusion.engine_step import DiffusionDecoder
from tandem.engine.outputs import RequestMetrics
from tandem.engine.request_state import Request
from tandem.engine.sampler import make_generator
from tandem.engine.sampling_params import SamplingParams, SamplingParamsError, check_diffusion
from tandem.engine.stop import StopChecker
from tandem.engine.structured_output import RequestGrammar, StructuredOutputManager
from tandem.engine.tokenizer import Tokenizer
from tandem.core.admission import ContextError, generation_budget


class InputProcessor:
    """Checks what a request asks of the model (EngineError, one line) and builds its record."""

    def __init__(self, tokenizer: Tokenizer, structured: StructuredOutputManager, vocab_size: int, max_model_len: int,
                 dllm: DiffusionDecoder | None, device: torch.device) -> None:
        self.tokenizer, self.structured, self.dllm, self.device = tokenizer, structured, dllm, device
        self.vocab_size, self.max_model_len = vocab_size, max_model_len

    def process(self, prompt: str | list[int], params: SamplingParams,
                remote: bool) -> tuple[str | None, list[int], RequestGrammar | None, int]:
        """(text, token ids, grammar, max_tokens) of a round's request: its prompt, params and length checked."""
        text, ids = self.tokens(prompt)
        self.check_logit_bias(params)
        self.check_diffusion(params)
        if params.prompt_logprobs is not None and remote:
            raise EngineError("a request with prompt_logprobs is prefilled on its decode worker, not remotely")
        grammar = self.grammar(params)
        canvas = self.dllm.block if self.dllm is not None and self.dllm.canvas else 0   # LLaDA: whole blocks
        try:
            max_tokens = generation_budget(len(ids), params.max_tokens, self.max_model_len, canvas)
        except ContextError as e:
            raise EngineError(str(e)) from None
        return text, ids, grammar, max_tokens

    def process_prefill(self, prompt_token_ids: list[int], params: SamplingParams, l_hist: int,
                        hist_compute: int) -> tuple[list[int], RequestGrammar | None]:
        """(token ids, grammar) of a remote prefill: tokens [l_hist, len) computed, the last `hist_compute` of the
        history too."""
        _, ids = self.tokens(list(prompt_token_ids))
        self.check_logit_bias(params)
        if params.prompt_logprobs is not None:
            raise EngineError("a request with prompt_logprobs is prefilled on its decode worker, not remotely")
        grammar = self.grammar(params)
        if not 0 <= l_hist < len(ids):
            raise EngineError(f"history of {l_hist} tokens leaves nothing to prefill in a {len(ids)}-token prompt")
        if len(ids) > self.max_model_len:
            raise EngineError(f"prompt of {len(ids)} tokens exceeds max_model_len={self.max_model_len}")
        if isinstance(hist_compute, bool) or not isinstance(hist_compute, int) or not 0 <= hist_compute <= l_hist:
            raise EngineError(f"hist_compute must be an integer in [0, l_hist={l_hist}], got {hist_compute!r}")
        return ids, grammar

    def request(self, request_id: str, session_id: str, keep: bool, text: str | None, ids: list[int],
                params: SamplingParams, task: PrefillTask, grammar: RequestGrammar | None,
                max_tokens: int | None = None) -> Request:
        """The request record; `max_tokens` (the room left in the context) caps its stop rules."""
        stop_params = params
        if max_tokens is not None:
            stop_params = params.clone()
            stop_params.max_tokens = max_tokens
        lps = params.logprobs is not None
        return Request(request_id, session_id, keep, text, list(ids), params,
                       StopChecker(stop_params, self.tokenizer.eos_token_ids, self.decoder(params), ids),
                       make_generator(params.seed, self.device), RequestMetrics(task.enqueue_s), task,
                       logprobs=[] if lps else None, cumulative_logprob=0.0 if lps else None, grammar=grammar)

    def tokens(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt given as text or token ids, each id inside the vocabulary."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            text = prompt
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids, text = list(prompt), None
        else:
            raise EngineError("a prompt must be a string or a list of token ids")
        if not ids:
            raise EngineError("the prompt is empty")
        vocab = self.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise EngineError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        return text, ids

    def check_logit_bias(self, params: SamplingParams) -> None:
        """EngineError when a logit_bias names a token id outside the model's vocabulary."""
        if not params.logit_bias:
            return
        vocab = self.vocab_size
        bad = next((t for t in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise EngineError(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab})")

    def check_diffusion(self, params: SamplingParams) -> None:
        """EngineError when a request's diffusion options do not fit this model (or it sets them on an AR model)."""
        try:
            check_diffusion(params, self.dllm.block if self.dllm is not None else None)
        except SamplingParamsError as e:
            raise EngineError(str(e)) from None
        if params.dllm_chunk is not None and self.dllm is not None and self.dllm.sparse is not None:
            raise EngineError(f"dllm_chunk {params.dllm_chunk} sizes Optimus's streaming windows; this engine decodes "
                              f"in dLLM-Serve phases, whose tokens do not depend on the load")

    def grammar(self, params: SamplingParams) -> RequestGrammar | None:
        """The request's compiled grammar (structured output), None without one."""
        return self.structured.grammar(params.structured_output) if params.structured_output else None

    def decoder(self, params: SamplingParams) -> Callable[[list[int]], str]:
        """Token ids to text as the request's stop strings see it."""
        tok, skip = self.tokenizer, params.skip_special_tokens
        return lambda ids: tok.decode(ids, skip_special_tokens=skip)
