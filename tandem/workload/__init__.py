"""Workloads: sessions and their JSONL format, public traces, synthetic generators, arrival processes."""
from tandem.workload.arrivals import check_rate, check_seed, poisson_arrivals, with_arrivals
from tandem.workload.generators import (
    AGENTIC_LONG,
    CHAT,
    CHAT_SLO,
    GENERATOR_NAMES,
    PAPER_GPUS,
    PAPER_SLOS,
    WORKLOAD_SLOS,
    WORKLOADS,
    AgenticLongSpec,
    ChatSpec,
    WorkloadSpec,
    agentic_long,
    chat_multiturn,
    default_slo,
    generate,
    paper_slo,
    workload_spec,
)
from tandem.workload.records import RoundRecord, SessionRecord
from tandem.workload.session import (
    SLO,
    Round,
    Session,
    WorkloadError,
    dump_sessions,
    load_sessions,
    parse_session,
    round_to_dict,
    session_to_dict,
)
from tandem.workload.traces import (
    TRACE_FILES,
    load_azure,
    load_mooncake,
    load_sharegpt,
    load_trace,
    sharegpt_lengths,
    trace_path,
    traces_dir,
)

__all__ = [
    "AGENTIC_LONG", "CHAT", "CHAT_SLO", "GENERATOR_NAMES", "PAPER_GPUS", "PAPER_SLOS", "TRACE_FILES",
    "WORKLOAD_SLOS", "WORKLOADS",
    "SLO", "AgenticLongSpec", "ChatSpec", "Round", "RoundRecord", "Session", "SessionRecord", "WorkloadError",
    "WorkloadSpec",
    "agentic_long", "chat_multiturn", "check_rate", "check_seed", "default_slo", "dump_sessions", "generate",
    "load_azure", "load_mooncake", "load_sessions", "load_sharegpt", "load_trace", "paper_slo", "parse_session",
    "poisson_arrivals", "round_to_dict", "session_to_dict", "sharegpt_lengths", "trace_path", "traces_dir",
    "with_arrivals", "workload_spec",
]
