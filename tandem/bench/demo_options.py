"""The knobs of `tandem demo` (tandem.bench.demo): which sessions it replays, at what load and SLO, against which
baseline, on which model, and where it writes; declared as fields (tandem.knob) so the demo's flags are generated
from them. Its server flags are `tandem serve`'s (ClusterConfig, EngineConfig)."""
from __future__ import annotations

from dataclasses import dataclass

from tandem.knob import knob, positive_float, positive_int, shared, unit_fraction
from tandem.workload.options import WorkloadOptions

DEFAULT_BASELINE = "dynamo"
DEFAULT_LOAD = 0.65          # the demo's rate as a share of the profiled capacity
DEFAULT_SLO_FACTOR = 5.0     # the demo's SLO as a multiple of the profiled unloaded latencies (their p90)
DEFAULT_THREADS = 1              # torch threads per worker when neither --threads nor OMP_NUM_THREADS says
DEMO_MODEL = "models/tiny-qwen3-1m"       # the tiny checkpoint the demo makes once when no --model is given
DEMO_MAX_MODEL_LEN = 4096                 # the demo's context: its scaled sessions and its quick profile fit it
DEFAULT_DEMO_WORKLOAD = "toolbench"
DEFAULT_DEMO_SESSIONS = 30
DEFAULT_DEMO_SCALE = 0.5
DEFAULT_DEMO_MAX_TOKENS_CAP = 16


@dataclass(slots=True)
class DemoOptions:
    """What `tandem demo` replays and how it compares the policies."""

    model: str | None = knob(None, f"Hugging Face checkpoint directory (default: {DEMO_MODEL}, a tiny Qwen3 made "
                             f"once)", metavar="PATH")
    threads: int | None = knob(None, f"torch threads per worker (default: $OMP_NUM_THREADS, else {DEFAULT_THREADS})",
                               parse=positive_int, metavar="N")
    max_model_len: int = knob(DEMO_MAX_MODEL_LEN, "the longest sequence (prompt + output) a request may have: the "
                              "demo profiles and serves its model at a context its sessions fit (EngineConfig's "
                              "max_model_len)", parse=positive_int, metavar="N")
    workload: str = knob(DEFAULT_DEMO_WORKLOAD, "the generator whose sessions are replayed (toolbench, gaia, "
                         "hotpotqa, dureader, agentic-long, chat-multiturn)", metavar="NAME")
    sessions: int = knob(DEFAULT_DEMO_SESSIONS, "sessions replayed per policy", parse=positive_int)
    rate: float | None = knob(None, "sessions/s (default: --load x the capacity the machine's profile gives 1P+1D)",
                              parse=positive_float)
    load: float = knob(DEFAULT_LOAD, "the calibrated rate as a share of the profiled capacity", parse=unit_fraction,
                       metavar="F")
    slo_factor: float = knob(DEFAULT_SLO_FACTOR, "the calibrated SLO as K x the profiled unloaded TTFT and ITL",
                             parse=positive_float, metavar="K")
    baseline: str = knob(DEFAULT_BASELINE, "the policy compared with AMPD on the same two worker processes (a "
                         "co-located one runs --colocated 2; ampd: no comparison)")
    scale: float = knob(DEFAULT_DEMO_SCALE, "token counts and tool gaps x this", parse=positive_float)
    max_tokens_cap: int = knob(DEFAULT_DEMO_MAX_TOKENS_CAP, "the most output tokens of any round",
                               parse=positive_int, metavar="N")
    seed: int = shared(WorkloadOptions, "seed")
    out: str = knob("reports/demo", "where the comparison table, its PNG and results.json go", metavar="DIR")
    verbose: bool = knob(False, "also print each run's full `tandem bench` table")
