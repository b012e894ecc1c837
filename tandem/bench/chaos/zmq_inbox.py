"""Strangers at a worker's KV inbox: raw ZMTP 3.0 clients that greet with CURVE and declare a huge frame.

No key is ever presented: the worker must refuse the frame (a declared size over the inbox's cap drops the
connection at once) or hold at most one cap-sized frame until its handshake timeout, and give the memory back.
Each connection is a plain TCP socket speaking the wire format by hand (a ZeroMQ library would refuse to send
such frames); everything goes to 127.0.0.1 and is bounded in count and time."""
from __future__ import annotations

import contextlib
import json
import re
import socket
import struct
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil

from tandem.bench.chaos import ChaosContext, Outcome
from tandem.bench.serve_process import serve_subprocess

MiB = 1 << 20
HUGE = 1 << 30                 # the declared frame of the attack as first reported: 1 GiB
CONNECTIONS = 3                # strangers per inbox at once
PER_CONNECTION_LIMIT = 80 * MiB   # a stranger's connection may add less than this to the worker's RSS
FREED_WITHIN_S = 5.0           # ... and the worker must be back within this long after the strangers stop
SLACK = 16 * MiB               # RSS noise allowed "after" (allocator, the worker's own work)
BURST = 64 * MiB               # at most this much of a declared frame is sent at full speed, the rest trickles
TRICKLE_S = 0.5                # then one byte this often (a slow sender; the handshake timeout is absolute)


def curve_greeting() -> bytes:
    """A ZMTP 3.0 greeting (64 bytes): signature, version 3.0, mechanism CURVE, as-server 0, filler."""
    return b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0]) + b"CURVE".ljust(20, b"\0") + b"\0" + b"\0" * 31


def long_frame_header(size: int, command: bool = True) -> bytes:
    """The header of a ZMTP long frame of `size` bytes (flags LONG, and COMMAND as a CURVE HELLO would be)."""
    return bytes([0x02 | (0x04 if command else 0)]) + struct.pack(">Q", size)


class Stranger:
    """One raw TCP connection: greeting, then a frame header declaring `declared` bytes, then up to `fill` of them
    as fast as the peer takes them, then one byte every TRICKLE_S. Non-blocking; `pump()` moves it along."""

    def __init__(self, port: int, declared: int, fill: int) -> None:
        self.declared, self.fill, self.sent = declared, min(fill, declared), 0
        self.opened_s = time.monotonic()
        self.closed_s: float | None = None          # when the peer closed it (None: still open)
        self._next_trickle = 0.0
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.sock.sendall(curve_greeting() + long_frame_header(declared))
        self.sock.setblocking(False)
        self._chunk = b"\0" * MiB

    @property
    def open(self) -> bool:
        return self.closed_s is None

    def pump(self) -> None:
        """Send what the peer takes now; notice a close."""
        if not self.open:
            return
        try:
            if self.sock.recv(4096, socket.MSG_PEEK) == b"":
                self._closed()
                return
        except BlockingIOError:
            pass                                    # nothing to read: still open
        except OSError:
            self._closed()
            return
        try:
            while self.sent < self.fill:
                n = self.sock.send(self._chunk[:min(MiB, self.fill - self.sent)])
                if n <= 0:
                    break
                self.sent += n
            now = time.monotonic()
            if self.sent >= self.fill and self.sent < self.declared and now >= self._next_trickle:
                self.sent += self.sock.send(b"\0")
                self._next_trickle = now + TRICKLE_S
        except BlockingIOError:
            pass
        except OSError:
            self._closed()

    def _closed(self) -> None:
        self.closed_s = time.monotonic()
        self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


@dataclass
class Attack:
    """RSS of the attacked process (bytes) before, at its peak while the strangers were at it, and `after_s` after
    they stopped; and how long each stranger's connection stayed open (None: still open when they stopped)."""

    before: int
    peak: int
    after: int
    after_s: float
    held_s: list[float | None]

    @property
    def per_connection(self) -> float:
        return max(0, self.peak - self.before) / max(1, len(self.held_s))


def attack_inboxes(targets: list[tuple[int, int]], declared: int, fill: int, hold_s: float,
                   connections: int = CONNECTIONS, after_s: float = FREED_WITHIN_S,
                   sample_s: float = 0.05) -> list[Attack]:
    """For each (pid, port) in `targets` at once: `connections` strangers at the port for `hold_s` (or until all are
    closed), the pid's RSS sampled meanwhile, then `after_s` after they stopped. One Attack per target."""
    procs = [psutil.Process(pid) for pid, _ in targets]
    before = [p.memory_info().rss for p in procs]
    peak = list(before)
    strangers = [[Stranger(port, declared, fill) for _ in range(connections)] for _, port in targets]
    everyone = [s for group in strangers for s in group]
    try:
        t_end = time.monotonic() + hold_s
        while time.monotonic() < t_end and any(s.open for s in everyone):
            for s in everyone:
                s.pump()
            peak = [max(pk, p.memory_info().rss) for pk, p in zip(peak, procs)]
            time.sleep(sample_s if all(s.sent >= s.fill or not s.open for s in everyone) else 0.001)
        peak = [max(pk, p.memory_info().rss) for pk, p in zip(peak, procs)]
    finally:
        for s in everyone:
            s.close()
    time.sleep(after_s)
    return [Attack(b, pk, p.memory_info().rss, after_s,
                   [None if s.open else round(s.closed_s - s.opened_s, 2) for s in group])
            for b, pk, p, group in zip(before, peak, procs, strangers)]


