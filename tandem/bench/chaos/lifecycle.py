"""Lifecycle attacks on a live `tandem serve` (1P+1D, a tiny model, 127.0.0.1): SIGTERM with requests open past the
grace period (a graceful drain), and SIGKILL of the decode worker under streaming load (recovery in seconds).

`recover_once` and `StreamLoad` are what `benchmarks/worker_recovery.py` repeats; `PROBES` is the chaos suite's."""
from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tandem.bench.chaos import ChaosContext, Outcome
from tandem.bench.ports import free_port

HOST = "127.0.0.1"
RECOVERY_LIMIT_S = 5.0        # /health must be 200 again within this long of a decode worker's death
HEALTH_POLL_S = 0.02          # how often /health is asked while a worker is replaced
HEALTH_WAIT_S = 30.0          # a run gives up waiting for /health 200 after this long
LOAD_RETRY_S = 0.1            # a load client that got an error waits this long before its next request, as a client
WORKER_LINE = re.compile(r"^tandem: (\w+) worker (\d+): tp\d+ \(pids? (\d+)")     # the start banner, one per worker
BACK_LINE = re.compile(r"worker (\d+) \((\w+)\) is back \(pid (\d+)\), ([\d.]+) s after its death was noticed: (.*) "
                       r"\[noticed at monotonic ([\d.]+)\]")
PHASE_ITEM = re.compile(r"([a-z][a-z ]*?) ([\d.]+) s")


# ---------------------------------------------------------------------------- the server
def tandem_command() -> list[str]:
    """`python -m tandem.cli` of this interpreter."""
    return [sys.executable, "-m", "tandem.cli"]


@dataclass
class Served:
    """A `tandem serve` subprocess: its URL, process and log file."""

    url: str
    proc: subprocess.Popen
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def workers(self) -> dict[int, tuple[str, int]]:
        """worker id -> (role, pid): from the banner's `tandem: ROLE worker N: tpT (pid P ...` lines, then each
        `is back (pid N)` line."""
        out: dict[int, tuple[str, int]] = {}
        for line in self.log_text().splitlines():
            m = WORKER_LINE.match(line)
            if m:
                out[int(m.group(2))] = (m.group(1), int(m.group(3)))
            b = BACK_LINE.search(line)
            if b:
                out[int(b.group(1))] = (b.group(2), int(b.group(3)))
        return out

    def health(self, timeout_s: float = 1.0) -> int:
        """GET /health on a fresh connection (as a load balancer's probe); its status, 0 for no answer."""
        try:
            with socket.create_connection((HOST, int(self.url.rsplit(":", 1)[1])), timeout=timeout_s) as s:
                s.settimeout(timeout_s)
                s.sendall(b"GET /health HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n")
                head = s.recv(64)
            return int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else 0
        except (OSError, ValueError, IndexError):
            return 0


@contextlib.contextmanager
def serve_tiny(model: Path, workdir: Path, extra: list[str], name: str = "server",
               timeout_s: float = 180.0) -> Iterator[Served]:
    """`tandem serve --model MODEL --prefill-workers 1 --decode-workers 1 EXTRA` on a free port of 127.0.0.1 until the
    block ends (then SIGTERM, SIGKILL after 30 s, and its process group killed: nothing is left)."""
    port = free_port()
    log = workdir / f"{name}.log"
    cmd = [*tandem_command(), "serve", "--model", str(model), "--prefill-workers", "1", "--decode-workers", "1",
           "--host", HOST, "--port", str(port), *extra]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, process_group=0,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    served = Served(f"http://{HOST}:{port}", proc, log)
    try:
        deadline = time.monotonic() + timeout_s
        while not served.workers() or served.health() != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"tandem serve exited with {proc.returncode}: {served.log_text()[-1500:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tandem serve did not become healthy within {timeout_s:g} s")
            time.sleep(0.1)
        yield served
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def make_model(path: Path) -> Path:
    """The tiny random Qwen3 checkpoint (about 1M parameters) at `path`, made once."""
    if not (path / "config.json").is_file():
        from tandem.engine.tiny_model import make_tiny_model
        make_tiny_model(path, arch="qwen3", size="1m", seed=0)
    return path


