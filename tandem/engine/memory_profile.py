"""Logit-aware memory profiling (dLLM-Serve): size the KV pool from a measured worst-case step.

At start, before the KV pool exists, the ModelRunner runs a dummy step at the scheduler's limits through its own
`execute` (forward, LM head, sampler, prompt logprobs) and measures the peak of the memory that step allocates:

- the batch (`worst_case_batch`): `max_num_batched_tokens` query tokens; `min(max_num_seqs, tokens)` rows sampled
  (one or more prefill chunks, each at the end of a `max_model_len` context so attention reads the longest history,
  the other rows decodes); every row in the sampler's most memory-hungry mode (temperature with top-k, top-p and
  min-p, repetition/frequency/presence penalties, a logit_bias, min_tokens, 20 logprobs, its own seeded generator so
  the engine's default generator is untouched) and prompt logprobs (top 20) for every prefill position. The history
  and every slot point at one scratch KV block: values are garbage, shapes are the real ones, and the profile needs
  one block of KV, not a context's worth. Structured-output bitmasks (an int32 per 32 tokens per row) are left out.
- the measure (`measure_peak`): on CUDA the caching allocator's counters (torch.cuda.max_memory_allocated minus what
  was allocated before the step); on the CPU `LiveBytes`, a TorchDispatchMode that adds the bytes of every storage an
  ATen op creates (outputs that alias an input are views, in-place or out= results: not new) and subtracts them when
  the storage is freed (a weakref finalizer), keeping the peak. It sees every tensor the step's ops return (the
  oneDNN linears', SDPA's, the sampler's), not memory a kernel allocates inside itself and frees before returning
  (SDPA's per-thread blocks) nor numpy/ctypes memory: the guard band covers those (tests/test_engine_memory_profile.py
  checks the guarded figure against the CPU allocator's own accounting, torch.profiler's memory events).
  torch.profiler was not chosen for the engine: it takes about 2 s to start and logs to stderr.
- the steps (`run_profile`): a warm-up (the forward and one row's logits; what it leaves allocated are buffers that
  stay: oneDNN's packed weights, attention's gather buffer: `persistent_bytes`), then one forward whose hidden states
  stay live while the logit phase (prompt logprobs, sampling) runs monolithic (every row's logits at once) and, with
  max_num_logits, decomposed; a step's peak is max(the forward's peak, hidden + the logit phase's peak), counting
  only what the step allocates on top of the persistent buffers.

The KV pool then gets budget - weights - persistent - (peak + guard), with the peak of the mode the engine runs
(`kv_budget`): on CUDA the budget is total x gpu_memory_utilization and "weights" is everything in use on the device
after the profile (weights, buffers, the CUDA context, other processes); on the CPU it is cpu_memory_budget_bytes.
"""
from __future__ import annotations

import logging
import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tandem.engine.model_input import ModelInput, PromptLogprobsSpec
from tandem.engine.sampler import make_generator
from tandem.engine.sampling_params import MAX_LOGPROBS, SamplingParams

log = logging.getLogger(__name__)

GUARD_FRACTION = 0.10           # the guard band: 10% of the measured peak ...
GUARD_MIN_BYTES = 4 << 20       # ... and at least 4 MiB (kernel-internal scratch the measure does not see)


def guard_bytes(peak: int) -> int:
    """The guard band added to a measured activation peak."""
    return max(int(math.ceil(GUARD_FRACTION * peak)), GUARD_MIN_BYTES)


