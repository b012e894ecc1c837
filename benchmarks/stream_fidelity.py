"""Streaming fidelity: a client that counts streamed chunks measures the same TTFT and ITL
as the server's own metrics.

    python benchmarks/stream_fidelity.py [--rate 2] [--requests 60] [--out docs/results/stream_fidelity]

Starts `tandem serve --colocated 1 --threads 1` on a random 30m Qwen3 (127.0.0.1, a free port), sends --requests
open-loop Poisson requests at --rate (256 random prompt token ids, 64 output tokens, ignore_eos, streamed
/v1/completions with stream_options.include_usage), and compares, over exactly those requests (the metrics are
scraped before and after), the client's figures with the server's histograms:
- TTFT: the client's time from sending the request to the first chunk that carries a token, against
  vllm:time_to_first_token_seconds (received to first token, server clock);
- ITL: the client's gaps between consecutive token-carrying chunks divided by the tokens the later chunk brought,
  against vllm:inter_token_latency_seconds (the same, server side);
- tokens: chunks counted and tokens in them against vllm:generation_tokens_total and each response's usage.
Means are exact on both sides (histogram sum / count). Pass: both means within 10% and every token seen.
Writes results.json and table.md under --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from tandem.bench.ports import free_port

METRICS = ("vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
           "vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count",
           "vllm:generation_tokens_total")


def _scrape(url: str) -> dict[str, float]:
    from tandem.bench.serve_client import parse_prometheus
    got = parse_prometheus(httpx.get(url + "/metrics", timeout=10).text, METRICS)
    return {k: float(v or 0.0) for k, v in got.items()}


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], out_len: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps: list[tuple[float, int]] = []            # (arrival, tokens the chunk brought)
    usage = None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now, chunk = time.perf_counter(), json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices"):
                stamps.append((now, 1))              # one engine output per chunk; text may be empty
    return {"t0": t0, "stamps": stamps, "usage": usage}


async def _load(url: str, model: str, rate: float, n: int, out_len: int, seed: int, vocab: int) -> list[dict]:
    rnd = random.Random(seed)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=n + 4)) as client:
        for _ in range(2):                            # warm-up, not counted (scraped after)
            await _one(client, url, model, [rnd.randrange(3, vocab - 8) for _ in range(16)], 4)
        return await _timed(client, url, model, rate, n, out_len, rnd, vocab)


async def _timed(client, url, model, rate, n, out_len, rnd, vocab) -> list[dict]:
    before = _scrape(url)
    tasks, t = [], time.perf_counter()
    for _ in range(n):
        prompt = [rnd.randrange(3, vocab - 8) for _ in range(256)]
        tasks.append(asyncio.create_task(_one(client, url, model, prompt, out_len)))
        t += rnd.expovariate(rate)
        await asyncio.sleep(max(0.0, t - time.perf_counter()))
    res = await asyncio.gather(*tasks)
    await asyncio.sleep(0.2)
    after = _scrape(url)
    return [{"before": before, "after": after}, *res]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=2.0, help="requests per second (default: 2)")
    p.add_argument("--requests", type=int, default=60, help="timed requests (default: 60)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/results/stream_fidelity")
    a = p.parse_args(argv)
    if not a.rate > 0 or a.requests < 2 or a.output_len < 2:
        print("stream_fidelity: --rate must be > 0, --requests and --output-len >= 2", file=sys.stderr)
        return 2
    from tandem.engine.tiny_model import make_tiny_model
    return _run(a, make_tiny_model)


def _run(a, make_tiny_model) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "m30", "qwen3", "30m", seed=0)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen([sys.executable, "-m", "tandem.cli", "serve", "--model", str(model), "--colocated",
                                   "1", "--prefill-workers", "0", "--decode-workers", "0", "--policy", "vllm",
                                   "--threads", "1", "--host", "127.0.0.1", "--port", str(port)],
                                  stdout=subprocess.DEVNULL, stderr=open(out / "server.log", "w"),
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            deadline = time.monotonic() + 120
            while True:
                if server.poll() is not None:
                    print(f"stream_fidelity: the server exited ({server.returncode}); see {out / 'server.log'}",
                          file=sys.stderr)
                    return 1
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    print("stream_fidelity: the server did not become healthy in 120 s", file=sys.stderr)
                    return 1
                time.sleep(0.2)
            vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
            scraped, *res = asyncio.run(_load(url, "m30", a.rate, a.requests, a.output_len, a.seed, vocab))
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
    return _report(a, out, scraped, res)


def _report(a, out: Path, scraped: dict, res: list[dict]) -> int:
    errors = [r["error"] for r in res if "error" in r]
    ok = [r for r in res if "error" not in r]
    ttft = [r["stamps"][0][0] - r["t0"] for r in ok if r["stamps"]]
    itl = [b[0] - a_[0] for r in ok for a_, b in zip(r["stamps"], r["stamps"][1:])]
    chunks = sum(len(r["stamps"]) for r in ok)
    usage_tokens = sum((r["usage"] or {}).get("completion_tokens", 0) for r in ok)
    d = {k: scraped["after"][k] - scraped["before"][k] for k in METRICS}
    server_ttft = d["vllm:time_to_first_token_seconds_sum"] / max(1.0, d["vllm:time_to_first_token_seconds_count"])
    server_itl = d["vllm:inter_token_latency_seconds_sum"] / max(1.0, d["vllm:inter_token_latency_seconds_count"])
    client_ttft, client_itl = statistics.fmean(ttft), statistics.fmean(itl)
    rows = {
        "requests": len(res), "errors": errors, "rate": a.rate, "output_len": a.output_len,
        "client": {"ttft_mean_s": client_ttft, "ttft_p50_s": statistics.median(ttft), "itl_mean_s": client_itl,
                   "itl_p50_s": statistics.median(itl), "chunks": chunks, "usage_completion_tokens": usage_tokens,
                   "ttft_n": len(ttft), "itl_n": len(itl)},
        "server": {"ttft_mean_s": server_ttft, "itl_mean_s": server_itl,
                   "ttft_count": d["vllm:time_to_first_token_seconds_count"],
                   "itl_count": d["vllm:inter_token_latency_seconds_count"],
                   "generation_tokens": d["vllm:generation_tokens_total"]},
        "ttft_ratio": client_ttft / server_ttft if server_ttft else None,
        "itl_ratio": client_itl / server_itl if server_itl else None,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    rows["pass"] = (not errors and rows["ttft_ratio"] is not None and abs(rows["ttft_ratio"] - 1) <= 0.10
                    and rows["itl_ratio"] is not None and abs(rows["itl_ratio"] - 1) <= 0.10
                    and chunks == usage_tokens == a.requests * a.output_len == d["vllm:generation_tokens_total"])
    c, s = rows["client"], rows["server"]
    table = "\n".join([
        "| figure | client (chunks counted) | server (/metrics) | client / server |", "|---|---|---|---|",
        f"| mean TTFT | {1e3 * c['ttft_mean_s']:.1f} ms ({c['ttft_n']} requests) | {1e3 * s['ttft_mean_s']:.1f} ms "
        f"({s['ttft_count']:.0f}) | {rows['ttft_ratio']:.3f} |",
        f"| mean ITL | {1e3 * c['itl_mean_s']:.2f} ms ({c['itl_n']} gaps) | {1e3 * s['itl_mean_s']:.2f} ms "
        f"({s['itl_count']:.0f}) | {rows['itl_ratio']:.3f} |",
        f"| tokens | {c['chunks']} chunks, usage {c['usage_completion_tokens']} | "
        f"{s['generation_tokens']:.0f} | |",
    ])
    print(table)
    print("PASS" if rows["pass"] else f"FAIL{': ' + '; '.join(errors[:3]) if errors else ''}")
    (out / "table.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    return 0 if rows["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
