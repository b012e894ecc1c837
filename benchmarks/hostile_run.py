"""Hostile-input run: a live `tandem serve` under bounded hostile input.

    python benchmarks/hostile_run.py [--out docs/results/hostile] [--duration-s 60] [--streams 200]
    python benchmarks/hostile_run.py --skip hostile,slow,frames      # one part alone: which part causes what
    python benchmarks/hostile_run.py --server-env MALLOC_MMAP_THRESHOLD_=131072   # an experiment on the server

What it checks: "a bounded hostile-input run (invalid and oversized bodies, out-of-range values,
malformed frames on every socket, 200 concurrent valid streams) leaves /health answering within 100 ms
throughout, every valid request answered, and coordinator memory back within 10% of its starting value".

What the run does (everything goes to 127.0.0.1 only, and every part is bounded in count and time):

1. writes a tiny random Qwen3 checkpoint (`tandem tiny-model --size 1m`) in a temporary directory and starts
   `tandem serve --prefill-workers 1 --decode-workers 1 --body-timeout S` on a free port (its output goes to
   <out>/server.log); waits for /health 200;
2. warms up with a few valid requests, lets the server settle and records the coordinator's RSS (psutil);
3. phase "baseline" (a few seconds, /health only), then phase "attack", in which these run at the same time:
   - a /health prober in its own process (a fresh TCP connection every ~20 ms, as a load balancer's probe; it
     runs for the whole run, so it sees every phase), each probe followed by one of a trivial HTTP server on a
     thread of the prober: the "control" latency is the machine's and the prober's own noise, so a slow /health
     probe with a fast control probe beside it is the server's doing;
   - hostile HTTP, in rounds until --duration-s: invalid JSON, non-object bodies, oversized bodies (a 12 MB chat
     body of 400k messages, 5M token ids, 1 MB of content, a 15 MB session id, ...), out-of-range values (seed
     2^70, top_k 2^64, stop_token_ids [2^64], negative max_tokens, temperature "NaN", ...), malformed HTTP. An
     application-level case passes when it gets its 4xx and an OpenAI error body {"error": {"message", "type",
     "param", "code"}} (the code named when the docs name one) of a few KB at most; an HTTP-level case (bytes
     that are not HTTP, a 15 MB header) passes on a 4xx or a closed connection. Anything else fails: a 5xx, a
     200, no answer within the case's timeout, a traceback in the body;
   - slow clients: --slowloris connections sending a header one byte every 0.5 s (pass: the server closes them
     within --slowloris-s), a body truncated and then left pending (pass: 408 after the body timeout), a body
     truncated and then half-closed (pass: a 4xx or a closed connection);
   - malformed frames on every TCP socket the coordinator and its workers listen on (found with psutil): raw
     garbage bytes, a ZeroMQ DEALER and a PUSH socket without CURVE keys sending b'\\xc1', random frames, a 1 MB
     frame and well-formed msgspec messages (a KVData with a wrong payload, a Shutdown, a Heartbeat) - in rounds
     until --duration-s. Pass: no worker process dies or restarts and the coordinator's control port never
     completes a handshake without keys;
   - --streams concurrent valid streaming chat requests (max_tokens 16; a third with a session_id body field, a
     third with an x-session-id header), in --max-waves waves spread over the attack. Each must answer 200 and
     end with a finish_reason and `data: [DONE]`;
4. phase "settle": once the attack is over and no request runs (/metrics), waits --settle-s and records the RSS
   again; then stops the server (SIGTERM, then SIGKILL) and checks that no process of it is left.

Output: a table on stdout (the conditions, then the sockets probed and every distinct failure: a slow /health
probe is listed with what was in flight then), <out>/results.json (the summary and each distinct failure),
<out>/raw.json (every probe, request and RSS sample), <out>/health.png (each probe's latency over time, phases
shaded, the 100 ms line, the coordinator's RSS on the right axis) and <out>/server.log. Acceptance conditions
(exit status 1 if one fails; each failing one is printed):

- every /health probe from the baseline on (the warm-up's first requests are shown, not counted) is a 200
  within 100 ms;
- every valid request (warm-up and streams) answered;
- the coordinator's RSS after the settle phase within 10% of the RSS before the baseline;
- every hostile input refused as above (slow clients included);
- every listening socket probed, no server process lost, tandem:workers_alive still 2, the coordinator's
  control port never accepting a keyless handshake;
- no "internal error" (a logged 500 with its traceback) in the server log;
- a clean stop: nothing of the server left once the coordinator exits after SIGTERM.

--skip leaves parts out and --server-env sets the server's environment: for finding causes, not for the
acceptance run (a skipped part's condition fails).

The parts live beside this script: hostile_config.py (Config, Results, shared constants), hostile_server.py (the
server subprocess and the /health prober), hostile_cases.py (raw HTTP, the hostile cases and their judging, slow
clients), hostile_frames.py (malformed frames), hostile_report.py (summary, conditions, tables, raw.json, plot);
this file holds the command line, the valid streams and the phases.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# benchmarks/ is this script's directory
from hostile_cases import Case, build_cases, run_hostile, run_slow  # noqa: E402
from hostile_config import CHAT, PARTS, Config, Results, console  # noqa: E402
from hostile_frames import run_frames  # noqa: E402
from hostile_report import conditions, machine, plot, print_report, server_log_summary, summarize, write_raw  # noqa: E402
from hostile_server import Prober, Server, make_model  # noqa: E402


# ---------------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None) -> Config:
    """The Config from the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="reports/hostile", help="output directory (default: reports/hostile)")
    p.add_argument("--duration-s", type=float, default=60.0, help="length of the attack phase (default: 60)")
    p.add_argument("--streams", type=int, default=200, help="concurrent valid streams per wave (default: 200)")
    p.add_argument("--max-waves", type=int, default=3, help="waves of streams, spread over the attack (default: 3)")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each valid stream (default: 16)")
    p.add_argument("--settle-s", type=float, default=5.0, help="wait before the final RSS (default: 5)")
    p.add_argument("--body-timeout", type=float, default=10.0, help="the server's --body-timeout (default: 10)")
    p.add_argument("--slowloris", type=int, default=16, help="slowloris connections (default: 16)")
    p.add_argument("--slowloris-s", type=float, default=30.0,
                   help="a slowloris connection still open after this fails (default: 30)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="an environment variable for `tandem serve` (repeatable; for experiments)")
    p.add_argument("--client-nice", type=int, default=0,
                   help="lower this load generator's CPU priority by N once the server and the prober run (default: 0)")
    p.add_argument("--skip", default="", help=f"comma-separated parts to leave out, of {','.join(PARTS)} (to find "
                   "which part causes what; the conditions of a skipped part then fail)")
    a = p.parse_args(argv)
    skip = tuple(x for x in a.skip.split(",") if x)
    if set(skip) - set(PARTS):
        p.error(f"--skip: unknown part(s) {sorted(set(skip) - set(PARTS))}; parts: {', '.join(PARTS)}")
    return Config(out=Path(a.out), duration_s=a.duration_s, streams=a.streams, max_waves=a.max_waves,
                  max_tokens=a.max_tokens, settle_s=a.settle_s, body_timeout_s=a.body_timeout,
                  slowloris=a.slowloris, slowloris_s=a.slowloris_s, seed=a.seed, skip=skip,
                  client_nice=a.client_nice, server_env=tuple(a.server_env))


# ---------------------------------------------------------------------------- valid streams
def stream_request(i: int, wave: int, model: str, max_tokens: int) -> tuple[dict, dict]:
    """Body and headers of valid stream `i`: a third with session_id, a third with x-session-id, a third none."""
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0.7, "seed": i,
            "messages": [{"role": "user", "content": f"stream {i} of wave {wave}: tell me something"}]}
    headers = {}
    if i % 3 == 0:
        body["session_id"] = f"hostile-run-w{wave}-s{i}"
    elif i % 3 == 1:
        headers["x-session-id"] = f"hostile-run-w{wave}-h{i}"
    return body, headers


