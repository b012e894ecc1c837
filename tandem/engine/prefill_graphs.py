"""LAPS's short-prefill buckets captured as CUDA graphs, one per (length, batch) bucket, and replayed (LAPS §3.1).

A LAPS prefill worker runs a batch of short prefills (mostly re-prefills: a few new tokens on top of cached history) in
the shape of the smallest bucket (T, B) of its grid that holds it (tandem/core/laps_sched.py `pad_shape`); the engine
marks such a step `ModelInput.bucket`. On a GPU its forward is bound by kernel launches, so each bucket's forward
(embeddings to final norm) is captured at engine start and the step replays it. Graphs fix shapes and addresses: the
inputs live in static buffers sized for the largest bucket (token ids and positions [T*B], slot mapping [T*B], block
tables [B, ceil(max_len / block_size)], seq lens [B]) and the output in a static hidden-state buffer; row i of the
bucket is slots i*T .. i*T+T-1, its real tokens first. Padding slots sit at position 0 and write their K/V into the
scratch KV block that the pool keeps out of the block manager's reach (as the decode graphs' padding rows do); their
outputs are dropped. Attention is `StaticPrefillBackend` (host-independent: each row reads its whole block table,
`max_len` keys, whatever its history). Logits and sampling stay eager on the real rows.

What the key width costs: a row attends over max_len keys gathered from the paged cache whether its history is 10 or
4000 tokens, so max_len (`EngineConfig.laps_graph_max_len`, default min(max_model_len, 4096)) trades coverage for
time: a step whose longest sequence is longer runs eagerly (correct, not graphed), and a step that fits pays for
max_len keys per row. The decode graphs' gather path, which reads max_model_len keys per row the same way, was slow
for long contexts on an H100 (BENCHMARKS.md, "Engine on an H100 against the roofline").

On CPU nothing is captured; `forward_static` runs the captured code eagerly, which is how the tests check it without a
GPU.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from tandem.engine.attention.static_prefill import PREFILL_GATHER_BYTES, PrefillGraphMetadata, StaticPrefillBackend
from tandem.engine.config import EngineConfig
from tandem.engine.cuda_graphs import capture_graphs
from tandem.engine.model_input import ModelInput
from tandem.policy.laps.buckets import Bucket, BucketGrid

log = logging.getLogger(__name__)
DEFAULT_MAX_LEN = 4096      # keys per row of a prefill graph by default (capped at max_model_len); see the docstring


def default_buckets(cfg: EngineConfig, grid: BucketGrid | None = None) -> list[Bucket]:
    """Every bucket of LAPS's grid (its default one unless given) that a step of this engine can take:
    T*B <= max_num_batched_tokens (the core's short-batch budget) and B <= max_num_seqs."""
    grid = grid or BucketGrid()
    return [Bucket(t, b) for t in grid.lengths for b in grid.batches
            if t * b <= cfg.max_num_batched_tokens and b <= cfg.max_num_seqs]


def graph_buckets(cfg: EngineConfig) -> list[Bucket]:
    """The buckets to capture: laps_graph_buckets (those within the engine's limits), else default_buckets."""
    if cfg.laps_graph_buckets is None:
        return default_buckets(cfg)
    want = [Bucket(t, b) for t, b in cfg.laps_graph_buckets]
    keep = [x for x in want if x.padded_tokens <= cfg.max_num_batched_tokens and x.batch <= cfg.max_num_seqs]
    if len(keep) < len(want):
        log.warning("laps_graph_buckets: %s exceed max_num_batched_tokens %d or max_num_seqs %d and are not captured",
                    [(x.tokens, x.batch) for x in want if x not in keep], cfg.max_num_batched_tokens, cfg.max_num_seqs)
    return keep


def graph_max_len(cfg: EngineConfig, max_model_len: int) -> int:
    """Longest sequence a prefill graph attends over: laps_graph_max_len, else min(max_model_len, 4096)."""
    return min(cfg.laps_graph_max_len or DEFAULT_MAX_LEN, max_model_len)


def prefill_graphs_apply(cfg: EngineConfig, device: torch.device, role: str) -> bool:
    """Whether a runner captures prefill graphs: on CUDA, unless enforce_eager, on a worker that runs bucket steps
    (only those replay), with at least one bucket to capture. Never on CPU."""
    if device.type != "cuda" or cfg.enforce_eager:
        return False
    return cfg.policy_spec().bucket_steps(role) and bool(graph_buckets(cfg))


class PrefillGraphs:
    """Static prefill inputs for the largest bucket and one CUDA graph per bucket (one shared memory pool)."""

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], block_size: int, max_len: int,
                 buckets: Sequence[Bucket], scratch_block: int, gather_bytes: int = PREFILL_GATHER_BYTES) -> None:
        if not buckets:
            raise ValueError("PrefillGraphs needs at least one bucket")
        self.model, self.kv_caches = model, kv_caches
        self.buckets = sorted(set(buckets), key=lambda x: (x.padded_tokens, x.tokens))
        self.block_size, self.scratch_block = block_size, scratch_block
        self.max_blocks = -(-max_len // block_size)
        self.max_len = self.max_blocks * block_size
        self.device = dev = kv_caches[0].device
        self.attention = StaticPrefillBackend(gather_bytes)
        n = max(x.padded_tokens for x in self.buckets)
        rows = max(x.batch for x in self.buckets)
        self.token_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)          # also each slot's key limit
        self.slot_mapping = torch.full((n,), scratch_block * block_size, dtype=torch.long, device=dev)
        self.block_tables = torch.full((rows, self.max_blocks), scratch_block, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=dev)
        self.hidden = torch.zeros(n, model.config.hidden_size, dtype=next(model.parameters()).dtype, device=dev)
        self._metas = {x: self._meta(x) for x in self.buckets}
        self.graphs: dict[Bucket, Any] = {}      # torch.cuda.CUDAGraph per captured bucket
        self.capture_s = 0.0                     # wall time of capture()
        self.pool_bytes = 0                      # CUDA memory reserved by capture (the graphs' pool)
        self.allocated_bytes = 0                 # CUDA memory allocated by capture and still held

    def _meta(self, b: Bucket) -> PrefillGraphMetadata:
        """Metadata over the bucket's first rows of the static buffers (host fields are the padded shape, or bounds:
        the backend reads none of them)."""
        T, B, N = b.tokens, b.batch, b.padded_tokens
        return PrefillGraphMetadata(
            query_lens=[T] * B, seq_lens=[self.max_len] * B,
            query_start_loc=torch.arange(0, N + 1, T, dtype=torch.int32, device=self.device),
            seq_lens_t=self.seq_lens[:B], block_tables=self.block_tables[:B], slot_mapping=self.slot_mapping[:N],
            block_size=self.block_size, max_query_len=T, max_seq_len=self.max_len, backend=self.attention,
            query_pos=self.positions[:N])

    def bucket_for(self, batch: ModelInput) -> Bucket | None:
        """The captured bucket this step replays in, or None (run eagerly): not a bucketed step, its bucket was not
        captured (or nothing was: CPU, enforce_eager), or it does not fit the bucket or the static block table."""
        if not self.graphs or batch.bucket is None:
            return None
        b = Bucket(*batch.bucket)
        if b not in self.graphs or not self.holds(b, batch):
            return None
        return b

    def holds(self, b: Bucket, batch: ModelInput) -> bool:
        """Whether the step fits bucket b and the key width: at most b.batch sequences of at most b.tokens new
        tokens each, none longer than max_len."""
        n = len(batch.query_lens)
        return 0 < n <= b.batch and max(batch.query_lens) <= b.tokens and max(batch.seq_lens) <= self.max_len

    def load(self, batch: ModelInput, b: Bucket) -> torch.Tensor:
        """Copy a step into the static inputs laid out as bucket b; returns the static slot of each real token
        (int64 [num tokens], batch order)."""
        T, B, N = b.tokens, b.batch, b.padded_tokens
        bs, sb = self.block_size, self.scratch_block
        table = np.full((B, self.max_blocks), sb, dtype=np.int32)
        for i, row in enumerate(batch.block_tables):
            row = row[:self.max_blocks]
            table[i, :len(row)] = row
        qlens = np.asarray(batch.query_lens, dtype=np.int64)
        seq = np.repeat(np.arange(len(qlens)), qlens)                            # each real token's row
        dst = seq * T + np.arange(len(seq)) - np.repeat(np.cumsum(qlens) - qlens, qlens)
        pos = np.asarray(batch.positions, dtype=np.int64)
        ids, positions = np.zeros(N, dtype=np.int64), np.zeros(N, dtype=np.int64)
        ids[dst], positions[dst] = batch.token_ids, pos
        slots = sb * bs + np.arange(N, dtype=np.int64) % bs                      # padding slots: the scratch block
        slots[dst] = table[seq, pos // bs].astype(np.int64) * bs + pos % bs
        lens = np.ones(B, dtype=np.int32)
        lens[:len(qlens)] = batch.seq_lens
        for buf, a in ((self.token_ids, ids), (self.positions, positions), (self.slot_mapping, slots)):
            buf[:N].copy_(torch.from_numpy(a))
        self.block_tables[:B].copy_(torch.from_numpy(table))
        self.seq_lens[:B].copy_(torch.from_numpy(lens))
        return torch.from_numpy(dst).to(self.device)

    def forward_static(self, b: Bucket) -> torch.Tensor:
        """The captured computation, run eagerly: the model over bucket b's static rows -> hidden [T*B, H]."""
        meta, N = self._metas[b], b.padded_tokens
        meta.scratch.clear()                       # per-step tensors of the backend are rebuilt from the buffers
        h = self.model(self.token_ids[:N], self.positions[:N], self.kv_caches, meta)
        self.hidden[:N].copy_(h)
        return self.hidden[:N]

    def execute(self, batch: ModelInput) -> torch.Tensor | None:
        """Replay the step's bucket graph: hidden states of its real tokens [num tokens, H] in batch order (a copy),
        or None when the step does not qualify and must run eagerly."""
        b = self.bucket_for(batch)
        if b is None:
            return None
        dst = self.load(batch, b)
        self.graphs[b].replay()
        return self.hidden.index_select(0, dst)

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> Any:
        """Capture every bucket, largest first, into one memory pool (`pool`, else a new one), each after an eager
        warm-up on a side stream; returns the pool, which other graphs that never run alongside may share."""
        cap = capture_graphs(self.device, list(reversed(self.buckets)), self.forward_static, pool)
        self.graphs.update(cap.graphs)
        self.capture_s, self.pool_bytes, self.allocated_bytes = cap.seconds, cap.pool_bytes, cap.allocated_bytes
        log.info("captured %d LAPS prefill CUDA graphs (buckets %s, up to %d keys per row) in %.2f s; graph pool "
                 "%.1f MiB reserved, %.1f MiB allocated", len(self.graphs),
                 " ".join(f"{b.tokens}x{b.batch}" for b in self.buckets), self.max_len, self.capture_s,
                 self.pool_bytes / 2**20, self.allocated_bytes / 2**20)
        return cap.pool
