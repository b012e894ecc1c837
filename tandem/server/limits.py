"""A request read and checked before expensive work: the body parsed under structure caps, the model, the features
that cannot be served, the session id, the number of choices and the prompt's size (messages, characters, ids)."""
from __future__ import annotations

import json
import math
from typing import Any, TypeVar

from fastapi import Request
from starlette.requests import ClientDisconnect

from tandem.engine.sampling_params import shorten
from tandem.server import body
from tandem.server.body import BodyLimits
from tandem.server.errors import APIError, ClientGone
from tandem.server.params import room_for
from tandem.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from tandem.server.state import ServerState

M = TypeVar("M", bound=SamplingFields)
SESSION_HEADER = "x-session-id"
MAX_SESSION_ID_CHARS = 256
MAX_N = 128                     # OpenAI's limit on choices per request
INLINE_PARSE_BYTES = 64 << 10   # bodies up to this are checked and parsed on the event loop (a few ms)


async def parse_body(request: Request, model: type[M], state: ServerState) -> M:
    """Read and validate a JSON body (tandem.server.body: structure caps checked while the bytes are scanned, then
    one parse-and-validate): 400 invalid_json when malformed, 400 naming the field when invalid or too large. A body
    over INLINE_PARSE_BYTES is handled on the preparation threads, a small one on the loop."""
    try:
        raw = await request.body()
    except ClientDisconnect:                     # the client left mid-body: nobody to answer, nothing to log
        raise ClientGone() from None
    limits = BodyLimits.for_longest(state.max_array)
    if len(raw) <= INLINE_PARSE_BYTES:
        return body.decode(raw, model, limits)
    return await state.offload(body.decode, raw, model, limits)


def check_model(state: ServerState, req: Any) -> None:
    """404 model_not_found unless the request names the served model (or none)."""
    if req.model is not None and req.model != state.model_name:
        raise APIError(f"The model {shorten(req.model)} does not exist.", 404, "model_not_found", "model")


def _check_common(req: SamplingFields) -> None:
    """stream_options without stream is refused (as vLLM)."""
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options can only be set when stream is true", 400, "invalid_value", "stream_options")


def check_chat(req: ChatCompletionRequest) -> None:
    """Reject chat features that cannot be served (400 naming the field)."""
    _check_common(req)
    if req.functions or req.function_call is not None:
        raise APIError("functions/function_call are deprecated and not supported: use tools", 400,
                       "unsupported_parameter", "functions")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs requires logprobs to be true", 400, "invalid_value", "top_logprobs")


def check_completion(req: CompletionRequest) -> None:
    """Reject completion features that cannot be served (400 naming the field)."""
    _check_common(req)
    if req.suffix:
        raise APIError("suffix is not supported", 400, "unsupported_parameter", "suffix")
    if req.best_of is not None and req.best_of != 1:
        raise APIError(f"best_of must be 1, got {shorten(req.best_of)}", 400, "unsupported_parameter", "best_of")


def tool_time_of(req: SamplingFields, session_id: str | None) -> float | None:
    """The body's `tool_s` (expected tool time after this round): a finite number of seconds >= 0, for a session
    (400 otherwise); None when not given."""
    t = req.tool_s
    if t is None:
        return None
    if isinstance(t, bool) or not math.isfinite(t) or t < 0:
        raise APIError(f"tool_s must be a finite number of seconds >= 0, got {shorten(t)}", 400, "invalid_value",
                       "tool_s")
    if session_id is None:
        raise APIError("tool_s is the expected tool time between a session's rounds: it needs a session_id", 400,
                       "invalid_value", "tool_s")
    return float(t)


def session_of(request: Request, req: SamplingFields) -> str | None:
    """The session id from the body's `session_id` or the `x-session-id` header (400 if they differ)."""
    header = request.headers.get(SESSION_HEADER) or None
    named = req.session_id or None
    for sid in (named, header):
        if sid is not None and (len(sid) > MAX_SESSION_ID_CHARS or not sid.isprintable()):
            raise APIError(f"session_id must be at most {MAX_SESSION_ID_CHARS} printable characters, got "
                           f"{shorten(sid, 40)}", 400, "invalid_value", "session_id")
    if header is not None and named is not None and header != named:
        raise APIError(f"session_id {named!r} differs from the {SESSION_HEADER} header {header!r}", 400,
                       "invalid_value", "session_id")
    return named if named is not None else header


def check_n(n: int, session_id: str | None) -> None:
    """400 naming n unless 1 ≤ n ≤ MAX_N, and for n > 1 in a session (a session's history is one conversation)."""
    if not 1 <= n <= MAX_N:
        raise APIError(f"n must be between 1 and {MAX_N}, got {shorten(n)}", 400, "invalid_value", "n")
    if n > 1 and session_id is not None:
        raise APIError("n > 1 cannot be used with a session (a session continues one conversation)", 400,
                       "invalid_value", "n")


def check_prompt_chars(state: ServerState, chars: int, param: str) -> None:
    """400 when a prompt's text exceeds the character cap (checked before templating and tokenizing)."""
    cap = state.limits.chars(state.client.max_model_len)
    if chars > cap:
        raise APIError(f"the prompt has {chars} characters, more than the limit of {cap} (the model's context is "
                       f"{state.client.max_model_len} tokens)", 400, "context_length_exceeded", param)


def chat_size(state: ServerState, req: ChatCompletionRequest) -> int:
    """400 before any templating when there are too many messages or too many characters of content; else the
    characters to render."""
    max_len = state.client.max_model_len
    cap = state.limits.messages(max_len)
    if len(req.messages) > cap:
        raise APIError(f"{len(req.messages)} messages are more than the limit of {cap} per request", 400,
                       "invalid_value", "messages")
    chars = 0
    for m in req.messages:
        c = m.content
        if isinstance(c, str):
            chars += len(c)
        elif c is not None:
            chars += sum(len(p.text or "") for p in c)
        for call in m.tool_calls or ():
            if isinstance(call.function.arguments, str):
                chars += len(call.function.arguments)
    if req.tools:                                     # the template renders them as JSON
        chars += len(json.dumps([t.model_dump(exclude_none=True) for t in req.tools]))
    check_prompt_chars(state, chars, "messages")
    return chars


def completion_size(state: ServerState, req: CompletionRequest) -> int:
    """400 before tokenizing: a text over the character cap; token ids that fill the context (a length check).
    Returns the characters to tokenize (0 for token ids)."""
    p: Any = req.prompt
    if isinstance(p, list) and len(p) == 1 and not isinstance(p[0], int):
        p = p[0]
    if isinstance(p, str):
        check_prompt_chars(state, len(p), "prompt")
        return len(p)
    if isinstance(p, list):
        room_for(len(p), None, state.client.max_model_len)
    return 0
