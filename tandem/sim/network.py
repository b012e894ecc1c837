"""Simulated KV-transfer network: per-worker egress/ingress links shared fairly by concurrent flows."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class Flow:
    """One KV transfer in flight."""

    src: int
    dst: int
    remaining: float            # bytes still to move
    latency_s: float
    payload: object
    start_s: float
    rate: float = 0.0           # bytes/s currently granted
    updated_s: float = 0.0
    version: int = 0
    links: tuple = field(default_factory=tuple)


class Network:
    """Bandwidth model: a flow's rate is the smaller fair share of its source egress and destination ingress.

    A flow completes `latency_s` after its last byte leaves. Workers on the same node talk over NVLink, others over the inter-node NICs; each worker has
    `tp` GPUs and so `tp` links of each kind. `schedule(time, flow, version)` is supplied by the
    event loop; stale completions are recognised by their version.
    """

    def __init__(self, nodes: list[int], tps: list[int], nvlink_bps: float, net_bps: float,
                 nvlink_latency_s: float, net_latency_s: float, schedule) -> None:
        self.nodes, self.tps = nodes, tps
        self.nvlink_bps, self.net_bps = nvlink_bps, net_bps
        self.nvlink_latency_s, self.net_latency_s = nvlink_latency_s, net_latency_s
        self.schedule = schedule
        self.on_link: dict[tuple, list[Flow]] = {}
        self.bytes_moved = 0.0

    def _capacity(self, link: tuple) -> float:
        w, kind, _ = link
        return self.tps[w] * (self.nvlink_bps if kind == "nv" else self.net_bps)

    def start(self, src: int, dst: int, nbytes: float, payload: object, now: float) -> Flow:
        """Begin moving `nbytes` from worker `src` to `dst`."""
        same = self.nodes[src] == self.nodes[dst]
        kind = "nv" if same else "net"
        latency = self.nvlink_latency_s if same else self.net_latency_s
        flow = Flow(src, dst, float(nbytes), latency, payload, now, updated_s=now,
                    links=((src, kind, "out"), (dst, kind, "in")))
        self.bytes_moved += nbytes
        for link in flow.links:
            self.on_link.setdefault(link, []).append(flow)
        self._rebalance(flow.links, now)
        return flow

    def finish(self, flow: Flow, now: float) -> None:
        """Remove a completed flow and give its bandwidth to the others."""
        for link in flow.links:
            self.on_link[link].remove(flow)
        self._rebalance(flow.links, now)

    def _rebalance(self, links: tuple, now: float) -> None:
        touched: dict[int, Flow] = {}
        for link in links:
            for f in self.on_link.get(link, ()):
                touched[id(f)] = f
        for f in touched.values():
            f.remaining -= f.rate * (now - f.updated_s)
            if f.remaining < 0:
                f.remaining = 0.0
            f.updated_s = now
            rate = min(self._capacity(link) / len(self.on_link[link]) for link in f.links)
            f.rate = rate
            f.version += 1
            self.schedule(now + f.remaining / rate + f.latency_s, f, f.version)
