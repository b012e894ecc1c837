"""`tandem serve` in a subprocess for benchmarks: started on a free port, awaited until /health answers, stopped
with its workers (SIGINT, then the whole process group)."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from tandem.bench.ports import free_port

TANDEM = [sys.executable, "-m", "tandem.cli"]


@contextlib.contextmanager
def serve_subprocess(serve_args: list[str], logfile: Path, cwd: Path | None = None, timeout_s: float = 180.0,
                     log: Callable[[str], None] | None = None) -> Iterator[tuple[str, int]]:
    """`tandem serve SERVE_ARGS --port P` with its output in `logfile`; yields (URL, pid) once /health is 200."""
    port = free_port()
    cmd = [*TANDEM, "serve", *serve_args, "--port", str(port)]
    if log is not None:
        log("starting: tandem serve " + " ".join(serve_args))
    f = open(logfile, "w")
    # its own process group (stopped as one) but this session, so it shares the session's scheduling priority
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, process_group=0)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tandem serve exited with {proc.returncode}; see {logfile}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() - t0 > timeout_s:
                raise RuntimeError(f"tandem serve did not become healthy in {timeout_s:g} s")
            time.sleep(0.2)
        if log is not None:
            log(f"server healthy after {time.time() - t0:.1f} s")
        yield url, proc.pid
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)                  # serve shuts its workers down itself
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)              # a worker left behind, if any
        f.close()
