"""The knobs of `tandem bench`, declared once (tandem.knob) so the command's flags are generated from these fields:
how to replay (BenchConfig, which tandem.bench.serve_client runs), how many sessions a generated workload has and
which tokenizer counts the synthetic text. Kept apart from the client so the CLI starts without asyncio."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from tandem.knob import knob, positive_float, positive_int, shared
from tandem.workload.options import WorkloadOptions
from tandem.workload.records import SessionRecord

ENDPOINTS = ("chat", "completions")
TOOL_ROLES = ("tool", "user")
DEFAULT_BENCH_SESSIONS = 20          # sessions a generator makes for a live benchmark when none are asked for


@dataclass(slots=True)
class BenchOptions:
    """The workload size and the tokenizer of a live benchmark (None: derived when it runs)."""

    sessions: int | None = knob(None, f"sessions to generate ({DEFAULT_BENCH_SESSIONS} when not given); for traces "
                                "and files, the first K", parse=positive_int)
    tokenizer: str | None = knob(None, "Hugging Face checkpoint dir: synthetic text with exact token counts, and "
                                 "token-id prompts with --endpoint completions (default: ~1 token per filler word)",
                                 metavar="PATH")


@dataclass
class BenchConfig:
    """How to replay: the server, the request shape, and the workload transformations (the knobs of `tandem
    bench`, tandem.knob)."""

    url: str = knob(help="server base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    endpoint: str = knob("chat", "/v1/chat/completions or /v1/completions", choices=ENDPOINTS)
    model: str | None = knob(None, "model name in requests (default: the first of GET /v1/models); a catalogue "
                             "name (e.g. llama-3.1-70b) also selects AMPD's SLOs for generated workloads")
    api_key: str | None = knob(None, "bearer token, sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY "
                               "if set)", metavar="KEY")
    scale: float = knob(1.0, "multiply input/output tokens (floor 1) and tool gaps by F, e.g. 0.05 for a tiny CPU "
                        "model", parse=positive_float, metavar="F")
    max_tokens_cap: int | None = knob(None, "cap every round's output tokens at N (after --scale)", parse=positive_int,
                                      metavar="N")
    tokenizer: object | None = None           # tandem.engine.tokenizer.Tokenizer: exact token counts
    seed: int = shared(WorkloadOptions, "seed")   # also the seed of the synthetic text
    timeout_s: float = knob(600.0, "per-request connect/read timeout in seconds (per read: between chunks)",
                            parse=positive_float, metavar="S", flags=("--timeout",))
    tool_role: str = knob("tool", "chat: role of the message carrying a later round's new tokens", choices=TOOL_ROLES)
    return_token_ids: bool = knob(True, "completions with --tokenizer: ask for the completion's token ids (vLLM's "
                                  "return_token_ids); --no-return-token-ids re-encodes the completion text instead")
    scrape_metrics: bool = True               # read tandem's prefill counters from /metrics before and after
    extra_body: dict | None = None            # merged into every request body
    on_session_done: Callable[[SessionRecord], None] | None = None   # e.g. a progress bar

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.tool_role not in TOOL_ROLES:
            raise ValueError(f"tool_role must be one of {', '.join(TOOL_ROLES)}, got {self.tool_role!r}")
        if not (isinstance(self.scale, (int, float)) and math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale must be a finite number > 0, got {self.scale!r}")
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise ValueError(f"max_tokens_cap must be >= 1, got {self.max_tokens_cap!r}")
        if not (self.timeout_s > 0):
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
