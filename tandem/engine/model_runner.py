"""The torch executor: owns the model weights and the paged KV tensors, runs one planned step, samples."""
from __future__ import annotations

import logging
from itertools import accumulate

import numpy as np
import torch

from tandem.engine import omp_affinity
from tandem.engine.attention import allocate_kv_cache, kv_bytes_per_block, native
from tandem.engine.attention.metadata import AttnMetadata
from tandem.engine.config import EngineConfig, EngineError, explicit_kv_pool, kv_pool_blocks, wants_memory_profile
from tandem.engine.cuda_graphs import DecodeGraphs, capture_sizes, graphs_apply
from tandem.engine.kv_transfer import KVPayload, KVTransferError, SwapSpace, dtype_name, export_kv, import_kv
from tandem.engine.loader import load_model, read_config
from tandem.engine.logits import target_logprobs
from tandem.engine.memory_profile import (DiffusionDummy, MemoryProfile, diffusion_worst_case, kv_budget, run_profile,
                                         weight_bytes, worst_case_batch)
from tandem.engine.model_input import ModelInput
from tandem.engine.parallel.group import TPGroup, check_shardable
from tandem.engine.parallel.kv_ranks import CLAIM_WAIT_S, DriverPlane, EndpointFactory
from tandem.engine.parallel.kv_stage import StagedKV
from tandem.engine.prefill_graphs import PrefillGraphs, graph_buckets, graph_max_len, prefill_graphs_apply
from tandem.engine.sampler import Sampler, SampleOutput
from tandem.policy.task import COLOCATED, PREFILL

log = logging.getLogger(__name__)
TP_LAPS_GRAPHS = ("tensor_parallel_size > 1 does not capture LAPS bucket CUDA graphs yet (they would capture the "
                  "group's collectives): use a LAPS policy without graphs (laps-no-graph) or enforce_eager")
PROMPT_LOGPROBS_ELEMS = 1 << 22     # without max_num_logits, the logits computed at once for prompt logprobs
                                    # (rows x vocab; 16 MiB of float32)


