"""Actions the coordinator core asks its shell to carry out."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from tandem.core.types import PrefillTask


class TransferPurpose(Enum):
    """Why KV moves: a remote prefill reads the session's history, or writes its new KV back."""

    HISTORY = "history"
    INCREMENTAL = "incremental"


@dataclass(slots=True)
class Submit:
    """Enqueue `task` on `worker`."""

    worker: int
    task: PrefillTask


@dataclass(slots=True, eq=False)
class Transfer:
    """Move `tokens` of KV from `src` to `dst` for `task`; `id` names it in on_transfer_done/failed."""

    src: int
    dst: int
    tokens: int
    purpose: TransferPurpose
    task: PrefillTask
    id: int = 0


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
class RunLocal:
    """A remote round's KV transfer failed or timed out: decode `worker` prefills `task` itself."""

    worker: int
    task: PrefillTask


@dataclass(slots=True)
class Cancel:
    """Prefill `worker` drops `task` (its result is no longer wanted) and frees its KV."""

    worker: int
    task: PrefillTask


@dataclass(slots=True)
class ToolCall:
    """The session is out calling a tool; its next round's input arrives after `delay_s` (in simulation)."""

    session_id: str
    delay_s: float


@dataclass(slots=True)
class ExpectReturn:
    """`worker`'s session `session_id` goes out on a tool expected to take `tool_s` when its current round ends (its
    host tier plans the idle KV with it)."""

    worker: int
    session_id: str
    tool_s: float


@dataclass(slots=True)
class Release:
    """Free the session's KV on `worker` (`keep_host`: an idle session's expiry on a tiered worker: only its GPU
    copy goes; its host-tier copy stays for its next round)."""

    worker: int
    session_id: str
    keep_host: bool = False


@dataclass(slots=True)
class Timer:
    """Call the coordinator's `on_tick` at `at_s` (a KV timeout or an idle session's expiry falls due then)."""

    at_s: float
