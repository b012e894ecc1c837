"""The `tandem` command: `simulate` one workload on one deployment, or run an `experiment` sweep.

Every user error (bad names, deployments, workloads, files, arguments) ends as one line
`tandem: error: <message>` on stderr with exit status 2; Ctrl-C exits with 130.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from tandem.cli import bench_cmd, plan_cmd, profile_cmd, serve_cmd, tiny_cmd
from tandem.cli.common import (DEFAULT_RATE, DEFAULT_SESSIONS, PROG, CLIError, Parser, add_cost_args, add_ray_args, check_out_path, cost_fields, cost_note,
                               PREEMPTION_MODE_HELP, check_preemption, clear_notes, csv_list, flush_notes, gpus_arg, load_workload,
                               nonneg_float, nonneg_int, note, positive_float, positive_int, ray_executor, seed_arg,
                               unit_fraction)
from tandem.core.config import DEFAULT_KV_OFFLOADING_SIZE_GIB, DEFAULT_SWAP_SPACE_GIB
from tandem.core.deploy import DeploymentError, parse_deploy
from tandem.perf.dllm import OPTIMUS_LENGTHS
from tandem.workload.session import WorkloadError

DLLM_DATASETS = tuple(OPTIMUS_LENGTHS)     # Optimus Table 2 rows (--dllm-dataset)


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of every subcommand."""
    p = Parser(prog=PROG, description="Multi-round LLM serving under PD disaggregation: simulator and experiments.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)

    s = sub.add_parser("simulate", help="simulate one workload on one deployment with one policy",
                       description="Simulate one workload (a generator name, a public trace name or a "
                                   "JSONL session file) on one deployment and print its metrics.")
    s.add_argument("--workload", required=True, metavar="NAME|FILE",
                   help="generator (toolbench, gaia, hotpotqa, dureader, agentic-long, chat-multiturn), public trace "
                        "(azure-conv, azure-code, mooncake, sharegpt) or a .jsonl session file")
    s.add_argument("--model", default="llama-3.1-70b", help="model name (default: %(default)s)")
    s.add_argument("--gpu", default="h20", help="GPU name (default: %(default)s)")
    s.add_argument("--gpus", type=positive_int, default=None,
                   help="GPUs in the cluster (default: AMPD's for the workload, else what --deploy uses)")
    s.add_argument("--deploy", default=None, metavar="SPEC",
                   help="deployment, e.g. 'P:tp4x1,D:tp4x1' or 'C:tp4x2' (default: a balanced one that fits)")
    s.add_argument("--policy", default="ampd", help="serving policy (default: %(default)s)")
    s.add_argument("--rate", type=positive_float, default=None,
                   help=f"session arrival rate per second (default: {DEFAULT_RATE:g} for generators)")
    s.add_argument("--seed", type=seed_arg, default=0, help="seed of the workload and simulator (default: 0)")
    s.add_argument("--sessions", type=positive_int, default=None,
                   help=f"sessions to generate (default: {DEFAULT_SESSIONS}); for traces, the first K")
    s.add_argument("--override-arrivals", action="store_true",
                   help="re-time a trace's sessions as a Poisson process at --rate")
    s.add_argument("--laps-length-threshold", type=positive_int, default=None, metavar="N",
                   help="LAPS policies: a prefill of fewer new tokens is short (default: the roofline's boundary "
                        "L_m for the prefill workers, where a prefill step turns compute-bound)")
    s.add_argument("--concurrency", type=positive_int, default=None, metavar="N",
                   help="closed loop: N clients, each running one session at a time (the first N start at 0 s, "
                        "each next one when a client's session ends); arrival times are not used, so not with "
                        "--rate or --override-arrivals")
    s.add_argument("--prefill-basis", choices=("input", "prompt"), default=None,
                   help="what AMPD Table 1's prefill length is read as for generators: new tokens per round "
                        "(input, default) or each round's whole prompt (prompt); docs/session-format.md")
    s.add_argument("--slo-ttft", type=positive_float, default=None, metavar="S", help="TTFT SLO in seconds")
    s.add_argument("--slo-itl", type=positive_float, default=None, metavar="S", help="mean ITL SLO in seconds")
    s.add_argument("--dllm-block-length", type=positive_int, default=None, metavar="B",
                   help="decode as a block-diffusion model in blocks of B positions (the model must be one of "
                        "Optimus's: sdar-8b, llada2.0-16b); default: autoregressive")
    s.add_argument("--dllm-chunk", default="elastic", metavar="elastic|block|N",
                   help="each diffusion step's window: elastic (Optimus: chosen per step from the load), block "
                        "(plain block diffusion, the whole block every step) or a fixed N (N masked positions a "
                        "step, besides the K/V writes of the last commits; default: %(default)s)")
    s.add_argument("--dllm-prefill-share", type=float, default=0.5, metavar="F",
                   help="elastic windows leave waiting prefills up to this share of the step's token budget, in "
                        "[0, 1); 0: the windows may take all of it, as the paper's c* (default: %(default)s)")
    s.add_argument("--preemption-mode", default=None, choices=("recompute", "swap"),
                   help=PREEMPTION_MODE_HELP)
    s.add_argument("--swap-space", type=nonneg_float, default=DEFAULT_SWAP_SPACE_GIB, metavar="GIB",
                   help="GiB of host memory per worker for KV preempted by swap (default: %(default)s)")
    s.add_argument("--kv-offloading-size", type=nonneg_float, default=DEFAULT_KV_OFFLOADING_SIZE_GIB, metavar="GIB",
                   help="GiB of host-memory KV tier per worker, summed over its TP ranks (vLLM's meaning); needed by "
                        "the tiered policies (docs/kv-tiers.md) (default: %(default)s)")
    s.add_argument("--dllm-dataset", default="sharegpt", choices=DLLM_DATASETS,
                   help="the Optimus Table 2 row the simulated commits per step follow (default: %(default)s)")
    s.add_argument("--dllm-admission", default=None, choices=("phase", "static", "reserve"),
                   help="dLLM-Serve mode of the diffusion worker (co-located): Refresh/Reuse phases packed under the "
                        "token budget by phase-multiplexed admission (phase), static batches reserving each request's "
                        "Refresh peak (static, Fast-dLLM-like) or continuous request-level admission reserving it "
                        "(reserve); the KV pool follows the dLLM memory model (docs/dllm-serve.md)")
    s.add_argument("--dllm-delay-step", type=nonneg_int, default=1, metavar="N",
                   help="dLLM-Serve: full-length steps at a block's start before its cache is written; a block starts "
                        "with N + 1 of them (default: %(default)s, dLLM-Serve's)")
    s.add_argument("--dllm-refresh-interval", type=nonneg_int, default=0, metavar="N",
                   help="dLLM-Serve: also refresh every N steps after the block's cache write (default: 0, only at "
                        "block transitions)")
    s.add_argument("--dllm-refresh-span", default="full", choices=("full", "prefix"),
                   help="dLLM-Serve: a Refresh recomputes the prompt and the whole generation length (full, LLaDA) or "
                        "the prompt, the generated tokens and the active block (prefix) (default: %(default)s)")
    s.add_argument("--dllm-kv-retention", type=unit_fraction, default=1.0, metavar="R",
                   help="dLLM-Serve: share of a request's positions whose KV it keeps (head-centric sparse KV), in "
                        "(0, 1] (default: %(default)s, the dense cache)")
    s.add_argument("--dllm-commits", type=_commits, default=None, metavar="MEAN[,STD]",
                   help="diffusion tokens committed per step at block 32 (mean and standard deviation of the stretch "
                        "distribution; 1 = one a step); default: Optimus Table 2's row, LLaDA-8B one a step")
    s.add_argument("--max-num-logits", type=positive_int, default=None, metavar="N",
                   help="dLLM-Serve memory model: logit rows materialised at once (default: every row, monolithic)")
    s.add_argument("--max-num-batched-tokens", type=_budget, default=None, metavar="N|auto",
                   help="query tokens per step of every worker (default: 2048); with --dllm-admission, auto is the "
                        "largest whose activation peak leaves KV for the retained positions of that many tokens")
    s.add_argument("--perf", default=None, metavar="FILE", help="fitted performance model (tandem profile)")
    add_cost_args(s)
    s.add_argument("--faults", default=None, metavar="SPEC",
                   help="inject faults and compare with the fault-free run: kv-fail=P (a KV transfer fails), "
                        "kv-lost=P (it never lands), kill=WORKER@SECONDS; comma-separated")
    s.add_argument("--kv-timeout", type=positive_float, default=None, metavar="S",
                   help="a KV transfer not landed after S seconds is recomputed locally (default: 10)")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    s.add_argument("--records", default=None, metavar="FILE.jsonl",
                   help="also write every session's per-round record (TTFT, ITL, placement, KV) as JSON lines")
    s.set_defaults(func=cmd_simulate)

    g = sub.add_parser("generate", help="write a workload (generator or public trace) as a session JSONL file",
                       description="Write sessions in tandem's JSONL format (docs/session-format.md), e.g. to "
                                   "edit them or to replay them with `tandem simulate --workload FILE.jsonl`.")
    g.add_argument("--workload", required=True, metavar="NAME",
                   help="generator (toolbench, gaia, hotpotqa, dureader, agentic-long, chat-multiturn) or public trace "
                        "(azure-conv, azure-code, mooncake, sharegpt)")
    g.add_argument("--model", default="llama-3.1-70b", help="model whose AMPD SLOs are attached (default: %(default)s)")
    g.add_argument("--sessions", type=positive_int, default=None,
                   help=f"sessions to generate (default: {DEFAULT_SESSIONS}); for traces, the first K")
    g.add_argument("--rate", type=positive_float, default=None, help="session arrival rate per second")
    g.add_argument("--seed", type=seed_arg, default=0, help="seed (default: 0)")
    g.add_argument("--override-arrivals", action="store_true", help="re-time a trace as a Poisson process at --rate")
    g.add_argument("--prefill-basis", choices=("input", "prompt"), default=None,
                   help="what AMPD Table 1's prefill length is read as for generators: new tokens per round "
                        "(input, default) or each round's whole prompt (prompt); docs/session-format.md")
    g.add_argument("--slo-ttft", type=positive_float, default=None, metavar="S", help="TTFT SLO in seconds")
    g.add_argument("--slo-itl", type=positive_float, default=None, metavar="S", help="mean ITL SLO in seconds")
    g.add_argument("--out", required=True, metavar="FILE.jsonl", help="where to write the sessions")
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser("experiment", help="sweep workloads x policies x rates (AMPD Fig. 4/5) and write a report",
                       description="Run a preset sweep, optionally narrowed, and write results.json, "
                                   "table.md/txt, summary.md and figures to --out.")
    e.add_argument("--preset", default="demo", help="demo, paper or ablation (default: %(default)s)")
    e.add_argument("--model", default=None, help="model (default: the preset's)")
    e.add_argument("--gpu", default=None, help="GPU (default: the preset's)")
    e.add_argument("--workloads", type=csv_list(str), default=None, metavar="A,B", help="workloads")
    e.add_argument("--policies", type=csv_list(str), default=None, metavar="A,B", help="policies")
    e.add_argument("--rates", type=csv_list(positive_float), default=None, metavar="R1,R2", help="arrival rates")
    e.add_argument("--sessions", type=positive_int, default=None, help="sessions per cell and seed")
    e.add_argument("--seeds", type=csv_list(seed_arg), default=None, metavar="0,1", help="seeds")
    e.add_argument("--jobs", type=positive_int, default=None, help="worker processes (default: 1)")
    e.add_argument("--gpus", type=gpus_arg, default=None, metavar="N|W=N,...",
                   help="GPUs per workload: one count for all, or e.g. toolbench=16,gaia=32 (default: AMPD's)")
    e.add_argument("--prefill-basis", choices=("input", "prompt"), default=None,
                   help="what AMPD Table 1's prefill length is read as (default: input; docs/session-format.md)")
    e.add_argument("--deploy-per-rate", action="store_true",
                   help="give each (workload, policy, rate) its own best deployment of the search "
                        "(default: one per workload and policy, best mean over the rates)")
    e.add_argument("--out", default=None, metavar="DIR", help="report folder (default: reports/<preset>)")
    add_cost_args(e)
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_ray_args(e, "simulations")
    e.set_defaults(func=cmd_experiment)

    for command in (plan_cmd, tiny_cmd, profile_cmd, serve_cmd, bench_cmd):
        command.add_parser(sub)
    return p


# --------------------------------------------------------------------------- simulate


def _commits(text: str) -> tuple[float, float]:
    parts = text.split(",")
    try:
        mean = float(parts[0])
        std = float(parts[1]) if len(parts) == 2 else 0.0
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MEAN or MEAN,STD, got {text!r}") from None
    if len(parts) > 2 or not 1 <= mean < 32 or std < 0 or (mean > 1 and std == 0):
        raise argparse.ArgumentTypeError(f"expected 1 <= MEAN < 32 and STD > 0 (or MEAN 1 alone), got {text!r}")
    return mean, std


def _budget(text: str) -> int:
    return 0 if text.strip().lower() == "auto" else positive_int(text)



def _deployment(args, model: str, gpu: str, policy: str, profiled: bool = False) -> tuple[str, int]:
    """The validated deployment string and the cluster's GPU count (profiled: tp1 engines, no catalogue checks)."""
    from tandem.bench.experiment import check_fits, deployment_candidates, policy_is_colocated
    from tandem.workload.generators import PAPER_GPUS

    colocated = policy_is_colocated(policy)
    if profiled and args.deploy is None:
        args.deploy = "C:tp1x1" if colocated else "P:tp1x1,D:tp1x1"
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
    if colocated and dep.disaggregated:
        raise DeploymentError(f"policy {policy} serves co-located workers; give a deployment like 'C:tp4x2', "
                              f"not {args.deploy!r}")
    if not colocated and not dep.disaggregated:
        raise DeploymentError(f"policy {policy} needs prefill and decode workers, e.g. 'P:tp4x1,D:tp4x1', "
                              f"not {args.deploy!r}")
    if profiled:
        tps = sorted({g.tp for g in dep.groups if g.tp != 1})
        if tps:
            raise DeploymentError(f"a profile describes one engine on one device (tp1); {args.deploy!r} asks for tp{tps[0]}")
    else:
        check_fits(model, gpu, str(dep))
    return str(dep), gpus


def _sim_config(cluster, args, model: str, gpu: str, gpus: int, deploy: str, policy: str):
    cfg = cluster.SimConfig(model=model, gpu=gpu, gpus=gpus, deploy=deploy, policy=policy, seed=args.seed,
                            **cost_fields(args))
    if args.perf is None:
        cost_note(gpu, args)                # one line when measured costs are asked for and missing
    if args.perf is not None:
        cfg = dataclasses.replace(cfg, perf=args.perf)
    if hasattr(args, "swap_space"):
        check_preemption(args.preemption_mode, args.swap_space)
        cfg = dataclasses.replace(cfg, preemption_mode=args.preemption_mode, swap_space=args.swap_space,
                                  kv_offloading_size=args.kv_offloading_size)
    if getattr(args, "dllm_block_length", None):
        from tandem.policy.optimus.chunk import parse_chunk
        try:
            chunk = str(parse_chunk(args.dllm_chunk))
        except ValueError as e:
            raise CLIError(f"--dllm-chunk: {e}") from None
        if args.dllm_block_length < 2:
            raise CLIError("--dllm-block-length must be at least 2")
        if not 0 <= args.dllm_prefill_share < 1:
            raise CLIError(f"--dllm-prefill-share must be in [0, 1), got {args.dllm_prefill_share}")
        cfg = dataclasses.replace(cfg, dllm_block_length=args.dllm_block_length, dllm_chunk=chunk,
                                  dllm_dataset=args.dllm_dataset, dllm_prefill_share=args.dllm_prefill_share,
                                  dllm_commits=getattr(args, "dllm_commits", None))
    admission = getattr(args, "dllm_admission", None)
    if admission is not None:
        if not getattr(args, "dllm_block_length", None):
            raise CLIError("--dllm-admission needs a block-diffusion model: give --dllm-block-length")
        cfg = dataclasses.replace(cfg, dllm_admission=admission, dllm_delay_step=args.dllm_delay_step,
                                  dllm_refresh_interval=args.dllm_refresh_interval,
                                  dllm_refresh_span=args.dllm_refresh_span, dllm_kv_retention=args.dllm_kv_retention,
                                  max_num_logits=args.max_num_logits)
    budget = getattr(args, "max_num_batched_tokens", None)
    if budget is not None:
        if budget == 0 and admission is None:
            raise CLIError("--max-num-batched-tokens auto sizes a dLLM-Serve worker's budget: give --dllm-admission")
        cfg = dataclasses.replace(cfg, colocated_max_num_batched_tokens=budget,
                                  max_num_batched_tokens=budget or cfg.max_num_batched_tokens)
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
    from tandem.workload.metrics import summarize

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
    deploy, gpus = _deployment(args, model, gpu, args.policy, profiled)
    sessions, rate, _ = load_workload(args, model)
    cfg = _sim_config(cluster, args, model, gpu, gpus, deploy, args.policy)
    if args.concurrency is not None:
        cfg = dataclasses.replace(cfg, concurrency=args.concurrency)
        rate = None
    if args.laps_length_threshold is not None:
        cfg = dataclasses.replace(cfg, laps_length_threshold=args.laps_length_threshold)
    faults = _faults(args)
    if args.kv_timeout is not None:
        cfg = dataclasses.replace(cfg, kv_timeout_s=args.kv_timeout)
    check_out_path(args.records)
    flush_notes()
    base = None
    if faults is not None:                       # the same run without faults: what the faults cost
        free = cluster.simulate(sessions, cfg)
        base = summarize(free.records, free.sim_time_s)
        cfg = dataclasses.replace(cfg, faults=faults)
    res = cluster.simulate(sessions, cfg)
    if args.records is not None:
        from tandem.workload.records import dump_records
        dump_records(res.records, args.records)
    out = summarize(res.records, res.sim_time_s)
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


def _faults(args):
    """The --faults spec, parsed; a malformed one is a one-line CLI error."""
    if args.faults is None:
        return None
    from tandem.sim.faults import FaultError, parse_faults
    try:
        return parse_faults(args.faults)
    except FaultError as e:
        raise CLIError(f"--faults: {e}") from None


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


# --------------------------------------------------------------------------- experiment


def cmd_experiment(args) -> int:
    """`tandem experiment`: run a preset (optionally narrowed) and print the table and report location."""
    from tandem.bench.experiment import PRESETS, format_cells, preset, run_experiment, summary_text

    if args.preset not in PRESETS:
        raise CLIError(f"unknown preset {args.preset!r} (valid: {', '.join(PRESETS)})")
    spec = preset(args.preset, model=args.model, gpu=args.gpu, workloads=args.workloads,
                  policies=args.policies, rates=args.rates, sessions=args.sessions, seeds=args.seeds,
                  jobs=args.jobs, prefill_basis=args.prefill_basis, deploy_per_rate=args.deploy_per_rate or None)
    if args.model is not None or args.gpu is not None:
        spec = dataclasses.replace(spec, deploys={})  # the preset's fixed deployments are for its model and GPU
    spec = dataclasses.replace(spec, sim={**spec.sim, **cost_fields(args)})
    cost_note(spec.gpu, args)
    if args.gpus is not None:
        gpus = args.gpus if isinstance(args.gpus, dict) else {w: args.gpus for w in spec.workloads}
        unknown = sorted(set(gpus) - set(spec.workloads))
        if unknown:
            raise CLIError(f"--gpus names workloads not in the experiment: {', '.join(unknown)}")
        spec = dataclasses.replace(spec, gpus={**spec.gpus, **gpus})
    out_dir = Path(args.out or f"reports/{args.preset}")
    if args.ray and args.jobs is not None:
        raise CLIError("--jobs does not apply with --ray (the Ray cluster's CPUs run the simulations)")
    with ray_executor(args) as executor:
        result = run_experiment(spec, out_dir, progress=not args.no_progress and sys.stderr.isatty(),
                                executor=executor)
    print(format_cells(result["cells"]), end="")
    if result["improvement"]:
        print()
        print(summary_text(result["improvement"]), end="")
    print(f"\nreport: {out_dir}/ ({', '.join(Path(f).name for f in result['files'].values())}) "
          f"in {result['wall_s']:.1f} s")
    return 0


# --------------------------------------------------------------------------- entry point


def _user_errors() -> tuple[type[BaseException], ...]:
    from tandem.bench.experiment import ExperimentError
    from tandem.perf.errors import DoesNotFitError, ParallelismError, UnknownNameError
    from tandem.perf.profile_io import PerfFileError
    from tandem.sim.cluster import ConfigError

    return (CLIError, WorkloadError, DeploymentError, FileNotFoundError, PermissionError, IsADirectoryError,
            NotADirectoryError, UnknownNameError, DoesNotFitError, ParallelismError, ExperimentError, ConfigError,
            PerfFileError)


def _message(err: BaseException) -> str:
    if isinstance(err, OSError) and err.filename is not None:
        text = f"{err.filename}: {err.strerror or err}"
    else:
        text = str(err) or type(err).__name__
    return " ".join(text.split())  # one line, whatever the message


def main(argv: Sequence[str] | None = None) -> int:
    """Run the tandem command line; returns the exit status (0 ok, 2 user error, 130 interrupted)."""
    clear_notes()
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except BrokenPipeError:  # e.g. `tandem simulate ... | head`
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except Exception as e:
        if not isinstance(e, _user_errors()):
            raise
        print(f"{PROG}: error: {_message(e)}", file=sys.stderr)
        return 2