@dataclass
class MemoryProfile:
    """What the worst-case dummy step measured, and the KV pool sized from it (bytes throughout)."""

    method: str                          # "cuda-allocator" or "dispatch-live-bytes" (CPU)
    tokens: int                          # query tokens of the dummy step (max_num_batched_tokens)
    logit_rows: int                      # rows sampled in it
    prompt_logprob_rows: int             # rows whose prompt logprobs it computed
    max_num_logits: int | None           # the logit cap of the decomposed step (None: not measured)
    weight_bytes: int                    # parameters (tied ones once)
    persistent_bytes: int                # buffers the first step left allocated (packed weights, gather buffers)
    monolithic_peak_bytes: int           # peak allocated by the step, every logit row at once
    decomposed_peak_bytes: int | None    # the same under max_num_logits
    seconds: float                       # wall time of the three steps
    budget_bytes: int | None = None      # what weights + activations + KV may take (None: the pool was explicit)
    used_bytes: int = 0                  # in use before the KV pool: weights + persistent (CPU), device use (CUDA)
    kv_pool_bytes: int = 0               # the KV pool allocated (set by the runner)

    @property
    def peak_bytes(self) -> int:
        """The activation peak of the mode the engine runs (decomposed with a cap, else monolithic)."""
        return self.decomposed_peak_bytes if self.decomposed_peak_bytes is not None else self.monolithic_peak_bytes

    @property
    def reserved_bytes(self) -> int:
        """What the pool sizing sets aside for activations: the peak plus its guard band."""
        return self.peak_bytes + guard_bytes(self.peak_bytes)

    @property
    def kv_gain_bytes(self) -> int:
        """How much larger the KV pool is thanks to the logit cap: the difference of the guarded peaks."""
        if self.decomposed_peak_bytes is None:
            return 0
        mono = self.monolithic_peak_bytes + guard_bytes(self.monolithic_peak_bytes)
        return mono - self.reserved_bytes

    def summary(self) -> str:
        """One log line: both peaks, the guard, the budget and the pool."""
        mib = 1 << 20
        dec = (f"{self.decomposed_peak_bytes / mib:.1f} MiB decomposed (max_num_logits={self.max_num_logits})"
               if self.decomposed_peak_bytes is not None else "no decomposed profile (max_num_logits unset)")
        text = (f"memory profile ({self.method}, {self.tokens} tokens, {self.logit_rows} logit rows, "
                f"{self.seconds:.2f} s): activation peak {self.monolithic_peak_bytes / mib:.1f} MiB monolithic, "
                f"{dec}; weights {self.weight_bytes / mib:.1f} MiB, persistent buffers "
                f"{self.persistent_bytes / mib:.1f} MiB, guard {guard_bytes(self.peak_bytes) / mib:.1f} MiB")
        if self.budget_bytes is not None:
            text += (f"; budget {self.budget_bytes / mib:.1f} MiB -> KV pool {self.kv_pool_bytes / mib:.1f} MiB"
                     f" (+{self.kv_gain_bytes / mib:.1f} MiB from the logit cap)")
        else:
            text += f"; KV pool {self.kv_pool_bytes / mib:.1f} MiB (not sized from the profile)"
        return text


