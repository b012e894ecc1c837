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


@dataclass(slots=True)
class PlanOutputOptions:
    """How `tandem plan` prints its plan and when it fails."""

    format: str = knob("table", "table, json, or deploy: only the first choice's --deploy string",
                       choices=("table", "json", "deploy"))
    json: bool = knob(False, "same as --format json")
    best_effort: bool = knob(False, "exit 0 even when no deployment meets the SLO at P95")


@dataclass(slots=True)
class ReportFileOptions:
    """Where a command also writes the JSON object it reports (`tandem bench`)."""

    out: str | None = knob(None, "also write the JSON object to FILE", metavar="FILE")


@dataclass(slots=True)
class ProfileFiles:
    """The checkpoint `tandem profile` measures and where it writes the profile."""

    model: str | None = knob(None, "Hugging Face checkpoint directory", metavar="PATH")
    out: str = knob("profile.json", "where to write the profile", metavar="FILE")
