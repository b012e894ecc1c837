"""`tandem serve` in a test: the real ServingCluster and HTTP app on a free port, on its own event loop in a daemon
thread, seen through HTTP as a separate client would (shared by the end-to-end and fault tests)."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx

from tandem.bench.serve_client import parse_prometheus
from tandem.cli.serve_cmd import serving
from tandem.runtime.cluster import ClusterConfig

METRICS = ("tandem:local_prefills_total", "tandem:remote_prefills_total", "tandem:kv_transfer_timeouts_total",
           "tandem:workers_alive", "vllm:kv_cache_usage_perc", "vllm:num_requests_running",
           "vllm:generation_tokens_total")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

    def pid(self, worker: int) -> int:
        return self.cluster.procs.workers[worker].pid

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
