"""`tandem serve`: the disaggregated OpenAI-compatible server; `tandem demo`: serve a tiny model, replay a
multi-round workload through the HTTP API, print the metrics, shut down (what `make run` shows)."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

from tandem.cli.bench_table import print_table
from tandem.bench.demo import DEFAULT_BASELINE as DEMO_BASELINE
from tandem.bench.demo_calibration import DEFAULT_LOAD as DEMO_LOAD, DEFAULT_SLO_FACTOR as DEMO_SLO_FACTOR
from tandem.cli.common import (PREEMPTION_MODE_HELP, CLIError, SessionBar, byte_size, check_preemption, csv_list,
                               nonneg_float, nonneg_int, positive_float, positive_int, ray_address_arg, require_ray,
                               unit_fraction)
from tandem.core.config import DEFAULT_SWAP_SPACE_GIB
from tandem.bench.ports import free_port
from tandem.policy.presets import POLICIES, PrefillSchedKind

LAPS_POLICIES = tuple(name for name, spec in POLICIES.items() if spec.prefill_sched is PrefillSchedKind.LAPS)

API_KEY_ENV = "TANDEM_API_KEY"
# Slow clients (slowloris): uvicorn closes an idle keep-alive connection after TIMEOUT_KEEP_ALIVE_S and refuses
# header blocks over H11_MAX_INCOMPLETE_EVENT_BYTES; the app answers 408 to a body not received within
# --body-timeout seconds. uvicorn has no timeout on reading headers: put a reverse proxy in front for that.
TIMEOUT_KEEP_ALIVE_S = 5
H11_MAX_INCOMPLETE_EVENT_BYTES = 64 << 10
GRACEFUL_SHUTDOWN_S = 10        # on SIGTERM, requests still open this long after it end with an error (a drain:
                                # tandem/server/drain.py; uvicorn would otherwise wait for every connection to close)


def _add_server_args(p: argparse.ArgumentParser, model_required: bool) -> None:
    p.add_argument("--model", required=model_required, metavar="PATH", help="Hugging Face checkpoint directory")
    p.add_argument("--prefill-workers", type=int, default=1, metavar="P", help="prefill worker processes (default: 1)")
    p.add_argument("--decode-workers", type=int, default=1, metavar="D", help="decode worker processes (default: 1)")
    p.add_argument("--colocated", type=int, default=0, metavar="N",
                   help="co-located worker processes instead of P/D (policies vllm, continuum)")
    p.add_argument("--policy", default=None, help="ampd | ampd-no-pr | ampd-no-ar-pr | dynamo | vllm | continuum | "
                                                  "laps | laps-no-graph | laps-no-split | ampd+laps | "
                                                  "ampd+laps-chunked | sglang-pd | sglang-pd-router (default: ampd; "
                                                  "with --colocated: vllm)")
    p.add_argument("--laps-length-threshold", type=positive_int, default=None, metavar="N",
                   help="LAPS policies: a prefill of fewer new tokens is short (default: 256)")
    p.add_argument("--laps-min-pool", type=int, default=None, metavar="N",
                   help="LAPS policies: the fewest prefill workers each pool keeps (default: 1; 0 lets one class "
                        "lose its pool, as 2 prefill workers need for the controller to move one)")
    p.add_argument("--state", default="embedded", help="state store: embedded or redis://HOST:PORT[/DB]")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--max-model-len", type=positive_int, default=None)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    p.add_argument("--max-num-seqs", type=positive_int, default=256)
    p.add_argument("--num-kv-blocks", type=positive_int, default=None, help="KV blocks per worker")
    p.add_argument("--max-num-logits", type=positive_int, default=None, metavar="N",
                   help="logit decomposition: the LM head and the sampler run on at most N rows at a time "
                        "(default: every row of a step at once)")
    p.add_argument("--gpu-memory-utilization", type=unit_fraction, default=None, metavar="F",
                   help="CUDA: fraction of the GPU's memory for weights, activations and KV; the KV pool gets "
                        "what the profiled worst-case step leaves (default: 0.9)")
    p.add_argument("--cpu-memory-budget", type=byte_size, default=None, metavar="BYTES",
                   help="CPU: bytes per worker for weights, activations and KV (e.g. 4G, 512M); the KV pool gets "
                        "what the profiled worst-case step leaves (default: a 1 GiB KV pool)")
    p.add_argument("--dllm-block-length", type=positive_int, default=None, metavar="B",
                   help="diffusion models: positions per block; SDAR: must be the model's (default: config.json); "
                        "LLaDA: any >= 2 (default: 32)")
    p.add_argument("--dllm-chunk", default=None, metavar="auto|elastic|block|N",
                   help="block-diffusion models: each step's window: auto (block for a greedy or seeded request, "
                        "whose tokens then do not depend on the load; elastic for the others), elastic (Optimus, for "
                        "every request), block (the whole block recomputed), or a fixed streaming chunk N (N masked "
                        "positions a step, besides the K/V writes of the last commits; default: auto)")
    p.add_argument("--dllm-unmasking-strategy", default=None,
                   choices=("low_confidence_dynamic", "low_confidence_static", "sequential"),
                   help="block-diffusion models: which positions a step commits (default: low_confidence_dynamic)")
    p.add_argument("--dllm-denoising-steps", type=positive_int, default=None, metavar="N",
                   help="block-diffusion models: steps per block, a divisor of the block length (default: the "
                        "block length: at least one token a step)")
    p.add_argument("--dllm-confidence-threshold", type=unit_fraction, default=None, metavar="T",
                   help="block-diffusion models: the dynamic strategy commits every position above T, in (0, 1] "
                        "(default: 0.9)")
    p.add_argument("--dllm-latency-profile", default=None, metavar="FILE",
                   help="block-diffusion models: Optimus's T(c, b) from this `tandem profile` output of the model "
                        "(its dllm_latency section) instead of measuring it at each worker's start")
    p.add_argument("--dllm-admission", default=None, choices=("phase", "static", "reserve"),
                   help="block-diffusion models: dLLM-Serve's Refresh/Reuse phases over sparse KV, admitted by "
                        "phase (dLLM-Serve), static (Fast-dLLM-like batches reserving each request's Refresh "
                        "peak) or reserve (request-level continuous); default: Optimus windows (--dllm-chunk); a LLaDA "
                        "model always runs in phases (default: phase)")
    p.add_argument("--dllm-delay-step", type=nonneg_int, default=None, metavar="N",
                   help="--dllm-admission: full-length steps of a block before its KV is packed (default: 1; LLaDA: 0)")
    p.add_argument("--dllm-refresh-interval", type=nonneg_int, default=None, metavar="N",
                   help="--dllm-admission: also refresh every N steps after the pack (default: 0, never)")
    p.add_argument("--kv-retention-ratio", type=unit_fraction, default=None, metavar="R",
                   help="--dllm-admission: share of a request's positions whose K/V each head keeps, in (0, 1] "
                        "(default: 0.5; LLaDA: 1, Fast-dLLM's dense prefix cache)")
    p.add_argument("--kv-pool-kernel", type=positive_int, default=None, metavar="K",
                   help="--dllm-admission: max-pool kernel over the position scores, odd (default: 3)")
    p.add_argument("--kv-selection", default=None, choices=("head", "uniform"),
                   help="--dllm-admission: per-KV-head selection (dLLM-Serve) or one shared set (Sparse-dLLM) "
                        "(default: head)")
    p.add_argument("--preemption-mode", default=None, choices=("recompute", "swap"),
                   help=PREEMPTION_MODE_HELP)
    p.add_argument("--swap-space", type=nonneg_float, default=None, metavar="GIB",
                   help=f"GiB of host memory per worker for KV preempted by swap (default: {DEFAULT_SWAP_SPACE_GIB:g})")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: run decode steps eagerly (no CUDA graphs)")
    p.add_argument("-tp", "--tensor-parallel-size", type=positive_int, default=None, metavar="N",
                   help="ranks per worker (one process each; co-located workers only; default: 1)")
    p.add_argument("--cuda-graph-sizes", type=csv_list(positive_int), default=None, metavar="1,2,4,8",
                   help="CUDA: decode batch sizes captured as CUDA graphs (default: 1,2,4,8,16,... up to "
                        "max-num-seqs, at most 512)")
    p.add_argument("--perf", default=None, metavar="FILE", help="a `tandem profile` output for routing costs")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per worker (default: 1)")
    p.add_argument("--kv-timeout", type=float, default=10.0, metavar="S",
                   help="a KV transfer slower than this falls back to local recompute (default: 10)")
    p.add_argument("--worker-timeout", type=float, default=10.0, metavar="S",
                   help="a worker silent S seconds (no heartbeat) is declared dead, fenced and replaced (default: 10)")
    p.add_argument("--max-worker-restarts", type=int, default=3, metavar="N",
                   help="replace a dead worker at most N times per 5 minutes (0: never; default: 3)")
    p.add_argument("--session-ttl", type=float, default=600.0, metavar="S",
                   help="a session idle this long (no round) is ended and its KV freed (default: 600)")
    p.add_argument("--slo-ttft", type=float, default=None, metavar="S",
                   help="TTFT target of every round: AMPD routes a prefill locally when no prefill worker meets it")
    p.add_argument("--slo-itl", type=float, default=None, metavar="S",
                   help="ITL target: local prefill only while the decode worker has ITL slack")
    p.add_argument("--launcher", choices=("embedded", "ray"), default="embedded",
                   help="where workers run: local processes (embedded, default) or Ray actors on the nodes of a "
                        "Ray cluster (ray; pip install 'tandem[ray]'; docs/ray.md)")
    p.add_argument("--ray-address", type=ray_address_arg, default=None, metavar="auto|HOST:PORT",
                   help="--launcher ray: the Ray cluster to join (auto: the one `ray start` started here; default: "
                        "$RAY_ADDRESS, else a private single-node Ray)")
    p.add_argument("--ray-place", type=_ray_place, action="append", default=None, metavar="ROLE=RESOURCE",
                   help="--launcher ray: put ROLE's workers (prefill, decode, colocated) on nodes offering custom "
                        "resource RESOURCE (`ray start --resources '{\"RESOURCE\": 1}'`); repeatable")
    p.add_argument("--ray-namespace", default=None, metavar="NS",
                   help="--launcher ray: Ray namespace of the worker actors (named worker-ID.N; default: "
                        "tandem-<random>)")


def _ray_place(text: str) -> tuple[str, str]:
    """ROLE=RESOURCE of --ray-place."""
    import argparse
    import re
    role, sep, resource = text.partition("=")
    if not sep or role not in ("prefill", "decode", "colocated"):
        raise argparse.ArgumentTypeError(f"expected ROLE=RESOURCE with ROLE prefill, decode or colocated, got {text!r}")
    if not re.fullmatch(r"[A-Za-z0-9_.:-]{1,100}", resource) or resource in ("CPU", "GPU", "memory"):
        raise argparse.ArgumentTypeError(f"{resource!r} is not a custom Ray resource name (letters, digits, _.:-)")
    return role, resource


def add_parser(sub) -> None:
    """Register `serve` and `demo`."""
    p = sub.add_parser("serve", help="serve a model over the OpenAI API with prefill/decode worker processes")
    _add_server_args(p, True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (visible in ps: prefer ${API_KEY_ENV} or "
                        "--api-key-file)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from this file (its first line)")
    p.add_argument("--max-body-bytes", type=positive_int, default=None, metavar="N",
                   help="largest request body accepted (413 beyond; default: 8 MiB)")
    p.add_argument("--max-messages", type=positive_int, default=None, metavar="N",
                   help="most chat messages per request (default: max_model_len)")
    p.add_argument("--max-prompt-chars", type=positive_int, default=None, metavar="N",
                   help="most characters of prompt text / message content (default: 64 x max_model_len)")
    p.add_argument("--body-timeout", type=float, default=None, metavar="S",
                   help="a request body not received within S seconds gets a 408 (default: 60)")
    p.add_argument("--timeout-keep-alive", type=float, default=TIMEOUT_KEEP_ALIVE_S, metavar="S",
                   help=f"close idle keep-alive connections after S seconds (default: {TIMEOUT_KEEP_ALIVE_S})")
    p.add_argument("--timeout-graceful-shutdown", "--shutdown-timeout", type=float, default=GRACEFUL_SHUTDOWN_S,
                   metavar="S", dest="timeout_graceful_shutdown",
                   help="on SIGTERM/SIGINT, refuse new requests (503) and let those in flight finish for up to S "
                        "seconds, then end each one left with an error (JSON, or an SSE error event and [DONE]); a "
                        f"second signal ends them at once (default: {GRACEFUL_SHUTDOWN_S})")
    p.add_argument("--limit-concurrency", type=positive_int, default=None, metavar="N",
                   help="most open connections + requests before uvicorn answers 503 (default: no limit)")
    p.set_defaults(func=cmd_serve)
    d = sub.add_parser("demo", help="serve a tiny model 1P+1D with AMPD and a baseline, replay multi-round sessions "
                                     "through HTTP at a load calibrated to this machine, compare with the simulator")
    _add_server_args(d, False)
    d.set_defaults(threads=None)
    d.add_argument("--workload", default="toolbench")
    d.add_argument("--sessions", type=positive_int, default=30)
    d.add_argument("--rate", type=positive_float, default=None,
                   help="sessions/s (default: --load x the capacity the machine's profile gives 1P+1D)")
    d.add_argument("--load", type=unit_fraction, default=DEMO_LOAD, metavar="F",
                   help=f"the calibrated rate as a share of the profiled capacity (default: {DEMO_LOAD:g})")
    d.add_argument("--slo-factor", type=positive_float, default=DEMO_SLO_FACTOR, metavar="K",
                   help=f"the calibrated SLO as K x the profiled unloaded TTFT and ITL (default: {DEMO_SLO_FACTOR:g})")
    d.add_argument("--baseline", default=DEMO_BASELINE,
                   help=f"the policy compared with AMPD on the same two worker processes (a co-located one runs "
                        f"--colocated 2; ampd: no comparison; default: {DEMO_BASELINE})")
    d.add_argument("--scale", type=positive_float, default=0.5, help="token counts and tool gaps x this (default: 0.5)")
    d.add_argument("--max-tokens-cap", type=positive_int, default=16)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--out", default="reports/demo", metavar="DIR",
                   help="where the comparison table, its PNG and results.json go (default: reports/demo)")
    d.add_argument("--verbose", action="store_true", help="also print each run's full `tandem bench` table")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_demo)


def _architecture(model: str) -> str:
    """The checkpoint's architecture (config.json's first `architectures` entry; "" when it names none)."""
    try:
        cfg = json.loads(Path(model, "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CLIError(f"--model {model}: config.json cannot be read: {e}") from None
    archs = cfg.get("architectures") if isinstance(cfg, dict) else None
    return str(archs[0]) if isinstance(archs, list) and archs else ""


# the engine's diffusion architectures (tandem.engine.models.config), without importing torch here
BLOCK_DIFFUSION_ARCHS = ("SDARForCausalLM",)
CANVAS_DIFFUSION_ARCHS = ("LLaDAModelLM",)       # LLaDA-style: bidirectional over the whole canvas


def _canvas_refusals(eng: dict, profile: str | None) -> None:
    """The options a LLaDA-style model cannot take (Optimus's windows), refused with why, as the engine would."""
    if "dllm_chunk" in eng:
        raise CLIError("--dllm-chunk sizes Optimus's streaming windows, which need a block-causal model (SDAR): in a "
                       "LLaDA-style bidirectional model every position attends to the whole canvas, so no position's "
                       "K/V is final when it is committed; LLaDA runs Fast-dLLM's prefix cache as dLLM-Serve phases")
    if profile is not None:
        raise CLIError("--dllm-latency-profile sizes Optimus's streaming windows, which a LLaDA-style model does not "
                       "run (its steps are dLLM-Serve phases)")


def _latency_profile(path: str, phased: bool) -> str:
    """The --dllm-latency-profile file, checked here (one line on a bad one) and made absolute for the workers."""
    from tandem.perf.profile_io import PerfFileError, load_window_latency
    if phased:
        raise CLIError("--dllm-latency-profile sizes Optimus windows; with --dllm-admission every step is a "
                       "dLLM-Serve phase")
    try:
        load_window_latency(path)
    except PerfFileError as e:
        raise CLIError(str(e)) from None
    return str(Path(path).resolve())


def _cluster_config(args):
    from tandem.runtime.cluster import ClusterConfig
    if not Path(args.model, "config.json").is_file():
        raise CLIError(f"--model {args.model}: not a checkpoint directory (no config.json)")
    if args.policy is None:                          # co-located workers run the co-located default
        args.policy = "vllm" if args.colocated else "ampd"
    eng = {"max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs}
    if args.max_model_len is not None:
        eng["max_model_len"] = args.max_model_len
    if args.num_kv_blocks is not None:
        eng["num_kv_blocks"] = args.num_kv_blocks
    for name, key in (("max_num_logits", "max_num_logits"), ("gpu_memory_utilization", "gpu_memory_utilization"),
                      ("cpu_memory_budget", "cpu_memory_budget_bytes")):
        if getattr(args, name, None) is not None:
            eng[key] = getattr(args, name)
    for name in ("dllm_block_length", "dllm_chunk", "dllm_unmasking_strategy", "dllm_denoising_steps",
                 "dllm_confidence_threshold", "dllm_admission", "dllm_delay_step", "dllm_refresh_interval",
                 "kv_retention_ratio", "kv_pool_kernel", "kv_selection"):
        if getattr(args, name, None) is not None:
            eng[name] = getattr(args, name)
    phase_knobs = [k for k in ("dllm_delay_step", "dllm_refresh_interval", "kv_retention_ratio", "kv_pool_kernel",
                               "kv_selection") if k in eng]
    if phase_knobs and "dllm_admission" not in eng:
        raise CLIError(f"--{phase_knobs[0].replace('_', '-')} needs --dllm-admission (phase, static or reserve)")
    if eng.get("kv_pool_kernel", 1) % 2 == 0:
        raise CLIError(f"--kv-pool-kernel must be odd (the window is centred on each position), got "
                       f"{eng['kv_pool_kernel']}")
    if "dllm_admission" in eng and "dllm_chunk" in eng:
        raise CLIError("--dllm-chunk sizes Optimus windows; with --dllm-admission every step is a dLLM-Serve phase")
    arch = _architecture(args.model)
    diffusion = arch in BLOCK_DIFFUSION_ARCHS + CANVAS_DIFFUSION_ARCHS
    if arch in CANVAS_DIFFUSION_ARCHS:
        _canvas_refusals(eng, getattr(args, "dllm_latency_profile", None))
    if getattr(args, "dllm_latency_profile", None) is not None:
        eng["dllm_latency_profile"] = _latency_profile(args.dllm_latency_profile, "dllm_admission" in eng)
    if any(k.startswith(("dllm_", "kv_")) for k in eng) and not diffusion:
        raise CLIError(f"--{next(k for k in eng if k.startswith(('dllm_', 'kv_'))).replace('_', '-')}: the model is "
                       "autoregressive (diffusion options need a diffusion checkpoint such as SDAR or LLaDA)")
    if diffusion and not args.colocated:
        raise CLIError("a block-diffusion model is served by co-located workers: add --colocated N")
    for name in ("preemption_mode", "swap_space"):
        if getattr(args, name, None) is not None:
            eng[name] = getattr(args, name)
    check_preemption(eng.get("preemption_mode"), eng.get("swap_space"))
    if args.enforce_eager:
        eng["enforce_eager"] = True
    tp = getattr(args, "tensor_parallel_size", None)
    if tp is not None and tp > 1:
        if not args.colocated:
            raise CLIError(f"--tensor-parallel-size {tp} runs co-located workers (--colocated N): prefill/decode "
                           f"workers at TP > 1 (KV regrouped between TP degrees) are not supported yet")
        _check_tp(args.model, tp)
        eng["tensor_parallel_size"] = tp
    if args.cuda_graph_sizes is not None:
        eng["cuda_graph_sizes"] = tuple(args.cuda_graph_sizes)
    p, d = args.prefill_workers, args.decode_workers
    if args.colocated:
        p = d = 0
    for name in ("kv_timeout", "slo_ttft", "slo_itl", "session_ttl", "worker_timeout"):
        v = getattr(args, name)
        if v is not None and not v > 0:
            raise CLIError(f"--{name.replace('_', '-')} must be > 0, got {v}")
    if args.perf is not None and not Path(args.perf).is_file():
        raise CLIError(f"--perf {args.perf}: no such file")
    opts = {}
    if args.laps_length_threshold is not None:
        opts["laps_length_threshold"] = args.laps_length_threshold
    if args.laps_min_pool is not None:
        if args.laps_min_pool < 0:
            raise CLIError(f"--laps-min-pool must be >= 0, got {args.laps_min_pool}")
        opts["laps_min_pool"] = args.laps_min_pool
    if opts and args.policy not in LAPS_POLICIES:
        raise CLIError(f"--laps-* options apply to the LAPS policies ({', '.join(LAPS_POLICIES)}), not {args.policy!r}")
    return ClusterConfig(args.model, p, d, args.colocated, args.policy, args.state, args.served_model_name, eng,
                         args.perf, args.threads, args.kv_timeout, slo_ttft_s=args.slo_ttft, slo_itl_s=args.slo_itl,
                         session_ttl_s=args.session_ttl, worker_timeout_s=args.worker_timeout,
                         max_restarts=_restarts(args.max_worker_restarts), policy_options=opts, **_launcher(args))


def _launcher(args) -> dict:
    """The ClusterConfig launcher fields of --launcher and --ray-*, checked (Ray installed, no stray --ray-*)."""
    place = dict(args.ray_place or ())
    if args.launcher != "ray":
        for flag, v in (("--ray-address", args.ray_address), ("--ray-place", place),
                        ("--ray-namespace", args.ray_namespace)):
            if v:
                raise CLIError(f"{flag} applies to --launcher ray")
        return {}
    require_ray("--launcher ray")
    if args.ray_namespace is not None and not args.ray_namespace.strip():
        raise CLIError("--ray-namespace must not be empty")
    return {"launcher": "ray", "ray_address": args.ray_address, "ray_place": place,
            "ray_namespace": args.ray_namespace}


def _restarts(n: int) -> int:
    """--max-worker-restarts, checked (≥ 0)."""
    if n < 0:
        raise CLIError(f"--max-worker-restarts must be >= 0, got {n}")
    return n


def api_key_of(args, environ=None) -> str | None:
    """The API key: --api-key, else the first line of --api-key-file, else $TANDEM_API_KEY, else None (open)."""
    environ = os.environ if environ is None else environ
    if getattr(args, "api_key", None):
        return args.api_key
    path = getattr(args, "api_key_file", None)
    if path:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise CLIError(f"--api-key-file {path}: {e.strerror or e}") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise CLIError(f"--api-key-file {path}: the file is empty")
        return key
    return environ.get(API_KEY_ENV) or None


def server_options(args) -> dict:
    """build_app and uvicorn settings from `tandem serve` flags (absent flags keep the defaults)."""
    from tandem.server.state import Limits
    app: dict = {"limits": Limits(max_messages=getattr(args, "max_messages", None),
                                  max_prompt_chars=getattr(args, "max_prompt_chars", None))}
    if getattr(args, "max_body_bytes", None) is not None:
        app["max_body_bytes"] = args.max_body_bytes
    body_timeout = getattr(args, "body_timeout", None)
    if body_timeout is not None:
        if not body_timeout > 0:
            raise CLIError(f"--body-timeout must be > 0, got {body_timeout}")
        app["body_timeout_s"] = body_timeout
    keep_alive = getattr(args, "timeout_keep_alive", TIMEOUT_KEEP_ALIVE_S)
    if not keep_alive > 0:
        raise CLIError(f"--timeout-keep-alive must be > 0, got {keep_alive}")
    graceful = getattr(args, "timeout_graceful_shutdown", GRACEFUL_SHUTDOWN_S)
    if not graceful > 0:
        raise CLIError(f"--timeout-graceful-shutdown must be > 0, got {graceful}")
    return {"app": app, "uvicorn": {"timeout_keep_alive": keep_alive, "timeout_graceful_shutdown": graceful,
                                    "limit_concurrency": getattr(args, "limit_concurrency", None),
                                    "h11_max_incomplete_event_size": H11_MAX_INCOMPLETE_EVENT_BYTES}}


@contextlib.asynccontextmanager
async def serving(cfg, host: str, port: int, api_key: str | None = None, options: dict | None = None,
                  drain=None):
    """Start the worker processes and the HTTP server; yields the cluster; on exit drains the HTTP server (new
    requests refused, those in flight given the graceful-shutdown timeout, the rest ended with an error), stops it,
    then stops the workers.

    `options`: server_options(args) (limits for build_app, uvicorn's keep-alive and header limits); `drain`: the
    tandem.server.drain.Drain to use (its caller may hurry it), else a new one."""
    import uvicorn

    from tandem.policy.presets import get_policy
    from tandem.server.drain import Drain, Server, drain_and_stop
    from tandem.runtime.cluster import ServingCluster
    from tandem.runtime.launcher import WorkerStartupError
    from tandem.runtime.state_store import StateStoreError
    from tandem.server.app import build_app
    try:
        get_policy(cfg.policy)
        cluster = await ServingCluster.start(cfg)
    except (ValueError, WorkerStartupError, StateStoreError) as e:
        raise CLIError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    options = options or {}
    drain = drain if drain is not None else Drain()
    from tandem.server.http_protocol import HeadTimeoutH11Protocol
    protocol = HeadTimeoutH11Protocol.answering_health(cluster.is_healthy)
    uv = {"timeout_keep_alive": TIMEOUT_KEEP_ALIVE_S, "h11_max_incomplete_event_size": H11_MAX_INCOMPLETE_EVENT_BYTES,
          "timeout_graceful_shutdown": GRACEFUL_SHUTDOWN_S, "http": protocol, **options.get("uvicorn", {})}
    grace_s = uv["timeout_graceful_shutdown"]
    server = Server(uvicorn.Config(build_app(cluster, api_key=api_key, drain=drain, **options.get("app", {})),
                                   host=host, port=port, log_level="warning", lifespan="off", **uv))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
                raise CLIError(f"the HTTP server did not start on {host}:{port}")
            await asyncio.sleep(0.02)
        yield cluster
    finally:
        try:
            await drain_and_stop(server, task, drain, grace_s, protocol)
        finally:
            await cluster.shutdown()


def cmd_serve(args) -> int:
    """Serve until interrupted."""
    cfg = _cluster_config(args)
    api_key = api_key_of(args)
    options = server_options(args)

    from tandem.runtime.event_loop import event_loop_factory
    from tandem.server.drain import Drain
    from tandem.server.process import freeze_startup_objects, tune_for_serving, warm_up
    tune_for_serving()
    stopped_by: list[int] = []

    async def run() -> None:
        stop = asyncio.Event()
        drain = Drain()
        loop = asyncio.get_running_loop()

        def on_signal(sig: int) -> None:                     # drain, stop the HTTP server, then the workers
            if stop.is_set():
                drain.hurry()                                # a second signal: end the open requests now
            stopped_by.append(sig)
            stop.set()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        async with serving(cfg, args.host, args.port, api_key, options, drain) as cluster:
            warm_up(cluster.tokenizer)
            freeze_startup_objects()
            print(f"tandem: serving {Path(cfg.model).name} on http://{args.host}:{args.port}/v1 "
                  f"({cfg.policy}; {cfg.prefill_workers}P+{cfg.decode_workers}D" +
                  (f", {cfg.colocated} co-located" if cfg.colocated else "") +
                  (f"; Ray actors in namespace {cluster.ray_namespace}" if cfg.launcher == "ray" else "") + ")",
                  flush=True)
            print("tandem: workers " + ", ".join(f"{wid} {role} (pid {pid})"
                                                 for wid, (role, pid) in cluster.worker_pids().items()), flush=True)
            await stop.wait()
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            runner.run(run())
    except KeyboardInterrupt:
        return 130
    return 130 if stopped_by and stopped_by[0] == signal.SIGINT else 0


def cmd_demo(args) -> int:
    """A tiny checkpoint (made once under models/) and its quick profile (cached per machine, speed-checked); the
    sessions at the calibrated rate and SLO served by AMPD, then by the baseline, each on fresh workers, and
    simulated (bench/demo)."""
    from tandem.bench import demo, demo_report
    from tandem.bench.demo_profile import ensure_profile, machine_key
    from tandem.engine.tokenizer import Tokenizer
    from tandem.perf.profile_io import PerfFileError, load_perf
    from tandem.perf.step_model import Profile
    if args.model is None:
        args.model = "models/tiny-qwen3-1m"
        if not Path(args.model, "config.json").is_file():
            from tandem.engine.tiny_model import make_tiny_model
            make_tiny_model(args.model, arch="qwen3", size="1m", seed=0)
    args.max_model_len = args.max_model_len or 4096
    args.threads = demo.demo_threads(args.threads)
    key, notes, speed = machine_key(args.threads), [], None
    if args.perf is None:                    # this machine's quick profile: cached, checked against its speed
        try:
            cached = ensure_profile(args.model, args.threads, args.max_model_len,
                                    lambda m: print(m, file=sys.stderr if args.json else sys.stdout, flush=True))
        except OSError as e:
            raise CLIError(f"--model {args.model}: cannot keep its profile there ({e})") from None
        args.perf, key, notes, speed = str(cached.path), cached.key, cached.notes, cached.speed
    try:
        prof = load_perf(args.perf)
    except (OSError, PerfFileError) as e:
        raise CLIError(str(e)) from None
    if not isinstance(prof, Profile):
        raise CLIError(f"--perf {args.perf}: the demo calibrates from a `tandem profile` output")
    try:
        plan = demo.plan_demo(prof, args.workload, args.sessions, args.scale, args.max_tokens_cap, args.seed,
                              args.rate, args.slo_ttft, args.slo_itl, args.load, args.slo_factor, args.baseline,
                              key.parallel)
    except ValueError as e:
        raise CLIError(str(e)) from None
    args.slo_ttft, args.slo_itl = plan.slo.ttft_s, plan.slo.itl_s
    for policy in plan.policies:
        _cluster_config(_demo_args(args, policy))            # every run's configuration checked before any starts

    @contextlib.asynccontextmanager
    async def serve(policy: str):
        port = free_port()
        async with serving(_cluster_config(_demo_args(args, policy)), "127.0.0.1", port):
            yield f"http://127.0.0.1:{port}"

    if not args.json:
        print(demo_report.header(plan, args.model, args.perf, prof, args.threads, _load_avg(), notes), flush=True)
    bar = SessionBar(not args.json and sys.stderr.isatty())
    try:
        factor = {"prefill": speed.prefill, "decode": speed.decode} if speed is not None else {}
        rt = demo.RuntimeSetup(Path(args.out, "profile-runtime.json"), factor, key.cores)
        runs, block = asyncio.run(demo.run_demo(plan, serve, Tokenizer.from_pretrained(args.model), prof, args.perf,
                                                lambda p: bar.track(f"{p} sessions", len(plan.sessions)), rt))
    finally:
        bar.close()
    results = demo_report.write_outputs(args.out, plan, runs, block)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0 if all(r.measured.get("sessions_completed") for r in runs) else 1
    if args.verbose:
        for run in runs:
            print_table({**run.measured, "workload": args.workload, "rate": plan.rate, "seed": args.seed})
    demo_report.print_comparison(demo_report.comparison(runs), demo_report.title(plan))
    print("\n".join(demo_report.footer(args.out, runs, prof, block)))
    return 0 if all(r.measured.get("sessions_completed") for r in runs) else 1


def _load_avg() -> tuple[float, float, float] | None:
    """The host's load averages (None where the OS has none)."""
    try:
        return os.getloadavg()
    except OSError:
        return None


def _demo_args(args, policy: str) -> argparse.Namespace:
    """The demo's server flags for one policy: its two worker processes 1P+1D, or co-located for such a policy."""
    from tandem.policy.presets import get_policy
    a = argparse.Namespace(**vars(args))
    a.policy = policy
    if not get_policy(policy).disaggregated:
        a.colocated = a.prefill_workers + a.decode_workers
    return a


def _check_tp(model: str, tp: int) -> None:
    """--tensor-parallel-size against the machine's cores or devices and the model's heads: one line, before any
    worker starts."""
    from tandem.engine.config import EngineConfig, EngineError
    from tandem.engine.loader import ModelLoadError, read_config
    from tandem.engine.parallel import check_shardable
    try:
        EngineConfig(model=model, tensor_parallel_size=tp)
        check_shardable(read_config(model), tp)
    except (EngineError, ModelLoadError, ValueError) as e:
        raise CLIError(f"--tensor-parallel-size: {e}") from None
