"""Prefill attention of a LAPS bucket that reads only device tensors of fixed shape: the attention of a CUDA-graphed
short-prefill step (engine/prefill_graphs.py).

A bucket (T, B) is B rows of T query slots, row-major: row i's first n_i slots hold its new tokens at positions
h_i .. h_i + n_i - 1 on top of h_i cached tokens, its other slots (and whole rows past the batch) are padding. The K/V
of every slot is written at `slot_mapping` first (padding slots point into the scratch block, which no sequence owns),
then each row attends over the whole width of its block table: key j is visible to a slot iff j <= the slot's
position (`PrefillGraphMetadata.query_pos`), which is causal over the new tokens and full over the history. Padding
slots sit at position 0, so they see key 0 only (a real key, or the scratch block's first slot for a padding row):
every slot has one visible key, no softmax is empty, and their outputs are dropped by the caller.

Nothing here reads host values (lengths, the longest row), so it can be captured in a CUDA graph: like the decode
graphs' gather path (static_decode.py), each row reads max_blocks_per_seq blocks whatever its history, gathered by
block id. The G query heads that share a KV head are folded into the query dim ([B, Hkv, G*T, D] against
[B, Hkv, L, D]) so each key is read once. The key range is cut into chunks whose gathered K+V and float32 scores stay
under `gather_bytes`; one chunk runs in SDPA, several are merged with an online softmax.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.engine.attention.base import online_softmax_attention, write_kv
from tandem.engine.attention.metadata import AttnMetadata

PREFILL_GATHER_BYTES = 256 << 20    # gathered K+V plus scores per key chunk (bytes), across the bucket


@dataclass
class PrefillGraphMetadata(AttnMetadata):
    """AttnMetadata of a bucket step (rows of `max_query_len` slots) with each slot's position, its key limit."""

    query_pos: torch.Tensor | None = None    # int64 [B*T]: slot sees keys j <= query_pos (0 for padding slots)


@dataclass
class _Chunks:
    blocks: list[torch.Tensor]       # per chunk: int64 [B * nb] block ids, row-major (row b's chunk blocks)
    masks: list[torch.Tensor]        # per chunk: bool [B, 1, G*T, nb * block_size], key visible to the slot


class StaticPrefillBackend:
    """T query slots per row; K/V written at meta.slot_mapping, read through meta.block_tables up to each slot's
    position (meta.query_pos). Reads only meta's device tensors, so a CUDA graph can capture it. Set as
    `AttnMetadata.backend` so every layer uses it for the step."""

    name = "static_prefill"

    def __init__(self, gather_bytes: int = PREFILL_GATHER_BYTES) -> None:
        self.gather_bytes = gather_bytes

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                meta: AttnMetadata, scale: float) -> torch.Tensor:
        """q [B*T, Hq, D], k/v [B*T, Hkv, D], kv [2, blocks, block_size, Hkv, D] -> out [B*T, Hq, D]."""
        write_kv(k, v, kv, meta.slot_mapping)
        B = meta.block_tables.shape[0]
        N, hq, d = q.shape
        T, hkv = N // B, kv.shape[3]
        G = hq // hkv
        chunks = self._chunks(meta, kv, B, T, hq)
        qg = q.view(B, T, hkv, G, d).permute(0, 2, 3, 1, 4).reshape(B, hkv, G * T, d)     # head h = kvh * G + g
        if len(chunks.blocks) == 1:
            kb = self._gather(kv, chunks.blocks[0], B)
            o = F.scaled_dot_product_attention(qg, kb[0], kb[1], attn_mask=chunks.masks[0], scale=scale)
        else:
            o = self._online(qg, kv, chunks, B, scale).to(q.dtype)
        return o.reshape(B, hkv, G, T, d).permute(0, 3, 1, 2, 4).reshape(N, hq, d)

    def _online(self, qg: torch.Tensor, kv: torch.Tensor, chunks: _Chunks, B: int, scale: float) -> torch.Tensor:
        """Attention over several key chunks merged by an online softmax (float32) -> [B, Hkv, G*T, D]."""
        return online_softmax_attention(qg.float() * scale, ((self._gather(kv, blocks, B).float(), mask)
                                                              for blocks, mask in zip(chunks.blocks, chunks.masks)))

    def _chunks(self, meta: AttnMetadata, kv: torch.Tensor, B: int, T: int, hq: int) -> _Chunks:
        """The step's key chunks (block ids and visibility masks), built at its first layer, kept in meta.scratch."""
        chunks = meta.scratch.get("static_prefill")
        if chunks is not None:
            return chunks
        qpos = getattr(meta, "query_pos", None)
        if qpos is None:
            raise ValueError("static prefill attention needs PrefillGraphMetadata.query_pos (each slot's position)")
        table = meta.block_tables.long()
        width = table.shape[1]
        bs, hkv, d = kv.shape[2], kv.shape[3], kv.shape[4]
        G = hq // hkv
        # per block of keys across the bucket: its K+V gathered (and a float32 copy) and the float32 scores of G*T
        # queries per KV head (twice: scores and probabilities)
        per_block = B * bs * (2 * hkv * d * (kv.element_size() + 4) + 2 * hq * T * 4)
        per_chunk = max(1, min(width, self.gather_bytes // max(1, per_block)))
        lim = qpos.view(B, 1, 1, T).expand(B, 1, G, T).reshape(B, 1, G * T, 1)
        blocks, masks = [], []
        for a in range(0, width, per_chunk):
            nb = min(per_chunk, width - a)
            blocks.append(table[:, a:a + nb].reshape(-1))
            j = torch.arange(a * bs, (a + nb) * bs, device=table.device)
            masks.append(j.view(1, 1, 1, -1) <= lim)
        chunks = meta.scratch["static_prefill"] = _Chunks(blocks, masks)
        return chunks

    @staticmethod
    def _gather(kv: torch.Tensor, blocks: torch.Tensor, B: int) -> torch.Tensor:
        """K and V of `blocks` ([B * nb]) as [2, B, Hkv, nb * block_size, D]."""
        g = kv.index_select(1, blocks)                                           # [2, B*nb, bs, Hkv, D]
        return g.view(2, B, -1, kv.shape[3], kv.shape[4]).transpose(2, 3)
