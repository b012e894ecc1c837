"""Replay multi-round sessions against an OpenAI-compatible server and measure what clients see.

`run_bench(sessions, cfg)` starts every session at its arrival time (one asyncio task per session, all
on one event loop, one shared `httpx.AsyncClient`). Round k of a session is one streamed request that
carries the header `x-session-id: <session_id>`; when its stream ends, the session sleeps the round's
(scaled) tool gap, appends the assistant's reply and the next round's new tokens, and sends round k+1.

Measurements are written into the same `SessionRecord`/`RoundRecord` objects the simulator fills
(times in seconds from the start of the benchmark), so `tandem.workload.metrics.summarize` computes
the session metrics (SLO attainment, initial/incremental TTFT, ...) of a measured run exactly as of a
simulated one. What `summarize` cannot see (every single inter-token gap, usage, vLLM's per-request
field names) is added by `bench_metrics`. See docs/bench.md for the protocol and every field.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tandem.bench.bench_options import BenchConfig
from tandem.bench.text import TextSynth
from tandem.workload.metrics import summarize
from tandem.workload.records import RoundRecord, SessionRecord
from tandem.workload.session import Round, Session

SESSION_HEADER = "x-session-id"
PREFILL_COUNTERS = ("tandem:local_prefills_total", "tandem:remote_prefills_total")
_REASON_CHARS = 300
# summarize() keys that only a simulator can know (queues, KV transfers, preemptions inside the server)
_SIM_ONLY = ("queue_mean_s", "queue_p95_s", "kv_transfer_mean_s", "kv_transfer_remote_mean_s",
             "preemptions", "recomputed_tokens")


class BenchError(Exception):
    """The benchmark cannot start (server unreachable, no model to name); the message is one line."""


@dataclass
class RoundMeasurement:
    """Everything measured about one request (one round), beyond what a RoundRecord keeps."""

    session_id: str
    index: int
    sent_s: float                             # request sent, seconds from the benchmark start
    new_input_tokens: int                     # the workload's new tokens for this round (after scaling)
    max_tokens: int
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)   # every gap between token chunks
    e2e_s: float | None = None
    token_chunks: int = 0
    prompt_tokens: int | None = None          # usage.prompt_tokens (the whole prompt, history included)
    prompt_tokens_sent: int | None = None     # prompt length as the client built it (exact with token ids)
    completion_tokens: int | None = None      # usage.completion_tokens, else the token chunks seen
    cached_tokens: int | None = None          # usage.prompt_tokens_details.cached_tokens
    finish_reason: str | None = None
    history_source: str = ""                  # completions mode, how the reply joined the history
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.e2e_s is not None

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.token_chunks


@dataclass
class BenchResult:
    """Records (as the simulator's), per-request measurements, and the server's counters."""

    records: list[SessionRecord]
    rounds: list[RoundMeasurement]
    duration_s: float
    model: str
    config: BenchConfig
    server_before: dict | None = None         # prefill counters scraped from /metrics before the run
    server_after: dict | None = None
    text_mode: str = "words"
    inexact_texts: int = 0

    def metrics(self) -> dict:
        return bench_metrics(self)


# --------------------------------------------------------------------------- workload transformation


def scale_session(s: Session, scale: float, cap: int | None) -> Session:
    """Tokens x scale rounded (floor 1; an empty incremental input stays 0), tool gaps x scale, outputs capped."""
    def tokens(n: int) -> int:
        return 0 if n == 0 else max(1, round(n * scale))

    rounds = []
    for r in s.rounds:
        out = tokens(r.output_tokens)
        if cap is not None:
            out = min(out, cap)
        rounds.append(Round(tokens(r.input_tokens), out, r.tool_s * scale, r.hash_ids))
    return dataclasses.replace(s, rounds=rounds)


# --------------------------------------------------------------------------- helpers


def base_url(url: str) -> str:
    """The server root: no trailing slash, no trailing /v1."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if "://" not in url:
        url = "http://" + url
    return url


def _one_line(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= _REASON_CHARS else text[: _REASON_CHARS - 3] + "..."


def _error_message(payload: object) -> str:
    """The message of an OpenAI/vLLM/FastAPI error body."""
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        for key in ("message", "detail"):
            if payload.get(key):
                return payload[key] if isinstance(payload[key], str) else json.dumps(payload[key])
    return json.dumps(payload) if not isinstance(payload, str) else payload


def parse_prometheus(text: str, names: Sequence[str] = PREFILL_COUNTERS) -> dict[str, float | None]:
    """Sum of every sample (all label sets) of each metric name in a Prometheus text page; None if absent."""
    out: dict[str, float | None] = dict.fromkeys(names)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        for n in names:
            if line.startswith(n) and line[len(n): len(n) + 1] in ("{", " "):
                try:
                    v = float(line.rsplit("}", 1)[-1].split()[0])
                except (ValueError, IndexError):
                    continue
                out[n] = (out[n] or 0.0) + v
    return out


def parse_kv_paths(text: str) -> tuple[dict[tuple[int, str, int], float], dict[int, float]]:
    """KV bytes by path from a /metrics page: (tandem:kv_rank_bytes_total by (worker, direction, rank),
    tandem:kv_driver_path_bytes_total by worker)."""
    ranks: dict[tuple[int, str, int], float] = {}
    driver: dict[int, float] = {}
    for line in text.splitlines():
        for name in ("tandem:kv_rank_bytes_total{", "tandem:kv_driver_path_bytes_total{"):
            if not line.startswith(name) or "}" not in line:
                continue
            labels = {k: v.strip('"') for k, _, v in (kv.partition("=") for kv in
                                                       line[len(name):line.index("}")].split(","))}
            try:
                value = float(line.rsplit(" ", 1)[1])
                if name.startswith("tandem:kv_rank"):
                    ranks[(int(labels["worker"]), labels["direction"], int(labels["rank"]))] = value
                else:
                    driver[int(labels["worker"])] = value
            except (KeyError, ValueError, IndexError):
                continue
    return ranks, driver


async def _scrape(client, root: str) -> dict | None:
    try:
        r = await client.get(root + "/metrics")
    except Exception:
        return None
    if r.status_code != 200:
        return None
    return parse_prometheus(r.text)


async def _preflight(client, root: str, model: str | None) -> str:
    """Check the server answers; find the model name when none is given."""
    import httpx

    try:
        r = await client.get(root + "/v1/models")
    except httpx.ConnectError as e:
        raise BenchError(f"cannot connect to {root}: {_one_line(str(e)) or 'connection refused'}") from None
    except httpx.TimeoutException:
        raise BenchError(f"cannot connect to {root}: timed out") from None
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach {root}: {_one_line(str(e)) or type(e).__name__}") from None
    if model:
        return model
    if r.status_code != 200:
        raise BenchError(f"GET {root}/v1/models answered {r.status_code}; give the model name with --model")
    try:
        data = r.json()["data"]
        return str(data[0]["id"])
    except Exception:
        raise BenchError(f"GET {root}/v1/models lists no model; give the model name with --model") from None


# --------------------------------------------------------------------------- one session


class _Conversation:
    """The growing prompt of one session: chat messages, token ids, or text."""

    def __init__(self, cfg: BenchConfig, synth: TextSynth, session_id: str) -> None:
        self.cfg, self.synth, self.sid = cfg, synth, session_id
        self.messages: list[dict] = []
        self.ids: list[int] = []
        self.text = ""
        self.id_mode = cfg.endpoint == "completions" and cfg.tokenizer is not None

    def add_round(self, k: int, n: int, reply_text: str, reply_ids: list[int] | None) -> str:
        """Append the previous reply (k>0) and round k's n new tokens; returns how the reply was appended."""
        source = ""
        if self.cfg.endpoint == "chat":
            if k == 0:
                text = self.synth.text(n, self.sid, 0)
                # exact texts keep their leading space: stripping it could change their token count
                self.messages.append({"role": "user", "content": text if self.cfg.tokenizer is not None else text.lstrip()})
            else:
                self.messages.append({"role": "assistant", "content": reply_text})
                content = self.synth.text(n, self.sid, k)
                if self.cfg.tool_role == "tool":
                    self.messages.append({"role": "tool", "tool_call_id": f"call-{self.sid}-{k}", "content": content})
                else:
                    self.messages.append({"role": "user", "content": content})
        elif self.id_mode:
            if k > 0:
                if reply_ids is not None:
                    self.ids += reply_ids
                    source = "server"
                else:
                    self.ids += self.cfg.tokenizer.encode(reply_text, add_special_tokens=False)
                    source = "reencoded"
            self.ids += self.synth.ids(n, self.sid, k)
        else:
            new = self.synth.text(n, self.sid, k)
            self.text = new.lstrip() if k == 0 else self.text + reply_text + new
            source = "text" if k > 0 else ""
        return source

    def body(self, model: str, max_tokens: int) -> dict:
        b: dict = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                   "stream_options": {"include_usage": True}, "ignore_eos": True}
        if self.cfg.endpoint == "chat":
            b["messages"] = self.messages
        elif self.id_mode:
            b["prompt"] = self.ids
            if self.cfg.return_token_ids:
                b["return_token_ids"] = True
        else:
            b["prompt"] = self.text
        if self.cfg.extra_body:
            b.update(self.cfg.extra_body)
        return b

    def prompt_len(self) -> int | None:
        """The prompt's length as sent: exact for token ids, None otherwise (the server's usage says)."""
        return len(self.ids) if self.id_mode else None


class _Run:
    """Shared state of one benchmark run."""

    def __init__(self, client, cfg: BenchConfig, root: str, model: str, synth: TextSynth) -> None:
        self.client, self.cfg, self.root, self.model, self.synth = client, cfg, root, model, synth
        self.t0 = time.perf_counter()
        self.rounds: list[RoundMeasurement] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def headers(self, sid: str, k: int) -> dict:
        return {SESSION_HEADER: sid, "x-request-id": f"{sid}-r{k}"}

    async def session(self, s: Session) -> SessionRecord:
        rec = SessionRecord(s.session_id, s.arrival_s, s.slo, len(s.rounds))
        delay = s.arrival_s - self.now()
        if delay > 0:
            await asyncio.sleep(delay)
        conv = _Conversation(self.cfg, self.synth, s.session_id)
        reply_text, reply_ids = "", None
        try:
            for k, rnd in enumerate(s.rounds):
                if k > 0 and s.rounds[k - 1].tool_s > 0:
                    await asyncio.sleep(s.rounds[k - 1].tool_s)
                source = conv.add_round(k, rnd.input_tokens, reply_text, reply_ids)
                body = conv.body(self.model, rnd.output_tokens)
                m = RoundMeasurement(s.session_id, k, 0.0, rnd.input_tokens, rnd.output_tokens,
                                     prompt_tokens_sent=conv.prompt_len(), history_source=source)
                rr = RoundRecord(index=k, arrival_s=0.0, input_tokens=rnd.input_tokens)
                rec.rounds.append(rr)
                self.rounds.append(m)
                reply_text, reply_ids = await self.request(s.session_id, k, body, m, rr)
                if m.error:
                    rec.failed, rec.fail_reason = True, m.error
                    break
            else:
                rec.finish_s = self.now()
        except asyncio.CancelledError:
            if not rec.failed:
                rec.failed, rec.fail_reason = True, "cancelled: the benchmark was stopped"
            raise
        finally:
            if self.cfg.on_session_done is not None:
                self.cfg.on_session_done(rec)
        return rec

    async def request(self, sid: str, k: int, body: dict, m: RoundMeasurement, rr: RoundRecord):
        """Send one streamed request, fill `m` and `rr`; returns the reply's text and ids (None if not given)."""
        import httpx

        path = "/v1/chat/completions" if self.cfg.endpoint == "chat" else "/v1/completions"
        chat = self.cfg.endpoint == "chat"
        text_parts: list[str] = []
        ids: list[int] | None = None
        last = None
        done = False
        event = ""
        m.sent_s = rr.arrival_s = self.now()
        try:
            async with self.client.stream("POST", self.root + path, json=body, headers=self.headers(sid, k)) as resp:
                if resp.status_code >= 400:
                    raw = (await resp.aread()).decode("utf-8", "replace")
                    try:
                        msg = _error_message(json.loads(raw))
                    except ValueError:
                        msg = raw or resp.reason_phrase
                    m.error = _one_line(f"http {resp.status_code}: {msg}")
                    return "", None
                async for line in resp.aiter_lines():
                    t = self.now()
                    if not line:
                        event = ""
                        continue
                    if line.startswith("event:"):
                        event = line[6:].strip()
                        continue
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        m.error = _one_line(f"protocol error: a stream event is not JSON: {data[:80]}")
                        return "", None
                    if event == "error" or not isinstance(chunk, dict) or "error" in chunk \
                            or chunk.get("object") == "error":
                        m.error = _one_line(f"stream error: {_error_message(chunk)}")
                        return "", None
                    usage = chunk.get("usage")
                    if usage:
                        m.prompt_tokens = usage.get("prompt_tokens", m.prompt_tokens)
                        m.completion_tokens = usage.get("completion_tokens", m.completion_tokens)
                        details = usage.get("prompt_tokens_details") or {}
                        if details.get("cached_tokens") is not None:
                            m.cached_tokens = details["cached_tokens"]
                    for choice in chunk.get("choices") or ():
                        if choice.get("index", 0) != 0:
                            continue
                        if chat:
                            delta = choice.get("delta") or {}
                            piece = delta.get("content")
                            thought = delta.get("reasoning_content") or delta.get("reasoning")
                        else:
                            piece, thought = choice.get("text"), None
                        got_ids = choice.get("token_ids")
                        if got_ids:
                            ids = (ids or []) + list(got_ids)
                        if piece or thought or got_ids:
                            text_parts.append(piece or "")
                            if last is None:
                                rr.first_token_s = t
                                m.ttft_s = t - m.sent_s
                            else:
                                gap = t - last
                                m.itls_s.append(gap)
                                rr.itl_sum_s += gap
                                rr.itl_count += 1
                                rr.itl_max_s = max(rr.itl_max_s, gap)
                            last = t
                            m.token_chunks += 1
                        if choice.get("finish_reason"):
                            m.finish_reason = choice["finish_reason"]
        except httpx.TimeoutException as e:
            m.error = _one_line(f"timeout: no data for {self.cfg.timeout_s:g} s ({type(e).__name__})")
            return "", None
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
            m.error = _one_line(f"connection error: {str(e) or type(e).__name__}")
            return "", None
        except httpx.HTTPError as e:
            m.error = _one_line(f"http error: {str(e) or type(e).__name__}")
            return "", None
        except (AttributeError, TypeError, KeyError) as e:   # a chunk of an unexpected shape
            m.error = _one_line(f"protocol error: unexpected stream chunk ({type(e).__name__}: {e})")
            return "", None
        end = self.now()
        if m.finish_reason in ("abort", "error"):
            m.error = f"aborted: the server ended the round with finish_reason {m.finish_reason!r}"
        elif not done and m.finish_reason is None:
            m.error = f"incomplete stream: ended without [DONE] or a finish_reason after {m.token_chunks} token chunks"
        elif m.token_chunks == 0:
            m.error = "empty stream: no token in the response"
        if m.error:
            return "", None
        m.e2e_s = end - m.sent_s
        rr.finish_s = end
        rr.output_tokens = m.output_tokens
        rr.history_tokens = m.cached_tokens or 0
        if m.prompt_tokens is None and m.prompt_tokens_sent is not None:
            m.prompt_tokens = m.prompt_tokens_sent
        return "".join(text_parts), ids


# --------------------------------------------------------------------------- the run


async def run_bench(sessions: Sequence[Session], cfg: BenchConfig) -> BenchResult:
    """Replay `sessions` (after scaling) against cfg.url; raises BenchError if the server cannot be reached."""
    import httpx

    root = base_url(cfg.url)
    sessions = [scale_session(s, cfg.scale, cfg.max_tokens_cap) for s in sessions]
    synth = TextSynth(cfg.tokenizer, cfg.seed)
    timeout = httpx.Timeout(cfg.timeout_s)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers, trust_env=False) as client:
        model = await _preflight(client, root, cfg.model)
        before = await _scrape(client, root) if cfg.scrape_metrics else None
        run = _Run(client, cfg, root, model, synth)
        tasks = [asyncio.create_task(run.session(s)) for s in sessions]
        try:
            records = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        duration = run.now()
        after = await _scrape(client, root) if cfg.scrape_metrics else None
    return BenchResult(list(records), run.rounds, duration, model, cfg, before, after, synth.mode, synth.inexact)


