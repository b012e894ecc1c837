"""SDAR (block diffusion) in HF's parameter layout: SDARForCausalLM, with its block-causal attention over the paged cache.

SDAR (JetLM/SDAR-*-Chat, config.json `model_type: "sdar"`) is Qwen3 layer for layer (same parameter names:
`model.layers.N.self_attn.q_proj.weight`, `q_norm`, `k_norm`, ...), with two differences at inference:

- **attention is block-causal**: positions are cut into diffusion blocks of `block_size` tokens aligned to absolute
  positions (block k holds positions k*B .. k*B+B-1); a token sees every token of its own block (bidirectionally)
  and of every earlier block, never a later one;
- **no next-token shift**: the logits at position p predict the token at p (a `mask_token_id` there is what the
  model fills in), not the one at p + 1.

One forward serves every step of the decoding loop (tandem.engine.diffusion), through `BlockDiffusionMetadata`:
each sequence's query tokens carry explicit positions (any subset of positions, not necessarily contiguous), read
the sequence's cached KV (positions 0 .. ctx_len-1, whole blocks), and see each other under the block-causal rule
(query j is visible to query i when block(pos_j) <= block(pos_i)). The first `num_write` query tokens of a sequence
(positions ctx_len .. ctx_len+num_write-1, whole blocks) have their K/V written into the cache; the others are
attended from this step's K/V only and never touch the cache. So:

- a prompt prefill is its whole blocks, all written (a partially filled last block is not prefilled: SDAR's generate
  treats the prompt tokens of that block as fixed tokens of the first block to denoise, so they are queries of each
  denoise step and their KV is written with the block when it is committed);
- a denoise step is the active block's positions (the c first undecoded ones plus the decoded ones, or the whole
  block), none written, on ctx_len = the block's start;
- committing a block writes its K/V once: the block's final tokens as written queries, which may share the forward
  with the next block's first denoise step (the next block's queries see the committed block's queries).

A plain `AttnMetadata` (the AR engine's) is read as a prefill of whole blocks: contiguous positions, all written.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from tandem.engine.attention.base import write_kv
from tandem.engine.attention.metadata import AttnMetadata, QueryShape
from tandem.engine.models.qwen3 import Qwen3ForCausalLM


@dataclass
class BlockDiffusionMetadata(QueryShape):
    """One block-diffusion step of S sequences: query tokens of all sequences concatenated in order."""

    query_lens: list[int]             # host, len S: query tokens per sequence
    ctx_lens: list[int]               # host, len S: cached KV tokens each sequence's queries read (positions 0..c-1)
    num_write: list[int]              # host, len S: leading query tokens whose K/V are written into the cache
    positions: torch.Tensor           # int64 [T] position of every query token (device)
    block_tables: torch.Tensor        # int32 [S, max_blocks] physical KV blocks per sequence, padded with 0
    write_rows: torch.Tensor          # int64 [W] rows (in the flattened batch) of the written query tokens
    slot_mapping: torch.Tensor        # int64 [W] their cache slots: block * block_size + offset
    block_size: int                   # the KV cache's block size (tokens per page)
    diffusion_block_size: int         # the diffusion block length B
    query_blocks: list[list[int]] = field(default_factory=list, repr=False)   # host: block(pos) per query token
    cached_blocks: list[list[int]] = field(default_factory=list, repr=False)  # host: block(pos) per cached extra
    cached_slots: list[torch.Tensor | None] = field(default_factory=list, repr=False)   # per sequence: int64 cache
                                      # slots of its cached positions past ctx_len (None: none), read as keys
    scratch: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    backend: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def build(cls, positions: Sequence[Sequence[int]], ctx_lens: Sequence[int], num_write: Sequence[int],
              block_tables: Sequence[Sequence[int]] | None, block_size: int, diffusion_block_size: int,
              device: torch.device | str = "cpu", *, writes: Sequence[Sequence[int]] | None = None,
              cached: Sequence[Sequence[int]] | None = None) -> "BlockDiffusionMetadata":
        """Validate one step's per-sequence query positions, cache lengths and writes, and build its tensors.

        Without a KV cache (block_tables None) every ctx_len and num_write must be 0: the step is a full
        recomputation under the block-causal mask. Streaming chunked decoding (Optimus) names its writes and reads
        position by position: `writes` (instead of num_write) lists the query positions whose K/V are written (any
        of them: decoded tokens of the active block), `cached` the positions >= ctx_len whose K/V the cache already
        holds and the queries read (the active block's decoded tokens; masked positions in between are skipped).
        """
        S = len(positions)
        if len(ctx_lens) != S or len(num_write) != S or (block_tables is not None and len(block_tables) != S):
            raise ValueError(f"positions, ctx_lens, num_write and block_tables need one entry per sequence (got {S}, "
                             f"{len(ctx_lens)}, {len(num_write)}, {S if block_tables is None else len(block_tables)})")
        B = int(diffusion_block_size)
        if B < 1 or block_size < 1:
            raise ValueError(f"block sizes must be >= 1, got diffusion {diffusion_block_size}, KV {block_size}")
        rows, slots, qblocks = [], [], []
        table = np.zeros((S, 1), dtype=np.int32)
        if block_tables is not None and S:
            width = max(1, max(len(b) for b in block_tables))
            table = np.zeros((S, width), dtype=np.int32)
            for i, b in enumerate(block_tables):
                table[i, :len(b)] = b
        if (writes is not None and len(writes) != S) or (cached is not None and len(cached) != S):
            raise ValueError("writes and cached need one entry per sequence")
        dev = torch.device(device)
        start = 0
        cblocks: list[list[int]] = []
        cslots: list[torch.Tensor | None] = []
        nws: list[int] = []
        for i, (pos, ctx) in enumerate(zip(positions, ctx_lens)):
            pos = [int(p) for p in pos]
            n = len(pos)
            if n < 1:
                raise ValueError(f"sequence {i} has no query tokens")
            if ctx < 0 or ctx % B:
                raise ValueError(f"sequence {i}: ctx_len {ctx} must be a multiple of the diffusion block size {B} "
                                 "(a cached block is complete)")
            if min(pos) < ctx or len(set(pos)) != n:
                raise ValueError(f"sequence {i}: query positions must be distinct and >= ctx_len {ctx}")
            if writes is None:
                nw = int(num_write[i])
                if not 0 <= nw <= n or nw % B or pos[:nw] != list(range(ctx, ctx + nw)):
                    raise ValueError(f"sequence {i}: the {nw} written queries must be the first ones, at positions "
                                     f"{ctx}..{ctx + nw - 1}, whole diffusion blocks of {B}")
                wrote = list(range(nw))
            else:
                index = {p: j for j, p in enumerate(pos)}
                wset = [int(p) for p in writes[i]]
                if any(p not in index for p in wset) or len(set(wset)) != len(wset):
                    raise ValueError(f"sequence {i}: written positions must be distinct query positions")
                wrote = [index[p] for p in wset]
            extra = [int(p) for p in cached[i]] if cached is not None else []
            if extra and (min(extra) < ctx or len(set(extra)) != len(extra) or set(extra) & set(pos)
                          or max(extra) >= max(pos) // B * B + B):
                raise ValueError(f"sequence {i}: cached positions must be distinct, >= ctx_len {ctx}, not queries, "
                                 "and in no later block than the queries")
            nws.append(len(wrote))
            if block_tables is None:
                if ctx or wrote or extra:
                    raise ValueError(f"sequence {i}: ctx_len, writes and cached positions must be 0 or empty without a KV cache")
                cslots.append(None)
            else:
                top = max([ctx - 1] + [pos[j] for j in wrote] + extra)
                need = -(-(top + 1) // block_size)
                if len(block_tables[i]) < need:
                    raise ValueError(f"sequence {i} reads/writes {top + 1} cached tokens but has only "
                                     f"{len(block_tables[i])} KV blocks of {block_size}")
                def slot(p: int, i: int = i) -> int:    # the cache slot of position p of sequence i
                    return int(table[i, p // block_size]) * block_size + p % block_size
                for j in wrote:
                    rows.append(start + j)
                    slots.append(slot(pos[j]))
                cslots.append(torch.tensor([slot(p) for p in extra], dtype=torch.long, device=dev) if extra else None)
            qblocks.append([p // B for p in pos])
            cblocks.append([p // B for p in extra])
            start += n
        flat = [int(p) for pos in positions for p in pos]
        return cls(query_lens=[len(p) for p in positions], ctx_lens=[int(c) for c in ctx_lens], num_write=nws,
                   positions=torch.tensor(flat, dtype=torch.long, device=dev),
                   block_tables=torch.from_numpy(table).to(dev),
                   write_rows=torch.tensor(rows, dtype=torch.long, device=dev),
                   slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
                   block_size=int(block_size), diffusion_block_size=B, query_blocks=qblocks, cached_blocks=cblocks,
                   cached_slots=cslots)

    @classmethod
    def from_attn_metadata(cls, meta: AttnMetadata, diffusion_block_size: int) -> "BlockDiffusionMetadata":
        """An AR engine step read as a block-causal prefill: each sequence's queries contiguous and all written."""
        pos = AttnMetadata.positions(meta.query_lens, meta.seq_lens).tolist()
        positions, acc = [], 0
        for n in meta.query_lens:
            positions.append(pos[acc:acc + n])
            acc += n
        ctx = [s - q for q, s in zip(meta.query_lens, meta.seq_lens)]
        B = diffusion_block_size
        for i, (c, q) in enumerate(zip(ctx, meta.query_lens)):
            if c % B or q % B:
                raise ValueError(f"sequence {i}: an SDAR model reads an AR step only as a prefill of whole diffusion "
                                 f"blocks of {B} (got {q} query tokens after {c} cached); decode it with "
                                 "tandem.engine.diffusion")
        tables = [row.tolist() for row in meta.block_tables.cpu()]
        return cls.build(positions, ctx, list(meta.query_lens), tables, meta.block_size, B,
                         device=meta.block_tables.device)


class BlockDiffusionBackend:
    """Block-causal attention over the paged cache: each sequence's queries read its cached blocks and each other.

    Pure PyTorch (scaled_dot_product_attention with an explicit mask, one call per sequence): the correct path on
    every device. Written query tokens have their K/V scattered into the cache first; attention reads the cached
    prefix (ctx_len tokens, gathered by whole pages) and this step's K/V of the sequence's queries.
    """

    name = "block_diffusion"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                meta: "BlockDiffusionMetadata | AttnMetadata", scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D], kv [2, blocks, block_size, Hkv, D] -> out [T, Hq, D]."""
        if not isinstance(meta, BlockDiffusionMetadata):
            raise TypeError("the block-diffusion backend needs BlockDiffusionMetadata (SDARForCausalLM converts an "
                            "AttnMetadata itself)")
        if meta.write_rows.numel():
            write_kv(k.index_select(0, meta.write_rows), v.index_select(0, meta.write_rows), kv, meta.slot_mapping)
        masks = _masks(meta, q.device)
        hq, hkv, d = q.shape[1], k.shape[1], k.shape[2]
        gqa = hq != hkv
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        start = 0
        for i, n in enumerate(meta.query_lens):
            ctx = meta.ctx_lens[i]
            ks, vs = k[start:start + n], v[start:start + n]
            extra = meta.cached_slots[i] if meta.cached_slots else None
            if ctx or extra is not None:
                kparts, vparts = [], []
                if ctx:
                    bs = kv.shape[2]
                    nblk = -(-ctx // bs)
                    blocks = meta.block_tables[i, :nblk].long()
                    kparts.append(kv[0].index_select(0, blocks).reshape(nblk * bs, hkv, d)[:ctx])
                    vparts.append(kv[1].index_select(0, blocks).reshape(nblk * bs, hkv, d)[:ctx])
                if extra is not None:                # decoded positions of the active block, read by slot
                    kparts.append(kv[0].reshape(-1, hkv, d).index_select(0, extra))
                    vparts.append(kv[1].reshape(-1, hkv, d).index_select(0, extra))
                ks = torch.cat([*kparts, ks.to(kv.dtype)]).to(q.dtype)
                vs = torch.cat([*vparts, vs.to(kv.dtype)]).to(q.dtype)
            elif kv.numel():
                # the same rounding as keys read back from the cache, so a written block attends to itself as a
                # later step attends to it
                ks, vs = ks.to(kv.dtype).to(q.dtype), vs.to(kv.dtype).to(q.dtype)
            o = F.scaled_dot_product_attention(q[start:start + n].transpose(0, 1).unsqueeze(0),
                                               ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                                               attn_mask=masks[i], scale=scale, enable_gqa=gqa)
            out[start:start + n] = o[0].transpose(0, 1)
            start += n
        return out


def _masks(meta: BlockDiffusionMetadata, device: torch.device) -> list[torch.Tensor | None]:
    """Per sequence, the bool mask [n, ctx + n] of the block-causal rule (None: every key visible); built once a step."""
    masks = meta.scratch.get("block_diffusion")
    if masks is not None:
        return masks
    masks = []
    for i, blocks in enumerate(meta.query_blocks):
        extra = meta.cached_blocks[i] if meta.cached_blocks else []
        if min(blocks) == max(blocks) and all(e <= blocks[0] for e in extra):
            masks.append(None)                       # one block: its queries see each other and the whole cache
            continue
        b = torch.tensor(blocks, dtype=torch.long, device=device)
        keys = torch.tensor(extra + blocks, dtype=torch.long, device=device)
        among = keys[None, :] <= b[:, None]           # key j visible to query i: block(j) <= block(i)
        ctx = meta.ctx_lens[i]
        if ctx:
            among = torch.cat([torch.ones(len(blocks), ctx, dtype=torch.bool, device=device), among], dim=1)
        masks.append(among)
    meta.scratch["block_diffusion"] = masks
    return masks


class SDARForCausalLM(Qwen3ForCausalLM):
    """SDAR: Qwen3's layers and parameter names under block-causal attention, logits unshifted (position p -> token p)."""

    def __init__(self, config: Any, backend: Any = None) -> None:
        """Qwen3's modules on the block-diffusion backend (an AR backend given by the loader is not used)."""
        if config.diffusion_block_size is None or config.mask_token_id is None:
            raise ValueError("an SDAR config needs block_size and mask_token_id")
        # The AR backends (sdpa, flash) are causal: SDAR always attends through the block-diffusion backend.
        super().__init__(config, backend if isinstance(backend, BlockDiffusionBackend) else BlockDiffusionBackend())
        self.diffusion_block_size: int = int(config.diffusion_block_size)
        self.mask_token_id: int = int(config.mask_token_id)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None,
                kv_caches: list[torch.Tensor] | None, meta: "BlockDiffusionMetadata | AttnMetadata") -> torch.Tensor:
        """Token ids [T] -> hidden states [T, hidden]; positions default to meta.positions, kv_caches None: no cache."""
        if not isinstance(meta, BlockDiffusionMetadata):
            meta = BlockDiffusionMetadata.from_attn_metadata(meta, self.diffusion_block_size)
        if positions is None:
            positions = meta.positions
        return self.model(input_ids, positions, self.caches_or_none(kv_caches, meta, input_ids.device), meta)
