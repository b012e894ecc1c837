"""Simulate the measured end-to-end runs aiconfigurator-core ships (`systems/silicon_sample.csv`) and compare.

Each row is one benchmark run of vLLM, SGLang or TRT-LLM: a model on a GPU at a precision, co-located (agg) or
disaggregated, a closed loop of `c` clients with inputs of isl and outputs of osl tokens, and the TTFT and TPOT it
measured. Two clients made them (see docs/cost-models.md, "Validation against silicon"):
- SemiAnalysis InferenceX (rows whose source is a dated InferenceX export or a db-dump): vLLM's benchmark_serving,
  10 x c requests with input and output lengths uniform in [0.8 L, L], EOS ignored; its 2 x c warm-up requests run
  to completion first, so the measured run starts cold, with all c clients sending at once;
- NVIDIA's gap analysis (the other rows): aiperf, 20 x c requests of exactly isl and osl tokens, after a warm-up
  that likewise ends before the measured phase.
TPOT is (latency - TTFT) / (output tokens - 1) per request; the rows keep the run's mean TTFT and mean TPOT (NVIDIA's
aisimulate accuracy driver fills silicon_ttft_ms / silicon_tpot_ms from InferenceX's mean_ttft / mean_tpot), which
the simulation is compared with; its medians are reported beside them. A row is simulated the same way under the
framework's scheduler defaults; a row tandem cannot represent is listed with the reason.
"""
from __future__ import annotations

import csv
import random
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from tandem.core.deploy import parse_deploy
from tandem.perf.errors import UnknownNameError
from tandem.perf.hardware import get_gpu
from tandem.perf.measured.frameworks import framework_defaults
from tandem.perf.measured.source import MissingCostData, data_root
from tandem.perf.models import get_model
from tandem.workload.session import Round, Session

SYSTEM_GPUS = {"h100_sxm": "h100", "h200_sxm": "h200", "a100_sxm": "a100-80g", "l40s": "l40s"}


@dataclass(frozen=True)
class Client:
    """How a row's load generator issued requests."""

    name: str
    requests_per_client: int      # requests of the measured run, per unit of concurrency
    range_ratio: float            # lengths uniform in [ratio x L, L] (1.0: exactly L)


INFERENCEX = Client("inferencex", 10, 0.8)
GAP_ANALYSIS = Client("aiperf", 20, 1.0)
CLIENTS = {c.name: c for c in (INFERENCEX, GAP_ANALYSIS)}


def client_of(row: dict) -> Client:
    """The load generator of a row, from its provenance."""
    src = row.get("silicon_data_source", "")
    return INFERENCEX if re.search(r"source_file=20\d\d-\d\d-\d\d\.csv|db-dump", src) else GAP_ANALYSIS


def silicon_csv() -> Path:
    """The package's silicon_sample.csv (MissingCostData naming the install when absent)."""
    return data_root().parent / "silicon_sample.csv"


@dataclass(frozen=True)
class Case:
    """One silicon row as a simulation."""

    row_id: str
    framework: str
    model: str
    gpu: str
    precision: str
    kv_cache_dtype: str
    mode: str                 # agg or disagg
    deploy: str
    concurrency: int
    isl: int
    osl: int
    ttft_ms: float            # measured
    tpot_ms: float
    client: Client = INFERENCEX


@dataclass(frozen=True)
class Skipped:
    row_id: str
    reason: str


def read_rows(path: Path | None = None) -> list[dict]:
    """The CSV's rows as dicts of strings."""
    with open(path or silicon_csv(), newline="") as f:
        return list(csv.DictReader(f))


def _int(v: str) -> int:
    return int(float(v)) if v not in ("", None) else 0


def _recorded_workers(row: dict, key: str) -> int:
    """A disaggregated row's worker count for `key` (prefill or decode): its column, else the same field in its
    provenance string; 0 when neither records it."""
    n = _int(row.get(f"{key}_num_workers"))
    if n:
        return n
    m = re.search(rf"{key}_num_workers=(\d+)", row.get("silicon_data_source", ""))
    return int(m.group(1)) if m else 0


