"""`tandem serve` in a test: the real ServingCluster and HTTP app on a free port, on its own event loop in a daemon
thread, seen through HTTP as a separate client would (shared by the end-to-end and fault tests)."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

import httpx

from tandem.bench.serve_client import parse_prometheus
from tandem.cli.serve_cmd import serving
from tandem.engine.llm import LLM
from tandem.runtime.cluster import ClusterConfig

METRICS = ("tandem:local_prefills_total", "tandem:remote_prefills_total", "tandem:kv_transfer_timeouts_total",
           "tandem:lost_requests_total",
           "tandem:workers_alive", "vllm:kv_cache_usage_perc", "vllm:num_requests_running",
           "vllm:generation_tokens_total")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def uvicorn_app(app, **config) -> Iterator[int]:
    """`app` on a real uvicorn (127.0.0.1, a free port, a daemon thread) until the block ends; yields the port.
    `config`: more uvicorn.Config settings (http=, lifespan=, ...)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


class LiveServer:
    """serve_cmd.serving(cfg) on a free port until stop(); errors while starting are raised here."""

    def __init__(self, cfg: ClusterConfig, api_key: str | None = None, timeout_s: float = 180.0) -> None:
        self.cfg, self.api_key = cfg, api_key
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cluster = None
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.thread.start()
        assert self._ready.wait(timeout_s), "the server did not start"
        if self.error is not None:
            raise self.error

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            async with serving(self.cfg, "127.0.0.1", self.port, self.api_key) as cluster:
                self.cluster = cluster
                self._ready.set()
                await self._stop.wait()
        except BaseException as e:             # noqa: BLE001 - reported to the test thread
            self.error = e
        finally:
            self._ready.set()

    def call(self, fn):
        """Run fn() on the server's loop (the coordinator's state is that loop's) and return its result."""
        async def run():
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def metrics(self, names: tuple[str, ...] = METRICS) -> dict:
        """The named series of GET /metrics."""
        r = httpx.get(self.url + "/metrics", timeout=30)
        assert r.status_code == 200
        return parse_prometheus(r.text, names)

    def health(self) -> int:
        return httpx.get(self.url + "/health", timeout=30).status_code

    def pid(self, worker: int) -> int | None:
        """The worker's process id; None while it has none (between a death and its replacement's start)."""
        proc = self.cluster.procs.workers.get(worker)
        return proc.pid if proc is not None else None

    def worker_state(self, worker: int):
        return self.call(lambda: next(s for s in self.cluster.shell.store.all() if s.worker_id == worker))

    def wait_for(self, what: str, pred, timeout_s: float = 20.0, every_s: float = 0.02) -> float:
        """Poll pred() until true; returns the seconds it took (fails after timeout_s)."""
        t0 = time.monotonic()
        while not pred():
            assert time.monotonic() - t0 < timeout_s, f"timed out waiting for {what}"
            time.sleep(every_s)
        return time.monotonic() - t0

    def idle_kv_usage(self) -> float:
        """The decode worker's KV usage once nothing runs and two readings 0.1 s apart agree (states lag a bit)."""
        last = None
        while True:
            m = self.metrics()
            if m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == last:
                return last
            last = m["vllm:kv_cache_usage_perc"]
            time.sleep(0.1)

    def stop(self) -> None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
            self.thread.join(60)


@contextlib.contextmanager
def one_thread_llm(ckpt: str, **engine_args) -> Iterator[LLM]:
    """The offline engine on one torch thread, as the workers run (two threads on two busy cores are ~7x slower)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLM(ckpt, **engine_args)
    finally:
        torch.set_num_threads(threads)


Request = Callable[[httpx.AsyncClient, int], Awaitable[tuple[bool, httpx.Response]]]


def fire_concurrently(url: str, one: Request, n: int = 200) -> tuple[list[httpx.Response], list[httpx.Response]]:
    """Send one(client, i) for i < n all at once over n connections; (answers to valid, answers to invalid requests)."""
    async def go() -> list[tuple[bool, httpx.Response]]:
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(one(c, i) for i in range(n)))

    results = asyncio.run(go())
    return [r for ok, r in results if ok], [r for ok, r in results if not ok]
