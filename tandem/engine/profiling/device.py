"""What a profile was measured on: the CPU or CUDA device, and how loaded the machine was."""
from __future__ import annotations

import os
import platform

import torch


def cpu_name() -> str:
    """The CPU model (/proc/cpuinfo's first `model name`, else what platform says)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(device: torch.device) -> dict:
    """What the profile was measured on: CPU model, cores and torch threads, or the CUDA device."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"type": "cuda", "name": props.name, "memory_bytes": int(props.total_memory),
                "capability": f"{props.major}.{props.minor}", "cuda": torch.version.cuda}
    return {"type": "cpu", "name": cpu_name(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "machine": platform.machine()}


def load_avg() -> float | None:
    """The 1-minute load average (other jobs competing for the cores make timings noisy), if known."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def memory_bandwidth(device: torch.device, nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes/s the device's memory moves in a large copy (read + write counted), median of `repeats`: the γ of
    LAPS's KV terms (KV bytes per token over this) when its boundary is fitted to the profile."""
    import statistics
    import time

    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2 * n * 4 / statistics.median(times[1:])
