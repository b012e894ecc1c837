"""POST /v1/completions: one prompt (text or token ids), streaming and not, logprobs as an int; `echo` puts the
prompt's text (and with logprobs its tokens' logprobs, the first one None) before the completion, as vLLM."""
from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from tandem.engine.outputs import RequestOutput
from tandem.engine.sampling_params import SamplingParams, shorten
from tandem.server import choices
from tandem.server import serving as sv
from tandem.server.chat import _vocab
from tandem.server.errors import APIError
from tandem.server.metrics import RequestTimer
from tandem.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse


def _check(req: CompletionRequest) -> None:
    """Reject completion features that cannot be served (400 naming the field)."""
    sv.check_common(req)
    choices.check_n(req.n, None)
    if req.n != 1:
        raise APIError(f"n must be 1 on completions, got {shorten(req.n)}", 400, "unsupported_parameter", "n")
    if req.suffix:
        raise APIError("suffix is not supported", 400, "unsupported_parameter", "suffix")
    if req.best_of is not None and req.best_of != 1:
        raise APIError(f"best_of must be 1, got {shorten(req.best_of)}", 400, "unsupported_parameter", "best_of")


def prompt_of(state: sv.ServerState, req: CompletionRequest) -> tuple[str | None, list[int]]:
    """(text, token ids) of the single prompt; 400 for several prompts or an empty one."""
    p: Any = req.prompt
    if isinstance(p, list) and p and not isinstance(p[0], int):
        if len(p) != 1:
            raise APIError(f"only one prompt per request is supported, got {len(p)}", 400,
                           "unsupported_parameter", "prompt")
        p = p[0]
    if isinstance(p, str):
        text, ids = p, sv.encode(state.client.tokenizer, p, add_special_tokens=True) if p else []
    else:
        text, ids = None, list(p)
    if not ids:
        raise APIError("the prompt is empty", 400, "invalid_value", "prompt")
    return text, ids


def check_size(state: sv.ServerState, req: CompletionRequest) -> None:
    """400 before tokenizing: a text over the character cap; token ids that fill the context (a length check)."""
    p: Any = req.prompt
    if isinstance(p, list) and len(p) == 1 and not isinstance(p[0], int):
        p = p[0]
    if isinstance(p, str):
        sv.check_prompt_chars(state, len(p), "prompt")
    elif isinstance(p, list):
        sv.room_for(len(p), None, state.client.max_model_len)


@dataclass(frozen=True)
class Echo:
    """What `echo` puts before a choice: the prompt's text, its token ids and, with logprobs, their logprobs."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float] | None] | None


def echo_of(tok: Any, req: CompletionRequest, text: str | None, ids: list[int], out: RequestOutput) -> Echo | None:
    """The echo of the prompt (a token-id prompt decoded), None without `echo`; the prompt logprobs come from the
    backend's output (vLLM's shape: one entry per prompt token, the first None)."""
    if not req.echo:
        return None
    shown = text if text is not None else tok.decode(ids, skip_special_tokens=False)
    lps = None
    if req.logprobs is not None:
        lps = out.prompt_logprobs
        if lps is None or len(lps) != len(ids):
            raise RuntimeError(f"the backend returned {'no' if lps is None else len(lps)} prompt logprobs for a "
                               f"{len(ids)}-token prompt with echo and logprobs")
    return Echo(shown, list(ids), lps)


def with_echo(echo: Echo | None, text: str, ids: list[int], lps: list[dict[int, float]] | None
              ) -> tuple[str, list[int], list[dict[int, float] | None] | None]:
    """(text, token ids, logprobs) with the echoed prompt's put first (its logprobs only where logprobs are)."""
    if echo is None:
        return text, ids, lps
    if lps is None or echo.logprobs is None:
        return echo.text + text, ids, lps
    return echo.text + text, echo.token_ids + list(ids), echo.logprobs + list(lps)


def completion_logprobs(tok: Any, ids: list[int], lps: list[dict[int, float] | None] | None,
                        offset: int) -> dict | None:
    """OpenAI completions logprobs (tokens, token_logprobs, top_logprobs, text_offset) starting at char `offset`; a
    None entry (an echoed prompt's first token) has None logprob and top logprobs."""
    if lps is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(ids, lps):
        s = tok.decode([tid], skip_special_tokens=False)
        tokens.append(s)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(sv.clamp_logprob(entry.get(tid, float("-inf"))))
            tops.append({tok.decode([k], skip_special_tokens=False): sv.clamp_logprob(v)
                         for k, v in sorted(entry.items(), key=lambda kv: -kv[1])})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


