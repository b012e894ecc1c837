"""Block-diffusion decoding loops for SDAR models: a plain full-recompute reference and a KV-cached batched variant.

The algorithm (SDAR's generate, LMDeploy's dllm options; unmasking.py has the per-step rules):

1. Blocks are aligned to absolute positions: block k is positions k*B .. k*B+B-1. The prompt's whole blocks are its
   prefix; its leftover tokens (P mod B of them) start the first block to decode, as fixed (unmasked) tokens.
2. The active block starts with every other position set to the mask token. Each step runs the model over the
   block (attending to everything before it, bidirectionally within it), samples a token and a confidence at each
   masked position, and commits some of them by the unmasking strategy, until none is left.
3. A completed block joins the prefix and the next block starts, until an EOS or max_tokens: an EOS anywhere in a
   completed block ends the output at its first EOS (the EOS kept in token_ids, as vLLM keeps it); max_tokens is
   honoured exactly: positions past it in the last block stay masked and are never committed (the model still
   sees them as mask tokens, as in training), and the block is complete when every position before it is.

`generate_reference` recomputes the whole sequence (prefix + active block) at every step, with no KV cache, under
the block-causal mask. `generate_cached` keeps each sequence's prefix in a paged KV cache, written once per block
(a completed block's K/V are written by the forward that also runs the next block's first step), and runs only the
active block each step, for a batch of prompts at once; each sequence draws from its own seeded generator, so its
tokens are those of the reference, alone or batched.
"""
from __future__ import annotations

from typing import Sequence

import torch

from tandem.engine.attention.metadata import allocate_kv_cache
from tandem.engine.diffusion.block_state import BlockState, DiffusionOutput, build_step, prefill_window
from tandem.engine.diffusion.unmasking import DllmConfig
from tandem.engine.models.sdar import BlockDiffusionMetadata
from tandem.engine.sampling_params import SamplingParams, unsupported_diffusion_fields


def check_params(params: SamplingParams) -> None:
    """Refuse the sampling fields the diffusion loops do not implement, rather than ignore them."""
    bad = unsupported_diffusion_fields(params) + (["stop"] if params.stop else [])
    if bad:
        raise ValueError(f"block-diffusion decoding does not support {', '.join(bad)}")


def setup(model: torch.nn.Module, params: SamplingParams, cfg: DllmConfig | None,
           eos_token_ids: Sequence[int] | None) -> tuple[DllmConfig, int, frozenset[int], int]:
    """The validated options, block length, EOS ids and position limit shared by both loops."""
    cfg = cfg or DllmConfig()
    check_params(params)
    mc = model.config
    block = cfg.block_length(model.diffusion_block_size)
    cfg.quota(block)
    eos = frozenset(mc.eos_token_ids if eos_token_ids is None else eos_token_ids)
    return cfg, block, eos, int(mc.max_position_embeddings)


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model's weights are (inputs and generators go there)."""
    return next(model.parameters()).device


@torch.inference_mode()
def generate_reference(model: torch.nn.Module, prompt: Sequence[int], params: SamplingParams,
                       cfg: DllmConfig | None = None, eos_token_ids: Sequence[int] | None = None) -> DiffusionOutput:
    """Decode one prompt by full recomputation: every step runs prefix + active block, no KV cache."""
    cfg, block, eos, max_len = setup(model, params, cfg, eos_token_ids)
    dev = model_device(model)
    seq = BlockState(prompt, params, cfg, block, model.mask_token_id, eos, max_len, dev)
    while not seq.done:
        cand = seq.candidates()
        ids = seq.prefix + seq.block
        meta = BlockDiffusionMetadata.build([range(len(ids))], [0], [0], None, 1, block, dev)
        hidden = model(torch.tensor(ids, dtype=torch.long, device=dev), None, None, meta)
        rows = torch.tensor([seq.start + j for j in cand], dtype=torch.long, device=dev)
        seq.step(model.compute_logits(hidden.index_select(0, rows)), cand)
    return seq.out


@torch.inference_mode()
def generate_cached(model: torch.nn.Module, prompts: Sequence[Sequence[int]], params: SamplingParams,
                    cfg: DllmConfig | None = None, eos_token_ids: Sequence[int] | None = None,
                    kv_block_size: int = 16, kv_dtype: torch.dtype | None = None,
                    chunk: int | None = None) -> list[DiffusionOutput]:
    """Decode a batch of prompts with each prefix's K/V cached, one forward per step: without `chunk` the whole
    active block each step (its K/V written once it is complete); with `chunk` = c, Optimus's streaming chunks of at
    most c positions, decoded positions' K/V reused inside the block (block_state.py)."""
    cfg, block, eos, max_len = setup(model, params, cfg, eos_token_ids)
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
    dev = model_device(model)
    seqs = [BlockState(p, params, cfg, block, model.mask_token_id, eos, max_len, dev) for p in prompts]
    mc = model.config
    pages = [-(-(s.limit + block) // kv_block_size) for s in seqs]     # room for the prefix + the active block
    tables, acc = [], 0
    for n in pages:
        tables.append(list(range(acc, acc + n)))
        acc += n
    kv = allocate_kv_cache(mc.num_hidden_layers, max(acc, 1), kv_block_size, mc.num_key_value_heads, mc.head_dim,
                           kv_dtype or next(model.parameters()).dtype, dev)
    if chunk is not None:                    # streaming: a prefill of the prompts' whole blocks first, as the engine's
        wins = [prefill_window(0, s.prefix) for s in seqs if s.start]
        if wins:
            ids, meta, _ = build_step(wins, [t for s, t in zip(seqs, tables) if s.start], kv_block_size, block, dev)
            model(ids, None, kv, meta)
        for s in seqs:
            s.prefilled()
    while True:
        live = [i for i, s in enumerate(seqs) if not s.done]
        if not live:
            return [s.out for s in seqs]
        wins = [seqs[i].window(chunk, reuse=chunk is not None) for i in live]
        ids, meta, rows = build_step(wins, [tables[i] for i in live], kv_block_size, block, dev)
        logits = model.compute_logits(model(ids, None, kv, meta).index_select(0, rows))
        off = 0
        for i, w in zip(live, wins):
            seqs[i].apply(w, logits[off:off + len(w.rows)])
            off += len(w.rows)
