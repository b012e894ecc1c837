"""POST /v1/completions: one prompt (text or token ids), streaming and not, logprobs as an int; `echo` puts the
prompt's text (and with logprobs its tokens' logprobs, the first one None) before the completion, as vLLM."""
from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from tandem.engine.outputs import RequestOutput
from tandem.engine.sampling_params import SamplingParams
from tandem.server import choices, limits
from tandem.server.errors import APIError
from tandem.server.params import completion_params
from tandem.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from tandem.server.state import ServerState, encode
from tandem.server.streaming import SSE_DONE, SSEResponse, TextDelta, clamp_logprob, now_s, sse, stream_error, usage
from tandem.server.vocab import check_token_ids, token_id_limit


def prompt_of(state: ServerState, req: CompletionRequest) -> tuple[str | None, list[int]]:
    """(text, token ids) of the single prompt; 400 for several prompts, an empty one, or a token id outside the
    vocabulary (tandem.server.vocab)."""
    p: Any = req.prompt
    if isinstance(p, list) and p and not isinstance(p[0], int):
        if len(p) != 1:
            raise APIError(f"only one prompt per request is supported, got {len(p)}", 400,
                           "unsupported_parameter", "prompt")
        p = p[0]
    if isinstance(p, str):
        text, ids = p, encode(state.client.tokenizer, p, add_special_tokens=True) if p else []
    else:
        text, ids = None, list(p)
        check_token_ids(ids, token_id_limit(state.client), "prompt")
    if not ids:
        raise APIError("the prompt is empty", 400, "invalid_value", "prompt")
    return text, ids


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


def completion_logprobs(tok: Any, ids: list[int], lps: list[dict[int, float] | None] | None, offset: int,
                        skip_special_from: int | None = None) -> tuple[dict | None, int]:
    """(OpenAI completions logprobs: tokens, token_logprobs, top_logprobs, text_offset starting at char `offset`;
    the offset after the last token). A None entry (an echoed prompt's first token) has None logprob and top
    logprobs. From index `skip_special_from` on (the completion's tokens under skip_special_tokens) a special token's
    text is not in `text`, so it does not advance text_offset."""
    if lps is None:
        return None, offset
    hidden = getattr(tok, "special_token_ids", frozenset()) if skip_special_from is not None else frozenset()
    tokens, token_lps, tops, offsets = [], [], [], []
    for i, (tid, entry) in enumerate(zip(ids, lps)):
        s = tok.decode([tid], skip_special_tokens=False)
        tokens.append(s)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(clamp_logprob(entry.get(tid, float("-inf"))))
            tops.append({tok.decode([k], skip_special_tokens=False): clamp_logprob(v)
                         for k, v in sorted(entry.items(), key=lambda kv: -kv[1])})
        offsets.append(offset)
        if not (tid in hidden and i >= skip_special_from):
            offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


async def create_completion(state: ServerState, request: Request, received: float) -> Any:
    """Handle one completion request: checks, the prompt tokenized, its params, then the choices generated."""
    req = await limits.parse_body(request, CompletionRequest, state)
    async with state.admission:
        limits.check_model(state, req)
        limits.check_completion(req)
        sid = limits.session_of(request, req)
        limits.check_n(req.n, sid)
        tool_s = limits.tool_time_of(req, sid)
        chars = limits.completion_size(state, req)
        text, ids = await state.prepare(chars, prompt_of, state, req)
        params = completion_params(state, req, len(ids))
    rid = f"cmpl-{uuid.uuid4().hex}"
    started = await choices.start(state, request, ids, params, rid, sid, text, req.n, received, tool_s)
    tok = state.client.tokenizer
    try:
        echo = echo_of(tok, req, text, ids, started[0].first)
    except BaseException:
        await choices.close_all(started)
        raise
    if req.stream:
        return SSEResponse(_stream(state, req, rid, len(ids), params, started, echo))
    outs = await choices.finish_all(state, request, started)
    body = CompletionResponse(id=rid, model=state.model_name, usage=usage(len(ids), outs),
                              choices=[_choice(tok, req, ids, echo, i, o) for i, o in enumerate(outs)])
    data = body.model_dump()
    if not req.return_token_ids:
        for c in data["choices"]:
            c.pop("token_ids", None)
            c.pop("prompt_token_ids", None)
    return JSONResponse(data)


