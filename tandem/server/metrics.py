"""Prometheus metrics on a per-app CollectorRegistry (vLLM's names, plus tandem's disaggregation metrics).

Latencies (TTFT, ITL, E2E) are measured in the server, from when the request was received to when tokens
reached it. Gauges and backend counters come from `client.stats()` at scrape time; `tandem:kv_transfer_seconds`
is a histogram fed with the transfer times the backend reports since the previous scrape.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from prometheus_client import (
    GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, Counter, Histogram, generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric, SummaryMetricFamily,
)

from tandem.engine.outputs import RequestOutput
from tandem.runtime.client import BackendStats, EngineClient

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0)                                        # vLLM's time-per-output-token buckets
_N_BUCKETS = (1, 2, 5, 10, 20)                                # vLLM's vllm:request_params_n buckets
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_DLLM_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)     # tokens committed in a step; chunk sizes


def _histogram(name: str, doc: str, label: list[str], counts: dict[int, int],
               bounds: tuple[int, ...]) -> HistogramMetricFamily:
    """A Prometheus histogram from exact value -> count pairs (cumulative buckets, the sum of the values)."""
    h = HistogramMetricFamily(name, doc, labels=["model_name"])
    buckets = [(str(float(le)), sum(n for k, n in counts.items() if k <= le)) for le in bounds]
    buckets.append(("+Inf", sum(counts.values())))
    h.add_metric(label, buckets, float(sum(k * n for k, n in counts.items())))
    return h


def _single(family: type, name: str, doc: str, model: str, value: float) -> Metric:
    """A gauge or counter family of one sample, labelled by the model name."""
    fam = family(name, doc, labels=["model_name"])
    fam.add_metric([model], float(value))
    return fam


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    out, mantissa, exp = [], (1, 2, 5), 0
    while True:
        for m in mantissa:
            v = m * 10 ** exp
            if v > max_value:
                return tuple(out)
            out.append(v)
        exp += 1


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
                  ("vllm:num_requests_swapped", "Requests preempted by swap (their KV in host memory).",
                   s.num_requests_swapped),
                  ("vllm:cpu_cache_usage_perc", "Swap-space usage (1 = full).", s.cpu_cache_usage_perc),
                  ("tandem:workers_alive", "Live decode/co-located/prefill workers.", s.workers_alive),
                  ("tandem:laps_pool_short_workers", "LAPS: prefill workers in the short pool.", s.laps_pool_short),
                  ("tandem:laps_pool_long_workers", "LAPS: prefill workers in the long pool.", s.laps_pool_long),
                  ("tandem:laps_short_waiting", "LAPS: short prefills waiting in AWD batchers.",
                   s.laps_short_waiting),
                  ("tandem:laps_long_waiting", "LAPS: long prefills queued.", s.laps_long_waiting),
                  ("tandem:laps_awd_window_seconds", "LAPS: AWD window W, mean over prefill workers.",
                   s.laps_window_s),
                  ("tandem:laps_awd_depth", "LAPS: AWD target depth D, mean over prefill workers.", s.laps_depth),
                  ("tandem:kv_cache_pool_bytes", "KV pool bytes, summed over the workers.", s.kv_cache_pool_bytes)]
        if s.activation_peak_bytes:
            gauges.append(("tandem:activation_budget_bytes", "Bytes the KV sizing set aside for activations: the "
                           "profiled peak of the running logit mode plus its guard band (largest worker).",
                           s.activation_budget_bytes))
        counters = [("vllm:prefix_cache_queries", "Prompt tokens looked up in the cache.", s.prefix_cache_queries),
                    ("vllm:prefix_cache_hits", "Prompt tokens found cached (history or prefix).", s.prefix_cache_hits),
                    ("tandem:local_prefills", "Prefills run on the session's decode worker.", s.local_prefills),
                    ("tandem:remote_prefills", "Prefills run on a prefill worker.", s.remote_prefills),
                    ("tandem:kv_transfer_timeouts", "KV transfers that fell back to local recompute.",
                     s.kv_transfer_timeouts),
                    ("tandem:lost_requests", "Requests failed because the worker they ran on no longer held them "
                     "(a message between them was lost).", s.lost_requests),
                    ("tandem:transport_rejected_frames", "Messages dropped as malformed or from an unknown peer "
                     "(coordinator and workers).", s.rejected_frames),
                    ("tandem:transport_rejected_handshakes", "Connections refused at the CURVE handshake "
                     "(coordinator and workers' KV inboxes).", s.rejected_handshakes),
                    ("tandem:laps_pool_moves", "LAPS: prefill workers moved between the pools.", s.laps_pool_moves),
                    ("tandem:laps_short_steps", "LAPS: short-prefill batch steps.", s.laps_short_steps),
                    ("tandem:laps_graph_steps", "LAPS: short-prefill steps run in a captured bucket (bucket hits).",
                     s.laps_graph_steps)]
        yield from (_single(GaugeMetricFamily, name, doc, self.model_name, v) for name, doc, v in gauges)
        yield from (_single(CounterMetricFamily, name, doc, self.model_name, v) for name, doc, v in counters)
        if s.activation_peak_bytes:
            g = GaugeMetricFamily("tandem:activation_peak_bytes", "Activation peak of the worst-case step measured at "
                                  "start, all logit rows at once (monolithic) or max_num_logits at a time "
                                  "(decomposed); largest worker.", labels=["model_name", "logits"])
            for mode, value in sorted(s.activation_peak_bytes.items()):
                g.add_metric([self.model_name, mode], float(value))
            yield g
        if s.kv_bytes:
            yield from _kv_path_metrics(s.kv_bytes, self.model_name)
        yield _histogram("vllm:iteration_tokens_total", "Tokens through the model per engine step.", label,
                         s.iteration_tokens, _ITERATION_BUCKETS)
        if s.dllm_commits or s.dllm_chunks:
            yield _histogram("tandem:dllm_tokens_committed_per_step", "Block diffusion: tokens a sequence committed "
                             "in one denoise step.", label, s.dllm_commits, _DLLM_BUCKETS)
            yield _histogram("tandem:dllm_chunk_size", "Block diffusion: the chunk size (window) chosen for a step "
                             "(the block length for plain block diffusion).", label, s.dllm_chunks, _DLLM_BUCKETS)
        if s.dllm_serve:
            yield from _dllm_serve_metrics(s.dllm_serve, self.model_name)
        if s.host_tier_capacity_bytes or s.host_tier:
            yield from _host_tier_metrics(s, self.model_name)
        if s.cache_config:
            info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache configuration.",
                                     labels=sorted(s.cache_config))
            info.add_metric([s.cache_config[k] for k in sorted(s.cache_config)], 1.0)
            yield info


def _host_tier_metrics(s: BackendStats, model: str) -> Iterator[Metric]:
    """The host KV tier (--kv-offloading-size): occupancy, prefix hits by the tier they came from (vLLM's KV-event
    media), bytes copied each way, how late returning rounds found their KV, failed copies."""
    c = s.host_tier
    for name, doc, value in (("tandem:host_kv_cache_usage_perc", "Host KV tier usage (1 = full).", s.host_tier_usage),
                             ("tandem:host_kv_cache_bytes", "Host KV tier bytes in use, summed over the workers.",
                              s.host_tier_bytes),
                             ("tandem:host_kv_cache_capacity_bytes", "Host KV tier capacity, summed over the workers.",
                              s.host_tier_capacity_bytes)):
        yield _single(GaugeMetricFamily, name, doc, model, value)
    hits = CounterMetricFamily("tandem:prefix_cache_hits_by_medium", "History and prefix tokens a round found "
                               "cached, by where they were: GPU (resident) or CPU (brought back from the host tier).",
                               labels=["model_name", "medium"])
    hits.add_metric([model, "GPU"], float(c.get("gpu_hit_tokens", 0)))
    hits.add_metric([model, "CPU"], float(c.get("cpu_hit_tokens", 0)))
    yield hits
    copied = CounterMetricFamily("tandem:host_kv_copied_bytes", "KV bytes copied between the GPU pool and the host "
                                 "tier: offload (idle sessions out), write (prefix blocks out), prefetch (back ahead "
                                 "of a round), load (back when a round asks).", labels=["model_name", "kind"])
    for kind in ("offload", "write", "prefetch", "load"):
        copied.add_metric([model, kind], float(c.get(f"{kind}_bytes", 0)))
    yield copied
    yield _single(CounterMetricFamily, "tandem:host_kv_failed_copies", "Host-tier copies that failed (their rounds "
                  "recomputed).", model, c.get("failed_copies", 0))
    late = SummaryMetricFamily("tandem:host_kv_prefetch_late_seconds", "Rounds that took their KV from the host "
                               "tier: how long each waited for it (0: prefetched in time).", labels=["model_name"])
    late.add_metric([model], float(c.get("late_rounds", 0)), c.get("late_us", 0) / 1e6)
    yield late


def _kv_path_metrics(kv: dict[str, int], model: str) -> Iterator[Metric]:
    """KV between workers by path: what each rank's endpoint sent and received rank to rank, and what went through
    each worker's driver (driver to driver, or gathered from / scattered to its ranks)."""
    ranks = CounterMetricFamily("tandem:kv_rank_bytes", "KV bytes a rank's endpoint sent or received rank to rank.",
                                labels=["model_name", "worker", "rank", "direction"])
    driver = CounterMetricFamily("tandem:kv_driver_path_bytes", "KV bytes through a worker's driver process (sent or "
                                 "received driver to driver, or gathered/scattered for its ranks).",
                                 labels=["model_name", "worker"])
    workers = sorted({key.partition("/")[0] for key in kv}, key=int)
    for worker in workers:                      # every worker that reported, 0 when nothing went through its driver
        driver.add_metric([model, worker], float(kv.get(f"{worker}/driver", 0)))
    for key, n in sorted(kv.items()):
        worker, _, path = key.partition("/")
        if path != "driver":
            direction, _, rank = path.partition("/")
            ranks.add_metric([model, worker, rank, direction], float(n))
    yield ranks
    yield driver


