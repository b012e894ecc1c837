"""Prefill and decode workers at different tensor-parallel degrees on the live server, against tp=1 for both.

    python benchmarks/tp_pd_serve.py [--sessions 20] [--rounds 3] [--concurrency 4] [--out docs/results/tp_pd_serve]

For each deployment (`tandem serve --deploy`, policy dynamo: every prefill on the prefill worker, so each later
round's history KV goes from the decode worker to the prefill worker and the new KV back, regrouped between the
degrees): `--sessions` multi-round sessions of a tiny Qwen3 (2 KV heads; made here, offline) over HTTP, greedy,
`--concurrency` sessions at a time. Per deployment: rounds whose tokens equal the tp=1 offline engine's on the whole
conversation, rounds whose cached tokens are the session's previous prompt + output - 1 (the decode worker reused
the KV it was sent), remote prefills, KV transfers and their mean seconds (/metrics), the KV bytes that went through
each worker's driver and those each rank's endpoint received (rank to rank; /metrics), wall time and its ratio to the
P:tp1x1,D:tp1x1 baseline measured in the same run. Each deployment with a tp>1 worker runs twice, KV rank to rank
(the default) and through the drivers (`--kv-transfer driver`). Writes table.md, results.json and a PNG of the wall times (the
servers' logs stay in a temporary folder).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import tempfile
import time
from pathlib import Path

import httpx
import torch
from rich.progress import Progress

from tandem.bench.serve_client import parse_kv_paths, parse_prometheus
from tandem.bench.serve_process import serve_subprocess
from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.tiny_model import make_tiny_model

DEPLOYS = ("P:tp1x1,D:tp1x1", "P:tp2x1,D:tp1x1", "P:tp1x1,D:tp2x1", "P:tp2x1,D:tp2x1")
PATHS = ("rank-to-rank", "driver")  # --kv-transfer of each tp>1 deployment, both measured in the same run
NEW = (48, 24, 12, 12, 12)          # new prompt tokens of each round
OUT = 8                             # output tokens of each round
SERVE = ["--policy", "dynamo", "--max-model-len", "512", "--num-kv-blocks", "256", "--max-num-batched-tokens", "256"]
METRICS = ("tandem:remote_prefills_total", "tandem:local_prefills_total", "tandem:kv_transfer_seconds_count",
           "tandem:kv_transfer_seconds_sum")


def tensor_parallel(deploy: str) -> bool:
    """Whether a deployment has a worker at tp > 1 (its KV can move rank to rank)."""
    return any(int(t) > 1 for t in re.findall(r"tp(\d+)", deploy))


def sessions_of(n: int, rounds: int, vocab: int) -> list[list[list[int]]]:
    """n sessions' new tokens per round (seeded)."""
    g = torch.Generator().manual_seed(7)
    return [[torch.randint(3, vocab - 8, (NEW[k % len(NEW)],), generator=g).tolist() for k in range(rounds)]
            for _ in range(n)]


async def replay(url: str, model: str, news: list[list[list[int]]], concurrency: int, advance) -> list[list[dict]]:
    """Every session's rounds through /v1/completions (x-session-id), `concurrency` sessions at a time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(c: httpx.AsyncClient, i: int) -> list[dict]:
        async with gate:
            conv, out = [], []
            for new in news[i]:
                conv = conv + new
                r = await c.post("/v1/completions", headers={"x-session-id": f"s{i}"},
                                 json={"model": model, "prompt": conv, "max_tokens": OUT, "temperature": 0,
                                       "ignore_eos": True, "return_token_ids": True})
                r.raise_for_status()
                d = r.json()
                ids = d["choices"][0]["token_ids"]
                out.append({"prompt": list(conv), "token_ids": ids,
                            "cached": d["usage"]["prompt_tokens_details"]["cached_tokens"]})
                conv = conv + ids
            advance()
            return out
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        return await asyncio.gather(*(one(c, i) for i in range(len(news))))


def measure(model_dir: str, deploy: str, path: str, news, concurrency: int, ref: dict, logdir: Path,
            progress) -> dict:
    """One deployment's row, KV moving by `path` (--kv-transfer)."""
    task = progress.add_task(f"{deploy} {path}", total=len(news))
    log = logdir / (deploy.replace(":", "").replace(",", "_") + f"_{path}.log")
    with serve_subprocess(["--model", model_dir, "--deploy", deploy, "--kv-transfer", path, *SERVE], log) as (url, _):
        t0 = time.perf_counter()
        done = asyncio.run(replay(url, Path(model_dir).name, news, concurrency,
                                  lambda: progress.advance(task)))
        wall = time.perf_counter() - t0
        time.sleep(0.5)                                # the workers' last byte counts reach the coordinator
        text = httpx.get(url + "/metrics").text
        m = parse_prometheus(text, METRICS)
        ranks, driver = parse_kv_paths(text)
    rounds = [r for s in done for r in s]
    same = sum(r["token_ids"] == ref[tuple(r["prompt"])] for r in rounds)
    reused = sum(b["cached"] == len(a["prompt"]) + len(a["token_ids"]) - 1 for s in done for a, b in zip(s, s[1:]))
    transfers = m.get("tandem:kv_transfer_seconds_count", 0.0)
    return {"deploy": deploy, "kv_transfer": path if tensor_parallel(deploy) else "driver", "rounds": len(rounds), "same_as_tp1": same,
            "later_rounds": sum(len(s) - 1 for s in done), "kv_reused": reused,
            "remote_prefills": m.get("tandem:remote_prefills_total", 0.0),
            "local_prefills": m.get("tandem:local_prefills_total", 0.0), "kv_transfers": transfers,
            "kv_transfer_ms": 1e3 * m.get("tandem:kv_transfer_seconds_sum", 0.0) / transfers if transfers else 0.0,
            "wall_s": wall, "driver_bytes": {str(w): b for w, b in sorted(driver.items())},
            "rank_received_bytes": {f"{w}/{r}": b for (w, d, r), b in sorted(ranks.items()) if d == "received"}}


