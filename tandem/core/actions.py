"""Actions the coordinator core asks its shell to carry out."""
from __future__ import annotations

from dataclasses import dataclass

from tandem.core.types import PrefillTask


@dataclass(slots=True)
class Submit:
    """Enqueue `task` on `worker`."""

    worker: int
    task: PrefillTask


@dataclass(slots=True)
class Transfer:
    """Move `tokens` of KV from `src` to `dst`: a lazy history read ("history") or the new KV ("incremental")."""

    src: int
    dst: int
    tokens: int
    purpose: str
    task: PrefillTask


@dataclass(slots=True)
class HistoryReady:
    """Tell `worker` the history KV of `task` has arrived."""

    worker: int
    task: PrefillTask


@dataclass(slots=True)
class KVArrived:
    """Tell decode `worker` the new KV of `task` has arrived."""

    worker: int
    task: PrefillTask


@dataclass(slots=True)
class Delivered:
    """Tell prefill `worker` its copy of `task`'s KV may be freed."""

    worker: int
    task: PrefillTask


@dataclass(slots=True)
class ToolCall:
    """The session is out calling a tool; its next round's input arrives after `delay_s` (in simulation)."""

    session_id: str
    delay_s: float


@dataclass(slots=True)
class Release:
    """Free the session's KV on `worker`."""

    worker: int
    session_id: str
