"""AsyncLLM: an in-process EngineClient that runs one co-located LLMEngine on a background thread.

The engine is not thread-safe, so only its thread touches it: the event loop sends commands (add,
abort) through a queue and the thread answers adds through futures and delivers each step's
cumulative RequestOutputs to per-request asyncio queues with `loop.call_soon_threadsafe`.
Closing a request's iterator early (the HTTP client went away) aborts it and frees its KV.
"""
from __future__ import annotations

import asyncio
import contextlib
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.engine.config import EngineConfig, EngineError
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.memory_profile import memory_report
from tandem.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tandem.engine.sampling_params import SamplingParams, SamplingParamsError
from tandem.engine.tokenizer import TokenizerError
from tandem.runtime.client import BackendStats, RequestError, add_memory_reports

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5          # the idle engine thread wakes this often even without commands
_TIER_WAIT_S = 0.01         # ... and this often while host-tier copies are in flight
COALESCE_BACKLOG = 64       # outputs a stream may fall behind before it skips to the latest (a stalled reader)


@dataclass
class _Stream:
    """Where one request's outputs go: a queue owned by an event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput]


@dataclass
class _Counters:
    """Backend counters kept by the engine thread (read without a lock: plain ints and floats)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    swapped: int = 0
    swap_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefills: int = 0


