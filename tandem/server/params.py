"""A request's sampling parameters: the room left in the context, the grammar its response_format or forced tool
calls ask for, and a 400 naming the API field for a value the engine refuses."""
from __future__ import annotations

import dataclasses
import json

from tandem.core.admission import ContextError, ContextFault, generation_budget
from tandem.engine.sampling_params import SamplingParams, SamplingParamsError, shorten
from tandem.engine.structured_output import StructuredOutput, StructuredOutputError
from tandem.server.errors import APIError
from tandem.server.forced_tools import ToolPolicy, forced_output
from tandem.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from tandem.server.state import ServerState
from tandem.server.vocab import logit_bias, token_id_limit

MAX_SCHEMA_BYTES = 64 << 10          # a JSON schema larger than this is refused before it is compiled


def chat_params(state: ServerState, req: ChatCompletionRequest, prompt_len: int, policy: ToolPolicy) -> SamplingParams:
    """A chat request's SamplingParams (max_completion_tokens before max_tokens; top_logprobs; the grammar of forced
    tool calls)."""
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = room_for(prompt_len, limit, state.client.max_model_len, field, "messages")
    top = req.top_logprobs or 0
    params = sampling_params(req, max_tokens, top if req.logprobs else None,
                             {"logprobs": "top_logprobs", "max_tokens": field}, token_id_limit(state.client))
    forced = forced_output(policy, req.tools or [])
    return params if forced is None else dataclasses.replace(params, structured_output=forced)


def completion_params(state: ServerState, req: CompletionRequest, prompt_len: int) -> SamplingParams:
    """A completion request's SamplingParams (with echo and logprobs, the prompt's logprobs too: vLLM's k each)."""
    max_tokens = room_for(prompt_len, req.max_tokens, state.client.max_model_len)
    params = sampling_params(req, max_tokens, req.logprobs, vocab_size=token_id_limit(state.client))
    if req.echo and req.logprobs is not None:
        params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
    return params


def room_for(prompt_len: int, max_tokens: int | None, max_model_len: int, field: str = "max_tokens",
             prompt_param: str = "prompt") -> int:
    """The max_tokens to run with; 400 context_length_exceeded when prompt + max_tokens exceeds the context (naming
    `prompt_param` when the prompt alone fills it)."""
    asked = max_tokens if isinstance(max_tokens, int) and max_tokens >= 1 else None
    try:
        room = generation_budget(prompt_len, asked, max_model_len, clamp=False)
    except ContextError as e:
        if e.fault is ContextFault.PROMPT_FILLS:
            raise APIError(f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
                           f"{prompt_len} tokens, leaving no room for the completion. Please shorten the prompt.",
                           400, "context_length_exceeded", prompt_param) from None
        raise APIError(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                       f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                       f"completion). Please reduce the prompt or {field}.", 400, "context_length_exceeded",
                       field) from None
    return room if max_tokens is None else max_tokens


def structured_output(response_format: dict | None) -> StructuredOutput | None:
    """The grammar a `response_format` asks for (None for text); 400 naming response_format when invalid."""
    if response_format is None:
        return None
    try:
        if len(json.dumps(response_format)) > MAX_SCHEMA_BYTES:
            raise StructuredOutputError(f"response_format is larger than {MAX_SCHEMA_BYTES} bytes")
        return StructuredOutput.from_response_format(response_format)
    except (StructuredOutputError, TypeError, ValueError) as e:
        raise APIError(shorten(str(e), 300), 400, "invalid_value", "response_format") from None


def sampling_params(req: SamplingFields, max_tokens: int, logprobs: int | None,
                    renames: dict[str, str] | None = None, vocab_size: int | None = None) -> SamplingParams:
    """SamplingParams from the request; a 400 naming the (API) field when a value is invalid (stop_token_ids and
    logit_bias ids outside [0, vocab_size) too)."""
    if vocab_size is not None and req.stop_token_ids:
        bad = next((t for t in req.stop_token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise APIError(f"stop_token_ids: token id {shorten(bad)} is outside the vocabulary [0, {vocab_size})",
                           400, "invalid_value", "stop_token_ids")
    structured = structured_output(req.response_format)
    bias = logit_bias(req.logit_bias, vocab_size)
    try:
        return SamplingParams(
            structured_output=structured, n=1, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
            min_p=req.min_p or 0.0, seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
            stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens, include_stop_str_in_output=req.include_stop_str_in_output,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty, logit_bias=bias,
            dllm_block_length=req.dllm_block_length, dllm_unmasking_strategy=req.dllm_unmasking_strategy,
            dllm_denoising_steps=req.dllm_denoising_steps, dllm_confidence_threshold=req.dllm_confidence_threshold,
            dllm_chunk=req.dllm_chunk)
    except SamplingParamsError as e:
        msg = str(e)
        field = msg.split(" ", 1)[0]
        api = (renames or {}).get(field, field)
        if api != field:
            msg = api + msg[len(field):]
        raise APIError(msg, 400, "invalid_value", api) from None
