"""Request and response bodies of the OpenAI-compatible API (OpenAI's names, plus vLLM's sampling extras).

Unknown request fields are ignored, with a warning naming them (vLLM's rule: tandem.server.body); known OpenAI fields
tandem cannot honour (several prompts per completion, suffix, best_of > 1, functions/function_call) are rejected by
the serving code with a 400 that names them. Token ids are `TokenId`s: JSON integers only (pydantic's lax mode would
take `true` as the token id 1).
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

TokenId = StrictInt                  # a token id: a JSON integer, never a boolean or a float


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    """`stream_options`: include_usage adds a final chunk with usage and no choices."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class FunctionDef(_Request):
    """A tool's function: name, description, JSON-schema parameters."""

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    """A tool the model may call (only type "function" exists)."""

    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionCall(_Request):
    """A function call inside an assistant message: arguments as a JSON string (or an object)."""

    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Request):
    """A tool call made by the assistant in an earlier round."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Request):
    """One part of a message's content; only text parts can be served."""

    type: str
    text: str | None = None


class ChatMessage(_Request):
    """One conversation message (system/developer/user/assistant/tool)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class SamplingFields(_Request):
    """Sampling fields shared by chat and completions (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    session_id: str | None = None
    tool_s: float | None = None                   # tandem's: expected seconds of the tool call after this round (the
                                                  # session's host-tier KV is planned with it; default: learnt)
    response_format: dict[str, Any] | None = None   # text, json_object, json_schema (grammar-constrained, xgrammar)
    # block-diffusion models (LMDeploy's names): override the server's --dllm-* defaults for this request
    dllm_block_length: int | None = None
    dllm_unmasking_strategy: str | None = None
    dllm_denoising_steps: int | None = None
    dllm_confidence_threshold: float | None = None
    dllm_chunk: str | int | None = None           # tandem's: auto, elastic, block or N (block diffusion's windows)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    return_token_ids: bool = False          # vLLM extension: the completion's token ids (and the prompt's)


class TokenizeRequest(_Request):
    """POST /tokenize (vLLM's): a text `prompt`, or chat `messages` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None       # default: True for a prompt, False for messages (as vLLM)
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    """POST /detokenize (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[TokenId]


# ---------------------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    """Prompt tokens served from cache (session history or prefix cache)."""

    cached_tokens: int = 0


class Usage(BaseModel):
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    dllm_chunk: str | None = None    # tandem's: the chunk a block-diffusion request decoded with (block, elastic, N)


class ResponseFunction(BaseModel):
    """A parsed function call: arguments are a JSON string."""

    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    """A tool call the model made."""

    id: str
    type: Literal["function"] = "function"
    function: ResponseFunction


class ResponseMessage(BaseModel):
    """The assistant's reply."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ResponseToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int = 0
    message: ResponseMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    """The body of a non-streaming chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    """One choice of a text completion."""

    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None          # with return_token_ids
    prompt_token_ids: list[int] | None = None   # with return_token_ids


class CompletionResponse(BaseModel):
    """The body of a non-streaming text completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    """One entry of GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tandem"
    root: str | None = None
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    """The answer of /tokenize."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    """The answer of /detokenize."""

    prompt: str
