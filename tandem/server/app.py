"""The FastAPI app: `build_app(client, ...)` serves an EngineClient over the OpenAI API.

Run it with uvicorn, e.g.::

    client = AsyncLLM.from_model("ckpt")
    uvicorn.run(build_app(client, api_key="sk-..."), host="0.0.0.0", port=8000)
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.engine.sampling_params import shorten
from tandem.runtime.client import EngineClient
from tandem.server.chat import create_chat_completion
from tandem.server.completions import create_completion
from tandem.server.drain import DRAIN_ENTRY, HEALTH_DRAINING, OPEN_PATHS, REFUSED, Drain, OpenRequest, ended_by_drain
from tandem.server.errors import APIError, ClientGone, error_bytes, error_response, install_handlers
from tandem.server.http_protocol import UNHEALTHY
from tandem.server.metrics import CONTENT_TYPE, ServerMetrics
from tandem.server.options import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from tandem.server.state import Limits, ServerState
from tandem.server.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                    CompletionResponse, DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList,
                                    TokenizeRequest, TokenizeResponse)
from tandem.server.tokenize import create_detokenize, create_tokenize

log = logging.getLogger("tandem.server")
_RECEIVED = "tandem_received"


KEYED_PATHS = ("/tokenize", "/detokenize")       # outside /v1 but doing work for the caller: the key applies


class Guard:
    """Outermost checks: API key on /v1/*, body size (Content-Length and streamed) and time to send it, a JSON 500
    for crashes; while draining, a 503 for new requests, and a JSON 503 for one the drain ends before it answered."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int,
                 body_timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S, drain: Drain | None = None) -> None:
        self.app, self.api_key, self.max_body = app, api_key, max_body_bytes
        self.body_timeout = body_timeout_s
        self.drain = drain if drain is not None else Drain()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})[_RECEIVED] = time.perf_counter()
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        tracked_here = scope["path"] not in OPEN_PATHS
        err = REFUSED if self.drain.draining and tracked_here else self._refuse(scope["path"], headers)
        if err is not None:
            await _drain(receive)
            await _send_error(send, err)
            return
        entry = self.drain.enter() if tracked_here else None
        scope["state"][DRAIN_ENTRY] = entry
        try:
            await self._guarded(scope, receive, send, entry)
        finally:
            if entry is not None:
                self.drain.leave(entry)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send, entry: OpenRequest | None) -> None:
        started = False
        seen = 0
        body_done = False
        deadline = None if self.body_timeout is None else time.monotonic() + self.body_timeout

        async def counted() -> Message:
            nonlocal seen, body_done
            if body_done or deadline is None:
                msg = await receive()
            else:
                try:
                    msg = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    raise APIError(f"the request body was not received within {self.body_timeout:g} s", 408,
                                   "request_timeout") from None
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_body:
                    raise APIError(f"request body exceeds the limit of {self.max_body} bytes", 413)
                body_done = not msg.get("more_body", False)
            return msg

        async def tracked(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
                if entry is not None:
                    entry.started = True
            await send(msg)

        try:
            await self.app(scope, counted, tracked)
        except APIError as e:                   # a limit hit outside the app's handlers (413, 408)
            if not started:
                if e.status == 413:
                    await _drain(receive)         # the rest of the body, bounded
                await _send_error(send, e)
        except asyncio.CancelledError:
            if not ended_by_drain(entry):         # uvicorn's, or anyone else's: theirs to handle
                raise
            if not started:
                await _send_error(send, entry.error)
        except Exception:  # noqa: BLE001 - never a traceback to the client
            log.exception("internal error on %s %s", scope.get("method"), scope["path"])
            if not started:
                await _send_error(send, APIError("internal server error", 500))

    def _refuse(self, path: str, headers: dict[bytes, bytes]) -> APIError | None:
        if self.api_key is not None and (path.startswith("/v1") or path in KEYED_PATHS):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, key = auth.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), self.api_key.encode()):
                msg = "missing API key" if not auth else "invalid API key"
                return APIError(f"{msg}: send 'Authorization: Bearer <key>'", 401, "invalid_api_key")
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return APIError("invalid Content-Length header", 400, "invalid_request")
            if n > self.max_body:
                return APIError(f"request body of {n} bytes exceeds the limit of {self.max_body} bytes", 413)
        return None


DRAIN_BYTES = 64 << 20       # a refused body is read and dropped up to this much ...
DRAIN_S = 5.0                # ... or this long, so the client reads the error instead of a connection reset


async def _drain(receive: Receive) -> None:
    """Read and drop what is left of a refused request's body (bounded in bytes and time): closing a connection
    with unread data resets it, and a client still sending would never see the 4xx."""
    left, deadline = DRAIN_BYTES, time.monotonic() + DRAIN_S
    while left > 0:
        try:
            msg = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return
        if msg["type"] != "http.request":
            return
        left -= len(msg.get("body", b""))
        if not msg.get("more_body", False):
            return


async def _send_error(send: Send, err: APIError) -> None:
    headers = [(b"content-type", b"application/json")]
    if err.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": error_bytes(err)})


def _received(request: Request) -> float:
    return request.scope.get("state", {}).get(_RECEIVED, time.perf_counter())


def build_app(client: EngineClient, api_key: str | None = None, served_model_name: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, limits: Limits | None = None,
              body_timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S, drain: Drain | None = None) -> FastAPI:
    """An OpenAI-compatible app in front of `client` (which it does not start or stop); `drain` (app.state.drain)
    refuses new requests and ends those in flight at shutdown (tandem.server.drain)."""
    name = served_model_name or client.model_name
    drain = drain if drain is not None else Drain()
    state = ServerState(client, name, ServerMetrics(client, name), limits or Limits())
    app = FastAPI(title="tandem", summary="OpenAI-compatible API of tandem", docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.tandem = state
    app.state.drain = drain
    install_handlers(app)
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s,
                       drain=drain)

    @app.get("/health")
    async def health() -> Response:
        if drain.draining:
            return error_response(HEALTH_DRAINING)
        if client.is_healthy():
            return Response(status_code=200)
        return error_response(UNHEALTHY)

    @app.get("/status")
    async def status() -> dict:
        """The deployment as given (`--deploy`'s form) and each worker as it runs: role, tensor-parallel degree,
        process ids, how its KV moves (a client without workers, e.g. an in-process engine, reports none)."""
        deployment = getattr(client, "deployment", None)
        return deployment() if deployment is not None else {"deploy": None, "workers": []}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    def card() -> ModelCard:
        return ModelCard(id=name, root=name, max_model_len=client.max_model_len)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(ModelList(data=[card()]).model_dump())

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        if model != name:
            raise APIError(f"The model {shorten(model)} does not exist.", 404, "model_not_found", "model")
        return JSONResponse(card().model_dump())

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest),
              responses={200: {"model": ChatCompletionResponse, "description": "a completion, or an SSE stream"}})
    async def chat(request: Request) -> Any:
        return await _answer(create_chat_completion(state, request, _received(request)))

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest),
              responses={200: {"model": CompletionResponse, "description": "a completion, or an SSE stream"}})
    async def completions(request: Request) -> Any:
        return await _answer(create_completion(state, request, _received(request)))

    @app.post("/tokenize", openapi_extra=_body_schema(TokenizeRequest),
              responses={200: {"model": TokenizeResponse, "description": "the token ids"}})
    async def tokenize(request: Request) -> Any:
        return await _answer(create_tokenize(state, request))

    @app.post("/detokenize", openapi_extra=_body_schema(DetokenizeRequest),
              responses={200: {"model": DetokenizeResponse, "description": "the text"}})
    async def detokenize(request: Request) -> Any:
        return await _answer(create_detokenize(state, request))

    app.openapi = lambda: _openapi(app)
    return app


_REQUEST_MODELS = (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest)


def _body_schema(model: type) -> dict[str, Any]:
    """The OpenAPI request body of a route that reads its body itself (parsed off the event loop, with limits)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the request bodies' models (their routes take the raw request), built once."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in _REQUEST_MODELS:
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            comps.update(js.pop("$defs", {}))
            comps[model.__name__] = js
        app.openapi_schema = schema
    return app.openapi_schema


async def _answer(work: Any) -> Any:
    """Await a handler; a client that left gets an empty 499 (nobody reads it)."""
    try:
        return await work
    except ClientGone:
        return Response(status_code=499)
