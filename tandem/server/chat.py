"""POST /v1/chat/completions: chat template, tool calls (the model's Hermes/Qwen blocks under "auto", grammar-forced
under "required" or a named function), streaming and not."""
from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from tandem.engine.outputs import RequestOutput
from tandem.engine.sampling_params import SamplingParams, shorten
from tandem.server import choices, limits
from tandem.server.errors import APIError
from tandem.server.forced_tools import ForcedCallScanner, ToolMode, ToolPolicy, resolve, scan_all
from tandem.server.params import chat_params
from tandem.server.state import ServerState, encode
from tandem.server.streaming import SSE_DONE, SSEResponse, TextDelta, clamp_logprob, now_s, sse, stream_error, usage
from tandem.server.protocol import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatMessage,
                                    ResponseFunction, ResponseMessage, ResponseToolCall)
from tandem.server.tool_parser import ParsedToolCall, StreamingToolParser, parse_tool_calls



def _content(m: ChatMessage, i: int) -> str | None:
    """A message's content as text (text parts joined); 400 for other part types."""
    c = m.content
    if isinstance(c, list):
        texts = []
        for part in c:
            if part.type != "text" or part.text is None:
                raise APIError(f"messages[{i}].content: only text parts are supported, got {shorten(part.type, 40)}",
                               400, "unsupported_parameter", f"messages.{i}.content")
            texts.append(part.text)
        c = "".join(texts)
    if c is None and not (m.role == "assistant" and m.tool_calls):
        raise APIError(f"messages[{i}].content is required for a {m.role} message", 400, "invalid_value",
                       f"messages.{i}.content")
    return c


def template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as plain dicts for the chat template (developer becomes system)."""
    out = []
    for i, m in enumerate(req.messages):
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _content(m, i)}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": c.function.arguments}}
                               for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def render_prompt(state: ServerState, req: ChatCompletionRequest, add_generation_prompt: bool = True,
                  add_special_tokens: bool = False) -> tuple[str, list[int]]:
    """The chat template applied with the tools (and a generation prompt), then encoded (without special tokens by
    default); slow for long conversations: the handler runs it on the preparation threads."""
    tok = state.client.tokenizer
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    msgs = template_messages(req)
    try:
        text = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # noqa: BLE001 - template errors (TokenizerError, jinja TypeError, ...) are the caller's
        raise APIError(f"the chat template cannot render these messages: {shorten(str(e), 300)}", 400,
                       "invalid_value", "messages") from None
    return text, encode(tok, text, add_special_tokens=add_special_tokens)


def logprobs_content(tok: Any, ids: list[int], lps: list[dict[int, float]] | None, top: int) -> list[dict] | None:
    """OpenAI chat logprobs entries for tokens `ids` (entries `lps`, chosen token plus the top ones)."""
    if lps is None:
        return None
    out = []
    for tid, entry in zip(ids, lps):
        s = tok.decode([tid], skip_special_tokens=False)
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
        out.append({"token": s, "logprob": clamp_logprob(entry.get(tid, float("-inf"))),
                    "bytes": list(s.encode()),
                    "top_logprobs": [{"token": (t := tok.decode([k], skip_special_tokens=False)),
                                      "logprob": clamp_logprob(v), "bytes": list(t.encode())}
                                     for k, v in ranked]})
    return out


def _calls(calls: list[ParsedToolCall]) -> list[ResponseToolCall]:
    return [ResponseToolCall(id=c.id, function=ResponseFunction(name=c.name, arguments=c.arguments)) for c in calls]


def _reply(policy: ToolPolicy, text: str, reason: str | None) -> tuple[str | None, list[ResponseToolCall], str | None]:
    """A finished output as (content, tool calls, finish_reason) under the request's tool policy."""
    if policy.forced:
        calls = scan_all(policy, text)
        if not calls:                        # cut before any call began: nothing is lost, the text is the content
            return text, [], reason
        tool_calls = [ResponseToolCall(id=c.id, function=ResponseFunction(name=c.name, arguments=c.arguments))
                      for c in calls]
        done = "tool_calls" if policy.mode == ToolMode.REQUIRED and reason != "length" else reason
        return None, tool_calls, done
    if policy.mode != ToolMode.AUTO:
        return text, [], reason
    content, parsed = parse_tool_calls(text)
    if not policy.parallel:
        parsed = parsed[:1]
    return content, _calls(parsed), "tool_calls" if parsed else reason


async def create_chat_completion(state: ServerState, request: Request, received: float) -> Any:
    """Handle one chat completion request: checks, the prompt rendered, its params, then the choices generated."""
    req = await limits.parse_body(request, ChatCompletionRequest, state)
    async with state.admission:
        limits.check_model(state, req)
        limits.check_chat(req)
        policy = resolve(req)
        sid = limits.session_of(request, req)
        limits.check_n(req.n, sid)
        tool_s = limits.tool_time_of(req, sid)
        chars = limits.chat_size(state, req)
        text, ids = await state.prepare(chars, render_prompt, state, req)
        params = chat_params(state, req, len(ids), policy)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    started = await choices.start(state, request, ids, params, rid, sid, text, req.n, received, tool_s)
    if req.stream:
        return SSEResponse(_stream(state, req, rid, len(ids), params, started, policy))
    outs = await choices.finish_all(state, request, started)
    body = ChatCompletionResponse(id=rid, model=state.model_name, usage=usage(len(ids), outs),
                                  choices=[_choice(state, req, policy, i, o) for i, o in enumerate(outs)])
    return JSONResponse(body.model_dump())


