"""The messages between the coordinator and worker processes (msgspec structs; KV bytes travel as extra frames).

Each coordinator action of the sans-I/O core is a command to a worker (tandem.core.commands), which one message
carries (`COMMAND`: Submit -> AddRequest/AddPrefill, Transfer -> SendKV, Cancel -> Abort, ...); each worker core
event comes back as one (FetchHistory, PrefillDone, FirstToken, RoundDone, SessionFailed) keyed by request id.
"""
from __future__ import annotations

from typing import Literal, Union

import msgspec

from tandem.core import commands as c
from tandem.core.host_tier import AllBlocksCleared, BlockRemoved, BlockStored, Medium

Purpose = Literal["history", "incremental"]     # tandem.core.actions.TransferPurpose on the wire


# ------------------------------------------------------------------ coordinator -> worker

class BeginRound(msgspec.Struct, tag=True):
    """Pin a session's resident KV for a new round; the worker answers RoundBegun. With the round's prompt, a
    session with nothing resident first takes the prompt's cached prefix (the worker's prefix cache)."""

    request_id: str
    session_id: str
    prompt_token_ids: list[int] = []


class AddRequest(msgspec.Struct, tag=True):
    """A round for a decode/co-located worker: local prefill, or wait for a remote prefill's KV."""

    request_id: str
    session_id: str
    prompt_token_ids: list[int]
    params: dict
    remote: bool = False
    keep_session: bool = True
    ttft_slo_s: float = float("inf")
    itl_slo_s: float = float("inf")


class AddPrefill(msgspec.Struct, tag=True):
    """A remote prefill for a prefill worker: tokens [l_hist, len) on top of the session's history."""

    request_id: str
    session_id: str
    prompt_token_ids: list[int]
    params: dict
    l_hist: int
    round_idx: int = 0
    ttft_slo_s: float = float("inf")          # the round's TTFT target: the worker's picker (Alg. 2) orders by it
    hist_compute: int = 0                     # history tokens computed here, not read (vLLM-like PD); <= l_hist


class SendKV(msgspec.Struct, tag=True):
    """Push KV to a peer: the session's history ("history") or the task's new KV and first token ("incremental").
    With the peer's rank endpoints (`dst_rank_addrs`, in rank order), each of this worker's ranks sends the peer's
    ranks their heads directly and only a KVRanked goes to `dst_addr`; without them, the payload goes driver to
    driver (KVData)."""

    request_id: str
    session_id: str
    purpose: Purpose
    tokens: int
    dst_worker: int
    dst_addr: str
    dst_rank_addrs: list[str] = []


class HistoryReady(msgspec.Struct, tag=True):
    request_id: str


class KVArrived(msgspec.Struct, tag=True):
    request_id: str


class Delivered(msgspec.Struct, tag=True):
    request_id: str


class RunLocal(msgspec.Struct, tag=True):
    """A remote round whose KV never came: prefill it on the decode worker instead (recompute)."""

    request_id: str


class Release(msgspec.Struct, tag=True):
    session_id: str


class ExpectReturn(msgspec.Struct, tag=True):
    """The session goes out on a tool expected to take `tool_s` seconds when its current round ends (the core's
    ExpectReturn: the worker's host tier plans the idle KV with it)."""

    session_id: str
    tool_s: float



class Abort(msgspec.Struct, tag=True):
    request_id: str


class Audit(msgspec.Struct, tag=True):
    """Which requests do you hold? Answered by Holding, after every message sent before it (the coordinator's
    check that no message of a running request was lost)."""

    nonce: int


# ------------------------------------------------------------------ worker -> worker (KV plane)

class KVData(msgspec.Struct, tag=True):
    """A KV payload header; the bytes follow as the next frame. A transfer longer than one message's share
    (tandem.engine.kv_transfer.kv_part_tokens) is sent as parts in order: `offset` is the part's first token
    within the transfer and `total_tokens` the transfer's length (0: this message is the whole transfer)."""

    request_id: str
    purpose: Purpose
    src_worker: int
    num_tokens: int
    dtype: str
    shape: list[int]
    sent_s: float
    first_token: int = -1
    first_logprobs: dict[int, float] | None = None
    offset: int = 0
    total_tokens: int = 0


class KVRanked(msgspec.Struct, tag=True):
    """The control half of a rank-to-rank transfer, driver to driver (no payload): transfer `transfer` of
    `num_tokens` tokens went from the sender's ranks to this worker's rank endpoints; the receiver claims it on every
    rank (all or none) and then answers KVReceived, or WorkerFailure as for a payload that does not fit."""

    request_id: str
    purpose: Purpose
    src_worker: int
    transfer: str
    num_tokens: int
    sent_s: float
    first_token: int = -1
    first_logprobs: dict[int, float] | None = None


# ------------------------------------------------------------------ worker -> coordinator

class RoundBegun(msgspec.Struct, tag=True):
    request_id: str
    session_id: str
    resident_tokens: int
    loading: bool = False             # that KV is on its way back from the worker's host tier (the round stays home)


class Delta(msgspec.Struct):
    """What one request gained in a step (text and tokens appended; `text` replaces all when `reset`)."""

    request_id: str
    token_ids: list[int]
    text: str
    reset: bool = False
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None   # once, with the first delta (prompt_logprobs set)
    num_preemptions: int = 0                                       # the request's preemptions so far (its metrics)
    dllm_chunk: str | None = None                                  # block diffusion: the chunk its round decodes with
    scheduled_ago_s: float | None = None     # with a request's first delta: seconds since this worker first scheduled
                                             # it (the coordinator dates vllm:request_queue_time_seconds by it)


class Outputs(msgspec.Struct, tag=True):
    deltas: list[Delta]