class ModelRunner:
    """Loads a checkpoint, sizes and allocates the KV pool, and executes ModelInputs."""

    def __init__(self, cfg: EngineConfig, eos_token_ids: list[int] | tuple[int, ...] = (),
                 role: str = COLOCATED) -> None:
        self.cfg = cfg
        self.device = cfg.torch_device()
        self.tp = TPGroup(0, cfg.tensor_parallel_size)
        if self.tp.size > 1 and prefill_graphs_apply(cfg, self.device, role):     # checked before any rank starts
            raise EngineError(TP_LAPS_GRAPHS)
        self.group = None                              # the other ranks of a tensor-parallel worker (parallel/driver.py)
        self.kv_plane = None                           # every rank's KV endpoint, once opened (parallel/kv_ranks.py)
        self.cpu_plan = omp_affinity.engine_plan(cfg, self.device)    # each rank's CPUs (checked before any starts)
        self.cpu_binding: omp_affinity.Binding | None = None          # what this rank's threads were bound to
        self.model, self.model_config = self._load()
        if self.cpu_plan is not None:                  # after the group's join set this rank's threads
            self.cpu_binding = omp_affinity.bind_threads(self.cpu_plan[0])
        mc = self.model_config
        self.dtype = next(self.model.parameters()).dtype
        self.block_size = cfg.block_size
        self.kv_heads = self.tp.kv_heads(mc.num_key_value_heads)[1]      # this rank's KV heads: all without TP
        self.swap_space = SwapSpace()                  # KV preempted by swap (each rank keeps its own heads')
        per_block = self.kv_block_bytes = kv_bytes_per_block(mc.num_hidden_layers, cfg.block_size,
                                                             self.kv_heads, mc.head_dim, self.dtype)
        self.max_num_logits: int | None = None         # logit rows at once when sampling (None: all of them)
        self.prompt_logit_rows = 1                     # ... and for prompt logprobs
        self._set_logit_cap(cfg.max_num_logits)
        self.sampler = Sampler(eos_token_ids=eos_token_ids, seed=cfg.seed)
        if self.device.type == "cpu" and self.dtype == torch.float32:
            native.load()            # build the CPU decode kernel now (about 1 s, once per machine), not in a step
        max_len = cfg.max_model_len or mc.max_position_embeddings
        self.graphs: DecodeGraphs | None = None        # decode steps as CUDA graphs (cuda_graphs.py)
        self.prefill_graphs: PrefillGraphs | None = None   # LAPS bucket steps as CUDA graphs (prefill_graphs.py)
        self.memory: MemoryProfile | None = None       # the worst-case step's measure (memory_profile.py)
        profiled_kv = None
        if wants_memory_profile(cfg, self.device):
            self.memory = self._profile_memory(max_len)
            if not explicit_kv_pool(cfg):
                profiled_kv = kv_budget(self.memory, self.device, cfg.gpu_memory_utilization,
                                        cfg.cpu_memory_budget_bytes)
                if profiled_kv is not None and profiled_kv < per_block:
                    raise EngineError(_no_room(self.memory, per_block))
        self.num_blocks = kv_pool_blocks(cfg, per_block, self.device, profiled_kv)
        # CUDA only; the graphs' padding rows get a scratch block. A prefill worker never decodes: no decode graphs
        # Under tensor parallelism steps run eagerly: graphs would capture the group's collectives (not supported)
        eager_tp = self.tp.size > 1
        graphs = graphs_apply(cfg, self.device) and role != PREFILL and not mc.is_diffusion and not eager_tp
        prefill_graphs = prefill_graphs_apply(cfg, self.device, role) and not eager_tp   # LAPS buckets: CUDA
        if eager_tp and graphs_apply(cfg, self.device):
            log.info("tensor_parallel_size %d: decode CUDA graphs are not captured; steps run eagerly", self.tp.size)
        self.kv_caches = self._allocate_kv(self.num_blocks + (1 if graphs or prefill_graphs else 0))
        self.kv_pool_bytes = self.num_blocks * per_block      # the pool the block manager is told about
        if self.memory is not None:
            self.memory.kv_pool_bytes = self.kv_pool_bytes
            log.info("%s", self.memory.summary())
        pool = None
        if prefill_graphs:
            self.prefill_graphs = PrefillGraphs(self.model, self.kv_caches, cfg.block_size, graph_max_len(cfg, max_len),
                                                graph_buckets(cfg), scratch_block=self.num_blocks)
            pool = self.prefill_graphs.capture()        # the larger graphs first; the decode graphs share the pool
        if graphs:
            self.graphs = DecodeGraphs(self.model, self.kv_caches, cfg.block_size, max_len, capture_sizes(cfg),
                                       scratch_block=self.num_blocks)
            self.graphs.capture(pool)

    def _load(self) -> tuple[torch.nn.Module, object]:
        """The model, or under tensor parallelism the driver's view of the group's (TPModel): the other ranks are
        started and load their shards while this one loads its own; EngineError, one line, when the model cannot
        be split so (checked before any rank starts) or a rank fails, its processes stopped."""
        cfg = self.cfg

        def load(tp: TPGroup):
            return load_model(cfg.model, dtype_for=lambda ckpt: cfg.torch_dtype(ckpt, self.device), device=self.device,
                              backend=cfg.attention_backend, tp=tp)
        if self.tp.size == 1:
            return load(self.tp)
        from tandem.engine.parallel.driver import RankGroup, TPModel
        mc = read_config(cfg.model)
        try:
            check_shardable(mc, self.tp.size)
        except ValueError as e:
            raise EngineError(str(e)) from None
        if mc.is_canvas_diffusion:
            raise EngineError("tensor_parallel_size > 1 does not run LLaDA-style models yet (their dLLM-Serve phases "
                              "keep packed KV on the driver only)")
        group = RankGroup(cfg, self.tp.size, self.device, self.cpu_plan)
        try:
            model, mc = load(self.tp)
            group.join()
        except BaseException:
            group.close()
            raise
        self.group = group
        return TPModel(model, group), mc

    def _allocate_kv(self, num_blocks: int) -> list[torch.Tensor]:
        """This rank's paged KV caches of num_blocks blocks (its heads), the other ranks allocating theirs."""
        if self.group is not None:
            self.group.send("alloc", num_blocks)
        mc = self.model_config
        return allocate_kv_cache(mc.num_hidden_layers, num_blocks, self.cfg.block_size, self.kv_heads, mc.head_dim,
                                 self.dtype, self.device)

    def swap(self, swaps: list) -> None:
        """The core's swaps (KV of preempted sequences to host memory and back), on every rank."""
        if self.group is not None:
            self.group.send("swap", swaps)
        self.swap_space.apply(self.kv_caches, swaps, self.block_size)

    def export_kv(self, block_table: list[int], start: int, end: int) -> KVPayload:
        """Positions [start, end) of a sequence's KV with every KV head, in head order (the wire layout, whatever
        this worker's tensor-parallel degree): under TP gathered from the ranks (parallel/kv_group.py)."""
        if self.group is None:
            return export_kv(self.kv_caches, block_table, self.block_size, start, end)
        from tandem.engine.parallel import kv_group
        return kv_group.export(self.group, self.kv_caches, self.model_config.num_key_value_heads, block_table,
                               self.block_size, start, end)

    def import_kv(self, block_table: list[int], start: int, payload: KVPayload | StagedKV) -> None:
        """Write a wire-layout payload into positions [start, start + num_tokens) of a sequence: under TP each rank
        takes exactly its KV heads; a transfer staged rank to rank is written by each rank from its own staging."""
        if isinstance(payload, StagedKV):
            if self.kv_plane is None:
                raise KVTransferError("KV staged rank to rank on a worker without KV endpoints")
            self.kv_plane.place(self.kv_caches, block_table, self.block_size, start, payload)
            return
        if self.group is None:
            import_kv(self.kv_caches, block_table, self.block_size, start, payload)
            return
        from tandem.engine.parallel import kv_group
        kv_group.import_(self.group, self.kv_caches, self.model_config.num_key_value_heads, block_table,
                         self.block_size, start, payload)

    def open_kv_plane(self, factory: EndpointFactory) -> list[str]:
        """Give every rank a KV endpoint from the runtime's factory; their addresses in rank order (KVTransferError
        when one cannot open: KV then keeps to the driver path)."""
        mc = self.model_config
        max_tokens = self.cfg.max_model_len or mc.max_position_embeddings
        self.kv_plane = DriverPlane.open(self.group, factory, mc.num_key_value_heads, mc.num_hidden_layers,
                                         mc.head_dim, self.dtype, max_tokens)
        return list(self.kv_plane.addresses)

    def send_kv_ranks(self, block_table: list[int], start: int, end: int, transfer: str, dst: list[str],
                      part_tokens: int) -> int:
        """Positions [start, end) from every rank straight to the receiving ranks' endpoints; the bytes sent."""
        if self.kv_plane is None:
            raise KVTransferError("this worker's ranks have no KV endpoints")
        before = sum(c[0] for c in self.kv_plane.byte_counts())
        self.kv_plane.send(self.kv_caches, block_table, self.block_size, start, end, transfer, dst, part_tokens)
        return sum(c[0] for c in self.kv_plane.byte_counts()) - before

    def claim_kv(self, transfer: str, tokens: int, wait_s: float = CLAIM_WAIT_S) -> StagedKV:
        """A transfer every rank holds its heads of (kept until placed; waiting at most wait_s), or KVTransferError
        and none keeps it."""
        if self.kv_plane is None:
            raise KVTransferError("this worker's ranks have no KV endpoints")
        return self.kv_plane.claim(transfer, tokens, wait_s)

    def on_kv_staged(self, fn) -> None:
        """Call fn() (from the endpoint's thread) whenever a rank-to-rank transfer may have become complete."""
        if self.kv_plane is not None:
            self.kv_plane.own.staging.on_change = fn

    def kv_ready(self, transfer: str, tokens: int) -> bool:
        """Whether every rank holds its heads of a rank-to-rank transfer now (claim_kv would not wait)."""
        return self.kv_plane is not None and self.kv_plane.ready(transfer, tokens)

    def forget_kv(self, payload: KVPayload | StagedKV) -> None:
        """KV received for a request that ended before it was placed: a staged transfer is forgotten on every rank."""
        if isinstance(payload, StagedKV) and self.kv_plane is not None:
            self.kv_plane.forget(payload)

    def kv_bytes(self) -> dict[str, int]:
        """Cumulative KV bytes by path: "sent/R", "received/R" per rank's endpoint, "driver" what the driver gathered
        or scattered for its ranks (the driver path)."""
        out = {"driver": 0 if self.group is None else self.group.forwarded_bytes}
        for r, (sent, got) in enumerate(self.kv_plane.byte_counts() if self.kv_plane is not None else ()):
            out[f"sent/{r}"], out[f"received/{r}"] = sent, got
        return out

    @property
    def wire_geometry(self) -> tuple[int, int, int, str]:
        """(layers, KV heads, head_dim, dtype name) of this worker's KV on the wire: every KV head, at any TP."""
        mc = self.model_config
        return mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, dtype_name(self.dtype)

    def tp_failure(self) -> str | None:
        """Why this worker's tensor-parallel group cannot run any more (a rank died), one line; None while it can or
        without a group."""
        return None if self.group is None else self.group.failure()

    @property
    def rank_pids(self) -> list[int]:
        """The process ids of this worker's other tensor-parallel ranks (none without a group)."""
        return [] if self.group is None else self.group.pids

    def bind_calling_thread(self) -> None:
        """Bind the calling thread's OpenMP team as this rank's was at start (cpu_omp_threads_bind): for a thread
        other than the one that built the runner that runs its steps (a live worker's step thread)."""
        if self.cpu_plan is not None:
            self.cpu_binding = omp_affinity.bind_threads(self.cpu_plan[0])

    def close(self, force: bool = False) -> None:
        """Stop a tensor-parallel group's other ranks (nothing to do without one): told to stop, or with `force`
        (another thread may be inside a collective) killed at once. Idempotent."""
        if self.kv_plane is not None:
            self.kv_plane.close()
        if self.group is not None:
            if force and self.group.error is None:
                self.group.error = "the worker stopped while a step was running"
            self.group.close()

    @torch.inference_mode()
    def execute(self, batch: ModelInput) -> SampleOutput | None:
        """Run the model over the batch (writing its KV) and sample the requested rows."""
        return self.compute_logits_phase(self.forward(batch), batch)

    @torch.inference_mode()
    def forward(self, batch: ModelInput) -> torch.Tensor:
        """The model over the batch, writing its KV: hidden states, the real tokens' rows first (then padding)."""
        dev = self.device
        hidden = self.graphs.execute(batch) if self.graphs is not None else None   # a decode step's graph replay
        if hidden is None and self.prefill_graphs is not None:
            hidden = self.prefill_graphs.execute(batch)          # a LAPS bucket's graph replay: real tokens' rows
        if hidden is None:
            meta = AttnMetadata.build(batch.query_lens, batch.seq_lens, batch.block_tables, self.block_size, dev)
            pad = batch.pad_to - len(batch.token_ids) if batch.pad_to > len(batch.token_ids) else 0
            ids = torch.tensor(batch.token_ids + [0] * pad, dtype=torch.long, device=dev)
            pos = torch.tensor(batch.positions + [0] * pad, dtype=torch.long, device=dev)
            hidden = self.model(ids, pos, self.kv_caches, meta)      # [real + pad, H]: padding rows come last
        return hidden

    @torch.inference_mode()
    def compute_logits_phase(self, hidden: torch.Tensor, batch: ModelInput) -> SampleOutput | None:
        """Everything a step does with the LM head: prompt logprobs, then sampling, at most max_num_logits rows of
        logits at a time (logits.py)."""
        prompt_lps = self._prompt_logprobs(hidden, batch) if batch.prompt_logprobs else None
        if not batch.sample_rows:
            return SampleOutput([], prompt_logprobs=prompt_lps) if prompt_lps is not None else None
        # hidden holds the real tokens in batch order (padding rows after them): each sequence's last token's row
        last = np.cumsum(np.asarray(batch.query_lens, dtype=np.int64)) - 1
        rows = torch.from_numpy(last[np.asarray(batch.sample_rows, dtype=np.int64)]).to(self.device)
        grammars = batch.grammars if any(g is not None for g in batch.grammars) else None
        out = self.sampler.sample_hidden(hidden[rows], self.model.compute_logits, batch.params, batch.generators,
                                         batch.output_tokens, batch.prompt_tokens, grammars,
                                         max_rows=self.max_num_logits)
        out.prompt_logprobs = prompt_lps
        return out

    def _set_logit_cap(self, max_rows: int | None) -> None:
        """Run the LM head on at most max_rows rows at a time; without a cap, sampling takes every row at once and
        prompt logprobs 16 MiB of logits at a time (PROMPT_LOGPROBS_ELEMS, as before max_num_logits)."""
        self.max_num_logits = max_rows
        self.prompt_logit_rows = max_rows or max(1, PROMPT_LOGPROBS_ELEMS // self.model_config.vocab_size)

    def _profile_memory(self, max_len: int) -> MemoryProfile:
        """The worst-case dummy step (memory_profile.py) on a one-block scratch KV cache, dropped afterwards."""
        cfg, mc = self.cfg, self.model_config
        if mc.is_diffusion:
            return self._profile_diffusion(max_len)
        self.kv_caches = self._allocate_kv(1)
        batch = worst_case_batch(cfg.max_num_batched_tokens, cfg.max_num_seqs, max_len, mc.vocab_size,
                                 cfg.block_size, self.sampler.eos_token_ids, self.device)

        def logits_phase(hidden: torch.Tensor, b: ModelInput, max_rows: int | None) -> None:
            self._set_logit_cap(max_rows)
            try:
                self.compute_logits_phase(hidden, b)
            finally:
                self._set_logit_cap(cfg.max_num_logits)
        try:
            prof = run_profile(self.forward, logits_phase, batch, self.device, cfg.max_num_logits,
                               weight_bytes(self.model), cfg.max_num_batched_tokens)
        finally:
            self.kv_caches = self._allocate_kv(0)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return prof

    def _profile_diffusion(self, max_len: int) -> MemoryProfile:
        """A block-diffusion model's worst-case step (memory_profile.diffusion_worst_case): the forward over
        max_num_batched_tokens recomputed positions, then every row's logits sampled as the decoder samples them
        (temperature, top-k, top-p on a seeded generator), all at once or max_num_logits rows at a time."""
        from tandem.engine.diffusion.llada_generate import DEFAULT_BLOCK_LENGTH as LLADA_BLOCK_LENGTH
        from tandem.engine.diffusion.unmasking import sample_tokens
        cfg, mc = self.cfg, self.model_config
        block = cfg.dllm_block_length or mc.diffusion_block_size or LLADA_BLOCK_LENGTH
        bi = mc.is_canvas_diffusion
        batch = diffusion_worst_case(cfg.max_num_batched_tokens, max_len, block, mc.vocab_size, self.device,
                                     bidirectional=bi)
        warm = diffusion_worst_case(cfg.max_num_batched_tokens, max_len, block, mc.vocab_size, self.device, rows=1,
                                    bidirectional=bi)

        def forward(b: DiffusionDummy) -> torch.Tensor:
            with torch.inference_mode():
                return self.model(b.ids, None, None, b.meta)

        def logits_phase(hidden: torch.Tensor, b: DiffusionDummy, max_rows: int | None) -> None:
            gen = torch.Generator(device=self.device).manual_seed(0)
            n = len(b.sample_rows)
            step = max_rows or n
            with torch.inference_mode():
                for a in range(0, n, step):
                    logits = self.model.compute_logits(hidden[a:min(n, a + step)])
                    logits[:, 0] = float("-inf")
                    sample_tokens(logits, 1.0, 50, 0.9, gen)
                    del logits
        return run_profile(forward, logits_phase, batch, self.device, cfg.max_num_logits, weight_bytes(self.model),
                           cfg.max_num_batched_tokens, warm=warm)

    def _prompt_logprobs(self, hidden: torch.Tensor, batch: ModelInput) -> list[list[dict[int, float]]]:
        """Per spec, each target's raw logprob (log-softmax of the full logits) and the top k: every spec's rows
        together, the LM head on at most prompt_logit_rows of them at a time (logits.target_logprobs)."""
        starts = [0, *accumulate(batch.query_lens)]
        idx: list[int] = []
        targets: list[int] = []
        ks: list[int] = []
        for spec in batch.prompt_logprobs:
            first = starts[spec.seq]
            idx.extend(range(first, first + len(spec.targets)))
            targets.extend(spec.targets)
            ks.extend([spec.k] * len(spec.targets))
        if not idx:
            return [[] for _ in batch.prompt_logprobs]
        if len(batch.prompt_logprobs) == 1:                  # one sequence: its rows are contiguous, no copy
            rows_h = hidden[idx[0]:idx[0] + len(idx)]
        else:
            rows_h = hidden.index_select(0, torch.tensor(idx, dtype=torch.long, device=hidden.device))
        flat = target_logprobs(self.model.compute_logits, rows_h, targets, ks, self.prompt_logit_rows)
        out: list[list[dict[int, float]]] = []
        a = 0
        for spec in batch.prompt_logprobs:
            out.append(flat[a:a + len(spec.targets)])
            a += len(spec.targets)
        return out


def _no_room(prof: MemoryProfile, per_block: int) -> str:
    """The EngineError text when the budget leaves no KV block: the figures and the ways out."""
    mib = 1 << 20
    return (f"the memory budget of {prof.budget_bytes / mib:.1f} MiB leaves no room for one KV block "
            f"({per_block} bytes): {prof.used_bytes / mib:.1f} MiB in use (weights, buffers) and an activation peak "
            f"of {prof.peak_bytes / mib:.1f} MiB plus its guard band at max_num_batched_tokens="
            f"{prof.tokens}: raise cpu_memory_budget_bytes/gpu_memory_utilization, lower max_num_batched_tokens or "
            f"max_num_seqs, or set max_num_logits")