def _choice(tok: Any, req: CompletionRequest, ids: list[int], echo: Echo | None, index: int,
            out: RequestOutput) -> CompletionChoice:
    """One finished choice of a non-streaming response (the echoed prompt first)."""
    comp = out.outputs[0]
    shown, lp_ids, lp_entries = with_echo(echo, comp.text, comp.token_ids, comp.logprobs)
    skip_from = len(lp_ids) - len(comp.token_ids) if req.skip_special_tokens else None
    return CompletionChoice(index=index, text=shown, logprobs=completion_logprobs(tok, lp_ids, lp_entries, 0,
                                                                                  skip_from)[0],
                            finish_reason=comp.finish_reason, stop_reason=comp.stop_reason,
                            token_ids=list(comp.token_ids) if req.return_token_ids else None,
                            prompt_token_ids=ids if req.return_token_ids else None)


@dataclass
class _ChoiceStream:
    """What one streamed choice has sent so far (the echoed prompt goes with its first chunk)."""

    texts: TextDelta
    echo: Echo | None
    sent_tokens: int = 0
    offset: int = 0
    done: RequestOutput | None = None

    def delta(self, tok: Any, out: RequestOutput, skip_special_tokens: bool) -> tuple[str, Any, list[int]]:
        """(text, logprobs, new token ids) for the output's new tokens."""
        comp = out.outputs[0]
        new_ids = comp.token_ids[self.sent_tokens:]
        text, lp_ids, lp_entries = with_echo(self.echo, self.texts.next(comp.text, out.finished), new_ids,
                                             comp.logprobs[self.sent_tokens:] if comp.logprobs is not None else None)
        self.echo = None
        lp = None
        if lp_entries is not None and lp_ids:
            skip_from = len(lp_ids) - len(new_ids) if skip_special_tokens else None
            lp, self.offset = completion_logprobs(tok, lp_ids, lp_entries, self.offset, skip_from)
        self.sent_tokens = len(comp.token_ids)
        if out.finished:
            self.done = out
        return text, lp, new_ids


async def _stream(state: ServerState, req: CompletionRequest, rid: str, prompt_len: int, params: SamplingParams,
                  started: list[choices.Choice], echo: Echo | None = None) -> AsyncIterator[bytes]:
    """SSE chunks of each choice's text deltas (its first led by the echoed prompt) and finish reason as they come,
    optional usage, then [DONE]."""
    created, tok = now_s(), state.client.tokenizer
    opts = req.stream_options
    with_usage = bool(opts and opts.include_usage)
    every_usage = with_usage and bool(opts and opts.continuous_usage_stats)
    ids_too = req.return_token_ids
    timers = {c.index: c.timer for c in started}
    streams = {c.index: _ChoiceStream(TextDelta(params), echo) for c in started}

    def chunk(index: int, text: str, reason: str | None, logprobs: Any, out: RequestOutput,
              new_ids: list[int]) -> bytes:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason,
                  "stop_reason": out.outputs[0].stop_reason if reason else None}
        if ids_too:
            choice["token_ids"] = list(new_ids)
        body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                                "choices": [choice]}
        if with_usage:
            body["usage"] = usage(prompt_len, [out]).model_dump() if every_usage else None
        return sse(body)

    try:
        async with contextlib.aclosing(choices.merged(started)) as events:
            async for index, out in events:
                timers[index].update(out)
                err = stream_error(state, out)
                if err is not None:
                    yield err
                    break
                text, lp, new_ids = streams[index].delta(tok, out, req.skip_special_tokens)
                if out.finished:
                    yield chunk(index, text, out.outputs[0].finish_reason, lp, out, new_ids)
                elif text or lp or new_ids:             # one chunk per engine output with tokens, as vLLM
                    yield chunk(index, text, None, lp, out, new_ids)
        done = [streams[i].done for i in sorted(streams)]
        if with_usage and all(d is not None for d in done):
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                          "choices": [], "usage": usage(prompt_len, done).model_dump()})
        yield SSE_DONE
    finally:
        await choices.close_all(started)