class EvFetchHistory(msgspec.Struct, tag=True):
    """Core event FetchHistory: a remote prefill needs `tokens` of its session's history KV."""

    session_id: str
    request_id: str
    tokens: int


class EvPrefillDone(msgspec.Struct, tag=True):
    """Core event PrefillDone: a remote prefill finished; its new KV goes back to the decode worker."""

    session_id: str
    request_id: str
    scheduled_ago_s: float | None = None     # seconds since the prefill worker first scheduled it (as Delta's)


class EvFirstToken(msgspec.Struct, tag=True):
    session_id: str
    prefill_start_s: float = 0.0


class EvRoundDone(msgspec.Struct, tag=True):
    session_id: str
    output_tokens: int
    itl_sum: float = 0.0
    itl_count: int = 0
    itl_max: float = 0.0
    preemptions: int = 0


class EvSessionFailed(msgspec.Struct, tag=True):
    session_id: str
    reason: str


class EvKVBlocks(msgspec.Struct, tag=True):
    """KV event (vLLM's BlockStored / BlockRemoved, or AllBlocksCleared when `cleared`): blocks of these chained
    hashes now held (`stored`) or no longer held in `medium` (GPU or CPU) of the sending worker."""

    stored: bool
    medium: str
    hashes: list[int] = []
    cleared: bool = False


def kv_event(worker: int, ev: EvKVBlocks) -> BlockStored | BlockRemoved | AllBlocksCleared | None:
    """The core's KV event of `worker` for a received EvKVBlocks (None: a medium this coordinator does not know)."""
    if ev.cleared:
        return AllBlocksCleared(worker)
    try:
        medium = Medium(ev.medium)
    except ValueError:
        return None
    return (BlockStored if ev.stored else BlockRemoved)(worker, tuple(ev.hashes), medium)


CoreEvent = Union[EvFetchHistory, EvPrefillDone, EvFirstToken, EvRoundDone, EvSessionFailed, EvKVBlocks]


class Events(msgspec.Struct, tag=True):
    events: list[CoreEvent]


class KVReceived(msgspec.Struct, tag=True):
    """A KV payload landed on this worker (and is held until the coordinator says HistoryReady/KVArrived); with
    `failed`, a rank-to-rank transfer that did not reach every rank (the core falls back: local recompute)."""

    request_id: str
    purpose: str
    src_worker: int
    nbytes: int
    elapsed_s: float
    failed: str = ""


class Holding(msgspec.Struct, tag=True):
    """The answer to Audit `nonce`: the requests this worker's engine holds now (queued, running, or waiting
    for KV, on a decode worker; prefilling or waiting for Delivered, on a prefill worker)."""

    nonce: int
    request_ids: list[str]


class WorkerFailure(msgspec.Struct, tag=True):
    """A message the worker could not carry out; the coordinator fails the request with the reason."""

    request_id: str
    reason: str


class StepCounts(msgspec.Struct, tag=True):
    """Worker -> coordinator, with its state: engine steps by tokens per step since the last StepCounts (the
    vllm:iteration_tokens_total histogram of the multi-process backend)."""

    iteration_tokens: dict[int, int]
    rejected_frames: int = 0          # messages its readers dropped as malformed, since the last StepCounts
    dllm_commits: dict[int, int] = {}     # diffusion: sequences by tokens committed in a step, since the last
    dllm_chunks: dict[int, int] = {}      # diffusion: steps by the chunk size chosen, likewise
    dllm_serve: dict[str, int] = {}       # dLLM-Serve: the core's counters (policy.dllm_serve COUNTERS), likewise
    rejected_handshakes: int = 0      # connections its KV inbox refused (no or wrong CURVE keys), likewise
    host_tier: dict[str, int] = {}    # host KV tier: its copy counters (engine.tier_copies HOST_TIER_COUNTERS), likewise
    kv_bytes: dict[str, int] = {}     # KV bytes by path since the last: "sent/R", "received/R" by rank endpoint,
                                      # "driver" through the driver (KVData, or gathered/scattered for its ranks)


UPSTREAM = [RoundBegun, Outputs, Events, KVReceived, WorkerFailure, StepCounts, Holding]
KV = [KVData, KVRanked]

# the worker command each message to a worker carries: the one table between core actions and the wire
COMMAND: dict[type, int] = {BeginRound: c.BEGIN, AddRequest: c.SUBMIT, AddPrefill: c.SUBMIT, SendKV: c.SEND_KV,
                            HistoryReady: c.HISTORY_READY, KVArrived: c.KV_ARRIVED, Delivered: c.DELIVERED,
                            RunLocal: c.RUN_LOCAL, Release: c.RELEASE, Abort: c.CANCEL, Audit: c.AUDIT,
                            ExpectReturn: c.EXPECT, KVData: c.KV_IN, KVRanked: c.KV_IN}
CONTROL = [t for t, kind in COMMAND.items() if kind != c.KV_IN]
# the messages a worker carries out while its model runs a step (tandem.core.commands.EARLY says which and why)
EARLY = tuple(t for t, kind in COMMAND.items() if kind in c.EARLY)
# the message of each command that names just its request
NOTICE: dict[int, type] = {c.HISTORY_READY: HistoryReady, c.KV_ARRIVED: KVArrived, c.DELIVERED: Delivered,
                           c.RUN_LOCAL: RunLocal, c.CANCEL: Abort}


class Stats(msgspec.Struct, tag=True):
    """A worker's state for the store (embedded mode: relayed by the coordinator); also a heartbeat."""

    state: "WorkerStateT"


from tandem.runtime.state_store import WorkerState as WorkerStateT  # noqa: E402  (a msgspec Struct)

UPSTREAM.append(Stats)
