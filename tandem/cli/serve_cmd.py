"""`tandem serve`: the disaggregated OpenAI-compatible server; `tandem demo`: serve a tiny model, replay a
multi-round workload through the HTTP API, print the metrics, shut down (what `make run` shows)."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

from tandem.bench.demo_options import DEMO_MODEL, DemoOptions
from tandem.bench.ports import free_port
from tandem.cli.args import add_knobs, knob_values
from tandem.cli.bench_table import print_table
from tandem.cli.commands import COMMAND_HELP
from tandem.cli.common import CLIError, SessionBar, check_preemption, require_ray
from tandem.cli.options import OutputOptions
from tandem.engine.config import DLLM_SERVE_KNOBS, EngineConfig
from tandem.knob import field_default
from tandem.policy.presets import POLICIES, PrefillSchedKind
from tandem.runtime.cluster_config import ClusterConfig, worker_cpu_binds
from tandem.server.options import API_KEY_ENV, ServerOptions

LAPS_POLICIES = tuple(name for name, spec in POLICIES.items() if spec.prefill_sched is PrefillSchedKind.LAPS)

# the EngineConfig fields `tandem serve` sets, in the order of its help (its --max-model-len comes first)
ENGINE_FLAGS = ("block_size", "max_num_batched_tokens", "max_num_seqs", "num_kv_blocks", "max_num_logits", "gpu_memory_utilization",
                "cpu_memory_budget_bytes", "dllm_block_length", "dllm_chunk", "dllm_unmasking_strategy",
                "dllm_denoising_steps", "dllm_confidence_threshold", "dllm_latency_profile", "dllm_admission",
                *DLLM_SERVE_KNOBS, "preemption_mode", "swap_space", "kv_offloading_size", "enforce_eager",
                "tensor_parallel_size", "cpu_omp_threads_bind",
                "cuda_graph_sizes")
CLUSTER_TIMEOUTS = ("kv_timeout_s", "worker_timeout_s", "max_restarts", "session_ttl_s", "slo_ttft_s", "slo_itl_s")
CLUSTER_LAUNCHER = ("launcher", "ray_address", "ray_place", "ray_namespace")


def _add_server_args(p: argparse.ArgumentParser, demo: bool) -> None:
    """The flags `serve` and `demo` share: the workers and policy (ClusterConfig), the engines (EngineConfig); the
    demo's model, context and threads have the demo's defaults (DemoOptions)."""
    own = DemoOptions if demo else ClusterConfig
    add_knobs(p, own, ("model",))
    add_knobs(p, ClusterConfig, ("prefill_workers", "decode_workers", "colocated", "policy", "laps_length_threshold",
                                 "laps_min_pool", "state", "served_model_name"))
    add_knobs(p, DemoOptions if demo else EngineConfig, ("max_model_len",))
    add_knobs(p, EngineConfig, ENGINE_FLAGS)
    add_knobs(p, ClusterConfig, ("perf",))
    add_knobs(p, own, ("threads",))
    add_knobs(p, ClusterConfig, CLUSTER_TIMEOUTS + CLUSTER_LAUNCHER)


def add_parser(sub) -> None:
    """Register `serve` and `demo`."""
    p = sub.add_parser("serve", help=COMMAND_HELP["serve"])
    _add_server_args(p, demo=False)
    add_knobs(p, ClusterConfig, ("deploy", "kv_transfer"))
    add_knobs(p, ServerOptions)
    p.set_defaults(func=cmd_serve)
    d = sub.add_parser("demo", help=COMMAND_HELP["demo"])
    _add_server_args(d, demo=True)
    add_knobs(d, DemoOptions, exclude=("model", "max_model_len", "threads"))
    add_knobs(d, OutputOptions, ("json",))
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


def _engine_args(args) -> dict:
    """The EngineConfig fields the flags set away from their defaults (every worker's engine keeps the others)."""
    import dataclasses
    defaults = {f.name: field_default(f) for f in dataclasses.fields(EngineConfig)}
    eng = {k: v for k, v in knob_values(args, EngineConfig).items() if v != defaults[k]}
    if "cuda_graph_sizes" in eng:
        eng["cuda_graph_sizes"] = tuple(eng["cuda_graph_sizes"])
    return eng


def _check_diffusion(args, eng: dict) -> None:
    """The diffusion flags against each other and the model's architecture (one line, before any worker starts);
    --dllm-latency-profile is checked and made absolute for the workers."""
    phase_knobs = [k for k in DLLM_SERVE_KNOBS if k in eng]
    if phase_knobs and "dllm_admission" not in eng:
        raise CLIError(f"--{phase_knobs[0].replace('_', '-')} needs --dllm-admission (phase, static or reserve)")
    if eng.get("kv_pool_kernel", 1) % 2 == 0:
        raise CLIError(f"--kv-pool-kernel must be odd (the window is centred on each position), got "
                       f"{eng['kv_pool_kernel']}")
    if "dllm_admission" in eng and "dllm_chunk" in eng:
        raise CLIError("--dllm-chunk sizes Optimus windows; with --dllm-admission every step is a dLLM-Serve phase")
    profile = eng.pop("dllm_latency_profile", None)
    arch = _architecture(args.model)
    diffusion = arch in BLOCK_DIFFUSION_ARCHS + CANVAS_DIFFUSION_ARCHS
    if arch in CANVAS_DIFFUSION_ARCHS:
        _canvas_refusals(eng, profile)
    if profile is not None:
        eng["dllm_latency_profile"] = _latency_profile(profile, "dllm_admission" in eng)
    dllm_knobs = [k for k in eng if k.startswith(("dllm_", "kv_")) and k != "kv_offloading_size"]
    if dllm_knobs and not diffusion:
        raise CLIError(f"--{dllm_knobs[0].replace('_', '-')}: the model is "
                       "autoregressive (diffusion options need a diffusion checkpoint such as SDAR or LLaDA)")
    if diffusion and not args.colocated:
        raise CLIError("a block-diffusion model is served by co-located workers: add --colocated N")


def _cluster_config(args) -> ClusterConfig:
    """The ClusterConfig of `serve`'s (or one demo run's) flags, every flag checked against the others and the
    model (CLIError: one line) before any worker starts."""
    if not Path(args.model, "config.json").is_file():
        raise CLIError(f"--model {args.model}: not a checkpoint directory (no config.json)")
    role_tp = _deployment(args) if getattr(args, "deploy", None) is not None else {}
    eng = _engine_args(args)
    _check_diffusion(args, eng)
    check_preemption(eng.get("preemption_mode"), eng.get("swap_space"))
    tp = eng.get("tensor_parallel_size")
    if tp is not None and tp > 1:
        _check_tp(args.model, tp, eng)
    for t in sorted(set(role_tp.values()) - {1}):
        _check_tp(args.model, t, eng, "--deploy")
    if args.perf is not None and not Path(args.perf).is_file():
        raise CLIError(f"--perf {args.perf}: no such file")
    _check_launcher(args)
    knobs = knob_values(args, ClusterConfig)
    if knobs["colocated"]:
        knobs["prefill_workers"] = knobs["decode_workers"] = 0
    cfg = ClusterConfig(**knobs, engine_args=eng, role_tp=role_tp)
    _check_host_tier(cfg, eng)
    _check_cpu_bind(cfg)
    if (cfg.laps_length_threshold is not None or cfg.laps_min_pool is not None) and cfg.policy not in LAPS_POLICIES:
        raise CLIError(f"--laps-* options apply to the LAPS policies ({', '.join(LAPS_POLICIES)}), not {cfg.policy!r}")
    return cfg


def _check_host_tier(cfg: ClusterConfig, eng: dict) -> None:
    """--kv-offloading-size: a tiered policy's, and the host tiers of every worker that keeps one (decode and
    co-located) within the machine's available memory, before any worker starts."""
    gib = eng.get("kv_offloading_size", 0.0)
    if not gib:
        return
    from tandem.policy.presets import get_policy
    spec = get_policy(cfg.policy)
    if not spec.tiered:
        tiered = ", ".join(name for name, p in POLICIES.items() if p.tiered)
        raise CLIError(f"--kv-offloading-size: policy {cfg.policy} keeps no KV in host memory (tiered policies: "
                       f"{tiered})")
    homes = cfg.decode_workers + cfg.colocated
    import psutil
    have = psutil.virtual_memory().available
    if gib * homes * (1 << 30) > have:
        raise CLIError(f"--kv-offloading-size {gib:g} GiB on each of {homes} worker(s) exceeds the "
                       f"{have / (1 << 30):.1f} GiB of host memory available")


def _check_cpu_bind(cfg: ClusterConfig) -> None:
    """--cpu-omp-threads-bind: every worker's CPUs within this process's, none shared (before any worker starts)."""
    tp = cfg.engine_args.get("tensor_parallel_size", 1)
    roles = [("colocated", cfg.colocated)] if cfg.colocated else [("prefill", cfg.prefill_workers),
                                                                     ("decode", cfg.decode_workers)]
    try:
        worker_cpu_binds(cfg, [cfg.role_tp.get(role, tp) for role, n in roles for _ in range(n)])
    except ValueError as e:
        raise CLIError(str(e)) from None


def _check_launcher(args) -> None:
    """--launcher and --ray-*: Ray installed for --launcher ray, no --ray-* without it."""
    if args.launcher != "ray":
        for flag, v in (("--ray-address", args.ray_address), ("--ray-place", args.ray_place),
                        ("--ray-namespace", args.ray_namespace)):
            if v:
                raise CLIError(f"{flag} applies to --launcher ray")
        return
    require_ray("--launcher ray")
    if args.ray_namespace is not None and not args.ray_namespace.strip():
        raise CLIError("--ray-namespace must not be empty")


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
    """build_app and uvicorn settings from `tandem serve`'s ServerOptions flags."""
    from tandem.server.state import Limits
    opts = ServerOptions(**knob_values(args, ServerOptions))
    app = {"limits": Limits(**knob_values(args, Limits)), "max_body_bytes": opts.max_body_bytes,
           "body_timeout_s": opts.body_timeout_s}
    return {"app": app, "uvicorn": opts.uvicorn_kwargs()}


@contextlib.asynccontextmanager
async def serving(cfg, host: str, port: int, api_key: str | None = None, options: dict | None = None,
                  drain=None):
    """Start the worker processes and the HTTP server; yields the cluster; on exit drains the HTTP server (new
    requests refused, those in flight given the graceful-shutdown timeout, the rest ended with an error), stops it,
    then stops the workers.

    `options`: server_options(args) (limits for build_app, uvicorn's keep-alive and header limits); `drain`: the
    tandem.server.drain.Drain to use (its caller may hurry it), else a new one."""
    import asyncio

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
    uv = {**ServerOptions().uvicorn_kwargs(), "http": protocol, **options.get("uvicorn", {})}
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


def deployment_lines(dep: dict) -> list[str]:
    """The start banner's deployment: as given, then one line per worker with its role, tensor-parallel degree,
    process ids (the driver's first) and how its KV moves."""
    lines = [f"tandem: deployment {dep['deploy']}"]
    for w in dep["workers"]:
        pids = f"pid {w['pid']}" if not w["rank_pids"] else "pids " + ", ".join(
            [f"{w['pid']} driver"] + [f"{p} rank {r}" for r, p in enumerate(w["rank_pids"], 1)])
        kv = "a KV endpoint per rank" if w["kv_rank_endpoints"] else "KV through its driver only"
        lines.append(f"tandem: {w['role']} worker {w['worker']}: tp{w['tensor_parallel_size']} ({pids}; {kv})")
    return lines


def cmd_serve(args) -> int:
    """Serve until interrupted."""
    cfg = _cluster_config(args)
    api_key = api_key_of(args)
    options = server_options(args)

    import asyncio

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
            print("\n".join(deployment_lines(cluster.deployment())), flush=True)
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
    import asyncio

    from tandem.bench import demo, demo_report
    from tandem.bench.demo_profile import ensure_profile, machine_key
    from tandem.engine.tokenizer import Tokenizer
    from tandem.perf.profile_io import PerfFileError, load_perf
    from tandem.perf.step_model import Profile
    if args.model is None:
        args.model = DEMO_MODEL
        if not Path(args.model, "config.json").is_file():
            from tandem.engine.tiny_model import make_tiny_model
            make_tiny_model(args.model, arch="qwen3", size="1m", seed=0)
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
                              args.rate, args.slo_ttft_s, args.slo_itl_s, args.load, args.slo_factor, args.baseline,
                              key.parallel)
    except ValueError as e:
        raise CLIError(str(e)) from None
    args.slo_ttft_s, args.slo_itl_s = plan.slo.ttft_s, plan.slo.itl_s
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


