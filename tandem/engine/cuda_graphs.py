"""Decode steps captured as CUDA graphs at fixed batch sizes, and replayed (vLLM's CUDA graph runner, nano-vllm's
`capture_cudagraph`).

A decode step of a small model on a GPU is bound by kernel launches, not by the GPU: one graph replay launches the
whole forward at once. Graphs fix shapes and addresses, so the inputs live in static buffers sized for the largest
captured batch (token ids, positions, slot mapping, block tables [max_bs, max_blocks_per_seq], seq lens) and the
output in a static hidden-state buffer; attention is the host-independent `StaticDecodeBackend`. A step of n decode
sequences runs in the graph of the smallest captured size >= n: padding rows hold token 0 at position 0 of a scratch
KV block that the KV pool keeps out of the block manager's reach, attend over that one key, and are dropped.
Logits and sampling stay eager on the real rows. On CPU nothing is captured; `forward_static` runs the captured code
eagerly, which is how the tests check it without a GPU.
"""
from __future__ import annotations

import logging
import time
from bisect import bisect_left
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from tandem.engine.attention.metadata import AttnMetadata
from tandem.engine.attention.static_decode import GATHER_BYTES, StaticDecodeBackend
from tandem.engine.config import EngineConfig
from tandem.engine.model_input import ModelInput

log = logging.getLogger(__name__)
MAX_CAPTURE_SIZE = 512      # vLLM's default largest captured batch


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's sizes: 1, 2, 4, then multiples of 8, up to the first that holds min(max_num_seqs, 512) sequences."""
    cap = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = []
    for s in (1, 2, 4, *range(8, MAX_CAPTURE_SIZE + 1, 8)):
        sizes.append(s)
        if s >= cap:
            break
    return sizes


def capture_sizes(cfg: EngineConfig) -> list[int]:
    """The batch sizes to capture: cuda_graph_sizes, else the default list for max_num_seqs."""
    return list(cfg.cuda_graph_sizes) if cfg.cuda_graph_sizes else default_capture_sizes(cfg.max_num_seqs)


def graphs_apply(cfg: EngineConfig, device: torch.device) -> bool:
    """Whether a runner captures decode graphs: on CUDA, unless enforce_eager (never on CPU)."""
    return device.type == "cuda" and not cfg.enforce_eager


@dataclass(slots=True)
class Captured:
    """What capture_graphs made: a graph per key, the pool they share, the capture's seconds and CUDA bytes."""

    graphs: dict
    pool: object
    seconds: float
    pool_bytes: int
    allocated_bytes: int


def capture_graphs(device: torch.device, keys: Sequence, forward: Callable[[object], object],
                   pool: object = None) -> Captured:
    """One CUDA graph of forward(key) per key, in the order given (largest first, so the smaller ones reuse its pool
    blocks), each after an eager warm-up on a side stream (lazy initialisation stays out of the graph), all in one
    memory pool (`pool`, else a new one)."""
    graphs: dict = {}
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        alloc0, res0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        for key in keys:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                forward(key)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                forward(key)
            graphs[key] = graph
        torch.cuda.synchronize()
        return Captured(graphs, pool, time.perf_counter() - t0, torch.cuda.memory_reserved() - res0,
                        torch.cuda.memory_allocated() - alloc0)


def padded_size(batch: ModelInput, sizes: Sequence[int]) -> int | None:
    """The captured size a step pads to (the smallest >= its batch), or None when it must run eagerly: not every
    sequence is a decode, prompt logprobs are asked, or the batch is larger than the largest size."""
    n = len(batch.query_lens)
    if n == 0 or n > sizes[-1] or len(batch.token_ids) != n or batch.prompt_logprobs:
        return None                      # query lens are >= 1, so n tokens for n sequences means all decodes
    return sizes[bisect_left(sizes, n)]