def worker_inboxes(serve_pid: int) -> list[tuple[int, int]]:
    """(pid, port) of every worker's KV inbox: the TCP listeners of the server's descendants (the coordinator's own,
    HTTP and its hub, are not among them; a worker listens on its inbox only)."""
    found = []
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(serve_pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                for c in child.net_connections(kind="tcp"):
                    if c.status == psutil.CONN_LISTEN and c.laddr.ip == "127.0.0.1":
                        found.append((child.pid, c.laddr.port))
    return sorted(found)


def served_kv_cap(url: str, model: Path) -> int:
    """The KV inbox cap the served deployment must have: its model's KV geometry (config.json), its block size and
    cache dtype (/metrics, vllm:cache_config_info) and max_model_len (/v1/models), as the workers compute it."""
    from tandem.engine.kv_transfer import kv_message_max_bytes

    cfg = json.loads((model / "config.json").read_text())
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        max_len = int(json.load(r)["data"][0]["max_model_len"])
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        info = next(line for line in r.read().decode().splitlines() if line.startswith("vllm:cache_config_info{"))
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return kv_message_max_bytes(int(labels["block_size"]), cfg["num_hidden_layers"],
                                cfg.get("num_key_value_heads", cfg["num_attention_heads"]), head_dim,
                                labels["cache_dtype"], max_len)


def _mib(n: float) -> str:
    return f"{n / MiB:.0f} MiB"


def judge(what: str, att: Attack, must_close_s: float | None) -> Outcome:
    """The row for one attack on one worker: under PER_CONNECTION_LIMIT per connection, back within SLACK of its
    start FREED_WITHIN_S after, and (when `must_close_s`) every connection closed by the worker within that long."""
    grew, left = att.per_connection, att.after - att.before
    closed = must_close_s is None or all(h is not None and h <= must_close_s for h in att.held_s)
    ok = grew < PER_CONNECTION_LIMIT and left <= SLACK and closed
    expected = (f"< {_mib(PER_CONNECTION_LIMIT)} RSS per connection, back within {_mib(SLACK)} "
                f"{att.after_s:g} s after" + (f", closed by the worker within {must_close_s:g} s"
                                             if must_close_s is not None else ""))
    observed = (f"RSS {_mib(att.before)} -> {_mib(att.peak)} with {len(att.held_s)} connections "
                f"(+{_mib(grew)} each) -> {_mib(att.after)} {att.after_s:g} s after; connections open for "
                f"{att.held_s} s")
    return Outcome(what, expected, observed, ok)


def probe_kv_inbox(ctx: ChaosContext) -> list[Outcome]:
    """Start `tandem serve` (1 prefill + 1 decode worker, the tiny model); at every worker's KV inbox at once, 3
    strangers declaring 1 GiB frames (the attack as first reported), then 3 declaring frames of exactly the inbox's
    cap and sending all but its last KiB, then trickling (the most a stranger can make a worker hold, until the
    handshake timeout)."""
    from tandem.runtime.transport import HANDSHAKE_S

    ctx.workdir.mkdir(parents=True, exist_ok=True)
    args = ["--model", str(ctx.ar_model), "--prefill-workers", "1", "--decode-workers", "1"]
    with serve_subprocess(args, ctx.workdir / "zmq_inbox_serve.log") as (url, pid):
        inboxes = worker_inboxes(pid)
        if len(inboxes) != 2:
            return [Outcome("find the workers' KV inboxes", "2 listening worker sockets", f"found {inboxes}", False)]
        cap = served_kv_cap(url, ctx.ar_model)
        ctx.notes.append(f"KV inbox cap of the served tiny model: {cap} bytes")
        outcomes = [judge(f"{CONNECTIONS} strangers declare a 1 GiB CURVE frame at worker pid {wpid}'s KV inbox and "
                          f"stream up to {_mib(BURST)} of it", att, must_close_s=1.0)
                    for (wpid, _), att in zip(inboxes, attack_inboxes(inboxes, HUGE, BURST, HANDSHAKE_S + 1.0))]
        outcomes += [judge(f"{CONNECTIONS} strangers declare a frame of the inbox's cap ({_mib(cap)}) at worker pid "
                           f"{wpid}'s KV inbox, send all but its last KiB, then trickle", att,
                           must_close_s=HANDSHAKE_S + 2.0)
                     for (wpid, _), att in zip(inboxes, attack_inboxes(inboxes, cap, cap - 1024, HANDSHAKE_S + 3.0))]
        alive = [p for p, _ in inboxes if _running(p)]
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            healthy = r.status == 200
        outcomes.append(Outcome("the server after the strangers", "both workers alive, /health 200",
                                f"{len(alive)} workers alive, /health {'200' if healthy else 'not 200'}",
                                len(alive) == 2 and healthy))
    return outcomes


def _running(pid: int) -> bool:
    try:
        p = psutil.Process(pid)
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


PROBES = [probe_kv_inbox]
