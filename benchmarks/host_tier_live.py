"""The host KV tier live: 1P+1D worker processes serving sessions whose KV is offloaded during their tool calls.

    python benchmarks/host_tier_live.py [--out docs/results/host_tier_live]

A random ~30M-parameter Qwen3 (made here; one torch thread per worker) on a decode worker whose GPU-role KV pool
holds 1024 tokens. Three sessions of 300-token prompts each run a round, then go idle on a tool call they announce
(`tool_s`); a 900-token request then needs the decode worker's pool and evicts their idle KV; then each session's
next round comes (20 new tokens, 8 output tokens). Two announcements:

- `load`: tool_s 30 s, the next round right after the eviction: the tier offloads each idle context (its GPU copy
  stays, evictable) and loads it back when the round asks (the core's cost model: a copy against a recompute);
- `prefetch`: tool_s 3 s, each next round 3 s after its first ended: the tool-aware rule offloads each context and
  prefetches it 1 s (plus its copy time) before the expected return, into blocks the finished request left free.

Each runs under `ampd-tiered --kv-offloading-size 0.25` and under `ampd` (no host tier: the evicted history is
recomputed). Reported: the host link the worker measured at start (an offline engine's probe of the same pool), the
second rounds' cached tokens and client-side latency (max, mean), and /metrics' host-tier counters (bytes copied
each way, hits by medium, prefetch lateness, failed copies). Writes results.json and table.md.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import tempfile
import time
from pathlib import Path

import httpx

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.tiny_model import make_tiny_model
from tandem.runtime.cluster import ClusterConfig, ServingCluster
from tandem.server.app import build_app

ENGINE = dict(num_kv_blocks=64, max_model_len=1024)
SESSIONS = 3
PROMPT, NEW, OUT, FILLER = 300, 20, 8, 900
TIER_GIB = 0.25


def _prompt(i: int, n: int, base: int = 10) -> list[int]:
    return [base + (i * 97 + k * 7) % 400 for k in range(n)]


def _metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("tandem:host_kv") or line.startswith("tandem:prefix_cache_hits_by_medium"):
            name, value = line.rsplit(" ", 1)
            base, _, labels = name.partition("{")
            kept = [lab for lab in labels.rstrip("}").split(",") if lab and not lab.startswith("model_name=")]
            out[base + ("{" + ",".join(kept).replace('"', "") + "}" if kept else "")] = float(value)
    return out


def first_outputs(model: str) -> list[list[int]]:
    """Each session's first-round output (greedy, as the server gives it), for its next round's prompt."""
    from tandem.engine.sampling_params import SamplingParams
    eng = LLMEngine(EngineConfig(model=model, **ENGINE))
    greedy = SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True)
    done = {}
    for i in range(SESSIONS):                       # one at a time, as the benchmark sends them
        eng.add_request(str(i), _prompt(i, PROMPT), greedy)
        while str(i) not in done:
            done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
    eng.close()
    return [done[str(i)] for i in range(SESSIONS)]


async def _scenario(cl, tool_s: float, wait: bool, tiered: bool, first: list[list[int]]) -> dict:
    app = build_app(cl)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://b", timeout=120) as http:
        async def complete(prompt, **extra):
            t0 = time.perf_counter()
            r = await http.post("/v1/completions", json={"model": cl.model_name, "prompt": prompt, "max_tokens": OUT,
                                                         "ignore_eos": True, "temperature": 0, **extra})
            if r.status_code != 200:
                raise SystemExit(f"host_tier_live: {r.status_code} {r.text}")
            body = r.json()
            return body, time.perf_counter() - t0

        ends = []
        for i in range(SESSIONS):
            await complete(_prompt(i, PROMPT), session_id=f"s{i}", tool_s=tool_s)
            ends.append(time.perf_counter())
        if tiered:                                     # the idle contexts' copies out land
            for _ in range(200):
                m = _metrics((await http.get("/metrics")).text)
                if m.get("tandem:host_kv_copied_bytes_total{kind=offload}", 0) > 0 and \
                        m.get("tandem:host_kv_cache_bytes", 0) > 0:
                    break
                await asyncio.sleep(0.05)
        await complete(_prompt(50, FILLER, base=30))   # no session: its decode worker frees it at its round's end
        cached, lat = [], []
        for i in range(SESSIONS):
            if wait:                                   # the round comes when its tool call said it would
                await asyncio.sleep(max(0.0, ends[i] + tool_s - time.perf_counter()))
            hist = _prompt(i, PROMPT)
            body, dt = await complete(hist + first[i] + _prompt(i + 9, NEW, base=40), session_id=f"s{i}")
            cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
            lat.append(dt)
        await asyncio.sleep(0.3)                       # the workers' last counters
        return {"cached_tokens": cached, "round2_latency_s": [round(x, 4) for x in lat],
                "metrics": _metrics((await http.get("/metrics")).text)}


async def _run(model: str, policy: str, tool_s: float, wait: bool, engine: dict, first: list[list[int]]) -> dict:
    cl = await ServingCluster.start(ClusterConfig(model, 1, 1, 0, policy, engine_args={**ENGINE, **engine}))
    try:
        return await _scenario(cl, tool_s, wait, bool(engine), first)
    finally:
        await cl.shutdown()


def probe(model: str) -> dict:
    """The host link as a worker measures it at start (the same pool on an offline engine)."""
    eng = LLMEngine(EngineConfig(model=model, policy="continuum-tool", kv_offloading_size=TIER_GIB, **ENGINE))
    pool = eng.tier.pool
    out = {"block_bytes": pool.block_bytes, "host_blocks": pool.capacity, "one_block_copy_us": pool.link_one_s * 1e6,
           "per_block_us": pool.link_block_s * 1e6, "bandwidth_GBps": pool.block_bytes / pool.link_block_s / 1e9}
    eng.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results/host_tier_live")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_model(tmp, arch="qwen3", size="30m", seed=4)
        results = {"machine": platform.processor() or platform.machine(), "probe": probe(tmp), "runs": {}}
        first = first_outputs(tmp)
        for mode, tool_s, wait in (("load", 30.0, False), ("prefetch", 3.0, True)):
            for policy, engine in (("ampd-tiered", {"kv_offloading_size": TIER_GIB}), ("ampd", {})):
                key = f"{mode}/{policy}"
                results["runs"][key] = asyncio.run(_run(tmp, policy, tool_s, wait, engine, first))
                print(key, json.dumps(results["runs"][key]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    p = results["probe"]
    lines = [f"host link (probe): {p['one_block_copy_us']:.0f} us for one block, {p['per_block_us']:.1f} us per further "
             f"block of {p['block_bytes']} bytes ({p['bandwidth_GBps']:.2f} GB/s)", "",
             "| run | cached tokens (round 2) | round-2 latency mean / max (s) | offload / write / prefetch / load "
             "bytes | hits GPU / CPU | late rounds, mean late (ms) | failed |", "|---|---|---|---|---|---|---|"]
    for key, r in results["runs"].items():
        m = r["metrics"]
        kinds = " / ".join(str(int(m.get(f"tandem:host_kv_copied_bytes_total{{kind={k}}}", 0)))
                           for k in ("offload", "write", "prefetch", "load")) if m else "-"
        hits = (f"{int(m.get('tandem:prefix_cache_hits_by_medium_total{medium=GPU}', 0))} / "
                f"{int(m.get('tandem:prefix_cache_hits_by_medium_total{medium=CPU}', 0))}") if m else "-"
        n = m.get("tandem:host_kv_prefetch_late_seconds_count", 0)
        late = f"{int(n)}, {1e3 * m.get('tandem:host_kv_prefetch_late_seconds_sum', 0) / n:.1f}" if n else "-"
        lat = r["round2_latency_s"]
        lines.append(f"| {key} | {r['cached_tokens']} | {sum(lat) / len(lat):.3f} / {max(lat):.3f} | {kinds} | {hits} "
                     f"| {late} | {int(m.get('tandem:host_kv_failed_copies_total', 0)) if m else '-'} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(results, out / "host_tier_live.png")


def plot(results: dict, path: Path) -> None:
    """Second rounds' mean client latency, host tier against recompute, per announcement."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    modes = ("load", "prefetch")
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for j, (policy, label) in enumerate((("ampd-tiered", "ampd-tiered, host tier"), ("ampd", "ampd, recompute"))):
        vals = [sum(results["runs"][f"{m}/{policy}"]["round2_latency_s"]) / SESSIONS for m in modes]
        ax.bar([i + 0.38 * j for i in range(len(modes))], vals, 0.36, label=label)
    ax.set_xticks([i + 0.19 for i in range(len(modes))], [f"{m} (tool_s {30 if m == 'load' else 3} s)" for m in modes])
    ax.set_ylabel("second round, mean latency (s)")
    ax.set_title("1P+1D, 3 sessions of 300 tokens evicted during their tool call")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