async def one_stream(client: httpx.AsyncClient, body: dict, headers: dict) -> str:
    """Run one valid stream; '' if it ended with a finish_reason and [DONE], else why not."""
    finish, done = None, False
    async with client.stream("POST", CHAT, json=body, headers=headers) as r:
        if r.status_code != 200:
            return f"status {r.status_code}: {(await r.aread())[:200]!r}"
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return f"error event: {json.dumps(chunk)[:200]}"
            finish = next((c["finish_reason"] for c in chunk.get("choices", []) if c.get("finish_reason")), finish)
    return "" if finish and done else f"ended without {'a finish_reason' if not finish else '[DONE]'}"


async def run_wave(url: str, cfg: Config, model: str, wave: int, res: Results, tick: Callable[[], None]) -> None:
    """`cfg.streams` valid streams at once."""
    limits = httpx.Limits(max_connections=cfg.streams + 8, max_keepalive_connections=cfg.streams + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        async def go(i: int) -> None:
            t0 = time.monotonic()
            try:
                why = await one_stream(client, *stream_request(i, wave, model, cfg.max_tokens))
            except (httpx.HTTPError, ValueError) as e:
                why = f"{type(e).__name__}: {e}"
            res.streams.append({"wave": wave, "i": i, "seconds": round(time.monotonic() - t0, 3), "start": t0,
                                "end": time.monotonic(), "failure": why})
            tick()
        await asyncio.gather(*(go(i) for i in range(cfg.streams)))


async def run_streams(url: str, cfg: Config, model: str, res: Results, deadline: float,
                      tick: Callable[[], None]) -> None:
    """`max_waves` waves of valid streams spread over the attack (wave k starts at k/max_waves of it, or when
    wave k-1 ends if later); at least one, none started after `deadline`."""
    start = time.monotonic()
    for wave in range(cfg.max_waves):
        slot = start + wave * (deadline - start) / cfg.max_waves
        await asyncio.sleep(max(0.0, slot - time.monotonic()))
        if wave and time.monotonic() >= deadline:
            break
        await run_wave(url, cfg, model, wave, res, tick)


# ---------------------------------------------------------------------------- the run
async def warm_up(url: str, model: str, res: Results) -> None:
    """A few valid requests, streaming and not, with and without a session."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        for i in range(6):
            body, headers = stream_request(i, -1, model, 8)
            if i % 2:
                why = await one_stream(c, body, headers)
            else:
                r = await c.post(CHAT, json={**body, "stream": False}, headers=headers)
                why = "" if r.status_code == 200 else f"status {r.status_code}"
            if why:
                res.warmup_failures.append(why)


async def sample_rss(server: Server, res: Results, stop: asyncio.Event) -> None:
    """The coordinator's RSS every 0.5 s until `stop`."""
    while not stop.is_set():
        with contextlib.suppress(psutil.Error):
            res.rss.append((time.monotonic(), server.rss()))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


async def wait_idle(url: str, timeout_s: float = 60.0) -> None:
    """Until /metrics shows no running or waiting request."""
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        while time.monotonic() - t0 < timeout_s:
            text = (await c.get("/metrics")).text
            busy = re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)", text, re.M)
            if busy and all(float(v) == 0 for v in busy):
                return
            await asyncio.sleep(0.25)


