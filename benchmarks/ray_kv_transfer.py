"""KV between two Ray nodes: the project's ZeroMQ KV plane (PeerOutbox -> PeerInbox, CURVE, as the workers use it;
and without CURVE for reference) against Ray's object store (ray.put on the sending node, ray.get on the
receiving one), one transfer at a time, for payloads the size of a prefill's KV (keep the faster).

    python benchmarks/ray_kv_transfer.py [--sizes-mib 0.25,4,32,128] [--repeats 10] [--out docs/results/ray_kv]

Starts its own two-node Ray cluster on this machine (tandem.bench.ray_local: `ray start` per node, a custom
resource per node), a sender actor on one node and a receiver actor on the other. Latency = the receiver's clock
when the whole payload is usable (a zmq frame received; ray.get returned the array) minus the sender's clock
before the send (before ray.put: putting the KV into the object store is part of Ray's path). Both nodes are on
this machine, so one clock serves both. Median and p90 of `--repeats` after one warm-up transfer (which
connects and, for CURVE, makes the handshake). Writes results.json and table.md under --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

MIB = 1 << 20
MODES = ("zmq-curve", "zmq-plain", "ray-object-store")


class _Loop:
    """An asyncio loop on a thread of its own: the actor's sockets live on it across method calls."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def run(self, coro, timeout_s: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)


def _codec():
    from tandem.runtime import messages as m
    from tandem.runtime.transport import Codec
    return Codec([m.KVData], frames={m.KVData: 1})


class Receiver:
    """Holds a KV inbox on its node; `next_zmq` is the next transfer's latency; `take_ray` gets an object."""

    def __init__(self) -> None:
        self._io = _Loop()
        self._inbox = None

    def open(self, auth) -> str:
        import ray

        from tandem.runtime.transport import PeerInbox

        async def make():
            if self._inbox is not None:
                self._inbox.close()
            self._inbox = PeerInbox(_codec(), address=f"tcp://{ray.util.get_node_ip_address()}:0", allow_remote=True,
                                    auth=auth)
            return self._inbox.address
        return self._io.run(make())

    def next_zmq(self) -> tuple[float, int]:
        async def recv():
            msg, bufs = await self._inbox.recv()
            got = time.time()
            view = np.frombuffer(bufs[0], dtype=np.uint8)             # usable in place, as the worker reads it
            return got - msg.sent_s, int(view.nbytes)
        return self._io.run(recv())

    def take_ray(self, refs: list, sent_s: float) -> tuple[float, int]:
        import ray
        arr = ray.get(refs[0])
        return time.time() - sent_s, int(arr.nbytes)


class Sender:
    """Sends payloads to a receiver: over a PeerOutbox, or as an object in Ray's object store."""

    def __init__(self) -> None:
        self._io = _Loop()
        self._outbox = None
        self._payload = np.zeros(0, np.uint8)

    def prepare(self, nbytes: int, auth) -> None:
        from tandem.runtime.transport import PeerOutbox
        self._payload = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)

        async def make():
            if self._outbox is not None:
                self._outbox.close(0)
            self._outbox = PeerOutbox(_codec(), auth=auth)
        self._io.run(make())

    def send_zmq(self, address: str) -> None:
        from tandem.runtime import messages as m
        n = int(self._payload.nbytes)
        msg = m.KVData("bench", "history", 0, n // 1024, "uint8", [n], time.time())
        self._io.run(self._outbox.send(address, msg, self._payload, wait_release=True))

    def send_ray(self, receiver) -> tuple[float, int]:
        import ray
        t0 = time.time()
        ref = ray.put(self._payload)
        return ray.get(receiver.take_ray.remote([ref], t0))


def _auth(secure: bool):
    from tandem.runtime.transport import Keys, WorkerAuth
    return WorkerAuth(0, b"", Keys.new(), Keys.new(), Keys.new()) if secure else None


def run(sizes_mib: list[float], repeats: int) -> list[dict]:
    """Every mode at every size on a fresh two-node cluster; one row per (mode, size)."""
    import ray

    from tandem.bench.ray_local import LocalRayCluster
    rows = []
    biggest = int(max(sizes_mib) * MIB)
    with LocalRayCluster(["kv_src", "kv_dst"], cpus=2, object_store_bytes=max(4 * biggest, 256 * MIB)) as rc, \
            rc.driver():
        ray.init(address=rc.address, logging_level="ERROR")
        try:
            src = ray.remote(Sender).options(resources={"kv_src": 0.01}, num_cpus=0).remote()
            dst = ray.remote(Receiver).options(resources={"kv_dst": 0.01}, num_cpus=0, max_concurrency=2).remote()
            for size in sizes_mib:
                nbytes = int(size * MIB)
                for mode in MODES:
                    auth = _auth(mode == "zmq-curve")
                    ray.get(src.prepare.remote(nbytes, auth))
                    lat = []
                    if mode == "ray-object-store":
                        for i in range(repeats + 1):
                            s, n = ray.get(src.send_ray.remote(dst))
                            assert n == nbytes
                            lat.append(s)
                    else:
                        addr = ray.get(dst.open.remote(auth))
                        for i in range(repeats + 1):
                            got = dst.next_zmq.remote()
                            ray.get(src.send_zmq.remote(addr))
                            s, n = ray.get(got)
                            assert n == nbytes
                            lat.append(s)
                    lat = sorted(lat[1:])                            # the first one connects (and shakes hands)
                    med = statistics.median(lat)
                    p90 = lat[min(len(lat) - 1, int(0.9 * len(lat)))]
                    rows.append({"mode": mode, "size_mib": size, "median_ms": med * 1e3, "p90_ms": p90 * 1e3,
                                 "gib_per_s": nbytes / med / (1 << 30)})
                    print(f"{mode:>17} {size:>7g} MiB  median {med * 1e3:8.2f} ms  p90 {p90 * 1e3:8.2f} ms  "
                          f"{nbytes / med / (1 << 30):6.2f} GiB/s", flush=True)
        finally:
            ray.shutdown()
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: one row per size, each mode's median latency (GiB/s)."""
    sizes = sorted({r["size_mib"] for r in rows})
    by = {(r["mode"], r["size_mib"]): r for r in rows}
    lines = ["| KV payload | " + " | ".join(MODES) + " | faster |", "|---" * (len(MODES) + 2) + "|"]
    for s in sizes:
        cells = [f"{by[m, s]['median_ms']:.2f} ms ({by[m, s]['gib_per_s']:.2f} GiB/s)" for m in MODES]
        best = min(("zmq-curve", "ray-object-store"), key=lambda m: by[m, s]["median_ms"])
        lines.append(f"| {s:g} MiB | " + " | ".join(cells) + f" | {best} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run, print, write results.json and table.md."""
    from tandem.bench.provenance import report_meta
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mib", default="0.25,4,32,128")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default="docs/results/ray_kv")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    rows = run([float(x) for x in a.sizes_mib.split(",")], a.repeats)
    meta = report_meta("benchmarks/ray_kv_transfer.py", argv if argv is not None else sys.argv[1:],
                       time.perf_counter() - t0)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    md = (f"`{meta['command']}` — {meta['machine']}, {meta['date']}, commit {meta['commit']}; median of "
          f"{a.repeats} one-at-a-time transfers between two Ray nodes on this machine.\n\n" + table(rows))
    (out / "table.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