class DecodeGraphs:
    """Static decode inputs for the largest size and one CUDA graph per size (one shared memory pool)."""

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], block_size: int, max_model_len: int,
                 sizes: Sequence[int], scratch_block: int, gather_bytes: int = GATHER_BYTES) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.sizes = sorted(set(sizes))
        self.block_size, self.scratch_block = block_size, scratch_block
        self.max_blocks = -(-max_model_len // block_size)
        self.max_len = self.max_blocks * block_size
        self.device = dev = kv_caches[0].device
        self.attention = StaticDecodeBackend(block_size, gather_bytes)
        n = self.sizes[-1]
        self.token_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), scratch_block * block_size, dtype=torch.long, device=dev)
        self.block_tables = torch.full((n, self.max_blocks), scratch_block, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.hidden = torch.zeros(n, model.config.hidden_size, dtype=next(model.parameters()).dtype, device=dev)
        self._metas = {s: self._meta(s) for s in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_s = 0.0              # wall time of capture()
        self.pool_bytes = 0               # CUDA memory reserved by capture (the graphs' pool)
        self.allocated_bytes = 0          # CUDA memory allocated by capture and still held

    def _meta(self, n: int) -> AttnMetadata:
        """Metadata over the first n rows of the static buffers (host fields are bounds: nothing reads them)."""
        return AttnMetadata(query_lens=[1] * n, seq_lens=[self.max_len] * n,
                            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=self.device),
                            seq_lens_t=self.seq_lens[:n], block_tables=self.block_tables[:n],
                            slot_mapping=self.slot_mapping[:n], block_size=self.block_size, max_query_len=1,
                            max_seq_len=self.max_len, backend=self.attention)

    def size_for(self, batch: ModelInput) -> int | None:
        """The captured graph's size this step replays in, or None (run eagerly): see padded_size; also None when
        nothing was captured (CPU, enforce_eager) or a sequence is longer than the static block table."""
        if self.device.type != "cuda" or not self.graphs:
            return None
        size = padded_size(batch, self.sizes)
        return size if size is not None and max(batch.seq_lens) <= self.max_len else None

    def load(self, batch: ModelInput, size: int) -> None:
        """Copy a decode batch into the static inputs; rows past the batch up to `size` become padding rows."""
        n, bs, sb = len(batch.query_lens), self.block_size, self.scratch_block
        table = np.full((size, self.max_blocks), sb, dtype=np.int32)
        for i, row in enumerate(batch.block_tables):
            row = row[:self.max_blocks]
            table[i, :len(row)] = row
        ids, pos = np.zeros(size, dtype=np.int64), np.zeros(size, dtype=np.int64)
        lens = np.ones(size, dtype=np.int32)
        ids[:n], pos[:n], lens[:n] = batch.token_ids, batch.positions, batch.seq_lens
        slots = table[np.arange(size), pos // bs].astype(np.int64) * bs + pos % bs
        for buf, a in ((self.token_ids, ids), (self.positions, pos), (self.seq_lens, lens),
                       (self.slot_mapping, slots), (self.block_tables, table)):
            buf[:size].copy_(torch.from_numpy(a))

    def forward_static(self, size: int) -> torch.Tensor:
        """The captured computation, run eagerly: the model over the first `size` static rows -> hidden [size, H]."""
        meta = self._metas[size]
        meta.scratch.clear()                       # per-step tensors of the backend are rebuilt from the buffers
        h = self.model(self.token_ids[:size], self.positions[:size], self.kv_caches, meta)
        self.hidden[:size].copy_(h)
        return self.hidden[:size]

    def execute(self, batch: ModelInput) -> torch.Tensor | None:
        """Replay the step's graph: hidden states [n, H] of its n sequences (a view of the static buffer), or None
        when the step does not qualify and must run eagerly."""
        size = self.size_for(batch)
        if size is None:
            return None
        self.load(batch, size)
        self.graphs[size].replay()
        return self.hidden[:len(batch.query_lens)]

    @torch.inference_mode()
    def capture(self, pool: object = None) -> object:
        """Capture every size, largest first, into one memory pool (`pool`, else a new one); returns the pool (the
        LAPS prefill graphs, captured first, lend theirs)."""
        cap = capture_graphs(self.device, list(reversed(self.sizes)), self.forward_static, pool)
        self.graphs.update(cap.graphs)
        self.capture_s, self.pool_bytes, self.allocated_bytes = cap.seconds, cap.pool_bytes, cap.allocated_bytes
        pool = cap.pool
        log.info("captured %d decode CUDA graphs (batch sizes %s..%s, attention %s) in %.2f s; graph pool "
                 "%.1f MiB reserved, %.1f MiB allocated", len(self.graphs), self.sizes[0], self.sizes[-1],
                 "flash paged" if self.attention.paged else "gather + SDPA", self.capture_s, self.pool_bytes / 2**20,
                 self.allocated_bytes / 2**20)
        return pool