def progress_bar() -> Progress:
    """The live progress display."""
    return Progress(TextColumn("{task.description:<22}"), BarColumn(), TextColumn("{task.fields[info]}"),
                    TimeElapsedColumn(), console=console, transient=False)


async def attack(server: Server, cfg: Config, model: str, sockets: list[dict], cases: list[tuple[Case, bytes]],
                 res: Results) -> None:
    """Phase "attack": hostile HTTP, slow clients, frames and valid streams together, with a progress bar."""
    deadline = time.monotonic() + cfg.duration_s
    with progress_bar() as bar:
        t_time = bar.add_task("attack", total=cfg.duration_s, info="")
        t_http = bar.add_task("hostile HTTP", total=None, info="0")
        t_frames = bar.add_task("malformed frames", total=None, info="0")
        t_streams = bar.add_task("valid streams", total=None, info="0")

        def ticker(task, rows: list) -> Callable[[], None]:
            def tick() -> None:
                bad = sum(bool(r.get("failure")) for r in rows)
                bar.update(task, advance=1, info=f"{len(rows)}" + (f" ({bad} failed)" if bad else ""))
            return tick

        async def clock() -> None:
            while time.monotonic() < deadline:
                bar.update(t_time, completed=cfg.duration_s - (deadline - time.monotonic()))
                await asyncio.sleep(0.25)
            bar.update(t_time, completed=cfg.duration_s)

        parts = {"hostile": lambda: run_hostile(cfg, server.port, cases, res, deadline, ticker(t_http, res.hostile)),
                 "slow": lambda: run_slow(cfg, server.port, res),
                 "frames": lambda: run_frames(sockets, res, deadline, cfg.seed, ticker(t_frames, res.frames)),
                 "streams": lambda: run_streams(server.url, cfg, model, res, deadline, ticker(t_streams, res.streams))}
        await asyncio.gather(clock(), *(run() for name, run in parts.items() if name not in cfg.skip))