# --------------------------------------------------------------------------- metrics


def _ms_block(name: str, xs: list[float]) -> dict:
    """vLLM's mean/median/std/p95/p99 `<stat>_<name>_ms` fields of seconds `xs` (None when empty)."""
    if not xs:
        return {f"{k}_{name}_ms": None for k in ("mean", "median", "std", "p95", "p99")}
    a = np.asarray(xs) * 1000.0
    return {f"mean_{name}_ms": float(a.mean()), f"median_{name}_ms": float(np.median(a)),
            f"std_{name}_ms": float(a.std()), f"p95_{name}_ms": float(np.percentile(a, 95)),
            f"p99_{name}_ms": float(np.percentile(a, 99))}


def _delta(before: dict | None, after: dict | None, name: str) -> int | None:
    if not before or not after or before.get(name) is None or after.get(name) is None:
        return None
    return int(round(after[name] - before[name]))


def bench_metrics(res: BenchResult) -> dict:
    """One flat JSON-ready dict: vLLM `bench serve` fields, then tandem's session metrics (docs/bench.md)."""
    ok = [m for m in res.rounds if m.ok]
    dur = res.duration_s
    total_in = sum(m.prompt_tokens or 0 for m in ok)
    total_out = sum(m.output_tokens for m in ok)
    cached = [m.cached_tokens for m in ok if m.cached_tokens is not None]
    arrivals = {r.session_id: r.arrival_s for r in res.records}
    tpot = [(m.e2e_s - m.ttft_s) / (m.output_tokens - 1) for m in ok if m.output_tokens > 1]
    out: dict = {
        "completed": len(ok),
        "failed": sum(1 for m in res.rounds if m.error),
        "rounds_not_run": sum(s.num_rounds - len(s.rounds) for s in res.records),
        "duration": dur,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_new_input_tokens": sum(m.new_input_tokens for m in ok),
        "total_cached_tokens": sum(cached) if cached else None,
        "cached_token_fraction": (sum(cached) / total_in) if cached and total_in else None,
        "request_throughput": len(ok) / dur if dur > 0 else None,
        "output_throughput": total_out / dur if dur > 0 else None,
        "total_token_throughput": (total_in + total_out) / dur if dur > 0 else None,
        "rounds_short_output": sum(1 for m in ok if m.output_tokens < m.max_tokens),
        # how late the client sent sessions' first requests after their arrival times (an overloaded client)
        "client_start_lag_max_s": max((m.sent_s - arrivals[m.session_id] for m in res.rounds if m.index == 0),
                                      default=None),
    }
    out.update(_ms_block("ttft", [m.ttft_s for m in ok]))
    out.update(_ms_block("tpot", tpot))
    out.update(_ms_block("itl", [g for m in ok for g in m.itls_s]))
    out.update(_ms_block("e2el", [m.e2e_s for m in ok]))
    summary = summarize(res.records, dur)
    for key in _SIM_ONLY:
        summary.pop(key, None)
    out.update(summary)
    local = _delta(res.server_before, res.server_after, PREFILL_COUNTERS[0])
    remote = _delta(res.server_before, res.server_after, PREFILL_COUNTERS[1])
    sources = Counter(m.history_source for m in res.rounds if m.history_source)
    out.update(local_prefills=local, remote_prefills=remote,
               local_prefill_fraction=(local / (local + remote) if local is not None and remote is not None
                                       and local + remote > 0 else None),
               history_sources=dict(sorted(sources.items())), text_mode=res.text_mode,
               inexact_texts=res.inexact_texts,
               failures=[{"session_id": m.session_id, "round": m.index, "reason": m.error}
                         for m in res.rounds if m.error],
               model=res.model, url=base_url(res.config.url), endpoint=res.config.endpoint, scale=res.config.scale,
               max_tokens_cap=res.config.max_tokens_cap)
    return out
