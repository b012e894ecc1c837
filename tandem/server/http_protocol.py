"""uvicorn's h11 protocol with a deadline on request heads (slowloris): uvicorn times out idle keep-alive
connections but waits forever for the head of a request that trickles in byte by byte, or for garbage without a
line end. Here a connection must complete each request head within `HEADER_TIMEOUT_S` of connecting (or of its
previous response), else it is closed. Bodies have their own deadline (the app's `body_timeout_s`)."""
from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("tandem.server")
HEADER_TIMEOUT_S = 10.0


class HeadTimeoutH11Protocol(H11Protocol):
    """H11Protocol that closes a connection whose request head is not complete in time."""

    header_timeout_s: float = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._waiting_cycle = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()                                  # the next request on a kept-alive connection begins
        super().data_received(data)
        if self._head_timer is not None and self.cycle is not self._waiting_cycle:
            self._disarm()                               # its head is complete: a new request cycle began

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