async def session(server: Server, cfg: Config, cases: list[tuple[Case, bytes]], res: Results,
                  prober_pid: int) -> dict:
    """Warm-up, start RSS, baseline, attack, settle, end RSS; the facts measured around the phases."""
    t = time.monotonic()
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
    await warm_up(server.url, model, res)
    await wait_idle(server.url)
    await asyncio.sleep(2.0)
    res.phases.append(("warm-up", t, time.monotonic()))
    facts = {"rss_start": server.rss(), "model": model}
    sockets = server.listeners()
    pids_before = server.alive_pids()
    watched = cpu_watch(server, prober_pid)
    stop = asyncio.Event()
    sampler = asyncio.ensure_future(sample_rss(server, res, stop))
    t = time.monotonic()
    await asyncio.sleep(cfg.baseline_s)
    res.phases.append(("baseline", t, time.monotonic()))
    t, cpu0 = time.monotonic(), cpu_seconds(watched)
    await attack(server, cfg, model, sockets, cases, res)
    res.phases.append(("attack", t, time.monotonic()))
    facts["cpu_during_attack"] = cpu_share(cpu0, cpu_seconds(watched), time.monotonic() - t)
    facts["load_avg_after_attack"] = os.getloadavg()
    t = time.monotonic()
    await wait_idle(server.url)
    await asyncio.sleep(cfg.settle_s)
    facts["rss_end"] = server.rss()
    res.phases.append(("settle", t, time.monotonic()))
    stop.set()
    await sampler
    facts.update(sockets=sockets, pids_before=sorted(pids_before), pids_after=sorted(server.alive_pids()),
                 workers_alive=await workers_alive(server.url))
    return facts


def cpu_watch(server: Server, prober_pid: int) -> dict[str, psutil.Process]:
    """The processes whose CPU time the run reports: the server's, this load generator and the prober."""
    procs = {"coordinator": server.ps}
    for pid, p in sorted(server.remember().items()):
        with contextlib.suppress(psutil.Error):
            if pid != server.proc.pid and "resource_tracker" not in " ".join(p.cmdline()):
                procs[f"worker {pid}"] = p
    return {**procs, "load generator (this script)": psutil.Process(), "/health prober": psutil.Process(prober_pid)}


def cpu_seconds(procs: dict[str, psutil.Process]) -> dict[str, float]:
    """User + system CPU seconds of each process so far."""
    out = {}
    for name, p in procs.items():
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            out[name] = t.user + t.system
    return out


def cpu_share(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """Cores used by each process between two readings."""
    return {k: round((after[k] - before[k]) / wall_s, 3) for k in after if k in before}


async def workers_alive(url: str) -> float | None:
    """tandem:workers_alive from /metrics."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        m = re.search(r"^tandem:workers_alive\{[^}]*\} (\S+)", (await c.get("/metrics")).text, re.M)
    return float(m.group(1)) if m else None


# ---------------------------------------------------------------------------- main
def run(cfg: Config) -> int:
    """The whole run; 0 if every acceptance condition holds, else 1."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    res, log_path = Results(), cfg.out / "server.log"
    with tempfile.TemporaryDirectory(prefix="tandem-hostile-") as tmp:
        console.print("making a tiny model and starting tandem serve 1P+1D ...")
        make_model(Path(tmp) / "model")
        cases = build_cases()
        server = Server(Path(tmp) / "model", log_path, cfg.body_timeout_s, cfg.server_env)
        prober, stop_info, facts, probes = None, {}, None, []
        try:
            console.print(f"server healthy after {server.wait_healthy():.1f} s: {server.url}")
            prober = Prober(cfg, server.port, Path(tmp) / "probes.json")
            t0 = time.monotonic()
            if cfg.client_nice:
                os.nice(cfg.client_nice)          # after the server and the prober started: they keep theirs
            facts = asyncio.run(session(server, cfg, cases, res, prober.proc.pid))
        finally:
            probes = prober.stop() if prober else []
            stop_info = server.stop()
    if facts is None:
        return 1
    s = summarize(cfg, res, probes, facts, stop_info, server_log_summary(log_path), t0)
    s.update(machine=machine(), command=" ".join(["python", "benchmarks/hostile_run.py", *sys.argv[1:]]),
             server_command=server.command)
    conds = conditions(s)
    s["conditions"] = [{"condition": n, "met": ok, "measured": d} for n, ok, d in conds]
    (cfg.out / "results.json").write_text(json.dumps(s, indent=1, default=str))
    write_raw(cfg.out / "raw.json", probes, res, t0)
    plot(cfg.out / "health.png", probes, res, t0)
    print_report(s, conds)
    console.print(f"results: {cfg.out / 'results.json'}, plot: {cfg.out / 'health.png'}, server log: {log_path}")
    failed = [n for n, ok, _ in conds if not ok]
    for n in failed:
        console.print(f"[red]FAILED[/]: {n}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    try:
        return run(parse_args(argv))
    except KeyboardInterrupt:
        console.print("interrupted; the server was stopped")
        return 130


if __name__ == "__main__":
    sys.exit(main())