def table(rows: list[dict]) -> str:
    base = rows[0]["wall_s"]
    lines = ["| deployment | KV path | rounds equal to tp=1 | later rounds reusing sent KV | remote prefills | "
             "KV transfers | mean transfer ms | KV MB through P / D driver | KV MB received per rank, P; D | wall s | "
             "wall / tp1 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mb = lambda b: f"{b / 1e6:.2f}"                                    # noqa: E731
        drivers = " / ".join(mb(b) for b in r["driver_bytes"].values()) or "-"
        got = {k: b for k, b in r["rank_received_bytes"].items() if b}
        per_rank = "; ".join("/".join(mb(b) for k, b in got.items() if k.startswith(f"{w}/")) for w in ("0", "1")) \
            if got else "-"
        lines.append(f"| `{r['deploy']}` | {r['kv_transfer']} | {r['same_as_tp1']}/{r['rounds']} | {r['kv_reused']}/{r['later_rounds']} | "
                     f"{r['remote_prefills']:.0f} | {r['kv_transfers']:.0f} | {r['kv_transfer_ms']:.1f} | "
                     f"{drivers} | {per_rank} | {r['wall_s']:.1f} | {r['wall_s'] / base:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.barh([f"{r['deploy']} {r['kv_transfer']}" for r in rows], [r["wall_s"] for r in rows],
            color=["#4c72b0" if r["kv_transfer"] == "rank-to-rank" else "#dd8452" for r in rows])
    ax.set_xlabel("wall seconds for every session")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--deploys", default=";".join(DEPLOYS), help="';'-separated deployments (the first: baseline)")
    ap.add_argument("--out", type=Path, default=Path("docs/results/tp_pd_serve"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(Path(tmp) / "tiny-tp")
        make_tiny_model(model_dir, arch="qwen3", size="1m", seed=5)
        torch.set_num_threads(1)
        offline = LLM(model_dir, max_model_len=512, max_num_batched_tokens=256)
        news = sessions_of(args.sessions, args.rounds, offline.engine.model_config.vocab_size)
        ref: dict = {}
        conv_of = [[] for _ in news]
        greedy = SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True)
        for k in range(args.rounds):                   # the tp=1 offline engine on each whole conversation
            prompts = [conv_of[i] + news[i][k] for i in range(len(news))]
            for p, o in zip(prompts, offline.generate(prompts, greedy)):
                ref[tuple(p)] = o.outputs[0].token_ids
            conv_of = [p + ref[tuple(p)] for p in prompts]
        rows = []
        with Progress() as progress:
            for deploy in args.deploys.split(";"):
                for path in PATHS if tensor_parallel(deploy) else PATHS[:1]:
                    rows.append(measure(model_dir, deploy, path, news, args.concurrency, ref, Path(tmp), progress))
    md = table(rows)
    print(md)
    print(f"cores {len(os.sched_getaffinity(0))}, load average {os.getloadavg()[0]:.1f}")
    (args.out / "table.md").write_text(md + "\n")
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    plot(rows, args.out / "wall.png")


if __name__ == "__main__":
    main()
