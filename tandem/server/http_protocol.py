"""uvicorn's h11 protocol with a deadline on request heads, and /health answered as soon as it is read.

* Slowloris: uvicorn times out idle keep-alive connections but waits forever for the head of a request that
  trickles in byte by byte, or for garbage without a line end. Here a connection must complete each request head
  within `HEADER_TIMEOUT_S` of connecting (or of its previous response), else it is closed. Bodies have their
  own deadline (the app's `body_timeout_s`).
* /health: a load balancer's probe is answered in the callback that reads it, from the same health check as the
  app's route, instead of in an ASGI task scheduled behind every stream the event loop is serving then (under a
  burst of 200 streams that task waited tens of ms per loop iteration). Anything but a plain `GET /health` head
  takes the normal path.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from tandem.server.errors import APIError, error_response

log = logging.getLogger("tandem.server")
HEADER_TIMEOUT_S = 10.0
_HEALTH_HEADS = (b"GET /health HTTP/1.1\r\n", b"GET /health HTTP/1.0\r\n")
_MAX_HEALTH_HEAD = 8192
UNHEALTHY = APIError("the backend is not healthy", 503, "service_unavailable")   # the app's /health says the same
_UNHEALTHY_BODY = bytes(error_response(UNHEALTHY).body)                          # byte for byte


class HeadTimeoutH11Protocol(H11Protocol):
    """H11Protocol that closes a connection whose request head is not complete in time."""

    header_timeout_s: float = HEADER_TIMEOUT_S
    is_healthy: Callable[[], bool] | None = None      # set: GET /health is answered here (see the module doc)

    @classmethod
    def answering_health(cls, is_healthy: Callable[[], bool]) -> type[HeadTimeoutH11Protocol]:
        """This protocol with /health answered from `is_healthy` (the app route's check) on arrival."""
        return type(cls.__name__, (cls,), {"is_healthy": staticmethod(is_healthy)})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._waiting_cycle = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.is_healthy is not None and data.startswith(_HEALTH_HEADS) and self._answer_health(data):
            return
        if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()                                  # the next request on a kept-alive connection begins
        super().data_received(data)
        if self._head_timer is not None and self.cycle is not self._waiting_cycle:
            self._disarm()                               # its head is complete: a new request cycle began

    def _answer_health(self, data: bytes) -> bool:
        """Answer a complete, body-less `GET /health` head between requests; False: not one (normal path)."""
        if (len(data) > _MAX_HEALTH_HEAD or not data.endswith(b"\r\n\r\n") or data.count(b"\r\n\r\n") != 1
                or not (self.cycle is None or self.cycle.response_complete)
                or self.conn.their_state is not h11.IDLE or self.conn.our_state is not h11.IDLE):
            return False
        self._unset_keepalive_if_required()
        self.conn.receive_data(data)
        try:
            event = self.conn.next_event()
            end = self.conn.next_event()
        except h11.RemoteProtocolError:
            self.send_400_response("Invalid HTTP request received.")
            return True
        if not isinstance(event, h11.Request) or not isinstance(end, h11.EndOfMessage):
            self.send_400_response("Invalid HTTP request received.")   # (a body on GET /health, say)
            return True
        healthy = self.is_healthy()
        body = b"" if healthy else _UNHEALTHY_BODY
        headers = [*self.server_state.default_headers, (b"content-length", str(len(body)).encode())]
        if not healthy:
            headers.append((b"content-type", b"application/json"))
        out = self.conn.send(h11.Response(status_code=200 if healthy else 503, headers=headers))
        out += self.conn.send(h11.Data(data=body)) if body else b""
        out += self.conn.send(h11.EndOfMessage())
        self.transport.write(out)
        self.server_state.total_requests += 1
        if self.conn.our_state is h11.MUST_CLOSE:
            self.transport.close()
            return True
        self.conn.start_next_cycle()
        self._disarm()                                   # the head came; the keep-alive timeout watches what follows
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._waiting_cycle = self.cycle
        self._head_timer = asyncio.get_running_loop().call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        timer, self._head_timer = getattr(self, "_head_timer", None), None
        if timer is not None:
            timer.cancel()

    def _expired(self) -> None:
        self._head_timer = None
        if self.cycle is self._waiting_cycle and not self.transport.is_closing():
            log.info("closing a connection from %s: no complete request head within %g s", self.client,
                     self.header_timeout_s)
            self.transport.close()
