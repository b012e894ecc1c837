"""The hostile-input run's `tandem serve` subprocess and its /health prober process."""
from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
# benchmarks/ is the script's directory (benchmarks/hostile_run.py)
from hostile_config import HOST, Config


# ---------------------------------------------------------------------------- the server process
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM it when this benchmark dies, even by SIGKILL."""
    with contextlib.suppress(Exception):
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


def tandem_command() -> list[str]:
    """The `tandem` console script (its entry point is guarded, as multiprocessing's spawn needs)."""
    script = Path(sys.executable).with_name("tandem")
    return [str(script)] if script.exists() else [shutil.which("tandem") or "tandem"]


def make_model(path: Path) -> None:
    """A tiny random Qwen3 checkpoint (about 1M parameters) at `path`."""
    subprocess.run([*tandem_command(), "tiny-model", "--arch", "qwen3", "--size", "1m", "--out", str(path)],
                   check=True, stdout=subprocess.DEVNULL)


class Server:
    """`tandem serve` 1P+1D as a subprocess: start, its processes, their sockets and memory, stop."""

    def __init__(self, model: Path, log: Path, body_timeout_s: float, env: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        cmd = [*tandem_command(), "serve", "--model", str(model), "--prefill-workers", "1", "--decode-workers", "1",
               "--host", HOST, "--port", str(self.port), "--body-timeout", str(body_timeout_s)]
        self.command = " ".join([*env, "tandem", *cmd[1:]])
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **dict(kv.split("=", 1) for kv in env)},
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        self.ps = psutil.Process(self.proc.pid)
        self.known: dict[int, psutil.Process] = {self.proc.pid: self.ps}

    def wait_healthy(self, timeout_s: float = 180.0) -> float:
        """Poll /health until 200; the seconds it took."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tandem serve exited with {self.proc.returncode} (see the server log)")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.remember()
                    return time.monotonic() - t0
            time.sleep(0.25)
        raise RuntimeError(f"tandem serve did not answer /health within {timeout_s:.0f} s")

    def remember(self) -> dict[int, psutil.Process]:
        """The coordinator and its descendants now (also kept for the final clean-up)."""
        procs = {self.proc.pid: self.ps}
        with contextlib.suppress(psutil.Error):
            procs.update({c.pid: c for c in self.ps.children(recursive=True)})
        self.known.update(procs)
        return procs

    def rss(self) -> int:
        """The coordinator process's resident set size in bytes."""
        return self.ps.memory_info().rss

    def listeners(self) -> list[dict]:
        """Every TCP socket in LISTEN state of the coordinator and its descendants."""
        found = []
        for pid, p in sorted(self.remember().items()):
            with contextlib.suppress(psutil.Error):
                for c in p.net_connections(kind="tcp"):
                    if c.status == psutil.CONN_LISTEN:
                        role = "http" if c.laddr.port == self.port else (
                            "coordinator" if pid == self.proc.pid else "worker")
                        found.append({"pid": pid, "ip": c.laddr.ip, "port": c.laddr.port, "role": role})
        return found

    def alive_pids(self) -> set[int]:
        """Processes of the server (as first seen) still running."""
        alive = set()
        for pid, p in self.known.items():
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.add(pid)
        return alive

    def stop(self, term_s: float = 10.0) -> dict:
        """SIGTERM the coordinator, SIGKILL it after `term_s`, then kill any of its processes still left."""
        self.remember()
        t0, how = time.monotonic(), "SIGTERM"
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(term_s)
            except subprocess.TimeoutExpired:
                how = "SIGKILL"
                self.proc.kill()
                self.proc.wait(10)
        rest = [p for pid, p in self.known.items() if pid != self.proc.pid]
        _, alive = psutil.wait_procs(rest, timeout=5)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        self._log.close()
        return {"signal": how, "exit_code": self.proc.returncode, "seconds": round(time.monotonic() - t0, 2),
                "left_over_killed": [p.pid for p in alive]}


# ---------------------------------------------------------------------------- the /health prober (own process)
def _probe_once(port: int, timeout_s: float) -> int:
    """One GET /health on a fresh connection; its HTTP status (0: no answer)."""
    with socket.create_connection((HOST, port), timeout=timeout_s) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n")
        head = s.recv(64)
    m = re.match(rb"HTTP/1\.1 (\d{3})", head)
    return int(m.group(1)) if m else 0


def _control_server() -> int:
    """A trivial HTTP server on a thread of the prober: its latency is the machine's and the prober's own noise."""
    srv = socket.create_server((HOST, 0))

    def serve() -> None:
        while True:
            conn, _ = srv.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1]


def _timed_probe(port: int, timeout_s: float) -> tuple[float, float, int]:
    """(monotonic start, seconds, status) of one probe."""
    t = time.monotonic()
    try:
        status = _probe_once(port, timeout_s)
    except OSError:
        status = 0
    return t, time.monotonic() - t, status


def probe_health(port: int, every_s: float, timeout_s: float, stop, path: str) -> None:
    """Probe /health every `every_s` until `stop` is set, each followed by a probe of the control server; write
    [(monotonic start, seconds, status, control seconds)] to `path`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    control, rows = _control_server(), []
    while not stop.is_set():
        t, took, status = _timed_probe(port, timeout_s)
        rows.append((t, took, status, _timed_probe(control, timeout_s)[1]))
        time.sleep(max(0.0, every_s - (time.monotonic() - t)))
    Path(path).write_text(json.dumps(rows))


class Prober:
    """The prober process: start, stop, its probes."""

    def __init__(self, cfg: Config, port: int, path: Path) -> None:
        ctx = mp.get_context("spawn")
        self.stop_event, self.path = ctx.Event(), path
        self.proc = ctx.Process(target=probe_health, daemon=True,
                                args=(port, cfg.probe_every_s, cfg.probe_timeout_s, self.stop_event, str(path)))
        self.proc.start()

    def stop(self) -> list[tuple[float, float, int, float]]:
        """Stop probing; every probe as (monotonic start, latency s, status, control latency s)."""
        self.stop_event.set()
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
        return [tuple(r) for r in json.loads(self.path.read_text())] if self.path.exists() else []
