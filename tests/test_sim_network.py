"""KV-transfer network: flows sharing a link split its bandwidth; NVLink inside a node, NICs across."""
import heapq

import pytest

from tandem.sim.network import Network


class Clock:
    def __init__(self):
        self.heap, self.n = [], 0

    def schedule(self, t, flow, version):
        self.n += 1
        heapq.heappush(self.heap, (t, self.n, flow, version))

    def run(self, net):
        done = {}
        while self.heap:
            t, _, f, v = heapq.heappop(self.heap)
            if v != f.version:
                continue
            net.finish(f, t)
            done[f.payload] = t
        return done


def make(nodes, tps):
    clock = Clock()
    net = Network(nodes, tps, nvlink_bps=100.0, net_bps=10.0, nvlink_latency_s=0.0, net_latency_s=1.0,
                  schedule=clock.schedule)
    return clock, net


def test_single_cross_node_flow_takes_latency_plus_bytes_over_tp_links():
    clock, net = make([0, 1], [2, 4])
    net.start(0, 1, 200.0, "a", 0.0)          # min(2x10 egress, 4x10 ingress) = 20 B/s
    assert clock.run(net) == {"a": pytest.approx(1.0 + 10.0)}


def test_two_flows_from_one_sender_share_its_egress_then_the_survivor_speeds_up():
    clock, net = make([0, 1, 2], [1, 1, 1])
    net.start(0, 1, 100.0, "long", 0.0)
    net.start(0, 2, 50.0, "short", 0.0)       # both at 5 B/s; short done at 10 s (+1 latency)
    done = clock.run(net)
    assert done["short"] == pytest.approx(11.0)
    # long moved 50 B by t=10 (and 5 more until the short one's completion event at 11), then 10 B/s
    assert done["long"] == pytest.approx(11.0 + 45.0 / 10.0 + 1.0)


def test_same_node_flows_use_nvlink():
    clock, net = make([0, 0], [2, 2])
    net.start(0, 1, 400.0, "a", 0.0)
    assert clock.run(net) == {"a": pytest.approx(2.0)}
