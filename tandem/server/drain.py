"""Graceful drain of the HTTP server on SIGTERM, as vLLM's `--shutdown-timeout`: new requests are refused with a 503
(OpenAI error body) and /health says draining; requests in flight may finish within the grace period; each one still
open then ends with an error its client can read: a JSON 503 when its response has not started, an SSE error event
then `data: [DONE]` when it streams. Only then does uvicorn stop, so it has nothing left to cancel (a cancelled
request is uvicorn's `500 text/plain` and a traceback in the log)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import uvicorn

from tandem.server.errors import APIError

log = logging.getLogger("tandem.server")
OPEN_PATHS = ("/health", "/metrics")   # still answered while draining (/health says so); never waited for
DRAIN_ENTRY = "tandem_drain"           # scope["state"] key of a request's OpenRequest (None: not tracked)
END_S = 2.0                            # after the grace period: how long the ended requests get to write their error
REFUSED = APIError("the server is shutting down: it accepts no new requests", 503, "service_unavailable")
HEALTH_DRAINING = APIError("draining: the server is shutting down", 503, "service_unavailable")


class OpenRequest:
    """One request in flight as the drain sees it: its task, whether its response started, how to end its stream."""

    __slots__ = ("task", "started", "error", "end_stream")

    def __init__(self, task: asyncio.Task | None) -> None:
        self.task = task
        self.started = False
        self.error: APIError | None = None                  # set when the drain ended it
        self.end_stream: Callable[[], None] | None = None    # set by a streaming response while it streams


class Drain:
    """The requests in flight and the drain's state; `begin`, `wait_idle`, `end_all` (serve_cmd runs them)."""

    def __init__(self) -> None:
        self.draining = False
        self._open: set[OpenRequest] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._hurry = asyncio.Event()

    def enter(self) -> OpenRequest:
        """Track the current task's request until `leave`."""
        req = OpenRequest(asyncio.current_task())
        self._open.add(req)
        self._idle.clear()
        return req

    def leave(self, req: OpenRequest) -> None:
        self._open.discard(req)
        if not self._open:
            self._idle.set()

    def begin(self) -> None:
        """Refuse new requests from now on (REFUSED; /health HEALTH_DRAINING)."""
        if not self.draining:             # a warning only when requests are cut short by it
            (log.warning if self._open else log.info)("draining: refusing new requests; %d in flight",
                                                      len(self._open))
        self.draining = True

    def hurry(self) -> None:
        """End the grace period now (a second SIGTERM/SIGINT)."""
        self._hurry.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Whether every request in flight ended within `timeout_s` (sooner after `hurry`)."""
        idle = asyncio.ensure_future(self._idle.wait())
        hurry = asyncio.ensure_future(self._hurry.wait())
        try:
            await asyncio.wait({idle, hurry}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            idle.cancel()
            hurry.cancel()
        return self._idle.is_set()

    def end_all(self, error: APIError) -> int:
        """End every request still in flight with `error`; how many. A streaming response ends its stream with an
        error event and [DONE]; a request whose response has not started is cancelled, and the app's Guard answers
        it with `error` as JSON; a response already being written (not a stream) is left to finish."""
        n = 0
        for req in list(self._open):
            if req.error is not None:
                continue
            if req.end_stream is not None:
                req.error = error
                req.end_stream()
            elif not req.started and req.task is not None:
                req.error = error
                req.task.cancel()
            else:
                continue
            n += 1
        return n


def ended_by_drain(req: OpenRequest | None) -> bool:
    """In a request's task that caught CancelledError: whether the drain cancelled it, and nothing else did (then
    the cancellation is taken back so the request can still answer)."""
    if req is None or req.error is None:
        return False
    task = asyncio.current_task()
    return task is not None and task.uncancel() == 0


class Server(uvicorn.Server):
    """uvicorn's server without its own SIGINT/SIGTERM handlers: `tandem serve` drains first, then stops it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


async def drain_and_stop(server: uvicorn.Server, serving: asyncio.Task, drain: Drain, grace_s: float,
                         protocol: Any = None) -> None:
    """Drain (see the module doc) within `grace_s`, then stop uvicorn and await its task. `protocol`: the HTTP
    protocol class answering /health itself (HeadTimeoutH11Protocol.answering_health); it stops doing so, so that
    /health is answered by the app, which says draining."""
    drain.begin()
    if protocol is not None:
        protocol.is_healthy = None
    if not serving.done() and not await drain.wait_idle(grace_s):
        error = APIError(f"the server shut down before this request finished (graceful shutdown timeout {grace_s:g} s)",
                         503, "service_unavailable")
        n = drain.end_all(error)
        log.warning("graceful shutdown: %d request(s) still open after %g s ended with an error", n, grace_s)
        await drain.wait_idle(END_S)
    server.config.timeout_graceful_shutdown = END_S       # uvicorn's own wait: connections writing their last bytes
    server.should_exit = True
    with contextlib.suppress(Exception):
        await serving
