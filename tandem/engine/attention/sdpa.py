"""The pure-PyTorch attention backend (scaled_dot_product_attention over the paged cache): CPU and reference."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.engine.attention.metadata import AttnMetadata
from tandem.engine.attention.registry import register_backend, write_kv


@dataclass
class _Prefill:
    start: int                       # first query row in the flattened batch
    qlen: int
    slots: torch.Tensor | None       # int64 [1, nblk] KV blocks of the whole sequence; None: no cached prefix
    mask: torch.Tensor | None        # bool [qlen, nblk * block_size] causal-with-offset mask; None: is_causal


@dataclass
class _Plan:
    dec_rows: torch.Tensor | None    # int64 [Sd] query rows of the decode sequences; None: every row is one
    dec_slots: torch.Tensor | None   # int64 [Sd, nblk] KV blocks of each decode sequence (padded, masked)
    dec_mask: torch.Tensor | None    # bool [Sd, 1, 1, nblk * block_size] key j < seq_len
    prefills: list[_Prefill]


def _plan(meta: AttnMetadata, device: torch.device) -> _Plan:
    """Index tensors of one step, built at its first layer and kept in meta.scratch for the others."""
    plan = meta.scratch.get("sdpa")
    if plan is not None:
        return plan
    bs = meta.block_size
    starts, acc = [], 0
    for n in meta.query_lens:
        starts.append(acc)
        acc += n
    dec = [i for i, n in enumerate(meta.query_lens) if n == 1]
    dec_rows = dec_slots = dec_mask = None
    if dec:
        all_dec = len(dec) == len(meta.query_lens)
        longest = max(meta.seq_lens[i] for i in dec)
        if all_dec:
            table, lens = meta.block_tables, meta.seq_lens_t.long()
        else:
            sel = torch.tensor(dec, dtype=torch.long, device=device)
            dec_rows = torch.tensor([starts[i] for i in dec], dtype=torch.long, device=device)
            table, lens = meta.block_tables.index_select(0, sel), meta.seq_lens_t.index_select(0, sel).long()
        nblk = -(-longest // bs)
        pos = torch.arange(nblk * bs, device=device)
        dec_mask = (pos[None, :] < lens[:, None])[:, None, None, :]
        dec_slots = table[:, :nblk].long()          # whole blocks: gathering 16-token runs beats token indexing
    prefills = []
    for i, n in enumerate(meta.query_lens):
        if n == 1:
            continue
        L = meta.seq_lens[i]
        if L == n:
            prefills.append(_Prefill(starts[i], n, None, None))
            continue
        nblk = -(-L // bs)
        pos = torch.arange(nblk * bs, device=device)
        qpos = torch.arange(L - n, L, device=device)
        prefills.append(_Prefill(starts[i], n, meta.block_tables[i, :nblk].long()[None, :],
                                 pos[None, :] <= qpos[:, None]))
    plan = _Plan(dec_rows, dec_slots, dec_mask, prefills)
    meta.scratch["sdpa"] = plan
    return plan


@register_backend("sdpa")
class SdpaBackend:
    """Decode sequences in one padded SDPA call; each prefill (chunk) in its own causal SDPA call."""

    name = "sdpa"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                meta: AttnMetadata, scale: float) -> torch.Tensor:
        """Write k/v at meta.slot_mapping, then attend each query to its sequence's keys up to its position."""
        write_kv(k, v, kv, meta.slot_mapping)
        plan = _plan(meta, q.device)
        gqa = q.shape[1] != k.shape[1]
        if plan.dec_slots is not None and plan.dec_rows is None:   # pure decode step: no scatter needed
            return self._decode(q, kv, plan, scale, gqa)
        out = torch.empty_like(q)
        if plan.dec_slots is not None:
            out.index_copy_(0, plan.dec_rows, self._decode(q.index_select(0, plan.dec_rows), kv, plan, scale, gqa))
        for p in plan.prefills:
            qs = q[p.start:p.start + p.qlen].transpose(0, 1).unsqueeze(0)      # [1, Hq, n, D]
            if p.slots is None:
                ks = k[p.start:p.start + p.qlen].transpose(0, 1).unsqueeze(0)
                vs = v[p.start:p.start + p.qlen].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
            else:
                g = self._gather(kv, p.slots)                                     # [2, nblk, bs, Hkv, D]
                g = g.reshape(2, 1, -1, kv.shape[3], kv.shape[4]).transpose(2, 3)  # [2, 1, Hkv, L, D]
                o = F.scaled_dot_product_attention(qs, g[0], g[1], attn_mask=p.mask, scale=scale, enable_gqa=gqa)
            out[p.start:p.start + p.qlen] = o[0].transpose(0, 1)
        return out

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None     # reused gather buffer: fresh big tensors cost page faults

    def _gather(self, kv: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """K and V of `blocks` ([Sd, nblk]) copied into a reused buffer: [2, Sd * nblk, bs, Hkv, D]."""
        n = blocks.numel()
        shape = (2, n) + tuple(kv.shape[2:])
        buf = self._buf
        if buf is None or buf.shape[1] < n or buf.shape[2:] != kv.shape[2:] or buf.dtype != kv.dtype \
                or buf.device != kv.device:
            buf = self._buf = torch.empty((2, max(n, 2 * (buf.shape[1] if buf is not None else 0)),) + shape[2:],
                                          dtype=kv.dtype, device=kv.device)
        out = buf[:, :n]
        flat = blocks.reshape(-1)
        torch.index_select(kv[0], 0, flat, out=out[0])
        torch.index_select(kv[1], 0, flat, out=out[1])
        return out

    def _decode(self, q: torch.Tensor, kv: torch.Tensor, plan: _Plan, scale: float, gqa: bool) -> torch.Tensor:
        sd, nblk = plan.dec_slots.shape
        g = self._gather(kv, plan.dec_slots)                                     # [2, Sd*nblk, bs, Hkv, D]
        g = g.view(2, sd, nblk * kv.shape[2], kv.shape[3], kv.shape[4]).transpose(2, 3)  # [2, Sd, Hkv, L, D]
        o = F.scaled_dot_product_attention(q.unsqueeze(2), g[0], g[1], attn_mask=plan.dec_mask,
                                           scale=scale, enable_gqa=gqa)
        return o.squeeze(2)
