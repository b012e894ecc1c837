"""What `tandem serve` starts: the workers, the policy, the state store, the timeouts and where the workers run.

Each field a flag sets is a knob (tandem.knob), so `tandem serve`'s flags are generated from this class; the
scheduler's timeouts are SchedulerConfig's knobs, shared. A light module (no transport, no torch), so that building
the command line stays fast; tandem.runtime.cluster runs it.
"""
from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.core.config import SchedulerConfig
from tandem.engine.cpu_bind import OPTION as CPU_BIND, parse_cpu_bind, plan_workers
from tandem.knob import KnobError, knob, nonneg_int, positive_float, positive_int, shared
from tandem.runtime.ray_address import ray_address

DEFAULT_POLICY = "ampd"                  # prefill/decode workers
DEFAULT_COLOCATED_POLICY = "vllm"        # co-located workers (--colocated N)
DEFAULT_WORKER_TIMEOUT_S = 10.0
DEFAULT_MAX_RESTARTS = 3
RESTART_WINDOW_S = 300.0
AUDIT_S = 5.0             # how often each worker is asked which requests it holds (a lost message fails its round)
LAUNCHERS = ("embedded", "ray")
RAY_ROLES = ("prefill", "decode", "colocated")
POLICY_HELP = ("ampd | ampd-no-pr | ampd-no-ar-pr | dynamo | vllm | continuum | laps | laps-no-graph | laps-no-split | "
               "ampd+laps | ampd+laps-chunked | sglang-pd | sglang-pd-router (tandem.policy.presets; default: "
               f"{DEFAULT_POLICY}; with --colocated: {DEFAULT_COLOCATED_POLICY})")


def ray_place(text: str) -> tuple[str, str]:
    """--ray-place: ROLE=RESOURCE, ROLE one of RAY_ROLES and RESOURCE a custom Ray resource name."""
    role, sep, resource = text.partition("=")
    if not sep or role not in RAY_ROLES:
        raise KnobError(f"expected ROLE=RESOURCE with ROLE {', '.join(RAY_ROLES[:-1])} or {RAY_ROLES[-1]}, "
                        f"got {text!r}")
    if not re.fullmatch(r"[A-Za-z0-9_.:-]{1,100}", resource) or resource in ("CPU", "GPU", "memory"):
        raise KnobError(f"{resource!r} is not a custom Ray resource name (letters, digits, _.:-)")
    return role, resource


KV_TRANSFERS = ("rank-to-rank", "driver")    # ClusterConfig.kv_transfer; the first is the default

