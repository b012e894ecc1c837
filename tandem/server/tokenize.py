"""POST /tokenize and /detokenize, as vLLM's: a text prompt or chat messages (rendered by the chat template) to
token ids, and token ids back to text, with the same limits, vocabulary bound and off-loop preparation as generation
requests."""
from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from tandem.server.chat import render_prompt
from tandem.server.limits import chat_size, check_model, check_prompt_chars, parse_body
from tandem.server.state import ServerState, encode
from tandem.server.errors import APIError
from tandem.server.protocol import (ChatCompletionRequest, DetokenizeRequest, DetokenizeResponse, TokenizeRequest,
                                    TokenizeResponse)
from tandem.server.vocab import check_token_ids, token_id_limit


def _chat_of(req: TokenizeRequest) -> ChatCompletionRequest:
    """The chat request whose prompt a messages-tokenize renders (no sampling fields matter)."""
    return ChatCompletionRequest.model_construct(messages=req.messages, tools=req.tools)


def _tokenize(state: ServerState, req: TokenizeRequest) -> list[int]:
    """The request's token ids (runs on the preparation threads)."""
    if req.messages is not None:
        special = bool(req.add_special_tokens)
        return render_prompt(state, _chat_of(req), req.add_generation_prompt, special)[1]
    special = True if req.add_special_tokens is None else req.add_special_tokens
    return encode(state.client.tokenizer, req.prompt or "", add_special_tokens=special)


async def create_tokenize(state: ServerState, request: Request) -> Any:
    """Handle POST /tokenize: exactly one of prompt or messages."""
    req = await parse_body(request, TokenizeRequest, state)
    check_model(state, req)
    if (req.prompt is None) == (req.messages is None):
        raise APIError("give exactly one of prompt or messages", 400, "invalid_value",
                       "prompt" if req.prompt is None else "messages")
    if req.messages is not None:
        if not req.messages:
            raise APIError("messages is empty", 400, "invalid_value", "messages")
        chars = chat_size(state, _chat_of(req))
    else:
        chars = len(req.prompt or "")
        check_prompt_chars(state, chars, "prompt")
    ids = await state.prepare(chars, _tokenize, state, req)
    check_token_ids(ids, token_id_limit(state.client), "prompt" if req.messages is None else "messages")
    tok = state.client.tokenizer
    strs = [tok.id_to_token(i) or "" for i in ids] if req.return_token_strs else None
    body = TokenizeResponse(count=len(ids), max_model_len=state.client.max_model_len, tokens=ids, token_strs=strs)
    return JSONResponse(body.model_dump())


async def create_detokenize(state: ServerState, request: Request) -> Any:
    """Handle POST /detokenize: 400 naming tokens for an id outside the vocabulary (tandem.server.vocab)."""
    req = await parse_body(request, DetokenizeRequest, state)
    check_model(state, req)
    check_token_ids(req.tokens, token_id_limit(state.client), "tokens")
    text = await state.prepare(len(req.tokens), state.client.tokenizer.decode, req.tokens)
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump())