def _worker(spec, row: dict, prefix: str, gpus_per_node: int) -> str | Skipped:
    """One worker's parallelism as a deployment's `tpN[epE]`, or why it cannot be represented: attention data or
    pipeline parallelism, tensor parallelism across nodes, experts sharded over other GPUs than attention's."""
    rid = row["id"]
    if _int(row[f"{prefix}attention_dp_size"]) > 1 or _int(row[f"{prefix}pp_size"]) > 1:
        return Skipped(rid, "attention data parallelism or pipeline parallelism")
    tp = _int(row[f"{prefix}tp_size"])
    if tp > gpus_per_node:
        return Skipped(rid, f"tensor parallelism across nodes (tp{tp} over {gpus_per_node}-GPU nodes)")
    if not spec.is_moe:
        return f"tp{tp}"
    ep = max(1, _int(row.get(f"{prefix}moe_ep_size")))
    moe_tp = _int(row.get(f"{prefix}moe_tp_size")) or tp // ep
    if moe_tp * ep != tp:
        return Skipped(rid, "experts sharded over other GPUs than attention (moe_tp x moe_ep differs from tp)")
    return f"tp{tp}ep{ep}" if ep > 1 else f"tp{tp}"


def to_case(row: dict) -> Case | Skipped:
    """The simulation of a row, or why it cannot be represented."""
    rid = row["id"]
    gpu = SYSTEM_GPUS.get(row["system"])
    if gpu is None:
        return Skipped(rid, f"GPU {row['system']} is not in tandem's catalogue")
    gpus_per_node = get_gpu(gpu).gpus_per_node
    try:
        spec = get_model(row["model_path"])
    except UnknownNameError:
        return Skipped(rid, f"model {row['model_path']} is not in tandem's catalogue")
    prec = row["precision"]
    if not prec and not row.get("gemm_quant_mode"):
        prec = "bf16"                 # no precision and no quantisation recorded: the checkpoint's own (bf16) weights
    if prec not in ("bf16", "fp8"):
        return Skipped(rid, f"precision {prec or 'unrecorded'} (tandem models bf16 and fp8)")
    if prec == "fp8":                 # per-tensor scales (fp8) or 128x128-block scales (fp8_block): Qwen's -FP8
        # checkpoints and DeepSeek-V3/R1's native weights are block-quantised (their model cards), whatever
        # quantisation label the row carries
        block = "block" in (row.get("gemm_quant_mode") or "") or re.match(r"(?i)qwen/.*-fp8$", row["model_path"]) \
            or spec.weight_dtype == "fp8_block"
        prec = "fp8_block" if block else "fp8"
    m = re.search(r"silicon_concurrency=(\d+)", row.get("silicon_data_source", ""))
    conc = int(m.group(1)) if m else _int(row["batch_size"])
    if conc < 1:
        return Skipped(rid, "no concurrency recorded")
    # KV cache: fp8 where the checkpoint says so (NVIDIA ModelOpt FP8 checkpoints) or TRT-LLM runs an fp8 model
    # (its fp8 recipes quantise the cache); vLLM and SGLang keep the model dtype by default (--kv-cache-dtype auto)
    kv = "fp8" if prec != "bf16" and (row["model_path"].startswith("nvidia/") or row["backend"] == "trtllm") \
        else "bf16"
    mode = row["mode"]
    if mode == "agg":
        w = _worker(spec, row, "", gpus_per_node)
        if isinstance(w, Skipped):
            return w
        deploy = f"C:{w}x1"
    else:
        parts = []
        for role, key in (("P", "prefill"), ("D", "decode")):
            w = _worker(spec, row, f"{key}_", gpus_per_node)
            if isinstance(w, Skipped):
                return w
            n = _recorded_workers(row, key)
            if n < 1:
                return Skipped(rid, "disaggregated worker counts not recorded (neither columns nor provenance)")
            parts.append(f"{role}:{w}x{n}")
        deploy = ",".join(parts)
    return Case(rid, row["backend"], spec.name, gpu, prec, kv, mode, deploy, conc, _int(row["isl"]),
                _int(row["osl"]), float(row["silicon_ttft_ms"]), float(row["silicon_tpot_ms"]), client_of(row))


