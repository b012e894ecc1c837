"""engine_vs_vllm.py's online client: the open-loop Poisson load (the same arrivals and prompts for both systems),
streamed /v1/completions requests timed token by token, and the per-run and per-cell serving metrics (vLLM's
names: TTFT, TPOT, ITL, E2E)."""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import time

SERVED_NAME = "tiny-qwen3-30m"
ONLINE = {"prompt_len": 256, "output_len": 64, "warmup": 2}


def online_load(rate: float, n: int, seed: int = 1) -> tuple[list[float], list[list[int]], list[list[int]]]:
    """Arrival times, prompts and warm-up prompts: the same for every system."""
    rng = random.Random(seed)
    t, arrivals = 0.0, []
    for _ in range(n):
        arrivals.append(t)
        t += rng.expovariate(rate)
    prompts = [[rng.randrange(3, 440) for _ in range(ONLINE["prompt_len"])] for _ in range(n)]
    warm = [[rng.randrange(3, 440) for _ in range(ONLINE["prompt_len"])] for _ in range(ONLINE["warmup"])]
    return arrivals, prompts, warm


async def _one(client, url: str, prompt: list[int], max_tokens: int, t0: float, at: float) -> dict:
    delay = at - (time.perf_counter() - t0)
    if delay > 0:
        await asyncio.sleep(delay)
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    times, tokens, err = [], None, ""
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                err = f"http {resp.status_code}: {(await resp.aread())[:200]!r}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if chunk.get("choices"):
                        times.append(time.perf_counter())
                    if chunk.get("usage"):
                        tokens = chunk["usage"].get("completion_tokens")
    except Exception as e:      # noqa: BLE001 - any failure of one request is recorded, the run goes on
        err = f"{type(e).__name__}: {e}"[:200]
    end = time.perf_counter()
    if not err and not times:
        err = "no token"
    return {"sent": sent - t0, "lag": sent - t0 - at, "end": end - t0, "ttft": times[0] - sent if times else None,
            "itls": [b - a for a, b in zip(times, times[1:])], "e2e": end - sent,
            "tokens": tokens if tokens is not None else len(times), "chunks": len(times), "error": err}


async def drive(url: str, arrivals, prompts, warm) -> dict:
    import httpx
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits, trust_env=False) as client:
        for p in warm:                                    # not measured: first requests pay one-time costs
            await _one(client, url, p, ONLINE["output_len"], time.perf_counter(), 0.0)
        t0 = time.perf_counter()
        res = await asyncio.gather(*[_one(client, url, p, ONLINE["output_len"], t0, a) for a, p in zip(arrivals, prompts)])
    return online_metrics(res)


def _pct(xs: list[float], q: float) -> float | None:
    import numpy as np
    return float(np.percentile(xs, q)) * 1e3 if xs else None


def online_metrics(res: list[dict]) -> dict:
    ok = [r for r in res if not r["error"]]
    dur = max((r["end"] for r in ok), default=0.0)      # from the first scheduled arrival (t = 0) to the last finish
    tpot = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    itl = [g for r in ok for g in r["itls"]]
    ttft = [r["ttft"] for r in ok]
    out = {"completed": len(ok), "failed": len(res) - len(ok), "duration_s": dur,
           "request_throughput": len(ok) / dur if dur else None,
           "output_throughput": sum(r["tokens"] for r in ok) / dur if dur else None,
           "short_outputs": sum(1 for r in ok if r["tokens"] < ONLINE["output_len"]),
           "itl_under_1ms_share": sum(g < 1e-3 for g in itl) / len(itl) if itl else None,   # tokens in bursts
           "chunks_per_token": sum(r["chunks"] for r in ok) / max(1, sum(r["tokens"] for r in ok)),
           "client_lag_max_s": max((r["lag"] for r in res), default=None),
           "max_itl_ms": max(itl) * 1e3 if itl else None,
           "errors": sorted({r["error"] for r in res if r["error"]})[:3],
           "failed_sent_s": [round(r["sent"], 2) for r in res if r["error"]][:20]}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", [r["e2e"] for r in ok])):
        out[f"p50_{name}_ms"], out[f"p99_{name}_ms"] = _pct(xs, 50), _pct(xs, 99)
        out[f"mean_{name}_ms"] = statistics.fmean(xs) * 1e3 if xs else None
    return out


ONLINE_KEYS = ("request_throughput", "output_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms",
               "p50_itl_ms", "p99_itl_ms", "mean_ttft_ms", "mean_itl_ms", "startup_s", "peak_rss_bytes",
               "peak_pss_bytes", "duration_s", "max_itl_ms", "client_lag_max_s")


def online_cell(runs: list[dict], n: int) -> dict:
    """One system's runs at one rate: every figure's median (min and max beside it), failures summed."""
    out: dict = {"runs": runs, "requests": n, "failed": sum(r["failed"] for r in runs),
                 "requests_total": n * len(runs), "errors": sorted({e for r in runs for e in r["errors"]})[:3]}
    for k in ONLINE_KEYS:
        xs = [r[k] for r in runs if r.get(k) is not None]
        if xs:
            out[k] = statistics.median(xs)
            out[k + "_range"] = [min(xs), max(xs)]
    return out
