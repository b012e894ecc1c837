"""Prometheus metrics on a per-app CollectorRegistry (vLLM's names, plus tandem's disaggregation metrics).

Latencies (TTFT, ITL, E2E) are measured in the server, from when the request was received to when tokens
reached it. Gauges and backend counters come from `client.stats()` at scrape time; `tandem:kv_transfer_seconds`
is a histogram fed with the transfer times the backend reports since the previous scrape.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tandem.engine.outputs import RequestOutput
from tandem.runtime.client import BackendStats, EngineClient

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5)


class _BackendCollector:
    """Exports the latest BackendStats snapshot as gauges and counters."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats = BackendStats()

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s, label = self.stats, [self.model_name]
        gauges = [("vllm:num_requests_running", "Requests prefilling or decoding.", s.num_requests_running),
                  ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_requests_waiting),
                  ("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full).", s.kv_cache_usage_perc),
                  ("tandem:workers_alive", "Live decode/co-located/prefill workers.", s.workers_alive)]
        counters = [("vllm:prefix_cache_queries", "Prompt tokens looked up in the cache.", s.prefix_cache_queries),
                    ("vllm:prefix_cache_hits", "Prompt tokens found cached (history or prefix).", s.prefix_cache_hits),
                    ("tandem:local_prefills", "Prefills run on the session's decode worker.", s.local_prefills),
                    ("tandem:remote_prefills", "Prefills run on a prefill worker.", s.remote_prefills),
                    ("tandem:kv_transfer_timeouts", "KV transfers that fell back to local recompute.",
                     getattr(s, "kv_transfer_timeouts", 0))]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(label, float(value))
            yield g
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(label, float(value))
            yield c


class ServerMetrics:
    """The app's metrics; `RequestTimer`s report per-request latencies and token counts into it."""

    def __init__(self, client: EngineClient, model_name: str) -> None:
        self.client = client
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, lab = self.registry, ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token, server-measured.", lab,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens, server-measured.", lab,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request received to finished.", lab,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled (backend clock).",
                               lab, buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_transfer = Histogram("tandem:kv_transfer_seconds", "KV transfer time between workers.", lab,
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", lab, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", lab, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=r)
        self._backend = _BackendCollector(model_name)
        r.register(self._backend)
        self._lock = threading.Lock()
        for m in (self.ttft, self.itl, self.e2e, self.queue, self.kv_transfer, self.prompt_tokens,
                  self.generation_tokens):
            m.labels(model_name)                  # export zero-valued series before the first request

    def timer(self, received: float | None = None) -> RequestTimer:
        """Time a request received at `received` (time.perf_counter(); default now)."""
        return RequestTimer(self, received)

    def render(self) -> bytes:
        """Take a backend snapshot and render every metric in the Prometheus text format."""
        with self._lock:
            stats = self.client.stats()
            for s in stats.kv_transfer_seconds:
                self.kv_transfer.labels(self.model_name).observe(s)
            self._backend.stats = stats
            return generate_latest(self.registry)


class RequestTimer:
    """Per-request latency bookkeeping: call `update` with each cumulative output as it arrives."""

    def __init__(self, metrics: ServerMetrics, received: float | None = None) -> None:
        self.m = metrics
        self.received = time.perf_counter() if received is None else received
        self.last: float | None = None
        self.tokens = 0
        self.done = False

    def update(self, out: RequestOutput) -> None:
        """Observe TTFT/ITL for new tokens, token counters, and E2E + finish reason when finished."""
        if self.done:
            return
        m, name, now = self.m, self.m.model_name, time.perf_counter()
        n = len(out.outputs[0].token_ids)
        new = n - self.tokens
        if new > 0:
            if self.last is None:
                m.ttft.labels(name).observe(now - self.received)
                m.prompt_tokens.labels(name).inc(len(out.prompt_token_ids))
                met = out.metrics
                if met.first_scheduled_time is not None:
                    m.queue.labels(name).observe(max(0.0, met.first_scheduled_time - met.arrival_time))
                new_itl = new - 1
            else:
                new_itl = new
            if new_itl > 0 and self.last is not None:
                gap = (now - self.last) / new_itl
                for _ in range(new_itl):
                    m.itl.labels(name).observe(gap)
            m.generation_tokens.labels(name).inc(new)
            self.tokens, self.last = n, now
        if out.finished:
            self.done = True
            m.e2e.labels(name).observe(now - self.received)
            m.success.labels(name, out.outputs[0].finish_reason or "abort").inc()
