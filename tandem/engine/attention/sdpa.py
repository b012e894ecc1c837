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
    slots: torch.Tensor | None       # int64 [seq_len] cache slots of the whole sequence; None: no cached prefix
    mask: torch.Tensor | None        # bool [qlen, seq_len] causal-with-offset mask; None: plain is_causal


@dataclass
class _Plan:
    dec_rows: torch.Tensor | None    # int64 [Sd] query rows of the decode sequences; None: every row is one
    dec_slots: torch.Tensor | None   # int64 [Sd, Lmax] cache slots of each decode sequence (clamped, masked)
    dec_mask: torch.Tensor | None    # bool [Sd, 1, 1, Lmax] key j < seq_len
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
        pos = torch.arange(longest, device=device)
        dec_mask = (pos[None, :] < lens[:, None])[:, None, None, :]
        pos = torch.minimum(pos[None, :], lens[:, None] - 1)
        dec_slots = table.long().gather(1, pos // bs) * bs + pos % bs
    prefills = []
    for i, n in enumerate(meta.query_lens):
        if n == 1:
            continue
        L = meta.seq_lens[i]
        if L == n:
            prefills.append(_Prefill(starts[i], n, None, None))
            continue
        pos = torch.arange(L, device=device)
        slots = meta.block_tables[i].long()[pos // bs] * bs + pos % bs
        qpos = torch.arange(L - n, L, device=device)
        prefills.append(_Prefill(starts[i], n, slots, pos[None, :] <= qpos[:, None]))
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
        flat = kv.view(2, -1, kv.shape[-2], kv.shape[-1])        # [2, slots, Hkv, D]
        if plan.dec_slots is not None and plan.dec_rows is None:   # pure decode step: no scatter needed
            return self._decode(q, flat, plan, scale, gqa)
        out = torch.empty_like(q)
        if plan.dec_slots is not None:
            out.index_copy_(0, plan.dec_rows, self._decode(q.index_select(0, plan.dec_rows), flat, plan, scale, gqa))
        for p in plan.prefills:
            qs = q[p.start:p.start + p.qlen].transpose(0, 1).unsqueeze(0)      # [1, Hq, n, D]
            if p.slots is None:
                ks = k[p.start:p.start + p.qlen].transpose(0, 1).unsqueeze(0)
                vs = v[p.start:p.start + p.qlen].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
            else:
                g = flat[:, p.slots].transpose(1, 2).unsqueeze(1)                # [2, 1, Hkv, L, D]
                o = F.scaled_dot_product_attention(qs, g[0], g[1], attn_mask=p.mask, scale=scale, enable_gqa=gqa)
            out[p.start:p.start + p.qlen] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, flat: torch.Tensor, plan: _Plan, scale: float, gqa: bool) -> torch.Tensor:
        g = flat[:, plan.dec_slots].transpose(2, 3)                              # [2, Sd, Hkv, Lmax, D]
        o = F.scaled_dot_product_attention(q.unsqueeze(2), g[0], g[1], attn_mask=plan.dec_mask,
                                           scale=scale, enable_gqa=gqa)
        return o.squeeze(2)
