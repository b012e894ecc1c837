"""What responses share, streamed or not: SSE events and the response that sends them, text deltas held back for
stop strings, the in-band error of a failed stream, usage, JSON-safe logprobs."""
from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tandem.engine.outputs import RequestOutput
from tandem.engine.sampling_params import SamplingParams
from tandem.server.drain import DRAIN_ENTRY
from tandem.server.errors import error_body, failure
from tandem.server.protocol import PromptTokensDetails, Usage
from tandem.server.state import ServerState

log = logging.getLogger("tandem.server")
_MIN_LOGPROB = -9999.0          # -inf is not JSON; vLLM clamps the same way
_encode_json = msgspec.json.Encoder().encode
SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    """One server-sent event carrying JSON (msgspec: a stream's chunks are the event loop's main work)."""
    return b"data: " + _encode_json(obj) + b"\n\n"


def now_s() -> int:
    """Unix seconds, for `created`."""
    return int(time.time())


def clamp_logprob(lp: float) -> float:
    """A JSON-safe logprob."""
    return lp if math.isfinite(lp) else _MIN_LOGPROB


def usage(prompt_len: int, outs: list[RequestOutput]) -> Usage:
    """The request's usage: the prompt once, every choice's completion tokens, the first choice's cached tokens."""
    done = sum(len(o.outputs[0].token_ids) for o in outs)
    cached = outs[0].num_cached_tokens or outs[0].metrics.num_cached_tokens if outs else 0
    return Usage(prompt_tokens=prompt_len, completion_tokens=done, total_tokens=prompt_len + done,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                 dllm_chunk=outs[0].dllm_chunk if outs else None)


def stream_error(state: ServerState, out: RequestOutput) -> bytes | None:
    """The SSE error event ending a stream whose request failed after acceptance; None while it is fine."""
    if out.error is None and out.outputs[0].finish_reason != "abort":
        return None
    err = failure(state, out)
    return sse({"error": {"message": err.message, "type": "server_error", "param": None, "code": err.code}})


async def close(gen: AsyncIterator[Any]) -> None:
    """Close a generation early (the backend aborts the request and frees its KV)."""
    aclose = getattr(gen, "aclose", None)
    if aclose is not None:
        await aclose()


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
