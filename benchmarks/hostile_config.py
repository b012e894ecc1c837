"""The hostile-input run's bounds (Config), what it records (Results) and the constants its parts share."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console


HOST = "127.0.0.1"
PARTS = ("hostile", "slow", "frames", "streams")
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
HEALTH_LIMIT_S = 0.1
RSS_TOLERANCE = 0.10
MAX_ERROR_BODY = 4096          # an error body larger than this echoes the input
USER = [{"role": "user", "content": "hello"}]
console = Console()


# ---------------------------------------------------------------------------- configuration
@dataclass
class Config:
    """The run's bounds (all from the command line)."""

    out: Path
    duration_s: float = 60.0
    streams: int = 200
    max_waves: int = 3
    max_tokens: int = 16
    baseline_s: float = 3.0
    settle_s: float = 5.0
    probe_every_s: float = 0.02
    probe_timeout_s: float = 2.0
    body_timeout_s: float = 10.0
    slowloris: int = 16
    slowloris_s: float = 30.0
    hostile_concurrency: int = 4
    request_timeout_s: float = 30.0
    seed: int = 0
    client_nice: int = 0
    server_env: tuple[str, ...] = ()      # KEY=VALUE set for `tandem serve` (e.g. MALLOC_MMAP_THRESHOLD_=131072)
    skip: tuple[str, ...] = ()            # parts left out (to find which part causes what): PARTS


# ---------------------------------------------------------------------------- results collected while running
@dataclass
class Results:
    """Everything the attack records."""

    hostile: list[dict] = field(default_factory=list)       # {case, status, seconds, failure}
    slow: list[dict] = field(default_factory=list)          # slowloris and pending-body outcomes
    frames: list[dict] = field(default_factory=list)        # {port, role, probe, outcome}
    streams: list[dict] = field(default_factory=list)       # {wave, ok, failure, seconds}
    rss: list[tuple[float, int]] = field(default_factory=list)
    phases: list[tuple[str, float, float]] = field(default_factory=list)
    warmup_failures: list[str] = field(default_factory=list)
