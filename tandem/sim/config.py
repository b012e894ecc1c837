"""What a simulation run is configured by: the target (model, GPU, deployment), the policy's knobs, the scheduler
knobs it shares with every worker (tandem.core.config), the diffusion and dLLM-Serve knobs, the cost model. Each
knob is declared once (tandem.knob); `tandem simulate`'s flags are generated from these fields."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tandem.core.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_WINDOW_S, SchedulerConfig
from tandem.policy.presets import get_policy
from tandem.knob import KnobError, knob, positive_int, shared
from tandem.perf.costs import COST_MODELS, DEFAULT_COST_MODEL, CostChoice, choose_cost_model
from tandem.perf.dllm import OPTIMUS_LENGTHS
from tandem.perf.hardware import get_gpu
from tandem.perf.measured.source import DEFAULT_FRAMEWORK, FRAMEWORKS, MissingCostData
from tandem.perf.models import get_model
from tandem.policy.presets import PolicySpec
from tandem.sim.faults import FaultError, FaultSpec, parse_faults


COST_KNOBS = ("cost_model", "cost_framework", "quantization", "kv_cache_dtype")   # how a run's steps are priced


class ConfigError(ValueError):
    """The simulation configuration is inconsistent (policy vs deployment, bad knob values)."""


def commits_text(text: str) -> tuple[float, float]:
    """--dllm-commits: MEAN or MEAN,STD of the commits per step at block 32."""
    parts = text.split(",")
    try:
        mean = float(parts[0])
        std = float(parts[1]) if len(parts) == 2 else 0.0
    except ValueError:
        raise KnobError(f"expected MEAN or MEAN,STD, got {text!r}") from None
    if len(parts) > 2 or not 1 <= mean < 32 or std < 0 or (mean > 1 and std == 0):
        raise KnobError(f"expected 1 <= MEAN < 32 and STD > 0 (or MEAN 1 alone), got {text!r}")
    return mean, std


def budget_text(text: str) -> int:
    """--max-num-batched-tokens of the simulator: N, or auto (0: dLLM-Serve sizes it)."""
    return 0 if text.strip().lower() == "auto" else positive_int(text)


def faults_text(text: str) -> FaultSpec:
    """--faults: the spec parsed (FaultError says what is malformed)."""
    try:
        return parse_faults(text)
    except FaultError as e:
        raise KnobError(str(e)) from None


@dataclass(slots=True)
class SimTarget:
    """What `tandem simulate` (and the commands that simulate) is pointed at, before defaults are resolved."""

    model: str = knob("llama-3.1-70b", "model name")
    gpu: str = knob("h20", "GPU name")
    gpus: int | None = knob(None, "GPUs in the cluster (default: AMPD's for the workload, else what --deploy uses)",
                            parse=positive_int)
    deploy: str | None = knob(None, "deployment, e.g. 'P:tp4x1,D:tp4x1' or 'C:tp4x2' (default: a balanced one that "
                              "fits)", metavar="SPEC")


@dataclass(slots=True)
class SimConfig:
    """Everything a simulation run needs besides the sessions."""

    model: str
    gpu: str
    gpus: int
    deploy: str
    policy: str = knob("ampd", "serving policy (tandem.policy.presets)")
    seed: int = 0
    block_size: int = shared(SchedulerConfig, "block_size")
    max_num_batched_tokens: int = shared(SchedulerConfig, "max_num_batched_tokens")  # prefill and decode workers
    colocated_max_num_batched_tokens: int = knob(
        DEFAULT_MAX_NUM_BATCHED_TOKENS, "query tokens per step of every worker; with --dllm-admission, "
        "auto is the largest whose activation peak leaves KV for the retained positions of that many tokens",
        parse=budget_text, metavar="N|auto", flags=("--max-num-batched-tokens",))
    max_num_seqs: int = shared(SchedulerConfig, "max_num_seqs")
    mem_util: float = 0.9
    window_s: float = DEFAULT_WINDOW_S           # AMPD windowed TTFT/ITL
    alpha: float = 0.9
    beta: float = 0.85
    reorder_window: int = 3
    continuum_ttl_s: float = 30.0               # idle KV retention of policies that retain it (Continuum)
    kv_timeout_s: float = shared(SchedulerConfig, "kv_timeout_s")
    session_ttl_s: float = shared(SchedulerConfig, "session_ttl_s")
    decode_query_tokens: int = 1                # query tokens per decode step (multi-token steps when > 1)
    commit_tokens: tuple[int, int] | None = None  # multi-token steps: each commits U[lo, hi] tokens (None: all)
    dllm_block_length: int = shared(SchedulerConfig, "dllm_block_length")
    dllm_chunk: str = shared(SchedulerConfig, "dllm_chunk", default="elastic",
                             why="a simulated request has no sampling parameters: every one runs Optimus's windows")
    dllm_dataset: str = knob("sharegpt", "the Optimus Table 2 row the simulated commits per step follow",
                             choices=tuple(OPTIMUS_LENGTHS))
    dllm_prefill_share: float = shared(SchedulerConfig, "dllm_prefill_share")
    dllm_admission: str | None = shared(SchedulerConfig, "dllm_admission")   # its co-located workers' KV pool
                                                # follows tandem.perf.dllm_memory; colocated_max_num_batched_tokens 0
                                                # means the largest that fits
    dllm_delay_step: int = shared(SchedulerConfig, "dllm_delay_step")
    dllm_refresh_interval: int = shared(SchedulerConfig, "dllm_refresh_interval")
    dllm_refresh_span: str = shared(SchedulerConfig, "dllm_refresh_span")
    dllm_kv_retention: float = shared(SchedulerConfig, "dllm_kv_retention")
    max_num_logits: int | None = knob(None, "dLLM-Serve memory model: logit rows materialised at once (default: "
                                      "every row, monolithic)", parse=positive_int, metavar="N")
    dllm_commits: tuple[float, float] | None = knob(
        None, "diffusion tokens committed per step at block 32 (mean and standard deviation of the stretch "
        "distribution; 1 = one a step); default: Optimus Table 2's row, LLaDA-8B one a step",
        parse=commits_text, metavar="MEAN[,STD]")
    faults: FaultSpec | None = knob(None, "inject faults and compare with the fault-free run: kv-fail=P (a KV "
                                    "transfer fails), kv-lost=P (it never lands), kill=WORKER@SECONDS; "
                                    "comma-separated", parse=faults_text, metavar="SPEC")
    perf: str | None = knob(None, "a `tandem profile` JSON (step timer, routing costs, KV pool) or an AMPD cost "
                            "model JSON (routing costs only)", metavar="FILE")
    cost_model: str = knob(DEFAULT_COST_MODEL, "step costs: measured GPU operator tables (aiconfigurator-core; "
                           "derived for GPUs of the same architecture without tables), the datasheet roofline, or "
                           "auto: measured where tables exist, else the roofline", choices=COST_MODELS)
    cost_framework: str = knob(DEFAULT_FRAMEWORK, "whose measured kernels price the steps", choices=FRAMEWORKS)
    cost_donor: str | None = None               # derive the GPU's costs from this GPU's tables (the check of
                                                # derived costs on a GPU that has tables of its own)
    quantization: str | None = knob(None, "fp8 weights in the linear layers (w8a8), as vLLM's --quantization fp8 "
                                    "(default: bf16)", choices=("fp8",))
    kv_cache_dtype: str = knob("auto", "KV-cache element type, as vLLM's --kv-cache-dtype (auto: the model's bf16)",
                               choices=("auto", "bf16", "fp8"))
    laps_length_threshold: int | None = knob(None, "LAPS policies: a prefill of fewer new tokens is short "
                                             "(default: the roofline's boundary L_m for the prefill workers, where "
                                             "a prefill step turns compute-bound)", parse=positive_int, metavar="N")
    concurrency: int | None = knob(None, "closed loop: N clients, each running one session at a time (the first N "
                                   "start at 0 s, each next one when a client's session ends); arrival times are "
                                   "not used, so not with --rate or --override-arrivals", parse=positive_int,
                                   metavar="N")
    preemption_mode: str | None = shared(SchedulerConfig, "preemption_mode")
    swap_space: float = shared(SchedulerConfig, "swap_space")
    kv_offloading_size: float = shared(SchedulerConfig, "kv_offloading_size")

    def policy_spec(self) -> PolicySpec:
        """The run's policy with this config's knobs (validated; ConfigError names the bad one)."""
        try:
            spec = get_policy(self.policy)
            return spec.with_options(
                reorder_window=self.reorder_window, alpha=self.alpha, beta=self.beta,
                retain_idle_kv_s=self.continuum_ttl_s if spec.retain_idle_kv else 0.0,
                laps_length_threshold=self.laps_length_threshold or spec.laps_length_threshold)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def model_spec(self):
        """The catalogue model at this run's precision (ConfigError for an unknown precision)."""
        try:
            return get_model(self.model).with_precision(self.quantization, self.kv_cache_dtype)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def cost_choice(self) -> CostChoice:
        """The run's resolved cost model (ConfigError when measured costs were asked for and are missing)."""
        try:
            return choose_cost_model(self.cost_model, get_gpu(self.gpu).name, self.cost_framework, self.cost_donor)
        except (ValueError, MissingCostData) as e:
            raise ConfigError(str(e)) from None

    def scheduler(self, **over) -> SchedulerConfig:
        """The scheduler configuration every core of this run is built with."""
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(SchedulerConfig) if hasattr(self, f.name)}
        kw.update(over)
        try:
            return SchedulerConfig(**kw)
        except ValueError as e:
            raise ConfigError(str(e)) from None
