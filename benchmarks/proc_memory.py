"""Peak memory of a process tree (RSS and PSS summed over a process and its descendants), sampled on a thread of
its own while the tree runs: benchmarks/engine_vs_vllm.py's memory figures for both systems."""
from __future__ import annotations

import threading


class TreeMemory(threading.Thread):
    """Peak RSS and PSS summed over a process and its descendants.

    RSS every `interval` seconds (/proc/PID/statm: microseconds); PSS every `pss_interval` (it walks the page
    tables: ~20 ms for vLLM's three processes, a CPU share the measured run would otherwise lose). The process
    list is refreshed every second."""

    def __init__(self, pid: int, interval: float = 0.25, pss_interval: float = 2.0):
        super().__init__(daemon=True)
        self.pid, self.interval, self.pss_every = pid, interval, max(1, round(pss_interval / interval))
        self.peak_rss = self.peak_pss = 0
        self._halt = threading.Event()

    def run(self) -> None:
        import psutil
        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        procs, tick = [root], 0
        while not self._halt.is_set():
            if tick % max(1, round(1.0 / self.interval)) == 0:
                try:
                    procs = [root, *root.children(recursive=True)]
                except psutil.Error:
                    break
            rss = pss = 0
            for p in procs:
                try:
                    if tick % self.pss_every == 0:
                        m = p.memory_full_info()
                        pss += getattr(m, "pss", m.rss)
                    rss += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak_rss = max(self.peak_rss, rss)
            self.peak_pss = max(self.peak_pss, pss)
            tick += 1
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)