def sessions(case: Case, seed: int = 0, scale: float = 1.0, warmup: int = 0) -> list[Session]:
    """The measured run's requests as one-round sessions, in the order the clients send them (`scale` shortens the
    run: fewer requests per client, at least one), after `warmup` x c warm-up requests ("w" ids) sent through the
    same closed loop (0: the run starts cold, as when the warm-up drains first)."""
    rng = random.Random(seed)
    n = case.concurrency * max(1, round(case.client.requests_per_client * scale))
    r = case.client.range_ratio
    out = []
    for i in range(warmup * case.concurrency + n):
        isl = rng.randint(max(1, int(case.isl * r)), case.isl)
        osl = rng.randint(max(2, int(case.osl * r)), max(2, case.osl))
        warm = i < warmup * case.concurrency
        out.append(Session(f"w{i}" if warm else f"r{i}", 0.0, [Round(isl, osl)]))
    return out


def agg_policy(framework: str) -> str:
    """The co-located policy that schedules as the framework does by default: SGLang runs a waiting prefill before
    the decodes (no mixed chunks); vLLM and TRT-LLM mix decodes into chunked-prefill steps."""
    return "sglang" if framework == "sglang" else "vllm"


@dataclass(frozen=True)
class Prediction:
    """A simulated row: means over its requests (what the rows hold), medians beside them."""

    ttft_ms: float
    tpot_ms: float
    ttft_median_ms: float
    tpot_median_ms: float
    cost_source: str


def simulate_case(case: Case, cost_model: str, seed: int = 0, scale: float = 1.0, donor: str | None = None,
                  warmup: int = 0) -> Prediction:
    """Simulate a row under `cost_model` (measured or roofline; measured with `donor`: derived from that GPU's
    tables) with the framework's scheduler defaults; `warmup` > 0 runs that many warm-up requests per client through
    the same closed loop first, left out of the figures (the alternative to a drained warm-up)."""
    from tandem.sim.cluster import SimConfig, simulate

    fw = framework_defaults(case.framework)
    gpus = parse_deploy(case.deploy).gpus
    cfg = SimConfig(model=case.model, gpu=case.gpu, gpus=gpus, deploy=case.deploy,
                    policy=agg_policy(case.framework) if case.mode == "agg" else "dynamo", seed=seed,
                    max_num_batched_tokens=fw.max_num_batched_tokens,
                    colocated_max_num_batched_tokens=fw.max_num_batched_tokens, max_num_seqs=fw.max_num_seqs,
                    concurrency=case.concurrency, cost_model=cost_model, cost_framework=case.framework,
                    cost_donor=donor, quantization=None if case.precision == "bf16" else case.precision,
                    kv_cache_dtype=case.kv_cache_dtype)
    res = simulate(sessions(case, seed, scale, warmup), cfg)
    done = [r for r in res.records if not r.failed and not r.session_id.startswith("w")]
    if not done:
        raise MissingCostData(f"{case.row_id}: no request finished")
    ttft = [r.rounds[0].ttft_s * 1e3 for r in done]
    tpot = [r.rounds[0].itl_sum_s / r.rounds[0].itl_count * 1e3 for r in done if r.rounds[0].itl_count]
    return Prediction(statistics.fmean(ttft), statistics.fmean(tpot), statistics.median(ttft),
                      statistics.median(tpot), str(cfg.cost_choice().label))


def prefill_demand(case: Case) -> float:
    """The prefill work a row's measured figures imply, as a share of what the measured tables allow: its request
    rate (c / (TTFT + (osl - 1) x TPOT)) times isl, over the tokens per second of prefill-only steps of the
    framework's token budget (whole prompts at their mean context). Above 1 the row ran more prefill than the
    tables' kernels can with the GPU doing nothing else: its prompts were shorter or partly served from a prefix
    cache, which a simulation of full prompts cannot show."""
    from tandem.core.types import Role
    from tandem.perf.costs import choose_cost_model, step_timer

    fw = framework_defaults(case.framework)
    spec = get_model(case.model).with_precision(None if case.precision == "bf16" else case.precision,
                                                case.kv_cache_dtype)
    group = next(g for g in parse_deploy(case.deploy).groups if g.role != Role.DECODE)   # who prefills, how many
    step = step_timer(spec, case.gpu, group.tp, choose_cost_model("measured", case.gpu, case.framework), group.ep)
    budget = fw.max_num_batched_tokens
    capacity = group.count * budget / step.step_time_args(budget, budget * case.isl / 2, 0,
                                                          max(1, budget // case.isl), 0, 0)
    rate = case.concurrency / ((case.ttft_ms + (case.osl - 1) * case.tpot_ms) / 1e3)
    return rate * case.isl / capacity
