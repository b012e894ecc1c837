"""The PyTorch attention backend (scaled_dot_product_attention over the paged cache): CPU and reference.

On the CPU in float32, decode sequences go to the paged decode kernel (native.py: K/V read once, in place) and
prefill chunks to the paged prefill kernel (causal, over the paged K/V in place) when they build on this machine;
otherwise, and on other devices, to the gather + SDPA paths below.

Decode (one query token per sequence) is memory-bound: every step reads each sequence's whole K/V. PyTorch has
no paged attention kernel, so K/V are gathered, whole blocks at a time, into a reused buffer and attended there.
The decode sequences are sorted by length and cut into groups whose gathered K/V stay small (DECODE_GROUP_BYTES,
about an L2/L3 slice): each group is gathered and attended before the next, so the copy is read back from cache
rather than from memory, and padding is only up to the longest sequence of its group. The G query heads that share
a KV head are folded into the query-length dim ([S, Hkv, G, D] against [S, Hkv, L, D]) so that every key and value
is read once, not once per query head.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.engine.attention import native
from tandem.engine.attention.base import write_kv
from tandem.engine.attention.metadata import AttnMetadata

DECODE_GROUP_BYTES = 4 << 20     # gathered K+V per decode group (bytes); at least one sequence per group


@dataclass
class _Prefill:
    start: int                       # first query row in the flattened batch
    qlen: int
    slots: torch.Tensor | None       # int64 [nblk] KV blocks of the whole sequence; None: no cached prefix
    mask: torch.Tensor | None        # bool [qlen, nblk * block_size] causal-with-offset mask; None: is_causal


@dataclass
class _DecodeGroup:
    rows: torch.Tensor | None        # int64 [g] query rows of the group's sequences; None: rows[0]..+g-1 (`start`)
    start: int
    n: int                           # sequences in the group
    blocks: torch.Tensor             # int64 [n * nblk] KV blocks per sequence (padded to the longest), flattened
    nblk: int
    mask: torch.Tensor | None        # bool [n, 1, 1, nblk * block_size] key j < seq_len; None: all full


@dataclass
class _Native:
    rows: torch.Tensor               # int64 [n] query rows of the decode sequences
    seqs: torch.Tensor               # int64 [n] their block-table rows
    lens: torch.Tensor               # int64 [n] their KV lengths


@dataclass
class _NativePrefill:
    starts: torch.Tensor             # int64 [n] first query row of each prefill chunk
    qlens: torch.Tensor              # int64 [n] its query tokens
    seqs: torch.Tensor               # int64 [n] its block-table row
    lens: torch.Tensor               # int64 [n] its KV length (cached prefix + the chunk)


@dataclass
class _Plan:
    groups: list[_DecodeGroup]       # for the gather + SDPA path
    all_decode: bool                 # every sequence of the step is a decode
    prefills: list[_Prefill]         # for SDPA, one call each (empty when native_prefill takes them)
    native: _Native | None           # for the paged decode kernel (native.py), when it takes this step
    native_prefill: _NativePrefill | None = None   # for the paged prefill kernel, when it takes this step


def _plan(meta: AttnMetadata, q: torch.Tensor, kv: torch.Tensor) -> _Plan:
    """Index tensors of one step, built at its first layer and kept in meta.scratch for the others (which kernels
    take the step is decided here, once)."""
    plan = meta.scratch.get("sdpa")
    if plan is not None:
        return plan
    device, use_native = q.device, native.supports(q, kv)
    native_prefill = use_native and native.supports_prefill(q, kv)
    kv_block_bytes = 2 * kv[0, 0].numel() * kv.element_size()
    bs = meta.block_size
    starts, acc = [], 0
    for n in meta.query_lens:
        starts.append(acc)
        acc += n
    dec = sorted((i for i, n in enumerate(meta.query_lens) if n == 1), key=lambda i: meta.seq_lens[i])
    groups: list[_DecodeGroup] = []
    decode_kernel = None
    if dec and use_native:
        decode_kernel = _Native(torch.tensor([starts[i] for i in dec], dtype=torch.long),
                         torch.tensor(dec, dtype=torch.long),
                         torch.tensor([meta.seq_lens[i] for i in dec], dtype=torch.long))
    elif dec:
        table = meta.block_tables
        cap = max(1, DECODE_GROUP_BYTES // max(1, kv_block_bytes))    # blocks per group
        i = 0
        while i < len(dec):
            j = i + 1
            while j < len(dec) and (j + 1 - i) * -(-meta.seq_lens[dec[j]] // bs) <= cap:
                j += 1
            members = dec[i:j]
            lens = [meta.seq_lens[m] for m in members]
            nblk = -(-max(lens) // bs)
            rows = [starts[m] for m in members]
            contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
            sel = torch.tensor(members, dtype=torch.long, device=device)
            blocks = table.index_select(0, sel)[:, :nblk].long().reshape(-1)
            mask = None
            if min(lens) != nblk * bs:
                lt = torch.tensor(lens, dtype=torch.long, device=device)
                mask = (torch.arange(nblk * bs, device=device)[None, :] < lt[:, None])[:, None, None, :]
            groups.append(_DecodeGroup(None if contiguous else torch.tensor(rows, dtype=torch.long, device=device),
                                       rows[0], len(members), blocks, nblk, mask))
            i = j
    prefills, prefill_kernel = [], None
    pre = [i for i, n in enumerate(meta.query_lens) if n > 1]
    if pre and native_prefill:
        prefill_kernel = _NativePrefill(torch.tensor([starts[i] for i in pre], dtype=torch.long),
                                        torch.tensor([meta.query_lens[i] for i in pre], dtype=torch.long),
                                        torch.tensor(pre, dtype=torch.long),
                                        torch.tensor([meta.seq_lens[i] for i in pre], dtype=torch.long))
        pre = []
    for i in pre:
        n, L = meta.query_lens[i], meta.seq_lens[i]
        if L == n:
            prefills.append(_Prefill(starts[i], n, None, None))
            continue
        nblk = -(-L // bs)
        pos = torch.arange(nblk * bs, device=device)
        qpos = torch.arange(L - n, L, device=device)
        prefills.append(_Prefill(starts[i], n, meta.block_tables[i, :nblk].long(), pos[None, :] <= qpos[:, None]))
    plan = _Plan(groups, len(dec) == len(meta.query_lens), prefills, decode_kernel, prefill_kernel)
    meta.scratch["sdpa"] = plan
    return plan


class SdpaBackend:
    """Decode sequences in length-sorted groups of gathered blocks; each prefill (chunk) in its own causal SDPA call."""

    name = "sdpa"

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None     # reused gather buffer: fresh big tensors cost page faults

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                meta: AttnMetadata, scale: float) -> torch.Tensor:
        """Write k/v at meta.slot_mapping, then attend each query to its sequence's keys up to its position."""
        write_kv(k, v, kv, meta.slot_mapping)
        plan = _plan(meta, q, kv)
        hq, hkv, d = q.shape[1], kv.shape[3], kv.shape[4]
        gqa = hq != hkv
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if q.shape[0] else q
        if plan.native is not None or plan.native_prefill is not None:
            q = q.contiguous()
        if plan.native is not None:
            n = plan.native
            native.paged_decode(q, kv, meta.block_tables, n.rows, n.seqs, n.lens, scale, out)
        if plan.native_prefill is not None:
            p = plan.native_prefill
            native.paged_prefill(q, kv, meta.block_tables, p.starts, p.qlens, p.seqs, p.lens, scale, out)
        for g in plan.groups:
            qs = q[g.start:g.start + g.n] if g.rows is None else q.index_select(0, g.rows)
            kb = self._gather(kv, g.blocks)                                          # [2, n*nblk, bs, Hkv, D]
            kb = kb.view(2, g.n, g.nblk * kv.shape[2], hkv, d).transpose(2, 3)        # [2, n, Hkv, L, D]
            o = F.scaled_dot_product_attention(qs.view(g.n, hkv, hq // hkv, d), kb[0], kb[1],
                                               attn_mask=g.mask, scale=scale)        # [n, Hkv, G, D]
            # reshape, not view: CUDA's SDPA kernels may return [n, Hkv, G, D] laid out as [n, G, Hkv, D]
            if g.rows is None:
                out[g.start:g.start + g.n] = o.reshape(g.n, hq, d)
            else:
                out.index_copy_(0, g.rows, o.reshape(g.n, hq, d))
        for p in plan.prefills:
            qs = q[p.start:p.start + p.qlen].transpose(0, 1).unsqueeze(0)      # [1, Hq, n, D]
            if p.slots is None:
                ks = k[p.start:p.start + p.qlen].transpose(0, 1).unsqueeze(0)
                vs = v[p.start:p.start + p.qlen].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
            else:
                kb = self._gather(kv, p.slots)                                     # [2, nblk, bs, Hkv, D]
                kb = kb.reshape(2, 1, -1, hkv, d).transpose(2, 3)                  # [2, 1, Hkv, L, D]
                o = F.scaled_dot_product_attention(qs, kb[0], kb[1], attn_mask=p.mask, scale=scale, enable_gqa=gqa)
            out[p.start:p.start + p.qlen] = o[0].transpose(0, 1)
        return out

    def _gather(self, kv: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """K and V of `blocks` ([n] block ids) copied into a reused buffer: [2, n, bs, Hkv, D]."""
        n = blocks.numel()
        buf = self._buf
        if buf is None or buf.shape[1] < n or buf.shape[2:] != kv.shape[2:] or buf.dtype != kv.dtype \
                or buf.device != kv.device:
            size = max(n, 2 * buf.shape[1]) if buf is not None and buf.shape[2:] == kv.shape[2:] else n
            buf = self._buf = torch.empty((2, size) + tuple(kv.shape[2:]), dtype=kv.dtype, device=kv.device)
        out = buf[:, :n]
        torch.index_select(kv[0], 0, blocks, out=out[0])
        torch.index_select(kv[1], 0, blocks, out=out[1])
        return out
