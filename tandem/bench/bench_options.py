"""The knobs of `tandem bench` that are not BenchConfig's (tandem.bench.serve_client): how many sessions a generated
workload has and which tokenizer counts the synthetic text, declared once (tandem.knob) so the command's flags are
generated from these fields."""
from __future__ import annotations

from dataclasses import dataclass

from tandem.knob import knob, positive_int

DEFAULT_BENCH_SESSIONS = 20          # sessions a generator makes for a live benchmark when none are asked for


@dataclass(slots=True)
class BenchOptions:
    """The workload size and the tokenizer of a live benchmark (None: derived when it runs)."""

    sessions: int | None = knob(None, f"sessions to generate ({DEFAULT_BENCH_SESSIONS} when not given); for traces "
                                "and files, the first K", parse=positive_int)
    tokenizer: str | None = knob(None, "Hugging Face checkpoint dir: synthetic text with exact token counts, and "
                                 "token-id prompts with --endpoint completions (default: ~1 token per filler word)",
                                 metavar="PATH")
