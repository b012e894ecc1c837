"""What request handlers share: the backend, the served name, metrics, the limits, and the preparation threads that
keep the event loop answering while a large request is parsed, templated or tokenized."""
from __future__ import annotations

import asyncio
import copy
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tandem.engine.tokenizer import Tokenizer
from tandem.knob import shared
from tandem.runtime.client import EngineClient
from tandem.server.metrics import ServerMetrics
from tandem.server.options import CHARS_PER_TOKEN, ServerOptions

T = TypeVar("T")
INLINE_ENCODE_CHARS = 4096      # texts up to this are tokenized on the event loop
INLINE_PREP_CHARS = 4096        # requests with up to this many characters are templated/tokenized on the loop
ADMISSION_SLOTS = 8             # requests preparing (checks, template, tokens) at once: a burst of arrivals is
                                # prepared a few per loop iteration, so /health and streams are not queued behind it


@dataclass
class Limits:
    """Caps checked before expensive work (None: derived from the model's context, max_model_len).

    max_messages: chat messages per request (default max_model_len: every message renders to >= 1 token);
    max_prompt_chars: characters of message content / text prompt (default CHARS_PER_TOKEN x max_model_len);
    prompt token ids are capped by max_model_len itself (a longer prompt leaves no room to generate).
    """

    max_messages: int | None = shared(ServerOptions, "max_messages")
    max_prompt_chars: int | None = shared(ServerOptions, "max_prompt_chars")
    prep_threads: int = 1           # threads that parse large bodies, render chat templates and tokenize (more
                                    # only take GIL time from the event loop: this work is pure Python)

    def messages(self, max_model_len: int) -> int:
        """The most chat messages a request may hold."""
        return self.max_messages if self.max_messages is not None else max_model_len

    def chars(self, max_model_len: int) -> int:
        """The most characters of prompt text a request may hold."""
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
