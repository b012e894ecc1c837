"""The runtime's state store: workers publish their load and windowed stats, the coordinator reads them.

`EmbeddedStore` keeps them in a dict (one process, `--state embedded`); `RedisStore` keeps them in
Redis so that worker processes on several hosts and the coordinator share them, as AMPD does.
Layout, TTLs and staleness rules: docs/state-store.md.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import msgspec

from tandem.core.worker import WorkerCore

DEFAULT_TTL_S = 5.0          # a worker key outlives its last publish by this long (Redis liveness)
URL_FORM = "redis://HOST:PORT[/DB]"
_URL = re.compile(r"redis://(?P<host>[A-Za-z0-9_.\-]+|\[[0-9A-Fa-f:.]+\]):(?P<port>\d{1,5})(?:/(?P<db>\d{1,2}))?")
_CLUSTER = re.compile(r"[A-Za-z0-9_.\-]+")
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.05, 1.0   # a RedisStore that lost Redis retries after this, doubling up to the max
LOG_EVERY_S = 5.0                          # at most one "Redis is down" warning per store this often
log = logging.getLogger("tandem.state_store")


class StateStoreError(Exception):
    """A state store that cannot be opened or reached; the message is one line for the CLI."""


class WorkerState(msgspec.Struct, frozen=True, kw_only=True):
    """One worker's published snapshot: identity, endpoints, windowed latency means and load."""

    worker_id: int
    role: str                      # tandem.core.types PREFILL | DECODE | COLOCATED
    tp: int
    node: int = 0
    control_addr: str = ""         # opaque to the store (ZeroMQ endpoints of the runtime)
    kv_addr: str = ""
    ttft_mean_s: float = 0.0       # WindowedMean of TTFT at publish time
    itl_mean_s: float = 0.0        # WindowedMean of ITL at publish time
    window_s: float = 10.0         # the window of those means: older than this, they say nothing
    queued_prefill_s: float = 0.0  # WorkerCore.pending_prefill_s(): AMPD Eq. 1-2 queue term
    utilization: float = 0.0       # WorkerCore.utilization(): busy share of the window (LAPS Alg. 2)
    queued_short_s: float = 0.0    # queued_prefill_s split into LAPS's classes (a worker without LAPS: the total)
    queued_long_s: float = 0.0
    laps_short_waiting: int = 0    # LAPS prefill worker (or AMPD+LAPS decode worker): short prefills in its AWD batcher
    laps_long_waiting: int = 0     # LAPS prefill worker: long prefills queued
    laps_window_s: float = 0.0     # AWD's window W and target depth D now
    laps_depth: int = 0
    laps_short_steps: int = 0      # short-batch steps so far, and those run in a captured bucket
    laps_graph_steps: int = 0
    capacity_tokens: int = 0
    free_tokens: int = 0
    kv_usage: float = 0.0
    num_running: int = 0           # sequences prefilling or decoding
    num_waiting: int = 0           # prefill tasks queued plus remote KV waiting for memory
    num_swapped: int = 0           # sequences preempted by swap, their KV in host memory
    swap_usage: float = 0.0        # fraction of the swap space in use
    host_tier_usage: float = 0.0   # host KV tier: fraction in use, bytes in use, capacity bytes (0: no tier)
    host_tier_bytes: int = 0
    host_tier_capacity_bytes: int = 0
    published_s: float = 0.0       # wall time of this publish: the heartbeat
    alive: bool = True             # False: the worker announced it is going away

    @classmethod
    def from_core(cls, core: WorkerCore, now: float, *, node: int = 0, control_addr: str = "",
                  kv_addr: str = "", published_s: float | None = None, alive: bool = True,
                  host_tier: dict | None = None) -> WorkerState:
        """Snapshot `core` at core time `now` (its means) and wall time `published_s` (default: time.time());
        `host_tier`: the engine's host tier gauges (engine.tier_copies.TierRunner.gauges)."""
        tier = {f"host_tier_{k}": v for k, v in (host_tier or {}).items()}
        short_s, long_s = core.pending_prefill_by_class()
        laps = {"queued_short_s": short_s, "queued_long_s": long_s}
        lp = core.laps if core.laps is not None else core.local_laps
        if lp is not None:
            short, long, window, depth = lp.gauges(now)
            st = lp.stats
            laps.update(laps_short_waiting=short, laps_long_waiting=long, laps_window_s=window, laps_depth=depth,
                        laps_short_steps=st.short_steps, laps_graph_steps=st.graph_steps)
        return cls(
            worker_id=core.id, role=str(core.role), tp=core.cfg.tp, node=node,
            control_addr=control_addr, kv_addr=kv_addr,
            ttft_mean_s=core.ttft.mean(now), itl_mean_s=core.itl.mean(now), window_s=core.cfg.window_s,
            queued_prefill_s=core.pending_prefill_s(), utilization=core.utilization(now),
            capacity_tokens=core.capacity_tokens,
            free_tokens=core.blocks.num_free * core.cfg.block_size, kv_usage=core.kv_usage,
            num_running=len(core.running) + len(core.active),
            num_waiting=len(core.queue) + len(core.pending_kv),
            num_swapped=len(core.swapped), swap_usage=core.swap_usage,
            published_s=time.time() if published_s is None else published_s, alive=alive, **laps, **tier)


class SessionInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A session's binding: its decode (home) worker and how many history tokens are resident there."""

    decode_worker: int
    resident_tokens: int = 0
    updated_s: float = 0.0
    loading: bool = False          # its history is on its way back from its worker's host tier


class StateStore(Protocol):
    """Where worker states and session bindings live; every method may raise StateStoreError."""

    def publish(self, state: WorkerState) -> None: ...
    def get(self, worker_id: int) -> WorkerState | None: ...
    def all(self) -> list[WorkerState]: ...
    def remove(self, worker_id: int) -> None: ...
    def put_session(self, session_id: str, info: SessionInfo) -> None: ...
    def get_session(self, session_id: str) -> SessionInfo | None: ...
    def delete_session(self, session_id: str) -> None: ...
    def close(self) -> None: ...


class EmbeddedStore:
    """In-process, thread-safe dict store; worker entries expire `ttl_s` after their publish if set."""

    def __init__(self, ttl_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.clock = ttl_s, clock
        self._lock = threading.Lock()
        self._workers: dict[int, tuple[float, WorkerState]] = {}   # id -> (expiry on clock, state)
        self._sessions: dict[str, SessionInfo] = {}

    def publish(self, state: WorkerState) -> None:
        expiry = self.clock() + self.ttl_s if self.ttl_s is not None else float("inf")
        with self._lock:
            self._workers[state.worker_id] = (expiry, state)

    def _live(self) -> dict[int, tuple[float, WorkerState]]:
        now = self.clock()
        dead = [w for w, (exp, _) in self._workers.items() if exp <= now]
        for w in dead:
            del self._workers[w]
        return self._workers

    def get(self, worker_id: int) -> WorkerState | None:
        with self._lock:
            entry = self._live().get(worker_id)
        return entry[1] if entry else None

    def all(self) -> list[WorkerState]:
        with self._lock:
            return [s for _, (_, s) in sorted(self._live().items())]

    def remove(self, worker_id: int) -> None:
        with self._lock:
            self._workers.pop(worker_id, None)

    def put_session(self, session_id: str, info: SessionInfo) -> None:
        with self._lock:
            self._sessions[session_id] = info

    def get_session(self, session_id: str) -> SessionInfo | None:
        with self._lock:
            return self._sessions.get(session_id)

    def delete_session(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)

    def close(self) -> None:
        pass


def parse_redis_url(url: str) -> tuple[str, int, int]:
    """(host, port, db) of a `redis://HOST:PORT[/DB]` URL; StateStoreError for any other form."""
    m = _URL.fullmatch(url)
    port = int(m["port"]) if m else 0
    if m is None or not 0 < port < 65536:
        raise StateStoreError(f"bad state store URL {url!r}: expected {URL_FORM}")
    return m["host"].strip("[]"), port, int(m["db"] or 0)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


class RedisStore:
    """Redis-backed store: msgspec-JSON strings under `tandem:{cluster}:`, worker keys with a TTL (liveness)."""

    def __init__(self, url: str, cluster: str = "default", ttl_s: float = DEFAULT_TTL_S,
                 session_ttl_s: float | None = None, timeout_s: float = 1.0) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        host, port, db = parse_redis_url(url)
        if not _CLUSTER.fullmatch(cluster):
            raise StateStoreError(f"bad cluster name {cluster!r}: letters, digits, '_', '.', '-' only")
        if ttl_s <= 0:
            raise StateStoreError(f"worker TTL must be positive, got {ttl_s}")
        self.url, self.cluster, self.ttl_s, self.session_ttl_s = url, cluster, ttl_s, session_ttl_s
        self.prefix = f"tandem:{cluster}:"
        self._where = f"Redis at {host}:{port}/{db}"
        self._errors_cls = redis.RedisError
        self._r = redis.Redis(host=host, port=port, db=db, socket_timeout=timeout_s,
                              socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 1))
        self._enc = msgspec.json.Encoder()
        self._dec_w = msgspec.json.Decoder(WorkerState)
        self._dec_s = msgspec.json.Decoder(SessionInfo)
        # resilience (docs/state-store.md "When Redis goes away"): writes never raise once the store is open
        self._down_since: float | None = None    # monotonic time of the first failure of the current outage
        self._retry_at = 0.0                     # no write is tried before this (backoff)
        self._backoff_s = BACKOFF_MIN_S
        self._logged_at = -float("inf")
        self._last: dict[int, WorkerState] = {}  # the last state published per worker (re-sent on reconnect)
        self._sessions: dict[str, SessionInfo] = {}   # sessions this process wrote and has not deleted
        self._dirty: set[str] = set()            # session writes/deletes Redis has not seen yet
        with self._errors("cannot reach"):
            self._r.ping()

    @contextmanager
    def _errors(self, what: str = "lost") -> Iterator[None]:
        try:
            yield
        except self._errors_cls as e:
            raise StateStoreError(f"state store: {what} {self._where}: {_one_line(e)}") from None

    def worker_key(self, worker_id: int) -> str:
        return f"{self.prefix}worker:{worker_id}"

    def session_key(self, session_id: str) -> str:
        return f"{self.prefix}session:{session_id}"

    @property
    def index_key(self) -> str:
        """A set of the worker ids ever published (entries whose key expired are pruned on read)."""
        return f"{self.prefix}workers"

    # ------------------------------------------------------------------ outages
    @property
    def down(self) -> bool:
        """True while the last Redis call failed (a write is then retried after a backoff)."""
        return self._down_since is not None

    def _failed(self, e: BaseException) -> None:
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = now
            self._backoff_s = BACKOFF_MIN_S
        else:
            self._backoff_s = min(BACKOFF_MAX_S, self._backoff_s * 2)
        self._retry_at = now + self._backoff_s
        if now - self._logged_at >= LOG_EVERY_S:               # rate-limited: a blip must not flood the log
            self._logged_at = now
            log.warning("state store: lost %s (%s); keeping the last state, retrying every <= %g s",
                        self._where, _one_line(e), BACKOFF_MAX_S)

    def _recovered(self) -> None:
        """A call succeeded after an outage: Redis may have restarted empty, so write back what this process owns."""
        if self._down_since is None:
            return
        down_s = time.monotonic() - self._down_since
        self._down_since, self._backoff_s, self._retry_at = None, BACKOFF_MIN_S, 0.0
        log.warning("state store: %s is back after %.2f s", self._where, down_s)
        try:
            p = self._r.pipeline(transaction=False)
            for st in self._last.values():
                self._queue_publish(p, st)
            self._queue_sessions(p, set(self._sessions) | self._dirty)
            p.execute()
            self._dirty.clear()
        except self._errors_cls as e:
            self._failed(e)

    def _write(self, fn: Callable[[], None]) -> bool:
        """Run a write unless backing off; on a Redis error log (rate-limited), back off and return False."""
        if self._down_since is not None and time.monotonic() < self._retry_at:
            return False
        try:
            fn()
        except self._errors_cls as e:
            self._failed(e)
            return False
        self._recovered()
        return True

    def _queue_publish(self, p, state: WorkerState) -> None:
        p.set(self.worker_key(state.worker_id), self._enc.encode(state), px=max(1, round(self.ttl_s * 1000)))
        p.sadd(self.index_key, state.worker_id)

    def _queue_sessions(self, p, sids) -> None:
        ttl = None if self.session_ttl_s is None else max(1, round(self.session_ttl_s * 1000))
        for sid in sids:
            info = self._sessions.get(sid)
            if info is None:
                p.delete(self.session_key(sid))
            else:
                p.set(self.session_key(sid), self._enc.encode(info), px=ttl)

    # ------------------------------------------------------------------ the store
    def publish(self, state: WorkerState) -> None:
        """Never raises: while Redis is unreachable the state is kept and published again on reconnect (the
        worker's key may expire meanwhile, which readers see as a silent worker)."""
        self._last[state.worker_id] = state

        def write() -> None:
            p = self._r.pipeline(transaction=False)
            self._queue_publish(p, state)
            if self._dirty:
                self._queue_sessions(p, self._dirty)
            p.execute()
            self._dirty.clear()
        self._write(write)

    def get(self, worker_id: int) -> WorkerState | None:
        with self._errors():
            raw = self._r.get(self.worker_key(worker_id))
        return self._dec_w.decode(raw) if raw is not None else None

    def all(self) -> list[WorkerState]:
        with self._errors():
            ids = sorted(int(i) for i in self._r.smembers(self.index_key))
            raws = self._r.mget([self.worker_key(i) for i in ids]) if ids else []
            gone = [i for i, raw in zip(ids, raws) if raw is None]
            if gone:
                self._r.srem(self.index_key, *gone)
        self._recovered()
        return [self._dec_w.decode(raw) for raw in raws if raw is not None]

    def remove(self, worker_id: int) -> None:
        self._last.pop(worker_id, None)
        with self._errors():
            p = self._r.pipeline(transaction=False)
            p.delete(self.worker_key(worker_id))
            p.srem(self.index_key, worker_id)
            p.execute()

    def put_session(self, session_id: str, info: SessionInfo) -> None:
        """Never raises: kept locally (what get_session falls back to) and written to Redis now or on reconnect."""
        self._sessions[session_id] = info
        self._dirty.add(session_id)
        self._flush_sessions()

    def get_session(self, session_id: str) -> SessionInfo | None:
        """From Redis; this process's own copy when Redis is unreachable or lost it (restarted empty)."""
        if session_id in self._dirty or (self._down_since is not None and time.monotonic() < self._retry_at):
            return self._sessions.get(session_id)
        try:
            raw = self._r.get(self.session_key(session_id))
        except self._errors_cls as e:
            self._failed(e)
            return self._sessions.get(session_id)
        self._recovered()
        return self._dec_s.decode(raw) if raw is not None else self._sessions.get(session_id)

    def delete_session(self, session_id: str) -> None:
        """Never raises (as put_session); the local copy goes at once, so ended sessions hold no memory here."""
        self._sessions.pop(session_id, None)
        self._dirty.add(session_id)
        self._flush_sessions()

    def _flush_sessions(self) -> None:
        def write() -> None:
            p = self._r.pipeline(transaction=False)
            self._queue_sessions(p, self._dirty)
            p.execute()
            self._dirty.clear()
        self._write(write)

    def close(self) -> None:
        self._r.close()


def open_store(spec: str, cluster: str = "default", ttl_s: float = DEFAULT_TTL_S) -> StateStore:
    """The store a `--state` value names: "embedded" or redis://HOST:PORT[/DB]."""
    if spec == "embedded":
        return EmbeddedStore()
    if spec.startswith("redis://"):
        return RedisStore(spec, cluster=cluster, ttl_s=ttl_s)
    raise StateStoreError(f"unknown state store {spec!r}: expected 'embedded' or {URL_FORM}")
