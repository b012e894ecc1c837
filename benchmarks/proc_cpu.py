"""CPU seconds spent by a process tree: a load-independent companion to wall time on a shared machine.

Used by both offline runners of benchmarks/engine_vs_vllm.py (tandem's and vLLM's, which runs in vLLM's own
virtualenv: this module needs only psutil, which both have). With one compute thread, tokens per CPU-second barely
move when other processes share the cores, where tokens per wall-second do.
"""
from __future__ import annotations


def tree_cpu_seconds() -> dict[int, float]:
    """User + system CPU seconds of this process and each descendant, by pid."""
    import psutil

    out = {}
    for p in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


def cpu_seconds_since(before: dict[int, float]) -> float:
    """CPU seconds the process tree spent since `before` (processes started since then count from zero)."""
    return sum(v - before.get(pid, 0.0) for pid, v in tree_cpu_seconds().items())
