"""What chat and completions share: sampling params, context checks, sessions, disconnect-aware generation, SSE."""
from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import msgspec
from fastapi import Request
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tandem.engine.outputs import RequestOutput
from tandem.engine.structured_output import StructuredOutput, StructuredOutputError
from tandem.engine.sampling_params import SamplingParams, SamplingParamsError, shorten
from tandem.engine.tokenizer import Tokenizer
from tandem.runtime.client import EngineClient, RequestError
from tandem.server import body
from tandem.server.body import BodyLimits
from tandem.server.drain import DRAIN_ENTRY
from tandem.server.errors import APIError, error_body
from tandem.server.metrics import ServerMetrics
from tandem.server.protocol import PromptTokensDetails, Usage, SamplingFields
from tandem.server.vocab import logit_bias_cap

log = logging.getLogger("tandem.server")
T = TypeVar("T")
M = TypeVar("M", bound=SamplingFields)
SESSION_HEADER = "x-session-id"
MAX_SESSION_ID_CHARS = 256
_MIN_LOGPROB = -9999.0          # -inf is not JSON; vLLM clamps the same way
INLINE_PARSE_BYTES = 64 << 10   # bodies up to this are checked and parsed on the event loop (a few ms)
INLINE_ENCODE_CHARS = 4096      # texts up to this are tokenized on the event loop
INLINE_PREP_CHARS = 4096        # requests with up to this many characters are templated/tokenized on the loop
ADMISSION_SLOTS = 8             # requests preparing (checks, template, tokens) at once: a burst of arrivals is
                                # prepared a few per loop iteration, so /health and streams are not queued behind it
CHARS_PER_TOKEN = 64            # default text cap: max_model_len x this many characters (no token is longer)
_REQUEST_ID = re.compile(r"\b(?:chatcmpl|cmpl)-[0-9a-f]{32}\b")


@dataclass
class Limits:
    """Caps checked before expensive work (None: derived from the model's context, max_model_len).

    max_messages: chat messages per request (default max_model_len: every message renders to >= 1 token);
    max_prompt_chars: characters of message content / text prompt (default CHARS_PER_TOKEN x max_model_len);
    prompt token ids are capped by max_model_len itself (a longer prompt leaves no room to generate).
    """

    max_messages: int | None = None
    max_prompt_chars: int | None = None
    prep_threads: int = 1           # threads that parse large bodies, render chat templates and tokenize (more
                                    # only take GIL time from the event loop: this work is pure Python)

    def messages(self, max_model_len: int) -> int:
        return self.max_messages if self.max_messages is not None else max_model_len

    def chars(self, max_model_len: int) -> int:
        return self.max_prompt_chars if self.max_prompt_chars is not None else CHARS_PER_TOKEN * max_model_len


@dataclass
class ServerState:
    """What request handlers need: the backend, the served name, metrics, limits, the preparation threads."""

    client: EngineClient
    model_name: str
    metrics: ServerMetrics
    limits: Limits = field(default_factory=Limits)
    pool: ThreadPoolExecutor | None = None

    admission: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(ADMISSION_SLOTS))

    def __post_init__(self) -> None:
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max(1, self.limits.prep_threads), thread_name_prefix="tandem-prep")

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) on the preparation threads so the event loop keeps answering (health, streams)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args))

    async def prepare(self, chars: int, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) for an input of `chars` characters: on the loop when small (handing a sub-millisecond job to a
        thread costs the loop more, in GIL hand-offs, than doing it), on the preparation threads when large."""
        if chars <= INLINE_PREP_CHARS:
            return fn(*args)
        return await self.offload(fn, *args)

    @property
    def max_array(self) -> int:
        """The longest JSON array a request may hold (messages or prompt token ids)."""
        return max(self.limits.messages(self.client.max_model_len), self.client.max_model_len)


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


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


def check_prompt_chars(state: ServerState, chars: int, param: str) -> None:
    """400 when a prompt's text exceeds the character cap (checked before templating and tokenizing)."""
    cap = state.limits.chars(state.client.max_model_len)
    if chars > cap:
        raise APIError(f"the prompt has {chars} characters, more than the limit of {cap} (the model's context is "
                       f"{state.client.max_model_len} tokens)", 400, "context_length_exceeded", param)