def _choice(state: ServerState, req: ChatCompletionRequest, policy: ToolPolicy, index: int,
            out: RequestOutput) -> ChatChoice:
    """One finished choice of a non-streaming response."""
    comp = out.outputs[0]
    top = req.top_logprobs or 0
    lp = logprobs_content(state.client.tokenizer, comp.token_ids, comp.logprobs, top) if req.logprobs else None
    content, calls, reason = _reply(policy, comp.text, comp.finish_reason)
    return ChatChoice(index=index, message=ResponseMessage(content=content, tool_calls=calls),
                      logprobs={"content": lp} if lp is not None else None, finish_reason=reason,
                      stop_reason=comp.stop_reason)


@dataclass
class _ChoiceStream:
    """What one streamed choice has sent so far, and how its next output becomes a chunk."""

    texts: TextDelta
    calls: _StreamedCalls
    sent_tokens: int = 0
    done: RequestOutput | None = None

    def delta(self, tok: Any, req: ChatCompletionRequest, out: RequestOutput) -> tuple[dict[str, Any], Any, bool]:
        """(delta, logprobs, whether new tokens came) for the output's new text, tool-call parts and tokens."""
        comp = out.outputs[0]
        text, call_deltas = self.calls.feed(self.texts.next(comp.text, out.finished), out.finished)
        delta: dict[str, Any] = {}
        if text:
            delta["content"] = text
        if call_deltas:
            delta["tool_calls"] = call_deltas
        new_ids = comp.token_ids[self.sent_tokens:]
        lp = None
        if req.logprobs and comp.logprobs is not None and new_ids:
            lp = {"content": logprobs_content(tok, new_ids, comp.logprobs[self.sent_tokens:], req.top_logprobs or 0)}
        self.sent_tokens = len(comp.token_ids)
        if out.finished:
            self.done = out
        return delta, lp, bool(new_ids)


async def _stream(state: ServerState, req: ChatCompletionRequest, rid: str, prompt_len: int,
                  params: SamplingParams, started: list[choices.Choice], policy: ToolPolicy) -> AsyncIterator[bytes]:
    """SSE chunks: each choice's role first, then its content / tool-call deltas and finish reason as they come,
    optional usage, [DONE]."""
    created, tok = now_s(), state.client.tokenizer
    opts = req.stream_options
    with_usage = bool(opts and opts.include_usage)
    every_usage = with_usage and bool(opts and opts.continuous_usage_stats)
    timers = {c.index: c.timer for c in started}
    streams = {c.index: _ChoiceStream(TextDelta(params), _StreamedCalls(policy)) for c in started}

    def chunk(index: int, delta: dict, reason: str | None = None, logprobs: Any = None,
              out: RequestOutput | None = None, final_usage: Any = None) -> bytes:
        body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                                "model": state.model_name,
                                "choices": [] if index < 0 else [{"index": index, "delta": delta,
                                                                  "logprobs": logprobs, "finish_reason": reason}]}
        if with_usage:
            body["usage"] = final_usage or (usage(prompt_len, [out]).model_dump() if every_usage and out else None)
        return sse(body)

    try:
        for c in started:
            yield chunk(c.index, {"role": "assistant", "content": ""})
        async with contextlib.aclosing(choices.merged(started)) as events:
            async for index, out in events:
                timers[index].update(out)
                err = stream_error(state, out)
                if err is not None:
                    yield err
                    break
                st = streams[index]
                delta, lp, new_tokens = st.delta(tok, req, out)
                if out.finished:
                    yield chunk(index, delta, st.calls.finish_reason(out.outputs[0].finish_reason), lp, out)
                elif delta or lp:
                    yield chunk(index, delta, None, lp, out)
                elif new_tokens and policy.mode == ToolMode.NONE:      # a token with no text yet: a chunk still
                    yield chunk(index, {"content": ""}, None, None, out)   # (as vLLM: one per engine output)
        done = [streams[i].done for i in sorted(streams)]
        if with_usage and all(d is not None for d in done):
            yield chunk(-1, {}, final_usage=usage(prompt_len, done).model_dump())
        yield SSE_DONE
    finally:
        await choices.close_all(started)


class _StreamedCalls:
    """A stream's text deltas split into content and OpenAI `tool_calls` deltas under the request's tool policy."""

    def __init__(self, policy: ToolPolicy) -> None:
        self.policy = policy
        self.forced = ForcedCallScanner(policy) if policy.forced else None
        self.parser = StreamingToolParser() if policy.mode == ToolMode.AUTO else None
        self.n_calls = 0
        self.forced_text = ""

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content to send, tool_calls deltas to send) for the next text delta."""
        if self.forced is not None:
            self.forced_text += text
            deltas = self.forced.feed(text)
            if finished:
                self.forced.finish()
                if not self.forced.calls:      # cut before any call began: the text is the content (as unstreamed)
                    return self.forced_text, []
            return "", [d.as_delta() for d in deltas]
        if self.parser is None:
            return text, []
        text, parsed = self.parser.feed(text)
        if finished:
            rest, more = self.parser.finish()
            text, parsed = text + rest, parsed + more
        if not self.policy.parallel:
            parsed = parsed[:max(0, 1 - self.n_calls)]
        out = [{"index": self.n_calls + k, "id": c.id, "type": "function",
                "function": {"name": c.name, "arguments": c.arguments}} for k, c in enumerate(parsed)]
        self.n_calls += len(parsed)
        return text, out

    def finish_reason(self, reason: str | None) -> str | None:
        """The stream's finish_reason: tool_calls when the model called tools (not for a named function: stop)."""
        if reason == "length":
            return reason
        if self.forced is not None:
            return "tool_calls" if self.policy.mode == ToolMode.REQUIRED and self.forced.calls else reason
        return "tool_calls" if self.n_calls else reason