async def create_completion(state: sv.ServerState, request: Request, received: float) -> Any:
    """Handle one completion request."""
    req = await sv.parse_body(request, CompletionRequest, state)
    sv.check_model(state, req)
    _check(req)
    sid = sv.session_of(request, req)
    check_size(state, req)
    text, ids = await state.offload(prompt_of, state, req)
    max_tokens = sv.room_for(len(ids), req.max_tokens, state.client.max_model_len)
    params = sv.sampling_params(req, max_tokens, req.logprobs, vocab_size=_vocab(state))
    if req.echo and req.logprobs is not None:                # the prompt's logprobs too (vLLM: k of them each)
        params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
    rid = f"cmpl-{uuid.uuid4().hex}"
    timer = state.metrics.timer(received)
    gen = sv.start(state, ids, params, rid, sid, text)
    first = await sv.first_output(request, gen)
    if first.error is not None or (first.finished and first.outputs[0].finish_reason == "abort"):
        timer.update(first)
        await sv.close(gen)
        raise sv.failure(state, first)
    tok = state.client.tokenizer
    try:
        echo = echo_of(tok, req, text, ids, first)
    except BaseException:
        await sv.close(gen)
        raise
    if req.stream:
        return sv.SSEResponse(_stream(state, req, rid, len(ids), params, gen, first, timer, echo))
    out = await sv.unless_gone(request, sv.collect(gen, first, timer.update))
    if out.error is not None or out.outputs[0].finish_reason == "abort":
        raise sv.failure(state, out)
    comp = out.outputs[0]
    shown, lp_ids, lp_entries = with_echo(echo, comp.text, comp.token_ids, comp.logprobs)
    lp = completion_logprobs(tok, lp_ids, lp_entries, 0)
    body = CompletionResponse(id=rid, model=state.model_name, usage=sv.usage(len(ids), out),
                              choices=[CompletionChoice(text=shown, logprobs=lp, finish_reason=comp.finish_reason,
                                                        stop_reason=comp.stop_reason,
                                                        token_ids=list(comp.token_ids) if req.return_token_ids else None,
                                                        prompt_token_ids=ids if req.return_token_ids else None)])
    data = body.model_dump()
    if not req.return_token_ids:
        for c in data["choices"]:
            c.pop("token_ids", None)
            c.pop("prompt_token_ids", None)
    return JSONResponse(data)


async def _stream(state: sv.ServerState, req: CompletionRequest, rid: str, prompt_len: int, params: SamplingParams,
                  gen: AsyncIterator[RequestOutput], first: RequestOutput, timer: RequestTimer,
                  echo: Echo | None = None) -> AsyncIterator[str]:
    """SSE chunks of text deltas (the first one led by the echoed prompt), the finish reason, optional usage, then
    [DONE]."""
    created, tok = sv.now_s(), state.client.tokenizer
    opts = req.stream_options
    with_usage = bool(opts and opts.include_usage)
    every_usage = with_usage and bool(opts and opts.continuous_usage_stats)

    ids_too = req.return_token_ids

    def chunk(text: str, reason: str | None, logprobs: Any, out: RequestOutput, new_ids: list[int]) -> str:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason,
                  "stop_reason": out.outputs[0].stop_reason if reason else None}
        if ids_too:
            choice["token_ids"] = list(new_ids)
        body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                                "choices": [choice]}
        if with_usage:
            body["usage"] = sv.usage(prompt_len, out).model_dump() if every_usage else None
        return sv.sse(body)

    texts = sv.TextDelta(params)
    sent_tokens, offset = 0, 0
    out = first
    try:
        while True:
            timer.update(out)
            err = sv.stream_error(state, out)
            if err is not None:
                yield err
                break
            comp = out.outputs[0]
            new_ids = comp.token_ids[sent_tokens:]
            text, lp_ids, lp_entries = with_echo(echo, texts.next(comp.text, out.finished), new_ids,
                                                 comp.logprobs[sent_tokens:] if comp.logprobs is not None else None)
            echo = None                                       # the prompt goes with the first chunk only
            lp = None
            if lp_entries is not None and lp_ids:
                lp = completion_logprobs(tok, lp_ids, lp_entries, offset)
                offset += sum(len(t) for t in lp["tokens"])
            sent_tokens = len(comp.token_ids)
            if out.finished:
                yield chunk(text, comp.finish_reason, lp, out, new_ids)
                if with_usage:
                    yield sv.sse({"id": rid, "object": "text_completion", "created": created,
                                  "model": state.model_name, "choices": [],
                                  "usage": sv.usage(prompt_len, out).model_dump()})
                break
            if text or lp or (ids_too and new_ids):
                yield chunk(text, None, lp, out, new_ids)
            try:
                out = await gen.__anext__()
            except StopAsyncIteration:
                break
        yield sv.SSE_DONE
    finally:
        await sv.close(gen)
