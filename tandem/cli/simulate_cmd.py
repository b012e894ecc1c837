"""`tandem simulate`: simulate one workload on one deployment and print its metrics; `tandem generate`: write a
workload as a session JSONL file."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tandem.cli.args import add_knobs, knob_values
from tandem.cli.commands import COMMAND_HELP
from tandem.cli.common import (CLIError, check_out_path, check_preemption, cost_note, flush_notes, load_workload,
                               note)
from tandem.cli.options import GenerateOptions, OutputOptions
from tandem.core.admission import check_deployment
from tandem.core.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from tandem.core.deploy import DeploymentError, parse_deploy
from tandem.policy.presets import get_policy
from tandem.sim.config import COST_KNOBS, SimConfig, SimTarget
from tandem.workload.options import WorkloadOptions


def add_parser(sub) -> None:
    """Register `simulate` and `generate` on the subparsers `sub` of the tandem parser."""
    s = sub.add_parser("simulate", help=COMMAND_HELP["simulate"],
                       description="Simulate one workload (a generator name, a public trace name or a "
                                   "JSONL session file) on one deployment and print its metrics.")
    add_knobs(s, WorkloadOptions, ("workload",), required=("workload",))
    add_knobs(s, SimTarget, ("model", "gpu", "gpus", "deploy"))
    add_knobs(s, SimConfig, ("policy",))
    add_knobs(s, WorkloadOptions, ("rate", "seed", "sessions", "override_arrivals"))
    add_knobs(s, SimConfig, ("laps_length_threshold", "concurrency"))
    add_knobs(s, WorkloadOptions, ("prefill_basis", "slo_ttft", "slo_itl"))
    add_knobs(s, SimConfig, ("dllm_block_length", "dllm_chunk", "dllm_prefill_share", "preemption_mode", "swap_space",
                             "kv_offloading_size",
                             "dllm_dataset", "dllm_admission", "dllm_delay_step", "dllm_refresh_interval",
                             "dllm_refresh_span", "dllm_kv_retention", "dllm_commits", "max_num_logits",
                             "colocated_max_num_batched_tokens", "perf", *COST_KNOBS, "faults", "kv_timeout_s"))
    add_knobs(s, OutputOptions, ("json", "records"))
    s.set_defaults(func=cmd_simulate)

    g = sub.add_parser("generate", help=COMMAND_HELP["generate"],
                       description="Write sessions in tandem's JSONL format (docs/session-format.md), e.g. to "
                                   "edit them or to replay them with `tandem simulate --workload FILE.jsonl`.")
    add_knobs(g, WorkloadOptions, ("workload",), required=("workload",))
    add_knobs(g, SimTarget, ("model",))
    add_knobs(g, WorkloadOptions, ("sessions", "rate", "seed", "override_arrivals", "prefill_basis", "slo_ttft",
                                   "slo_itl"))
    add_knobs(g, GenerateOptions, required=("out",))
    g.set_defaults(func=cmd_generate)


# --------------------------------------------------------------------------- simulate


def _deployment(args, model: str, gpu: str, policy: str, prof=None) -> tuple[str, int]:
    """The validated deployment string and the cluster's GPU count (with a `tandem profile` output `prof`: workers at
    the degrees it prices, no catalogue checks)."""
    from tandem.bench.experiment import check_fits, deployment_candidates, policy_is_colocated
    from tandem.workload.generators import PAPER_GPUS

    colocated = policy_is_colocated(policy)
    profiled = prof is not None
    if profiled and args.deploy is None:
        tp = prof.tensor_parallel_size
        args.deploy = f"C:tp{tp}x1" if colocated else f"P:tp{tp}x1,D:tp{tp}x1"
        note(f"no --deploy given; using {args.deploy} (copies of the profiled engine)")
    if args.deploy is None:
        gpus = args.gpus or PAPER_GPUS.get(args.workload, 8)
        cands = deployment_candidates(model, gpu, gpus, colocated, cap=1)
        if not cands:
            kind = "co-located" if colocated else "prefill/decode"
            raise CLIError(f"no {kind} deployment of {model} fits {gpus} x {gpu}; give --gpus or --deploy")
        note(f"no --deploy given; using {cands[0]} on {gpus} GPUs")
        return cands[0], gpus
    dep = parse_deploy(args.deploy, args.gpus)
    gpus = args.gpus or dep.gpus
    check_deployment(get_policy(policy), dep)
    if profiled:
        why = next((prof.refusal(g.tp) for g in dep.groups if prof.refusal(g.tp)), None)
        if why:
            raise DeploymentError(f"--perf {args.perf}: {why} ({args.deploy!r})")
    else:
        check_fits(model, gpu, str(dep))
    return str(dep), gpus


def _sim_config(cluster, args, model: str, gpu: str, gpus: int, deploy: str, policy: str):
    """The SimConfig of the command line: its knob flags as they are, the target resolved (faults left out: the
    caller runs with and without them)."""
    knobs = knob_values(args, cluster.SimConfig)
    knobs.update(model=model, gpu=gpu, gpus=gpus, deploy=deploy, policy=policy, seed=args.seed, faults=None)
    budget = knobs["colocated_max_num_batched_tokens"]
    if budget == 0 and knobs.get("dllm_admission") is None:
        raise CLIError("--max-num-batched-tokens auto sizes a dLLM-Serve worker's budget: give --dllm-admission")
    knobs["max_num_batched_tokens"] = budget or knobs.get("max_num_batched_tokens", DEFAULT_MAX_NUM_BATCHED_TOKENS)
    if knobs.get("dllm_admission") is not None and not knobs.get("dllm_block_length"):
        raise CLIError("--dllm-admission needs a block-diffusion model: give --dllm-block-length")
    if knobs.get("dllm_block_length") == 1:
        raise CLIError("--dllm-block-length must be at least 2")
    check_preemption(knobs.get("preemption_mode"), knobs.get("swap_space"))
    cfg = cluster.SimConfig(**knobs)
    if cfg.perf is None:
        cost_note(gpu, args)                # one line when measured costs are asked for and missing
    return cfg


def _perf(args):
    """The --perf file parsed (a Profile or an AMPDCostModel), None without --perf; user errors are one line."""
    from tandem.perf.profile_io import load_perf

    if args.perf is None:
        return None
    if not Path(args.perf).is_file():
        raise FileNotFoundError(2, "No such file", args.perf)
    return load_perf(args.perf)


SIM_TABLE_METRICS: list[tuple[str, str]] = [
    ("sessions_total", "sessions"), ("sessions_completed", "completed"), ("sessions_failed", "failed"),
    ("slo_attainment", "SLO attainment"), ("round_slo_attainment", "round SLO attainment"),
    ("goodput_sessions_per_s", "goodput (sessions/s)"),
    ("ttft_initial_mean_s", "TTFT initial mean (s)"), ("ttft_initial_p95_s", "TTFT initial p95 (s)"),
    ("ttft_incremental_mean_s", "TTFT incremental mean (s)"), ("ttft_incremental_p95_s", "TTFT incremental p95 (s)"),
    ("itl_mean_s", "ITL mean (s)"), ("itl_p95_s", "ITL p95, round means (s)"), ("tpot_mean_s", "TPOT mean (s)"),
    ("e2e_mean_s", "round E2E mean (s)"), ("queue_mean_s", "queue mean (s)"),
    ("kv_transfer_mean_s", "KV transfer mean (s)"), ("local_prefill_fraction", "local prefill share"),
    ("preemptions", "preemptions"), ("throughput_output_tokens_per_s", "output tokens/s"),
    ("dllm_tokens_per_step", "diffusion tokens/step"), ("dllm_chunk_mean", "diffusion chunk mean"),
    ("dllm_max_num_batched_tokens", "dLLM-Serve token budget"), ("dllm_kv_pool_tokens", "dLLM-Serve KV pool (positions)"),
    ("dllm_batch_tokens_mean", "dLLM-Serve batch tokens mean"), ("dllm_batch_tokens_max", "dLLM-Serve batch tokens max"),
    ("dllm_refresh_share", "dLLM-Serve Refresh share"), ("dllm_max_running", "dLLM-Serve max running"),
    ("dllm_deferrals", "dLLM-Serve deferred seq-steps"), ("dllm_max_deferred_steps", "dLLM-Serve longest wait (steps)"),
    ("sim_time_s", "simulated time (s)"), ("events", "events"), ("wall_s", "wall time (s)"),
]


DLLM_SERVE_KEYS = frozenset(k for k, _ in SIM_TABLE_METRICS if k.startswith("dllm_") and k not in
                            ("dllm_tokens_per_step", "dllm_chunk_mean"))


def _print_sim_table(out: dict) -> None:
    from tandem.sim.report import Column, format_table, pct

    rows = []
    for key, label in SIM_TABLE_METRICS:
        v = out.get(key)
        if v is None and key in DLLM_SERVE_KEYS:
            continue                                 # shown only for dLLM-Serve runs
        text = "-" if v is None else (pct(v) if "attainment" in key or "fraction" in key
                                      else f"{v:.4g}" if isinstance(v, float) else str(v))
        rows.append({"metric": label, "value": text})
    rate = ("trace arrivals" if out["rate"] is None else f"{out['rate']:g}/s") if out.get("concurrency") is None \
        else f"closed loop, {out['concurrency']} clients"
    print(f"{out['workload']} · {out['model']} on {out['gpus']} x {out['gpu']} · {out['deploy']} · "
          f"{out['policy']} · {rate} · seed {out['seed']} · costs: {out.get('cost_source', '-')}")
    print(format_table(rows, [Column("metric", "metric"), Column("value", "value")]), end="")
    for reason, count in (out.get("fail_reasons") or {}).items():
        print(f"failed x{count}: {reason}")


def cmd_simulate(args) -> int:
    """`tandem simulate`: validate, build the workload, simulate, print metrics."""
    from tandem.bench.experiment import canonical_gpu, canonical_model
    from tandem.sim import cluster

    perf = _perf(args)
    profiled = perf is not None and hasattr(perf, "step_model")
    if profiled:  # a `tandem profile` output: model and GPU are labels from it, the catalogue is not used
        model, gpu = perf.name, perf.device_name
        note(f"--perf {args.perf}: every worker is the profiled engine ({perf.name} on {gpu}, "
              f"{perf.kv_capacity_tokens:,} KV tokens, held-out step error {100 * (perf.heldout_error.get('median') or 0):.1f}%); "
              f"--model/--gpu are not used and the catalogue's memory checks are skipped")
    else:
        model, gpu = canonical_model(args.model), canonical_gpu(args.gpu)
    if args.policy not in cluster.POLICIES:
        raise CLIError(f"unknown policy {args.policy!r} (valid: {', '.join(cluster.POLICIES)})")
    _check_concurrency(args)
    deploy, gpus = _deployment(args, model, gpu, args.policy, perf if profiled else None)
    sessions, rate, _ = load_workload(args, model)
    cfg = _sim_config(cluster, args, model, gpu, gpus, deploy, args.policy)
    if args.concurrency is not None:
        rate = None
    faults = args.faults
    check_out_path(args.records)
    flush_notes()
    base = None
    if faults is not None:                       # the same run without faults: what the faults cost
        base = _simulate(cluster, sessions, cfg, None)[1]
        cfg = dataclasses.replace(cfg, faults=faults)
    res, out = _simulate(cluster, sessions, cfg, args.records)
    out.update(cluster.dllm_summary(res.workers))
    out.update(cluster.dllm_serve_summary(res.workers))
    out.update(cluster.kv_tier_summary(res.workers))
    out.update({"wall_s": res.wall_s, "sim_time_s": res.sim_time_s, "events": res.events,
                "deploy": res.deployment, "policy": res.policy, "model": model, "gpu": gpu, "gpus": gpus,
                "workload": args.workload, "rate": rate, "concurrency": args.concurrency, "seed": args.seed,
                "cost_source": f"profiled ({args.perf})" if profiled else str(cfg.cost_choice().label)})
    if base is not None:
        out["faults"] = _fault_cost(str(faults), base, out)
    if args.json:
        from tandem.sim.report import to_jsonable
        print(json.dumps(to_jsonable(out), indent=2))
    else:
        _print_sim_table(out)
        if base is not None:
            _print_fault_cost(out["faults"])
    return 0


def _simulate(cluster, sessions, cfg, records: str | None):
    """One run with its records streamed (to `records` as JSON lines, if given) rather than kept: memory stays flat
    at a million rounds; returns the result and its metrics."""
    from tandem.workload.metrics import RecordStream

    stream = RecordStream(records)
    try:
        res = cluster.simulate(sessions, cfg, stream=stream)
    finally:
        stream.close()
    return res, dict(res.metrics)


def _check_concurrency(args) -> None:
    """--concurrency replaces arrival times: it cannot be combined with the flags that set them."""
    if args.concurrency is None:
        return
    if args.rate is not None:
        raise CLIError("--concurrency runs a closed loop (a session starts when a client's previous one ends); "
                       "it cannot be combined with --rate")
    if args.override_arrivals:
        raise CLIError("--concurrency runs a closed loop and ignores arrival times; it cannot be combined with "
                       "--override-arrivals")


FAULT_METRICS = ("sessions_completed", "sessions_failed", "slo_attainment", "round_slo_attainment",
                 "ttft_initial_p95_s", "ttft_incremental_p95_s", "itl_mean_s", "kv_failures", "kv_fallback_tokens",
                 "recomputed_tokens", "local_prefill_fraction")


def _fault_cost(spec: str, base: dict, faulty: dict) -> dict:
    """The faulty run against the fault-free one, metric by metric."""
    rows = {}
    for k in FAULT_METRICS:
        a, b = base.get(k), faulty.get(k)
        rows[k] = {"fault_free": a, "with_faults": b,
                   "change": (b - a) if isinstance(a, (int, float)) and isinstance(b, (int, float)) else None}
    return {"spec": spec, "metrics": rows}


def _print_fault_cost(cost: dict) -> None:
    from tandem.sim.report import Column, format_table

    def show(v):
        return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)
    rows = [{"metric": k, "free": show(v["fault_free"]), "faults": show(v["with_faults"]), "change": show(v["change"])}
            for k, v in cost["metrics"].items()]
    print(f"faults {cost['spec']} against the fault-free run:")
    print(format_table(rows, [Column("metric", "metric"), Column("free", "fault-free"), Column("faults", "with faults"),
                              Column("change", "change")]), end="")


# --------------------------------------------------------------------------- generate


def cmd_generate(args) -> int:
    """`tandem generate`: build a workload and write it as JSONL."""
    from tandem.bench.experiment import canonical_model
    from tandem.workload.session import dump_sessions

    if Path(args.workload).suffix in (".jsonl", ".json", ".ndjson"):
        raise CLIError("--workload must be a generator or trace name; a .jsonl file is already a session file")
    sessions, _, _ = load_workload(args, canonical_model(args.model))
    flush_notes()
    dump_sessions(sessions, args.out)
    rounds = sum(len(s.rounds) for s in sessions)
    print(f"wrote {len(sessions)} sessions ({rounds} rounds) to {args.out}")
    return 0