def _deployment(args) -> dict[str, int]:
    """--deploy read by the planner's parser (tandem.core.deploy): worker counts set on `args`; each role's TP."""
    from tandem.core.deploy import DeploymentError, parse_deploy
    if args.colocated or getattr(args, "tensor_parallel_size", None) not in (None, 1):
        raise CLIError("--deploy names the workers and their tensor-parallel degrees: drop --colocated and "
                       "--tensor-parallel-size")
    try:
        dep = parse_deploy(args.deploy)
    except DeploymentError as e:
        raise CLIError(f"--deploy: {e}") from None
    tps, counts = {}, {}
    for g in dep.groups:
        if g.ep > 1:
            raise CLIError(f"--deploy: expert parallelism (ep{g.ep}) is not run by the live server yet")
        if tps.setdefault(str(g.role), g.tp) != g.tp:
            raise CLIError(f"--deploy: every {g.role} worker runs at one tensor-parallel degree here, got "
                           f"tp{tps[str(g.role)]} and tp{g.tp}")
        counts[str(g.role)] = counts.get(str(g.role), 0) + g.count
    args.prefill_workers, args.decode_workers, args.colocated = (counts.get(r, 0) for r in ("prefill", "decode",
                                                                                              "colocated"))
    return tps


def _check_tp(model: str, tp: int, eng: dict, flag: str = "--tensor-parallel-size") -> None:
    """A tensor-parallel degree against the machine's cores or devices, the model's heads and what TP does not run
    yet (LLaDA, dLLM-Serve phases): one line naming `flag`, before any worker starts."""
    from tandem.engine.config import EngineConfig, EngineError
    from tandem.engine.loader import ModelLoadError, read_config
    from tandem.engine.parallel import check_shardable
    try:
        EngineConfig(model=model, tensor_parallel_size=tp, dllm_admission=eng.get("dllm_admission"))
        mc = read_config(model)
        check_shardable(mc, tp)
        if mc.is_canvas_diffusion:
            raise EngineError("tensor parallelism does not run LLaDA-style models yet")
    except (EngineError, ModelLoadError, ValueError) as e:
        raise CLIError(f"{flag}: {e}") from None