class _GILFreeEncoding:
    """tokenizers' `encode_batch` releases the GIL while it works; `encode` holds it to the end."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def encode(self, text: str, add_special_tokens: bool = True) -> Any:
        return self.inner.encode_batch([text], add_special_tokens=add_special_tokens)[0]


@functools.lru_cache(maxsize=8)
def _gil_free_view(tok: Tokenizer) -> Tokenizer:
    view = copy.copy(tok)
    view._tok = _GILFreeEncoding(tok._tok)
    return view


def encode(tok: Any, text: str, add_special_tokens: bool) -> list[int]:
    """tok.encode(text); a long text through encode_batch, so the event loop runs while it is tokenized."""
    if len(text) > INLINE_ENCODE_CHARS and type(tok) is Tokenizer and hasattr(getattr(tok, "_tok", None),
                                                                             "encode_batch"):
        tok = _gil_free_view(tok)
    return tok.encode(text, add_special_tokens=add_special_tokens)


def check_model(state: ServerState, req: SamplingFields) -> None:
    """404 model_not_found unless the request names the served model (or none)."""
    if req.model is not None and req.model != state.model_name:
        raise APIError(f"The model {shorten(req.model)} does not exist.", 404, "model_not_found", "model")


def check_common(req: SamplingFields) -> None:
    """Reject OpenAI features that cannot be served, and stream_options without stream (as vLLM)."""
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options can only be set when stream is true", 400, "invalid_value", "stream_options")


def session_of(request: Request, req: SamplingFields) -> str | None:
    """The session id from the body's `session_id` or the `x-session-id` header (400 if they differ)."""
    header = request.headers.get(SESSION_HEADER) or None
    body = req.session_id or None
    for sid in (body, header):
        if sid is not None and (len(sid) > MAX_SESSION_ID_CHARS or not sid.isprintable()):
            raise APIError(f"session_id must be at most {MAX_SESSION_ID_CHARS} printable characters, got "
                           f"{shorten(sid, 40)}", 400, "invalid_value", "session_id")
    if header is not None and body is not None and header != body:
        raise APIError(f"session_id {body!r} differs from the {SESSION_HEADER} header {header!r}", 400,
                       "invalid_value", "session_id")
    return body if body is not None else header


def room_for(prompt_len: int, max_tokens: int | None, max_model_len: int, field: str = "max_tokens",
             prompt_param: str = "prompt") -> int:
    """The max_tokens to run with; 400 context_length_exceeded when prompt + max_tokens exceeds the context (naming
    `prompt_param` when the prompt alone fills it)."""
    if prompt_len >= max_model_len:
        raise APIError(f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
                       f"{prompt_len} tokens, leaving no room for the completion. Please shorten the prompt.",
                       400, "context_length_exceeded", prompt_param)
    if max_tokens is None:
        return max_model_len - prompt_len
    if isinstance(max_tokens, int) and max_tokens >= 1 and prompt_len + max_tokens > max_model_len:
        raise APIError(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                       f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                       f"completion). Please reduce the prompt or {field}.", 400, "context_length_exceeded", field)
    return max_tokens


MAX_SCHEMA_BYTES = 64 << 10          # a JSON schema larger than this is refused before it is compiled


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


_TOKEN_ID_KEY = re.compile(r"-?[0-9]+")


def logit_bias(bias: dict[str, float] | None, vocab_size: int | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON string keys) as token id -> bias; a 400 naming logit_bias for more
    entries than logit_bias_cap, a key that is not an integer, an id outside [0, vocab_size), or a bias that is not a
    number in [-100, 100]."""
    if not bias:
        return None
    cap = logit_bias_cap(vocab_size)
    if len(bias) > cap:
        raise APIError(f"logit_bias may have at most {cap} entries (vLLM's cap or the vocabulary's size, whichever is "
                       f"smaller), got {len(bias)}", 400, "invalid_value", "logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise APIError(f"logit_bias keys must be token ids (integers), got {shorten(key)}", 400,
                           "invalid_value", "logit_bias")
        tid = int(key) if len(key) <= 20 else -1            # no vocabulary has a 20-digit id
        if tid < 0 or (vocab_size is not None and tid >= vocab_size):
            top = f"[0, {vocab_size})" if vocab_size is not None else "of the model"
            shown = key if len(key) <= 20 else shorten(key)
            raise APIError(f"logit_bias: token id {shown} is outside the vocabulary {top}", 400, "invalid_value",
                           "logit_bias")
        if not math.isfinite(value) or not -100.0 <= value <= 100.0:
            raise APIError(f"logit_bias values must be in [-100, 100], got {shorten(value)} for token {tid}", 400,
                           "invalid_value", "logit_bias")
        out[tid] = value
    return out


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


def usage(prompt_len: int, out: RequestOutput | None) -> Usage:
    """Usage of a request (cached tokens from the output, on every path)."""
    done = len(out.outputs[0].token_ids) if out is not None else 0
    cached = 0
    if out is not None:
        cached = out.num_cached_tokens or out.metrics.num_cached_tokens
    return Usage(prompt_tokens=prompt_len, completion_tokens=done, total_tokens=prompt_len + done,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                 dllm_chunk=out.dllm_chunk if out is not None else None)


def as_api_error(e: RequestError) -> APIError:
    """A backend RequestError as an APIError; other requests' ids are redacted (a busy session's message names
    the request that holds it, another client's) and the message is cut to 1000 characters."""
    msg = _REQUEST_ID.sub("another request", e.message)
    return APIError(msg if len(msg) <= 1000 else msg[:1000] + "...", e.status, e.code, e.param)