def _dllm_serve_metrics(c: dict[str, int], model: str) -> Iterator[Metric]:
    """dLLM-Serve's phase mix and admissions (policy.dllm_serve COUNTERS, summed over the workers): sequence-steps
    and query tokens by phase, steps (mix per step = sequence-steps / steps), admissions by what ran beside them,
    deferrals."""
    phases = ("full", "refresh", "reuse")
    for name, doc, key in (("tandem:dllm_phase_seq_steps", "dLLM-Serve: sequence-steps by phase (full: a delay "
                            "step, refresh: full-length and packing the sparse KV, reuse: the active block).",
                            "seq_steps_"),
                           ("tandem:dllm_phase_tokens", "dLLM-Serve: query tokens packed by phase.", "tokens_")):
        fam = CounterMetricFamily(name, doc, labels=["model_name", "phase"])
        for p in phases:
            fam.add_metric([model, p], float(c.get(key + p, 0)))
        yield fam
    steps = c.get("steps", 0)
    g = GaugeMetricFamily("tandem:dllm_phase_mix", "dLLM-Serve: mean sequences per step in each phase, since start.",
                          labels=["model_name", "phase"])
    for p in phases:
        g.add_metric([model, p], c.get("seq_steps_" + p, 0) / steps if steps else 0.0)
    yield g
    yield _single(CounterMetricFamily, "tandem:dllm_steps", "dLLM-Serve: steps run.", model, steps)
    fam = CounterMetricFamily("tandem:dllm_admissions", "dLLM-Serve: requests admitted into a step that ran earlier "
                              "requests (into=running: the Reuse headroom) or an idle one (into=idle).",
                              labels=["model_name", "into"])
    for into in ("running", "idle"):
        fam.add_metric([model, into], float(c.get("admitted_" + into, 0)))
    yield fam
    yield _single(CounterMetricFamily, "tandem:dllm_deferrals", "dLLM-Serve: sequence-steps a running request waited "
                  "(its phase did not fit the token budget).", model, c.get("deferrals", 0))


