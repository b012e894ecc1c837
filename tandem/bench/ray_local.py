"""A Ray cluster of several nodes on this machine, each a `ray start --block` process of its own (a head, then
workers joining it), stopped by ending those processes: what the Ray tests and benchmarks run on (docs/ray.md).

Only the processes it started are stopped (never `ray stop`, which ends every Ray process of the user). Each node
gets its own custom resource label, so work can be pinned to a node the way a real cluster pins it to a host.
The cluster requires Ray's token authentication with a token of its own (`env`: give it to every driver, e.g.
`with rc.driver():` in this process, or `env={**os.environ, **rc.env}` for a subprocess), so whatever token
~/.ray holds from earlier Ray runs never decides whether its nodes can join.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

START_TIMEOUT_S = 60.0
_ADDRESS = re.compile(r"ray start --address='([^']+)'")


@dataclass
class LocalRayCluster:
    """`labels[i]` names node i's custom resource (node 0 is the head); `cpus` logical CPUs per node.

    Use as a context manager: `with LocalRayCluster(["node_p", "node_d"]) as rc: ... rc.address ...`."""

    labels: Sequence[str] = ("node_a", "node_b")
    cpus: int = 1
    object_store_bytes: int = 80 << 20
    address: str = ""
    procs: list[subprocess.Popen] = field(default_factory=list)
    temp_dir: str = ""
    env: dict[str, str] = field(default_factory=dict)      # RAY_AUTH_MODE, RAY_AUTH_TOKEN of this cluster

    def start(self) -> LocalRayCluster:
        """Start the head, then the other nodes; returns once every node has joined."""
        ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
        if ray_bin is None:
            raise RuntimeError("the `ray` command is not installed: pip install 'tandem[ray]'")
        # Ray puts sockets under its temp folder, whose path must stay short (AF_UNIX): /tmp, not pytest's tmp_path
        self.temp_dir = tempfile.mkdtemp(prefix="tray-", dir="/tmp")
        self.env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex}
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", **self.env)
        env.pop("RAY_ADDRESS", None)
        env.pop("RAY_AUTH_TOKEN_PATH", None)
        try:
            for i, label in enumerate(self.labels):
                args = [ray_bin, "start", "--block", "--num-cpus", str(self.cpus), "--num-gpus", "0",
                        "--resources", json.dumps({label: 1}), "--object-store-memory", str(self.object_store_bytes),
                        "--disable-usage-stats"]
                args += (["--head", "--port", "0", "--include-dashboard", "false", "--temp-dir", self.temp_dir]
                         if i == 0 else ["--address", self.address])
                proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                        start_new_session=True)
                self.procs.append(proc)
                self._await_started(proc, head=i == 0)
        except BaseException:
            self.stop()
            raise
        return self

    def _await_started(self, proc: subprocess.Popen, head: bool) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        seen: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line.rstrip())
            m = _ADDRESS.search(line)
            if head and m:
                self.address = m.group(1)
            if "block forever" in line:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"ray start did not start within {START_TIMEOUT_S:g} s: {seen[-5:]}")
        else:
            raise RuntimeError(f"ray start exited with code {proc.wait()}: {seen[-8:]}")
        if head and not self.address:
            raise RuntimeError(f"ray start --head printed no address: {seen[-8:]}")
        # keep reading its output so a full pipe never blocks it
        import threading
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()

    def stop(self) -> None:
        """End the nodes this cluster started (workers first, then the head) and remove its temp folder."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(5)
        self.procs.clear()
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    @contextlib.contextmanager
    def driver(self) -> Iterator[None]:
        """This process may join the cluster as a driver while the block runs (its token in os.environ)."""
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def __enter__(self) -> LocalRayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["LocalRayCluster"]