def failure(state: ServerState, out: RequestOutput) -> APIError:
    """The error for a request that failed after acceptance (503 if the backend is down, else 500)."""
    msg = out.error or "the request was aborted by the backend"
    status = 500 if state.client.is_healthy() else 503
    return APIError(msg, status, "request_failed")


def stream_error(state: ServerState, out: RequestOutput) -> bytes | None:
    """The SSE error event ending a stream whose request failed after acceptance; None while it is fine."""
    if out.error is None and out.outputs[0].finish_reason != "abort":
        return None
    err = failure(state, out)
    return sse({"error": {"message": err.message, "type": "server_error", "param": None, "code": err.code}})


def clamp_logprob(lp: float) -> float:
    """A JSON-safe logprob."""
    return lp if math.isfinite(lp) else _MIN_LOGPROB


def start(state: ServerState, ids: list[int], params: SamplingParams, request_id: str,
          session_id: str | None, prompt: str | None) -> AsyncIterator[RequestOutput]:
    """Call the backend's generate (errors surface on the first output)."""
    return state.client.generate(ids, params, request_id, session_id=session_id, prompt=prompt)


async def close(gen: AsyncIterator[Any]) -> None:
    """Close a generation early (the backend aborts the request and frees its KV)."""
    aclose = getattr(gen, "aclose", None)
    if aclose is not None:
        await aclose()


async def _wait_disconnect(receive: Receive) -> None:
    """Return when the ASGI server reports that the client went away."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it and raising ClientGone if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        raise ClientGone()
    try:
        return task.result()
    except RequestError as e:
        raise as_api_error(e) from None


async def first_output(request: Request, gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The first output of a generation (add-time errors raise APIError; a vanished client raises ClientGone)."""
    try:
        return await unless_gone(request, gen.__anext__())
    except StopAsyncIteration:
        raise APIError("the backend returned no output", 500, "request_failed") from None
    except BaseException:
        await close(gen)
        raise


async def collect(gen: AsyncIterator[RequestOutput], first: RequestOutput, on_output: Any) -> RequestOutput:
    """Drain a generation to its finished output, reporting each one to `on_output`."""
    out = first
    on_output(out)
    try:
        while not out.finished:
            out = await gen.__anext__()
            on_output(out)
    finally:
        await close(gen)
    return out


_encode_json = msgspec.json.Encoder().encode


def sse(obj: Any) -> bytes:
    """One server-sent event carrying JSON (msgspec: a stream's chunks are the event loop's main work)."""
    return b"data: " + _encode_json(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def guarded(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Pass SSE events through; a crash mid-stream becomes an error event and [DONE] (and is logged)."""
    try:
        async for event in events:
            yield event
    except Exception:  # noqa: BLE001 - the status line is gone: report in-band
        log.exception("streaming response failed")
        yield sse(error_body("internal server error", 500))
        yield SSE_DONE
    finally:
        await close(events)


class TextDelta:
    """Streams cumulative text, holding back what a stop string could still cut (max stop length - 1 chars)."""

    def __init__(self, params: SamplingParams) -> None:
        self.hold = max(0, params.max_stop_len - 1)
        self.sent = 0

    def next(self, text: str, finished: bool) -> str:
        """The text to send now."""
        end = len(text) if finished else len(text) - self.hold
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent:end], end
        return delta


class SSEResponse(StreamingResponse):
    """A streaming response that always watches for disconnects and always closes its iterator."""

    def __init__(self, content: AsyncIterator[bytes]) -> None:
        super().__init__(guarded(content), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        entry = scope.get("state", {}).get(DRAIN_ENTRY)        # the drain may end this stream (server shutdown)
        complete = False
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    nonlocal complete
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                        complete = True
                    tg.cancel_scope.cancel()

                async def watch() -> None:
                    await self.listen_for_disconnect(receive)
                    tg.cancel_scope.cancel()

                if entry is not None:
                    entry.end_stream = tg.cancel_scope.cancel
                tg.start_soon(stream)
                tg.start_soon(watch)
        finally:
            if entry is not None:
                entry.end_stream = None
            await close(self.body_iterator)
        if entry is not None and entry.error is not None and not complete:   # ended by the drain: why, then [DONE]
            err = entry.error
            with contextlib.suppress(OSError):
                await send({"type": "http.response.body", "more_body": False,
                            "body": sse(error_body(err.message, err.status, err.code)) + SSE_DONE})


def now_s() -> int:
    """Unix seconds, for `created`."""
    return int(time.time())