@dataclass
class ClusterConfig:
    """What `tandem serve` starts (names follow its flags)."""

    model: str = knob(help="Hugging Face checkpoint directory", metavar="PATH")
    prefill_workers: int = knob(1, "prefill worker processes", parse=nonneg_int, metavar="P")
    decode_workers: int = knob(1, "decode worker processes", parse=nonneg_int, metavar="D")
    colocated: int = knob(0, "co-located worker processes instead of P/D (policies vllm, continuum)",
                          parse=nonneg_int, metavar="N")
    policy: str | None = knob(None, POLICY_HELP)   # None: resolved on construction from `colocated`
    state: str = knob("embedded", "state store: embedded or redis://HOST:PORT[/DB]")
    served_model_name: str | None = knob(None, "the model's name in the API (default: the checkpoint folder's name)",
                                          metavar="NAME")
    engine_args: dict = field(default_factory=dict)   # EngineConfig fields every worker's engine gets
    perf: str | None = knob(None, "a `tandem profile` output for routing costs", metavar="FILE")
    threads: int | None = knob(1, "torch threads per worker", parse=positive_int, metavar="N")
    kv_timeout_s: float = shared(SchedulerConfig, "kv_timeout_s")
    session_ttl_s: float = shared(SchedulerConfig, "session_ttl_s")
    slo_ttft_s: float | None = knob(None, "TTFT target of every round: AMPD routes a prefill locally when no prefill "
                                    "worker meets it (default: no target, prefill workers first)",
                                    parse=positive_float, metavar="S", flags=("--slo-ttft",))
    slo_itl_s: float | None = knob(None, "ITL target: local prefill only while the decode worker has ITL slack",
                                   parse=positive_float, metavar="S", flags=("--slo-itl",))
    startup_timeout_s: float = 120.0
    seed: int = 0
    # worker id -> extra keyword arguments of its worker_main.main: fault injection for tests, e.g.
    # {0: {"drop_kv_sends": 1}} makes worker 0 drop its next KV send (see docs/runtime.md)
    worker_kwargs: dict[int, dict] = field(default_factory=dict)
    # a request whose client reads none of this many queued outputs is aborted (coordinator_shell MAX_UNREAD)
    max_unread_outputs: int = 4096
    # every worker is asked this often which requests it holds; one it should hold and does not fails (a message
    # between them was lost) instead of waiting forever (coordinator_shell.CoordinatorShell.audit)
    audit_interval_s: float = AUDIT_S
    worker_timeout_s: float = knob(DEFAULT_WORKER_TIMEOUT_S, "a worker silent S seconds (no heartbeat: stopped, "
                                   "hung, or its host gone) is declared dead, fenced and replaced",
                                   parse=positive_float, metavar="S", flags=("--worker-timeout",))
    max_restarts: int = knob(DEFAULT_MAX_RESTARTS, f"replace a dead worker at most N times per "
                             f"{RESTART_WINDOW_S / 60:g} minutes (0: never)", parse=nonneg_int, metavar="N",
                             flags=("--max-worker-restarts",))
    policy_options: dict = field(default_factory=dict)   # PolicySpec knobs for every core (e.g. laps_min_pool)
    deploy: str | None = knob(None, "the workers and their tensor-parallel degrees in the planner's form, e.g. "
                              "'P:tp2x1,D:tp1x2' or 'C:tp2x1' (instead of --prefill-workers/--decode-workers/"
                              "--colocated/--tensor-parallel-size)", metavar="SPEC")
    kv_transfer: str = knob(KV_TRANSFERS[0], "how KV moves between workers of different tensor-parallel degrees: "
                            "each rank straight to the ranks that hold its heads (rank-to-rank), or through both "
                            "workers' driver processes (driver; as between two tp=1 workers)", choices=KV_TRANSFERS)
    # role (prefill, decode, colocated) -> its workers' tensor-parallel degree (`tandem serve --deploy
    # "P:tp2x1,D:tp1x2"`); a role not named takes engine_args' tensor_parallel_size (1 without it)
    role_tp: dict[str, int] = field(default_factory=dict)
    # where the workers run: "embedded" (local processes) or "ray" (Ray actors, tandem.runtime.ray_launcher:
    # joining ray_address, each role on nodes offering its ray_place resource, actors in ray_namespace)
    launcher: str = knob(LAUNCHERS[0], "where workers run: local processes (embedded) or Ray actors on the nodes of a "
                         "Ray cluster (ray; pip install 'tandem[ray]'; docs/ray.md)", choices=LAUNCHERS)
    ray_address: str | None = knob(None, "--launcher ray: the Ray cluster to join (auto: the one `ray start` started "
                                   "here; default: $RAY_ADDRESS, else a private single-node Ray)", parse=ray_address,
                                   metavar="auto|HOST:PORT")
    ray_place: dict[str, str] | list[tuple[str, str]] = knob(
        default_factory=list, help="--launcher ray: put ROLE's workers (prefill, decode, colocated) on nodes offering "
        "custom resource RESOURCE (`ray start --resources '{\"RESOURCE\": 1}'`); repeatable", parse=ray_place,
        metavar="ROLE=RESOURCE", repeat=True)       # role -> resource (or its (role, resource) pairs)
    ray_namespace: str | None = knob(None, "--launcher ray: Ray namespace of the worker actors (named worker-ID.N; "
                                     "default: tandem-<random>)", metavar="NS")
    laps_length_threshold: int | None = knob(None, "LAPS policies: a prefill of fewer new tokens is short (default: "
                                             "the boundary L_m fitted to --perf's profile, else the policy's)",
                                             parse=positive_int, metavar="N")
    laps_min_pool: int | None = knob(None, "LAPS policies: the fewest prefill workers each pool keeps (default: the "
                                     "policy's; 0 lets one class lose its pool, as 2 prefill workers need for the "
                                     "controller to move one)", parse=nonneg_int, metavar="N")

    def __post_init__(self) -> None:
        if self.policy is None:                      # co-located workers run the co-located default
            self.policy = DEFAULT_COLOCATED_POLICY if self.colocated else DEFAULT_POLICY
        self.ray_place = dict(self.ray_place)

    def policy_knobs(self) -> dict:
        """The PolicySpec knobs every core gets: policy_options with the LAPS fields that are set."""
        laps = {k: getattr(self, k) for k in ("laps_length_threshold", "laps_min_pool") if getattr(self, k) is not None}
        return {**self.policy_options, **laps}


def worker_cpu_binds(cfg: ClusterConfig, tps: Sequence[int]) -> list[str | None]:
    """Each worker's own cpu_omp_threads_bind (workers of tensor-parallel degrees `tps`, in worker order), decided by
    tandem.engine.cpu_bind over the CPUs this process may use: under auto no two workers share a CPU. None per
    worker when nothing is bound; ValueError (one line) when it cannot be applied, before any worker starts."""
    bind = parse_cpu_bind(cfg.engine_args.get(CPU_BIND))
    if not bind.on:
        return [None] * len(tps)
    if cfg.launcher != "embedded":
        raise ValueError(f"--{CPU_BIND.replace('_', '-')} applies to the embedded launcher (Ray places each worker on "
                         f"its node's CPUs)")
    return plan_workers(bind, os.sched_getaffinity(0), cfg.threads or 1, tps)
