"""dLLM-Serve (../shared/papers/dllm-serve-memory-footprint.txt): the Refresh/Reuse phases of block-diffusion
requests and phase-multiplexed admission under a query-token budget, with the request-level baselines."""
from tandem.policy.dllm_serve.admission import (
    Admission, AdmissionMode, Candidate, DllmServe, DllmServeStats, Selection, parse_admission,
)
from tandem.policy.dllm_serve.phases import (
    DEFAULT_DELAY_STEP, DEFAULT_RETENTION, Phase, PhaseSchedule, PhaseSpec, PhaseState, RefreshSpan, canvas_max_tokens,
)

__all__ = ["Admission", "AdmissionMode", "Candidate", "DEFAULT_DELAY_STEP", "DEFAULT_RETENTION", "DllmServe",
           "DllmServeStats", "Phase", "PhaseSchedule", "PhaseSpec", "PhaseState", "RefreshSpan", "Selection",
           "canvas_max_tokens", "parse_admission"]
