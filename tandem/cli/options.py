"""The knobs of the command line itself (what a command prints or writes), declared as fields like every other
knob (tandem.knob), so that every `tandem` flag comes from a configuration field."""
from __future__ import annotations

from dataclasses import dataclass

from tandem.knob import knob


@dataclass(slots=True)
class OutputOptions:
    """Where and how a command reports."""

    json: bool = knob(False, "print one JSON object instead of a table")
    records: str | None = knob(None, "also write every session's per-round record (TTFT, ITL, placement, KV) as "
                               "JSON lines", metavar="FILE.jsonl")
    no_progress: bool = knob(False, "no progress bar")


@dataclass(slots=True)
class GenerateOptions:
    """Where `tandem generate` writes its sessions."""

    out: str | None = knob(None, "where to write the sessions", metavar="FILE.jsonl")