class LiveBytes(TorchDispatchMode):
    """While active: the bytes of live tensor storages created by ATen ops, and their peak (a CPU allocation
    account that works on any device; views, in-place and out= results are not new storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}                  # id(storage object) -> bytes, while alive
        self._finalizers: list[weakref.finalize] = []

    def _freed(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        """Run the op; count each output storage that no input shares."""
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {_storage(t)[0] for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            ptr, n, owner = _storage(t)
            key = id(owner)
            if n == 0 or ptr in inputs or key in self._sizes:
                continue
            self._sizes[key] = n
            self.live += n
            self.peak = max(self.peak, self.live)
            self._finalizers.append(weakref.finalize(owner, self._freed, key))
        return out

    def __exit__(self, *exc) -> None:  # noqa: ANN002
        """Leave the mode; storages still alive keep no link to this account."""
        super().__exit__(*exc)
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()


def _storage(t: torch.Tensor) -> tuple[int, int, object]:
    """(address, bytes, the object whose death frees them) of a tensor's memory: its storage, or for an opaque
    tensor without one (oneDNN's packed weights) the tensor itself, sized as numel x element size."""
    if not t.is_mkldnn:
        try:
            st = t.untyped_storage()
            return st.data_ptr(), st.nbytes(), st
        except (NotImplementedError, RuntimeError):      # sparse and other storage-less layouts
            pass
    return id(t), t.numel() * t.element_size(), t


def measure_peak(fn: Callable[[], object], device: torch.device) -> tuple[int, int]:
    """(peak bytes allocated while fn runs above what was allocated before, bytes still allocated after it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - base, torch.cuda.memory_allocated(device) - base)
    mode = LiveBytes()
    with mode:
        fn()
    return mode.peak, mode.live


def worst_case_batch(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, vocab_size: int,
                     block_size: int, eos_token_ids: list[int] | tuple[int, ...] = (),
                     device: torch.device | str = "cpu", scratch_block: int = 0) -> ModelInput:
    """The dummy step at the scheduler's limits (module docstring): every slot in block `scratch_block`."""
    tokens, seqs = max_num_batched_tokens, min(max_num_seqs, max_num_batched_tokens)
    n_pf = 1                                       # prefill chunks: as few as max_model_len allows
    while True:
        n_dec = max(0, seqs - n_pf)
        prefill = tokens - n_dec
        need = -(-prefill // max_model_len)
        if need <= n_pf:
            break
        n_pf = need
    chunks = [prefill // n_pf + (1 if i < prefill % n_pf else 0) for i in range(n_pf)]
    batch = ModelInput()
    tok = 0
    for n in chunks:
        hist = max_model_len - n
        ids = [(tok + j) % vocab_size for j in range(n)]
        batch.add(ids, hist, [scratch_block] * -(-(hist + n) // block_size))
        batch.prompt_logprobs.append(PromptLogprobsSpec(len(batch.query_lens) - 1,
                                                        [(t + 1) % vocab_size for t in ids], MAX_LOGPROBS))
        tok += n
    for _ in range(n_dec):
        batch.add([tok % vocab_size], 0, [scratch_block])
        tok += 1
    hungry = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, logprobs=MAX_LOGPROBS,
                            repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5,
                            logit_bias={0: 1.0}, min_tokens=2, stop_token_ids=[1])
    history = list(range(min(16, vocab_size)))
    for i in range(len(batch.query_lens)):
        batch.sample_rows.append(i)
        batch.params.append(hungry)
        batch.generators.append(make_generator(i, device))
        batch.output_tokens.append([1 % vocab_size])
        batch.prompt_tokens.append(history)
        batch.grammars.append(None)
    return batch


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage once (tied embeddings)."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


@dataclass
class DiffusionDummy:
    """The worst-case step of a block-diffusion model (diffusion_worst_case): its inputs and the rows it samples."""

    ids: torch.Tensor
    meta: object                        # BlockDiffusionMetadata over no KV cache
    sample_rows: list[int]              # every row: a diffusion step may sample each of its query positions
    prompt_logprobs: tuple = ()


def diffusion_worst_case(max_num_batched_tokens: int, max_model_len: int, block: int, vocab_size: int,
                         device: torch.device | str = "cpu", rows: int | None = None,
                         bidirectional: bool = False) -> DiffusionDummy:
    """A diffusion model's dummy step: `max_num_batched_tokens` query tokens as full-length recomputations
    (dLLM-Serve's Refresh, a block-diffusion prefill: positions 0.. of sequences as long as max_model_len allows,
    dense block-causal attention, or bidirectional for a LLaDA-style canvas; no KV cache), every row sampled (or the
    first `rows`)."""
    from tandem.engine.models.bidirectional import BidirectionalMetadata
    from tandem.engine.models.sdar import BlockDiffusionMetadata
    longest = max(block, max_model_len // block * block)
    lens, left = [], max_num_batched_tokens
    while left > 0:
        lens.append(min(left, longest))
        left -= lens[-1]
    zeros = [0] * len(lens)
    if bidirectional:
        meta = BidirectionalMetadata.build(lens, zeros, zeros, None, 1, device)
    else:
        meta = BlockDiffusionMetadata.build([range(n) for n in lens], zeros, zeros, None, 1, block, device)
    ids = torch.arange(max_num_batched_tokens, device=device) % vocab_size
    return DiffusionDummy(ids, meta, list(range(max_num_batched_tokens if rows is None else rows)))


def run_profile(forward: Callable[[ModelInput], torch.Tensor],
                logits_phase: Callable[[torch.Tensor, ModelInput, int | None], object], batch: ModelInput,
                device: torch.device, max_num_logits: int | None, weights: int, tokens: int,
                warm: object | None = None) -> MemoryProfile:
    """Measure the dummy step: forward(batch) -> hidden, then logits_phase(hidden, batch, max_rows) (prompt logprobs
    and sampling under that cap). A warm-up (the forward and one row's logits; `warm`, else built from the batch)
    first leaves the persistent buffers allocated; then one forward, whose hidden states stay live while the logit
    phase runs monolithic and, with a cap, decomposed. A step's peak is max(forward's peak, hidden + the logit
    phase's peak)."""
    t0 = time.perf_counter()
    if warm is None:
        warm = ModelInput(batch.token_ids, batch.positions, batch.query_lens, batch.seq_lens, batch.block_tables,
                          batch.sample_rows[:1], batch.params[:1], batch.generators[:1], batch.output_tokens[:1],
                          batch.prompt_tokens[:1], batch.grammars[:1])

    def warm_up() -> None:
        logits_phase(forward(warm), warm, None)
    _, persistent = measure_peak(warm_up, device)
    held: list[torch.Tensor] = []
    fwd_peak, fwd_live = measure_peak(lambda: held.append(forward(batch)), device)
    hidden = held.pop()
    mono = max(fwd_peak, fwd_live + measure_peak(lambda: logits_phase(hidden, batch, None), device)[0])
    dec = None
    if max_num_logits is not None:
        dec = max(fwd_peak, fwd_live + measure_peak(lambda: logits_phase(hidden, batch, max_num_logits), device)[0])
    plp = sum(len(s.targets) for s in batch.prompt_logprobs)
    return MemoryProfile("cuda-allocator" if device.type == "cuda" else "dispatch-live-bytes", tokens,
                         len(batch.sample_rows), plp, max_num_logits, weights, max(0, persistent), mono, dec,
                         time.perf_counter() - t0)


def kv_budget(prof: MemoryProfile, device: torch.device, gpu_memory_utilization: float,
              cpu_memory_budget_bytes: int | None) -> int | None:
    """Bytes left for the KV pool by the budget, or None where no budget applies (CPU without one); sets the
    profile's budget_bytes and used_bytes. May be <= 0: the caller says what to change."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        prof.budget_bytes = int(total * gpu_memory_utilization)
        prof.used_bytes = int(total - free)          # weights, persistent buffers, context, other processes
    elif cpu_memory_budget_bytes is not None:
        prof.budget_bytes = int(cpu_memory_budget_bytes)
        prof.used_bytes = prof.weight_bytes + prof.persistent_bytes
    else:
        return None
    return prof.budget_bytes - prof.used_bytes - prof.reserved_bytes


def memory_report(prof: MemoryProfile | None, kv_pool_bytes: int) -> dict[str, int]:
    """One engine's memory figures for /metrics: the KV pool's bytes and, when profiled, each activation peak measured
    (monolithic, decomposed) and the bytes reserved for activations (the running mode's peak plus the guard)."""
    out = {"kv_cache_pool_bytes": int(kv_pool_bytes)}
    if prof is not None:
        out["activation_peak_monolithic_bytes"] = prof.monolithic_peak_bytes
        if prof.decomposed_peak_bytes is not None:
            out["activation_peak_decomposed_bytes"] = prof.decomposed_peak_bytes
        out["activation_budget_bytes"] = prof.reserved_bytes
    return out
