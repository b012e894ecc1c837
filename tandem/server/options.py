"""The HTTP server's options: where it listens, the API key, the request limits and the slow-client timeouts.

Each is a knob (tandem.knob), so `tandem serve`'s server flags are generated from ServerOptions; the app
(tandem.server.app, tandem.server.state) takes its default limits from here, so each default is written once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.knob import byte_size, knob, port, positive_float, positive_int

API_KEY_ENV = "TANDEM_API_KEY"
DEFAULT_MAX_BODY_BYTES = 8 << 20
DEFAULT_BODY_TIMEOUT_S = 60.0       # a client that takes longer to send its body gets a 408 (slow clients)
CHARS_PER_TOKEN = 64                # default text cap: max_model_len x this many characters (no token is longer)
# Slow clients (slowloris): uvicorn closes an idle keep-alive connection after TIMEOUT_KEEP_ALIVE_S and refuses
# header blocks over H11_MAX_INCOMPLETE_EVENT_BYTES; the app answers 408 to a body not received within
# body_timeout_s. uvicorn has no timeout on reading headers: put a reverse proxy in front for that.
TIMEOUT_KEEP_ALIVE_S = 5
H11_MAX_INCOMPLETE_EVENT_BYTES = 64 << 10
GRACEFUL_SHUTDOWN_S = 10        # on SIGTERM, requests still open this long after it end with an error (a drain:
                                # tandem/server/drain.py; uvicorn would otherwise wait for every connection to close)


@dataclass
class ServerOptions:
    """How `tandem serve`'s HTTP server listens, authenticates and limits its clients."""

    host: str = knob("127.0.0.1", "the address to listen on")
    port: int = knob(8000, "the TCP port to listen on", parse=port)
    api_key: str | None = knob(None, f"require 'Authorization: Bearer KEY' on /v1/* (visible in ps: prefer "
                               f"${API_KEY_ENV} or --api-key-file)", metavar="KEY")
    api_key_file: str | None = knob(None, "read the API key from this file (its first line)", metavar="PATH")
    max_body_bytes: int = knob(DEFAULT_MAX_BODY_BYTES, "largest request body accepted (413 beyond; e.g. 8M)",
                               parse=byte_size, metavar="BYTES")
    max_messages: int | None = knob(None, "most chat messages per request (default: max_model_len)",
                                    parse=positive_int, metavar="N")
    max_prompt_chars: int | None = knob(None, f"most characters of prompt text / message content (default: "
                                        f"{CHARS_PER_TOKEN} x max_model_len)", parse=positive_int, metavar="N")
    body_timeout_s: float = knob(DEFAULT_BODY_TIMEOUT_S, "a request body not received within S seconds gets a 408",
                                 parse=positive_float, metavar="S", flags=("--body-timeout",))
    timeout_keep_alive: float = knob(TIMEOUT_KEEP_ALIVE_S, "close idle keep-alive connections after S seconds",
                                     parse=positive_float, metavar="S")
    timeout_graceful_shutdown: float = knob(
        GRACEFUL_SHUTDOWN_S, "on SIGTERM/SIGINT, refuse new requests (503) and let those in flight finish for up to S "
        "seconds, then end each one left with an error (JSON, or an SSE error event and [DONE]); a second signal ends "
        "them at once", parse=positive_float, metavar="S", flags=("--timeout-graceful-shutdown", "--shutdown-timeout"))
    limit_concurrency: int | None = knob(None, "most open connections + requests before uvicorn answers 503 "
                                         "(default: no limit)", parse=positive_int, metavar="N")

    def uvicorn_kwargs(self) -> dict[str, Any]:
        """uvicorn.Config's connection settings: keep-alive, graceful shutdown, concurrency and header size limits."""
        return {"timeout_keep_alive": self.timeout_keep_alive, "timeout_graceful_shutdown": self.timeout_graceful_shutdown,
                "limit_concurrency": self.limit_concurrency,
                "h11_max_incomplete_event_size": H11_MAX_INCOMPLETE_EVENT_BYTES}