class AsyncLLM:
    """EngineClient over one LLMEngine stepped on a daemon thread (co-located prefill and decode)."""

    def __init__(self, engine: LLMEngine, served_model_name: str | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.model_config.vocab_size     # the model's (rows of its embedding)
        self.model_name: str = served_model_name or Path(engine.config.model).name
        self._cache_config = engine.cache_config()
        self._memory = memory_report(engine.runner.memory, engine.runner.kv_pool_bytes)
        self._inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}          # only the engine thread mutates it
        self._prefilled: set[str] = set()
        self._counters = _Counters()
        self._error: str | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_model(cls, path: str, served_model_name: str | None = None, **engine_args: Any) -> AsyncLLM:
        """Load a checkpoint (any EngineConfig field as a keyword) and start the engine thread."""
        try:
            config = EngineConfig(model=path, **engine_args)
        except TypeError as e:
            raise EngineError(f"unknown engine argument: {e}") from None
        return cls(LLMEngine(config), served_model_name=served_model_name)

    # ------------------------------------------------------------------ EngineClient
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       session_id: str | None = None, prompt: str | None = None,
                       tool_s: float | None = None) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs, one per engine step that touched the request (so a streamed chunk per
        token), until the finished one; a consumer COALESCE_BACKLOG outputs behind jumps to the latest."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        added: concurrent.futures.Future[None] = concurrent.futures.Future()
        arrival = self.engine.clock()
        ids = list(prompt_token_ids)
        self._send(lambda: self._add(added, request_id, ids, params, session_id, arrival, stream, tool_s))
        finished = False
        try:
            await asyncio.wrap_future(added)
            while True:
                out = await stream.queue.get()
                if stream.queue.qsize() >= COALESCE_BACKLOG:    # far behind: jump to the latest output
                    while not out.finished and not stream.queue.empty():
                        out = stream.queue.get_nowait()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self._send(lambda: self._abort(request_id), quiet=True)

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its KV; unknown or finished requests are ignored."""
        self._send(lambda: self._abort(request_id), quiet=True)

    def stats(self) -> BackendStats:
        """Gauges and counters of the engine (no KV transfers: everything is local)."""
        c = self._counters
        out = BackendStats(num_requests_running=c.running, num_requests_waiting=c.waiting,
                           kv_cache_usage_perc=c.kv_usage, num_requests_swapped=c.swapped,
                           cpu_cache_usage_perc=c.swap_usage, prefix_cache_queries=c.prefix_queries,
                           prefix_cache_hits=c.prefix_hits, local_prefills=c.prefills, remote_prefills=0,
                           workers_alive=int(self.is_healthy()),
                           iteration_tokens=dict(self.engine.stats.iteration_tokens),   # a C-level copy: atomic
                           dllm_commits=dict(self.engine.stats.dllm_commits),
                           dllm_chunks=dict(self.engine.stats.dllm_chunks),
                           dllm_serve=dict(self.engine.stats.dllm_serve),
                           cache_config=self._cache_config)
        add_memory_reports(out, [self._memory])
        tier = self.engine.tier
        if tier is not None:                             # the host KV tier's counters and occupancy
            out.host_tier = dict(tier.counters)
            g = tier.gauges()
            out.host_tier_usage, out.host_tier_bytes, out.host_tier_capacity_bytes = \
                g["usage"], g["bytes"], g["capacity_bytes"]
        return out

    def is_healthy(self) -> bool:
        """True while the engine thread runs and has not failed."""
        return not self._closed and self._thread.is_alive()

    async def shutdown(self) -> None:
        """Stop the engine thread; requests still running end with an error output."""
        self._send(None, quiet=True)
        await asyncio.to_thread(self._thread.join)

    def end_session(self, session_id: str) -> None:
        """Forget a session and free its resident KV (not part of the EngineClient protocol)."""
        self._send(lambda: self.engine.end_session(session_id), quiet=True)

    def _send(self, cmd: Callable[[], None] | None, quiet: bool = False) -> None:
        """Queue a command for the engine thread; refused (RequestError 503) once the engine is closed."""
        with self._lock:
            if not self._closed:
                self._inbox.put(cmd)
                return
        if not quiet:
            raise RequestError(f"the engine is not running: {self._error or 'it was shut down'}", status=503,
                               code="engine_unavailable")

    # ------------------------------------------------------------------ engine thread
    def _add(self, fut: concurrent.futures.Future[None], request_id: str, ids: list[int], params: SamplingParams,
             session_id: str | None, arrival: float, stream: _Stream, tool_s: float | None = None) -> None:
        """Add a request to the engine and answer the caller's future (engine thread)."""
        if not fut.set_running_or_notify_cancel():
            return                                   # the caller went away before the request was added
        if self._closed:
            fut.set_exception(RequestError(f"the engine is not running: {self._error or 'it was shut down'}",
                                           status=503, code="engine_unavailable"))
            return
        try:
            self.engine.add_request(request_id, ids, params, session_id=session_id, arrival_time=arrival,
                                    tool_s=tool_s)
        except (EngineError, SamplingParamsError, TokenizerError) as e:
            fut.set_exception(RequestError(str(e), status=400))
            return
        except Exception as e:  # noqa: BLE001 - handed to the caller, who answers 500
            log.exception("add_request failed for %s", request_id)
            fut.set_exception(e)
            return
        self._streams[request_id] = stream
        fut.set_result(None)

    def _abort(self, request_id: str) -> None:
        """Forget a request's stream and abort it in the engine (engine thread)."""
        self._streams.pop(request_id, None)
        self._prefilled.discard(request_id)
        if not self._closed:
            self.engine.abort_request(request_id)

    def _run(self) -> None:
        """The engine thread: run queued commands, step while work remains, deliver outputs."""
        eng = self.engine
        try:
            while True:
                busy = eng.has_unfinished_requests()
                try:
                    cmd = self._inbox.get_nowait() if busy else self._inbox.get(timeout=self._idle_wait())
                except queue.Empty:
                    cmd = _NOTHING
                if not self._run_commands(cmd):
                    break
                if not eng.has_unfinished_requests():
                    if eng.tier_due():                  # the host tier's decisions and copies run without requests
                        prep = eng.prepare_step()
                        eng.finish_step(prep, eng.execute_step(prep))
                    self._snapshot()
                    continue
                steps = eng.stats.steps
                outs = eng.step()
                self._deliver(outs)
                self._snapshot()
                if not outs and eng.stats.steps == steps:
                    time.sleep(0.001)               # nothing could run (waiting on memory): don't spin
            self._close("the engine was shut down")
        except Exception as e:  # noqa: BLE001 - the engine is dead; every caller learns why
            log.exception("engine thread failed")
            self._close(f"engine failure: {type(e).__name__}: {e}", error=True)

    def _idle_wait(self) -> float:
        """How long the idle engine thread waits for a command: _IDLE_WAIT_S, less while host-tier copies are in
        flight or the core's tier wants a schedule call sooner (a prefetch, a pin's end)."""
        eng = self.engine
        if eng.tier is None:
            return _IDLE_WAIT_S
        if eng.tier.busy():
            return _TIER_WAIT_S
        return min(_IDLE_WAIT_S, max(_TIER_WAIT_S, eng.core.wake_s - eng.clock()))

    def _run_commands(self, cmd: Any) -> bool:
        """Run `cmd` and every other queued command; False on the shutdown sentinel (None)."""
        while True:
            if cmd is None:
                return False
            if cmd is not _NOTHING:
                cmd()
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _deliver(self, outs: list[RequestOutput]) -> None:
        """Hand each output to its request's queue and count prefills and cache hits."""
        c = self._counters
        for out in outs:
            rid = out.request_id
            if rid not in self._prefilled and (out.outputs[0].token_ids or out.finished):
                self._prefilled.add(rid)
                c.prefills += 1
                c.prefix_queries += len(out.prompt_token_ids)
                c.prefix_hits += out.num_cached_tokens
            stream = self._streams.get(rid)
            if out.finished:
                self._streams.pop(rid, None)
                self._prefilled.discard(rid)
            if stream is not None:
                _put(stream, out)

    def _snapshot(self) -> None:
        """Copy the core's gauges for stats() (read from other threads)."""
        core = self.engine.core
        c = self._counters
        c.running = len(core.active) + len(core.running)
        c.waiting = len(core.queue) + len(core.pending_kv)
        c.kv_usage = core.kv_usage
        c.swapped, c.swap_usage = len(core.swapped), core.swap_usage

    def _close(self, message: str, error: bool = False) -> None:
        """Refuse new commands, fail queued adds, and end every open stream with `message`."""
        with self._lock:
            self._closed = True
            if error:
                self._error = message
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if cmd is not None:
                try:
                    cmd()                            # an _add answers 503 now that the engine is closed
                except Exception:  # noqa: BLE001
                    log.exception("command failed while closing")
        now = self.engine.clock()
        streams, self._streams = self._streams, {}
        for rid, stream in streams.items():
            _put(stream, RequestOutput(rid, None, [], [CompletionOutput(0, "", [], None, None, "abort")], True,
                                       RequestMetrics(now, finished_time=now), error=message))


_NOTHING = object()


def _put(stream: _Stream, out: RequestOutput) -> None:
    """Hand an output to its event loop (ignored if that loop has closed)."""
    with contextlib.suppress(RuntimeError):
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
