"""Engine configuration (vLLM's names) and the sizing of the paged KV pool from a memory budget.

The fields `tandem serve` sets are knobs (tandem.knob): its flags are generated from them, and the ones the scheduler
owns are SchedulerConfig's, shared. torch is imported where it is used, so building the command line does not load it.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.core.config import SchedulerConfig
from tandem.core.factory import resolve_policy
from tandem.engine.cpu_bind import CpuBindError, cpu_bind_text, parse_cpu_bind
from tandem.engine.sampling_params import UNMASKING_STRATEGIES
from tandem.engine.sparse_kv_config import DEFAULT_POOL_KERNEL, DEFAULT_RETENTION, SELECTIONS, SparseKVConfig
from tandem.knob import byte_size, csv_list, knob, nonneg_int, positive_int, shared, unit_fraction
from tandem.policy.dllm_serve.phases import DEFAULT_DELAY_STEP
from tandem.policy.presets import PolicySpec

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "float16", "bfloat16")
CPU_KV_CACHE_BYTES = 1 << 30        # vLLM's CPU backend takes its KV space from an env var; 1 GiB by default here
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_CONFIDENCE_THRESHOLD = 0.9
LLADA_BLOCK_LENGTH = 32             # LLaDA's and Fast-dLLM's examples (LLaDA's config.json has no block length)


def _dtypes() -> dict[str, torch.dtype]:
    """The dtype names an engine takes, as torch dtypes."""
    import torch
    return {name: getattr(torch, name) for name in DTYPE_NAMES}


class EngineError(ValueError):
    """A request or configuration the engine cannot serve; the message says which limit and by how much."""


@dataclass
class EngineConfig:
    """What one engine instance loads and how it schedules (names follow vLLM's EngineArgs)."""

    model: str
    dtype: str = "auto"                       # auto (the checkpoint's; float32 on CPU), float32, float16, bfloat16
    device: str = "auto"                      # auto (cuda when available), cpu, cuda, cuda:N
    block_size: int = shared(SchedulerConfig, "block_size")
    max_model_len: int | None = knob(None, "the longest sequence (prompt + output) a request may have (default: the "
                                     "model's max_position_embeddings)", parse=positive_int, metavar="N")
    max_num_batched_tokens: int = shared(SchedulerConfig, "max_num_batched_tokens")
    max_num_seqs: int = shared(SchedulerConfig, "max_num_seqs")
    policy: str = "vllm"                      # the scheduling policy of the worker core (tandem.policy.presets):
                                              # its prefill picker and idle-KV retention
    policy_options: dict = field(default_factory=dict)   # knobs of the policy (PolicySpec fields), e.g.
                                              # {"laps_length_threshold": 200}
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None  # KV pool budget; default: 1 GiB on CPU (or what cpu_memory_budget_bytes
                                              # leaves), on CUDA what gpu_memory_utilization leaves (memory_profile.py)
    gpu_memory_utilization: float = knob(DEFAULT_GPU_MEMORY_UTILIZATION, "CUDA: fraction of the GPU's memory for "
                                         "weights, activations and KV; the KV pool gets what the profiled "
                                         "worst-case step leaves", parse=unit_fraction, metavar="F")
    num_kv_blocks: int | None = knob(None, "KV blocks per worker, overriding the memory budget (vLLM's "
                                     "num_gpu_blocks_override)", parse=positive_int, metavar="N")
    max_num_logits: int | None = knob(None, "logit decomposition: the LM head and the sampler run on at most N rows "
                                      "at a time (default: every row of a step at once)", parse=positive_int,
                                      metavar="N")
    cpu_memory_budget_bytes: int | None = knob(
        None, f"CPU: bytes per worker for weights, activations and KV (e.g. 4G, 512M); the KV pool gets what the "
        f"profiled worst-case step leaves (default: a {CPU_KV_CACHE_BYTES >> 30} GiB KV pool)", parse=byte_size,
        metavar="BYTES", flags=("--cpu-memory-budget",))
    memory_profile: bool | None = None        # the worst-case dummy step at start (memory_profile.py); None: when the
                                              # pool is sized from a budget (CUDA without explicit sizes, CPU with
                                              # cpu_memory_budget_bytes); True: always (reported even with explicit
                                              # sizes); False: never (CUDA then sizes the pool as free x utilization)
    attention_backend: str | None = None      # None/auto: flash on CUDA when installed, else sdpa
    seed: int = 0
    tensor_parallel_size: int = knob(1, "ranks per worker (one process each, rank 0 the driver that schedules and "
                                     "samples; heads, MLP and vocabulary split; --deploy sets one per role)",
                                     parse=positive_int, metavar="N", flags=("-tp", "--tensor-parallel-size"))
    cpu_omp_threads_bind: str | None = knob(
        None, "CPU: bind the engine's OpenMP threads one per CPU, as vLLM's VLLM_CPU_OMP_THREADS_BIND: auto (the "
        "first N CPUs this process may use, N its threads; each tensor-parallel rank, and each worker of a server, its "
        "own N), or CPU "
        "lists such as 0-3 or 0,2,4,6, one per rank separated by '|' (a list sets its rank's threads to its length); "
        "default: nobind, threads left to the OS scheduler", parse=cpu_bind_text, metavar="auto|nobind|CPUS")
    enforce_eager: bool = knob(False, "CUDA: run decode steps eagerly (no CUDA graphs)")
    cuda_graph_sizes: tuple[int, ...] | None = knob(None, "CUDA: decode batch sizes captured as CUDA graphs "
                                                    "(default: 1,2,4,8,16,... up to max-num-seqs, at most 512)",
                                                    parse=csv_list(positive_int), metavar="1,2,4,8")
    laps_graph_buckets: tuple[tuple[int, int], ...] | None = None   # CUDA, LAPS prefill workers: the (length,
                                              # batch) buckets captured as prefill graphs; None: every bucket of LAPS's
                                              # grid within max_num_batched_tokens and max_num_seqs; (): none
    laps_graph_max_len: int | None = None     # longest sequence (history + new tokens) a prefill graph attends over;
                                              # longer steps run eagerly. None: min(max_model_len, 4096)
    # block-diffusion models (SDAR; LMDeploy's names): the engine's defaults, a request may override the last three
    dllm_block_length: int | None = knob(None, f"diffusion models: positions per block; SDAR: must be the model's "
                                         f"(default: config.json); LLaDA: any >= 2 (default: {LLADA_BLOCK_LENGTH})",
                                         parse=positive_int, metavar="B")
    dllm_chunk: str = shared(SchedulerConfig, "dllm_chunk")   # SDAR only; under auto and elastic a request may
                                              # name its own
    dllm_unmasking_strategy: str = knob(UNMASKING_STRATEGIES[0], "block-diffusion models: which positions a step "
                                        "commits", choices=UNMASKING_STRATEGIES)
    dllm_denoising_steps: int | None = knob(None, "block-diffusion models: steps per block, a divisor of the block "
                                            "length (default: the block length: at least one token a step)",
                                            parse=positive_int, metavar="N")
    dllm_confidence_threshold: float = knob(DEFAULT_CONFIDENCE_THRESHOLD, "block-diffusion models: the dynamic "
                                            "strategy commits every position above T, in (0, 1]",
                                            parse=unit_fraction, metavar="T")
    dllm_latency_profile: str | None = knob(None, "block-diffusion models: Optimus's T(c, b) from this `tandem "
                                            "profile` output of the model (its dllm_latency section) instead of "
                                            "measuring it at each worker's start", metavar="FILE")
    # dLLM-Serve: Refresh/Reuse phases over head-centric sparse KV, admitted by the worker core (a LLaDA model always
    # runs in phases: None is phase there); the options below need it
    dllm_admission: str | None = shared(SchedulerConfig, "dllm_admission")
    dllm_delay_step: int | None = knob(None, "--dllm-admission: full-length steps of a block before its KV is packed "
                                       f"(default: {DEFAULT_DELAY_STEP}; LLaDA: 0)", parse=nonneg_int, metavar="N")
    dllm_refresh_interval: int = shared(SchedulerConfig, "dllm_refresh_interval")
    kv_retention_ratio: float | None = knob(None, f"--dllm-admission: share of a request's positions whose K/V each "
                                            f"head keeps, in (0, 1] (default: {DEFAULT_RETENTION:g}; LLaDA: "
                                            f"1, Fast-dLLM's dense prefix cache)", parse=unit_fraction, metavar="R")
    kv_pool_kernel: int | None = knob(None, f"--dllm-admission: max-pool kernel over the position scores, odd "
                                      f"(default: {DEFAULT_POOL_KERNEL})", parse=positive_int, metavar="K")
    kv_selection: str | None = knob(None, f"--dllm-admission: per-KV-head selection (dLLM-Serve) or one shared set "
                                    f"(Sparse-dLLM) (default: {SELECTIONS[0]})", choices=SELECTIONS)
    preemption_mode: str | None = shared(SchedulerConfig, "preemption_mode")
    swap_space: float = shared(SchedulerConfig, "swap_space")
    kv_offloading_size: float = shared(SchedulerConfig, "kv_offloading_size")

    def policy_spec(self) -> PolicySpec:
        """The worker core's policy with this config's knobs (ValueError/TypeError name a bad one)."""
        return resolve_policy(self.policy, **self.policy_options)

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, os.PathLike)) or not str(self.model):
            raise EngineError("model must be a path to a Hugging Face checkpoint directory")
        self.model = str(self.model)
        if not isinstance(self.policy_options, dict):
            raise EngineError(f"policy_options must be a dict of policy knobs, got {self.policy_options!r}")
        try:
            self.policy_spec()
        except (ValueError, TypeError) as e:
            raise EngineError(f"policy {self.policy!r}: {e}") from None
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise EngineError(f"dtype must be auto or one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise EngineError(f"{name} must be an integer >= 1, got {v!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise EngineError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1):
            raise EngineError(f"num_kv_blocks must be an integer >= 1, got {self.num_kv_blocks!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise EngineError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise EngineError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        for name in ("max_num_logits", "cpu_memory_budget_bytes"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise EngineError(f"{name} must be an integer >= 1, got {v!r}")
        if self.memory_profile is not None and not isinstance(self.memory_profile, bool):
            raise EngineError(f"memory_profile must be true, false or None (auto), got {self.memory_profile!r}")
        if self.cpu_memory_budget_bytes is not None and self.memory_profile is False:
            raise EngineError("cpu_memory_budget_bytes sizes the KV pool from the memory profile: it needs "
                              "memory_profile true or None, not false")
        if not isinstance(self.enforce_eager, bool):
            raise EngineError(f"enforce_eager must be true or false, got {self.enforce_eager!r}")
        if self.cuda_graph_sizes is not None:
            self.cuda_graph_sizes = _graph_sizes(self.cuda_graph_sizes)
        if self.laps_graph_buckets is not None:
            self.laps_graph_buckets = _graph_buckets(self.laps_graph_buckets)
        m = self.laps_graph_max_len
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise EngineError(f"laps_graph_max_len must be an integer >= 1, got {m!r}")
        self._check_tp()
        try:                                      # the CPUs are checked where the engine starts (omp_affinity)
            parse_cpu_bind(self.cpu_omp_threads_bind)
        except CpuBindError as e:
            raise EngineError(str(e)) from None
        try:                                      # the scheduler's own check of the preemption knobs
            SchedulerConfig(preemption_mode=self.preemption_mode, swap_space=self.swap_space,
                            kv_offloading_size=self.kv_offloading_size)
        except ValueError as e:
            raise EngineError(str(e)) from None
        self._check_dllm()

    def _check_tp(self) -> None:
        """tensor_parallel_size: an integer >= 1, at most the CPU cores (or CUDA devices) there are to run it; the
        model's heads are checked when it is read (ModelRunner)."""
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise EngineError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        if tp == 1:
            return
        dev = self.torch_device()
        if dev.type == "cuda":
            import torch
            have = torch.cuda.device_count() - (dev.index or 0)
            if tp > have:
                raise EngineError(f"tensor_parallel_size {tp} exceeds the {have} CUDA devices from {dev} on")
        else:
            from tandem.engine.parallel import group
            have = group.usable_cpus()
            if tp > have:
                raise EngineError(f"tensor_parallel_size {tp} exceeds the {have} CPU cores this process may use "
                                  f"(one rank per core at least)")
        if self.dllm_admission is not None:
            raise EngineError("tensor_parallel_size > 1 does not run dLLM-Serve's phases (dllm_admission) yet: their "
                              "packed sparse KV is kept on the driver only")

    def _check_dllm(self) -> None:
        """The diffusion options' types and ranges (EngineError naming the option)."""
        from tandem.engine.diffusion.unmasking import DllmConfig
        from tandem.policy.optimus.chunk import parse_chunk
        try:
            self.dllm_chunk = str(parse_chunk(str(self.dllm_chunk)))
            DllmConfig(self.dllm_block_length, self.dllm_unmasking_strategy, self.dllm_denoising_steps,
                       self.dllm_confidence_threshold)
        except ValueError as e:
            raise EngineError(str(e)) from None
        t = self.dllm_confidence_threshold
        if not 0 < float(t) <= 1:
            raise EngineError(f"dllm_confidence_threshold must be in (0, 1], got {t!r}")
        f = self.dllm_latency_profile
        if f is not None and (not isinstance(f, (str, os.PathLike)) or not str(f)):
            raise EngineError(f"dllm_latency_profile must be a file path, got {f!r}")
        if f is not None and self.dllm_admission is not None:
            raise EngineError("dllm_latency_profile sizes Optimus's windows; with dllm_admission every step is a "
                              "dLLM-Serve phase")
        self._check_dllm_serve()

    def _check_dllm_serve(self) -> None:
        """dLLM-Serve's options: an admission mode, and the phase and sparse-KV knobs only with one."""
        from tandem.policy.dllm_serve import PhaseSpec, parse_admission
        if self.dllm_admission is None:
            given = [k for k in DLLM_SERVE_KNOBS if getattr(self, k) not in (None, _DEFAULTS[k])]
            if given:
                raise EngineError(f"{', '.join(given)} need dllm_admission (phase, static or reserve)")
            return
        try:
            self.dllm_admission = parse_admission(self.dllm_admission).value
            self.sparse_kv()
            PhaseSpec(2, *self.phase_knobs())
        except ValueError as e:
            raise EngineError(str(e)) from None

    def phase_knobs(self, delay_default: int | None = None) -> tuple[int, int]:
        """(delay_step, refresh_interval) of the dLLM-Serve mode, defaults filled in (dLLM-Serve's: 1, 0; a LLaDA
        engine passes delay_default 0, Fast-dLLM's refresh at each block's first step)."""
        d, k = self.dllm_delay_step, self.dllm_refresh_interval
        if d is None:
            d = DEFAULT_DELAY_STEP if delay_default is None else delay_default
        return (d, 0 if k is None else k)

    def sparse_kv(self, retention_default: float | None = None) -> SparseKVConfig:
        """The sparse-KV options of the dLLM-Serve mode, defaults filled in (dLLM-Serve's: ρ 0.5, kernel 3, head; a
        LLaDA engine passes retention_default 1.0, Fast-dLLM's dense cache)."""
        r, k, sel = self.kv_retention_ratio, self.kv_pool_kernel, self.kv_selection
        if r is None:
            r = DEFAULT_RETENTION if retention_default is None else retention_default
        return SparseKVConfig(r, DEFAULT_POOL_KERNEL if k is None else k, SELECTIONS[0] if sel is None else sel)

    def torch_device(self) -> torch.device:
        """The device to run on: `device`, or CUDA when present for auto."""
        import torch
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise EngineError(f"device {self.device!r} requested but CUDA is not available")
        return dev

    def torch_dtype(self, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
        """The compute dtype: explicit, else the checkpoint's on CUDA and float32 on CPU."""
        dtypes = _dtypes()
        if self.dtype != "auto":
            return dtypes[self.dtype]
        if device.type == "cpu":
            return dtypes["float32"]
        return dtypes.get(checkpoint_dtype or "", dtypes["bfloat16"])


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
# dLLM-Serve's phase and sparse-KV options: each needs dllm_admission (and, at the CLI, --dllm-admission)
DLLM_SERVE_KNOBS = ("dllm_delay_step", "dllm_refresh_interval", "kv_retention_ratio", "kv_pool_kernel", "kv_selection")


def _graph_sizes(sizes: object) -> tuple[int, ...]:
    """cuda_graph_sizes checked (a non-empty list of integers >= 1) and sorted without repeats."""
    ok = isinstance(sizes, (list, tuple)) and len(sizes) > 0 and all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes)
    if not ok:
        raise EngineError(f"cuda_graph_sizes must be a non-empty list of integers >= 1, got {sizes!r}")
    return tuple(sorted(set(sizes)))


def _graph_buckets(buckets: object) -> tuple[tuple[int, int], ...]:
    """laps_graph_buckets checked (a list of (length, batch) pairs of integers >= 1) and sorted without repeats."""
    def pair(b: object) -> bool:
        return isinstance(b, (list, tuple)) and len(b) == 2 and all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in b)
    if not isinstance(buckets, (list, tuple)) or not all(pair(b) for b in buckets):
        raise EngineError(f"laps_graph_buckets must be a list of (length, batch) pairs of integers >= 1, "
                          f"got {buckets!r}")
    return tuple(sorted({(int(t), int(b)) for t, b in buckets}))


def explicit_kv_pool(cfg: EngineConfig) -> bool:
    """True when the config fixes the KV pool itself (num_kv_blocks or kv_cache_memory_bytes): no budget applies."""
    return cfg.num_kv_blocks is not None or cfg.kv_cache_memory_bytes is not None


def wants_memory_profile(cfg: EngineConfig, device: torch.device) -> bool:
    """Whether the engine runs the worst-case dummy step at start: as memory_profile says, else (None) when the KV
    pool is sized from a budget: on CUDA unless the pool is explicit, on CPU when cpu_memory_budget_bytes is set."""
    if cfg.memory_profile is not None:
        return cfg.memory_profile
    if explicit_kv_pool(cfg):
        return False
    return device.type == "cuda" or cfg.cpu_memory_budget_bytes is not None


def kv_pool_blocks(cfg: EngineConfig, bytes_per_block: int, device: torch.device,
                   profiled_kv_bytes: int | None = None) -> int:
    """Blocks in the KV pool: the override, else kv_cache_memory_bytes, else what the memory profile left for KV
    (profiled_kv_bytes), else the default budget, divided by one block's bytes."""
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    budget = cfg.kv_cache_memory_bytes
    if budget is None:
        budget = profiled_kv_bytes
    if budget is None:
        if device.type == "cuda":
            import torch
            free, _total = torch.cuda.mem_get_info(device)
            budget = int(free * cfg.gpu_memory_utilization)
        else:
            budget = CPU_KV_CACHE_BYTES
    n = budget // bytes_per_block
    if n < 1:
        raise EngineError(f"KV cache budget of {budget} bytes holds no block ({bytes_per_block} bytes per block)")
    return int(n)
