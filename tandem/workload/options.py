"""Which sessions a command runs: the workload knobs every command that reads a workload shares (simulate,
generate, plan, bench, demo), declared once (tandem.knob) so their flags are generated from these fields."""
from __future__ import annotations

from dataclasses import dataclass

from tandem.knob import knob, positive_float, positive_int, seed

PREFILL_BASES = ("input", "prompt")       # what AMPD Table 1's prefill length is read as
DEFAULT_SESSIONS = 200                    # sessions a generator makes when none are asked for
DEFAULT_RATE = 1.0                        # sessions/s of a generator (or a re-timed trace) when none is asked for


@dataclass(slots=True)
class WorkloadOptions:
    """A workload by name (generator or public trace) or file, its size, arrivals and SLO."""

    workload: str | None = knob(None, "generator (toolbench, gaia, hotpotqa, dureader, agentic-long, "
                                "chat-multiturn), public trace (azure-conv, azure-code, mooncake, sharegpt) or a "
                                ".jsonl session file", metavar="NAME|FILE")
    rate: float | None = knob(None, f"session arrival rate per second (generators and re-timed traces: "
                              f"{DEFAULT_RATE:g} when not given; a trace keeps its own times)", parse=positive_float)
    sessions: int | None = knob(None, f"sessions to generate ({DEFAULT_SESSIONS} when not given); for traces and "
                                "files, the first K", parse=positive_int)
    seed: int = knob(0, "seed of the workload (and of the simulator where there is one)", parse=seed)
    override_arrivals: bool = knob(False, "re-time a trace's sessions as a Poisson process at --rate")
    prefill_basis: str | None = knob(None, "what AMPD Table 1's prefill length is read as for generators: new "
                                     "tokens per round (input, the default) or each round's whole prompt (prompt); "
                                     "docs/session-format.md", choices=PREFILL_BASES)
    slo_ttft: float | None = knob(None, "TTFT SLO in seconds (default: the workload's)", parse=positive_float,
                                  metavar="S")
    slo_itl: float | None = knob(None, "mean ITL SLO in seconds (default: the workload's)", parse=positive_float,
                                 metavar="S")