class ServerMetrics:
    """The app's metrics; `RequestTimer`s report per-request latencies and token counts into it."""

    def __init__(self, client: EngineClient, model_name: str, max_model_len: int | None = None) -> None:
        self.client = client
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, lab = self.registry, ["model_name"]
        for c in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):   # process_*, python_info, python_gc_*
            r.register(c)
        tok_buckets = build_1_2_5_buckets(max_model_len or getattr(client, "max_model_len", 0) or 1 << 20)
        # attribute, metric, help, histogram buckets (None: a counter); each labelled by model_name alone
        for attr, name, doc, buckets in (
                ("request_prompt_tokens", "vllm:request_prompt_tokens", "Prompt tokens per finished request.",
                 tok_buckets),
                ("request_generation_tokens", "vllm:request_generation_tokens",
                 "Generated tokens per finished request.", tok_buckets),
                ("request_prefill", "vllm:request_prefill_time_seconds",
                 "First scheduled to first token (arrival when not reported).", _LATENCY_BUCKETS),
                ("request_decode", "vllm:request_decode_time_seconds", "First token to last token.", _LATENCY_BUCKETS),
                ("request_inference", "vllm:request_inference_time_seconds",
                 "First scheduled (or arrival) to last token.", _LATENCY_BUCKETS),
                ("num_preemptions", "vllm:num_preemptions", "Preemptions of finished requests.", None),
                ("ttft", "vllm:time_to_first_token_seconds", "Time to first token, server-measured.",
                 _LATENCY_BUCKETS),
                ("itl", "vllm:inter_token_latency_seconds", "Time between tokens, server-measured.", _ITL_BUCKETS),
                ("e2e", "vllm:e2e_request_latency_seconds", "Request received to finished.", _LATENCY_BUCKETS),
                ("queue", "vllm:request_queue_time_seconds", "Arrival to first scheduled (backend clock); a request "
                 "never scheduled: arrival to finished.", _LATENCY_BUCKETS),
                ("tpot", "vllm:request_time_per_output_token_seconds", "Per finished request: first to last token "
                 "over the tokens after the first (0 for one token), server-measured.", _TPOT_BUCKETS),
                ("params_n", "vllm:request_params_n", "The n request parameter (choices per request).", _N_BUCKETS),
                ("kv_transfer", "tandem:kv_transfer_seconds", "KV transfer time between workers.", _LATENCY_BUCKETS),
                ("prompt_tokens", "vllm:prompt_tokens", "Prompt tokens processed.", None),
                ("generation_tokens", "vllm:generation_tokens", "Tokens generated.", None)):
            m = Counter(name, doc, lab, registry=r) if buckets is None else \
                Histogram(name, doc, lab, buckets=buckets, registry=r)
            m.labels(model_name)                  # export zero-valued series before the first request
            setattr(self, attr, m)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=r)
        self._backend = _BackendCollector(model_name)
        r.register(self._backend)
        self._lock = threading.Lock()

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
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        self.queued = False
        self.done = False

    def update(self, out: RequestOutput) -> None:
        """Observe TTFT/ITL for new tokens, token counters, queue time once the backend reports when the request was
        first scheduled, and E2E, TPOT and the finish reason when finished."""
        if self.done:
            return
        m, name, now = self.m, self.m.model_name, time.perf_counter()
        met = out.metrics
        if not self.queued and (met.first_scheduled_time is not None or out.finished):
            self.queued = True              # a request never scheduled waited from arrival until it finished
            end = met.first_scheduled_time if met.first_scheduled_time is not None else met.finished_time
            m.queue.labels(name).observe(max(0.0, (end if end is not None else met.arrival_time) - met.arrival_time))
        n = len(out.outputs[0].token_ids)
        new = n - self.tokens
        if new > 0:
            if self.last is None:
                m.ttft.labels(name).observe(now - self.received)
                m.prompt_tokens.labels(name).inc(len(out.prompt_token_ids))
                self.first = now
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
            m.request_prompt_tokens.labels(name).observe(len(out.prompt_token_ids))
            m.request_generation_tokens.labels(name).observe(n)
            tpot = 0.0                      # vLLM's rule: decode time over the tokens after the first, 0 for one
            if n > 1 and self.first is not None and self.last is not None:
                tpot = (self.last - self.first) / (n - 1)
            m.tpot.labels(name).observe(tpot)
            start = met.first_scheduled_time if met.first_scheduled_time is not None else met.arrival_time
            if met.first_token_time is not None:
                m.request_prefill.labels(name).observe(max(0.0, met.first_token_time - start))
                if met.last_token_time is not None:
                    m.request_decode.labels(name).observe(max(0.0, met.last_token_time - met.first_token_time))
                    m.request_inference.labels(name).observe(max(0.0, met.last_token_time - start))
            if met.num_preemptions:
                m.num_preemptions.labels(name).inc(met.num_preemptions)
