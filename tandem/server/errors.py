"""OpenAI-style error bodies and the exception handlers that make every failure one of them.

Every error the server returns is `{"error": {"message", "type", "param", "code"}}` (OpenAI's shape):
`type` is "invalid_request_error" for 4xx and "server_error" for 5xx; `code` is a short machine-readable
string (e.g. "invalid_json", "model_not_found", "context_length_exceeded").
"""
from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.engine.outputs import RequestOutput
from tandem.runtime.client import RequestError
from tandem.server.state import ServerState

log = logging.getLogger("tandem.server")

_DEFAULT_CODES = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
                  408: "request_timeout", 409: "conflict", 413: "request_too_large", 500: "internal_error",
                  503: "service_unavailable"}
_REQUEST_ID = re.compile(r"\b(?:chatcmpl|cmpl)-[0-9a-f]{32}\b")


class APIError(Exception):
    """An error the server answers with status `status` and an OpenAI error body."""

    def __init__(self, message: str, status: int = 400, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.code = code or _DEFAULT_CODES.get(status, "error")


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


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


def error_body(message: str, status: int, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """The `{"error": {...}}` body for a status."""
    return {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                      "param": param, "code": code or _DEFAULT_CODES.get(status, "error")}}


def error_response(err: APIError) -> JSONResponse:
    """A JSON response carrying an APIError."""
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(error_body(err.message, err.status, err.code, err.param), status_code=err.status,
                        headers=headers)


def error_bytes(err: APIError) -> bytes:
    """The encoded body of an APIError (for raw ASGI responses)."""
    return json.dumps(error_body(err.message, err.status, err.code, err.param)).encode()


_MAX_PARAM = 100
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "literal"}


def _split_loc(loc: tuple) -> tuple[str, str | None]:
    """(field path, union member) of a pydantic error location."""
    path: list[str] = []
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or part.startswith("function-")):
            return ".".join(path), part
        path.append(str(part))
    return ".".join(path), None


def validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """A 400 naming the first invalid field of a pydantic validation failure (union alternatives folded)."""
    errors = exc.errors()
    if not errors:
        return APIError("invalid request body", 400, "invalid_value")
    param, member = _split_loc(tuple(errors[0].get("loc", ())))
    if member is not None:
        kinds = [m for e in errors if (sp := _split_loc(tuple(e.get("loc", ()))))[0] == param and (m := sp[1])]
        msg = f"expected one of: {', '.join(dict.fromkeys(kinds))}"
    else:
        msg = errors[0].get("msg", "invalid value")
    if len(param) > _MAX_PARAM:             # a location can hold a client's dict key: never echo it whole
        param = param[:_MAX_PARAM] + "..."
    if len(msg) > 2 * _MAX_PARAM:
        msg = msg[:2 * _MAX_PARAM] + "..."
    where = f"{param}: " if param else "request body: "
    return APIError(f"{where}{msg}", 400, "invalid_value", param or None)


def install_handlers(app: FastAPI) -> None:
    """Route APIError, pydantic, routing (404/405) and unexpected errors to OpenAI error bodies."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            msg = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            msg = f"method {request.method} is not allowed on {request.url.path}"
        else:
            msg = str(exc.detail)
        return error_response(APIError(msg, exc.status_code))