# ---------------------------------------------------------------------------- streaming load (its own process)
def _load_main(url: str, clients: int, max_tokens: int, stop, results) -> None:
    """Run `clients` streaming completion clients back to back until `stop` is set; put the counts on `results`."""
    import httpx

    counts = {"completed": 0, "failed": 0, "tokens": 0}

    async def client(c: httpx.AsyncClient, model: str, i: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            body = {"model": model, "prompt": [10 + (i * 7 + n) % 200 for _ in range(32)], "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            ok = False
            try:
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code == 200:
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                ok = '"error"' not in line[:20]
                                counts["tokens"] += 1 if ok else 0
            except httpx.HTTPError:
                ok = False
            counts["completed" if ok else "failed"] += 1
            if not ok:
                await asyncio.sleep(LOAD_RETRY_S)

    async def main() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            model = (await c.get("/v1/models")).json()["data"][0]["id"]
            tasks = [asyncio.create_task(client(c, model, i)) for i in range(clients)]
            while not stop.is_set():
                await asyncio.sleep(0.1)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    asyncio.run(main())
    results.put(counts)


class StreamLoad:
    """`clients` streaming clients against `url` in a process of their own (the prober's timing stays its own)."""

    def __init__(self, url: str, clients: int = 4, max_tokens: int = 128) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop, self._results = ctx.Event(), ctx.Queue()
        self.proc = ctx.Process(target=_load_main, args=(url, clients, max_tokens, self._stop, self._results),
                                daemon=True, name="stream-load")
        self.proc.start()

    def stop(self) -> dict:
        """Stop the clients; their counts (completed and failed requests, streamed chunks)."""
        self._stop.set()
        try:
            out = self._results.get(timeout=15)
        except Exception:  # noqa: BLE001 - a load process that died says so in the counts
            out = {"completed": 0, "failed": 0, "tokens": 0, "error": "the load process gave no counts"}
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        return out


# ---------------------------------------------------------------------------- one kill, timed
@dataclass
class Recovery:
    """One SIGKILL of a worker: seconds to /health 200 again and where they went."""

    worker: int
    pid: int
    health_s: float | None                 # kill -> /health 200 again (None: not within HEALTH_WAIT_S)
    saw_503: bool                          # /health said 503 in between (the loss was visible)
    detection_s: float | None = None       # kill -> the coordinator noticed the death
    phases: dict[str, float] = field(default_factory=dict)   # the coordinator's breakdown of the replacement
    new_pid: int | None = None

    def passed(self, limit_s: float = RECOVERY_LIMIT_S) -> bool:
        return self.health_s is not None and self.health_s <= limit_s


def recover_once(served: Served, worker: int, wait_s: float = HEALTH_WAIT_S) -> Recovery:
    """SIGKILL `worker` of `served`, poll /health every HEALTH_POLL_S until 200, read the coordinator's breakdown."""
    role, pid = served.workers()[worker]
    before = served.log_text().count(" is back (pid ")
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    saw_503, back = False, None
    while time.monotonic() - t0 < wait_s:
        status = served.health()
        if status == 503:
            saw_503 = True
        elif status == 200 and saw_503:
            back = time.monotonic() - t0
            break
        time.sleep(HEALTH_POLL_S)
    rec = Recovery(worker, pid, back, saw_503)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:               # the log line is written as /health turns 200
        lines = [m for m in BACK_LINE.finditer(served.log_text()) if int(m.group(1)) == worker]
        if len(lines) > before:
            m = lines[-1]
            rec.new_pid = int(m.group(3))
            rec.detection_s = float(m.group(6)) - t0
            rec.phases = {name.strip(): float(v) for name, v in PHASE_ITEM.findall(m.group(5))}
            break
        time.sleep(0.05)
    return rec


def decode_worker(served: Served) -> int:
    """The id of the (first) decode worker."""
    return next(w for w, (role, _) in sorted(served.workers().items()) if role == "decode")


# ---------------------------------------------------------------------------- probes
def probe_worker_recovery(ctx: ChaosContext) -> list[Outcome]:
    """SIGKILL the decode worker under 4 streaming clients: /health 200 again within RECOVERY_LIMIT_S."""
    with serve_tiny(ctx.ar_model, ctx.workdir, ["--max-model-len", "1024"], name="recovery") as served:
        load = StreamLoad(served.url)
        try:
            time.sleep(2.0)
            rec = recover_once(served, decode_worker(served))
        finally:
            counts = load.stop()
    phases = ", ".join(f"{k} {v:.2f}" for k, v in rec.phases.items())
    observed = (f"/health 200 after {rec.health_s:.2f} s (detection {rec.detection_s or 0:.2f} s; {phases}); load "
                f"{counts.get('completed')} ok, {counts.get('failed')} failed" if rec.health_s is not None
                else f"/health not 200 within {HEALTH_WAIT_S:g} s")
    return [Outcome("SIGKILL the decode worker under 4 streaming clients",
                    f"/health 503, then 200 again within {RECOVERY_LIMIT_S:g} s (a replacement serves)", observed,
                    rec.passed() and rec.saw_503)]


def _open_requests(url: str, model: str, max_tokens: int) -> tuple[dict, list, threading.Event]:
    """A non-streaming and a streaming completion of `max_tokens` tokens, each on a thread; (results, threads, an
    event set once the stream has sent its first chunk)."""
    import httpx

    body = {"model": model, "prompt": [11, 12, 13, 14, 15, 16], "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0}
    results: dict = {}
    streaming = threading.Event()

    def plain() -> None:
        try:
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            results["plain"] = (r.status_code, r.headers.get("content-type"), r.text)
        except httpx.HTTPError as e:
            results["plain"] = (0, None, f"{type(e).__name__}: {e}")

    def stream() -> None:
        events: list[str] = []
        try:
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        events.append(line)
                        streaming.set()
            results["stream"] = (r.status_code, events)
        except httpx.HTTPError as e:
            results["stream"] = (0, [*events, f"{type(e).__name__}: {e}"])
        streaming.set()

    threads = [threading.Thread(target=plain, daemon=True), threading.Thread(target=stream, daemon=True)]
    for t in threads:
        t.start()
    return results, threads, streaming


def probe_sigterm_drain(ctx: ChaosContext, grace_s: float = 1.0) -> list[Outcome]:
    """SIGTERM with a non-streaming and a streaming request open past the grace period: new requests 503 (JSON),
    both open ones end with a well-formed error (JSON; SSE error event then [DONE]), no traceback, exit code 0."""
    import httpx

    with serve_tiny(ctx.ar_model, ctx.workdir, ["--max-model-len", "4096", "--served-model-name", "m",
                                                "--timeout-graceful-shutdown", f"{grace_s:g}"], name="drain") as served:
        results, threads, streaming = _open_requests(served.url, "m", 4000)
        streaming.wait(30)
        time.sleep(0.2)
        served.proc.send_signal(signal.SIGTERM)
        time.sleep(min(0.3, grace_s / 3))
        try:
            r = httpx.post(served.url + "/v1/completions", json={"model": "m", "prompt": [1], "max_tokens": 1},
                           timeout=10)
            refused = (r.status_code, r.headers.get("content-type"), r.text[:200])
        except httpx.HTTPError as e:
            refused = (0, None, f"{type(e).__name__}: {e}")
        try:
            code = served.proc.wait(30)
        except subprocess.TimeoutExpired:
            code = None
        for t in threads:
            t.join(10)
        log = served.log_text()
    plain = results.get("plain", (0, None, "no answer"))
    status, events = results.get("stream", (0, []))
    err_event = len(events) >= 2 and events[-1] == "data: [DONE]" and events[-2].startswith('data: {"error"')
    plain_ok = plain[:2] == (503, "application/json") and '"error"' in plain[2]
    return [
        Outcome("a new request while draining", "503 application/json with an OpenAI error body",
                f"{refused[0]} {refused[1]} {refused[2][:100]}",
                refused[:2] == (503, "application/json") and '"error"' in refused[2]),
        Outcome(f"a non-streaming request open past the {grace_s:g} s grace period", "503 application/json error",
                f"{plain[0]} {plain[1]} {plain[2][:120]}", plain_ok),
        Outcome(f"a stream open past the {grace_s:g} s grace period", 'a data: {"error": ...} event, then [DONE]',
                f"{status}; last events {[e[:80] for e in events[-2:]]}", status == 200 and err_event),
        Outcome("SIGTERM's exit", "exit code 0, no traceback in the log",
                f"exit code {code}; traceback in log: {'Traceback' in log}", code == 0 and "Traceback" not in log),
    ]


PROBES = [probe_sigterm_drain, probe_worker_recovery]

