"""What a round's request must satisfy before the coordinator takes it, and how many tokens it may generate:
refused here with a 400 naming the field, not by a worker later with a 500."""
from __future__ import annotations

from tandem.engine.sampling_params import SamplingParams, SamplingParamsError, check_diffusion
from tandem.core.admission import ContextError, generation_budget
from tandem.runtime.client import RequestError


def check_prompt(prompt: list[int], params: SamplingParams, max_model_len: int, vocab_size: int | None,
                 dllm_block: int | None, dllm_canvas: bool) -> None:
    """The prompt's tokens, the diffusion options and the context against the model; RequestError (400) if not."""
    if not prompt:
        raise RequestError("the prompt is empty", 400, param="prompt")
    if vocab_size is not None:
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab_size})", 400, param="prompt")
    try:
        check_diffusion(params, dllm_block)
    except SamplingParamsError as e:
        raise RequestError(str(e), 400) from None
    if params.dllm_chunk is not None and dllm_canvas:
        raise RequestError(f"dllm_chunk {params.dllm_chunk} sizes Optimus's streaming windows, which need a "
                           f"block-causal model (SDAR); this LLaDA-style model decodes in dLLM-Serve phases",
                           400, param="dllm_chunk")
    round_budget(prompt, params, max_model_len, dllm_block, dllm_canvas)


def round_budget(prompt: list[int], params: SamplingParams, max_model_len: int, dllm_block: int | None,
                 dllm_canvas: bool) -> int:
    """The most tokens the round may generate: the context left, max_tokens, and a diffusion canvas's whole blocks
    (as the engine clamps it)."""
    try:
        return generation_budget(len(prompt), params.max_tokens, max_model_len,
                                 dllm_block if dllm_canvas and dllm_block else 0)
    except ContextError as e:
        raise RequestError(str(e), 400, param="messages") from None
