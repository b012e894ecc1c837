"""Semi-autoregressive decoding of LLaDA-style (bidirectional) masked-diffusion models: a full-recompute reference and
Fast-dLLM's prefix cache.

The canvas is the prompt followed by `gen_length` mask tokens (LLaDA's generate). It is decoded block by block, left
to right, in blocks of `dllm_block_length` positions starting at the prompt's end (not at absolute multiples of the
block, as SDAR's are); every step runs the model over the canvas (every position sees every other, the masks after
the active block too), samples the active block's masked positions and commits some by the unmasking strategy
(unmasking.py, through BlockState: the same rules, sampler, EOS and max_tokens handling as SDAR's loops). A completed
block's first EOS ends the output; at most min(max_tokens, gen_length) tokens are generated.

- `generate_llada_reference`: the whole canvas recomputed at every step, no KV cache.
- `generate_llada_cached` (Fast-dLLM's `generate_with_prefix_cache`): at the first step of each block, one forward
  over the whole canvas (its logits serve that step) whose K/V of the prefix (prompt + completed blocks) are kept in a
  paged cache; the block's later steps compute only the active block and the masks after it, attending to the cached
  prefix. The prefix's K/V are exact when written and then go stale (they were computed while the active block was
  still masked): Fast-dLLM's approximation. `refresh_interval` k > 0 also recomputes the whole canvas (and rewrites
  the prefix) every k steps within a block; k = 1 recomputes at every step and gives the reference's tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from tandem.engine.attention.metadata import allocate_kv_cache
from tandem.engine.diffusion.block_state import BlockState, DiffusionOutput
from tandem.engine.diffusion.generate import check_params, model_device
from tandem.engine.diffusion.unmasking import DllmConfig
from tandem.engine.models.bidirectional import BidirectionalMetadata
from tandem.engine.sampling_params import SamplingParams

from tandem.engine.config import LLADA_BLOCK_LENGTH as DEFAULT_BLOCK_LENGTH


@dataclass
class LladaOutput(DiffusionOutput):
    """A DiffusionOutput with, per denoise step, whether it recomputed the whole canvas and where its block started."""

    refreshed: list[bool] = field(default_factory=list)        # the step ran the whole canvas (else the cached path)
    context_per_step: list[int] = field(default_factory=list)  # the active block's first position at each step
    gen_length: int = 0                                         # the canvas's masked length


class CanvasState(BlockState):
    """BlockState laid out as LLaDA's canvas: the prompt is the prefix, blocks start at its end, the canvas ends
    gen_length positions after it (so at most min(max_tokens, gen_length) tokens are generated)."""

    def __init__(self, prompt: Sequence[int], params: SamplingParams, cfg: DllmConfig, block: int, mask_id: int,
                 eos: frozenset[int], gen_length: int, device: torch.device) -> None:
        """The prompt as the committed prefix and a first block of masks right after it."""
        super().__init__(prompt, params, cfg, block, mask_id, eos, len(prompt) + gen_length, device)
        self.prefix = list(prompt)
        self.block = [mask_id] * block
        self.undecoded = [True] * block
        self.end = len(prompt) + gen_length
        self.out = LladaOutput([], "", gen_length=gen_length)

    def canvas(self) -> list[int]:
        """The whole canvas: prefix, the active block, and masks up to its end."""
        return self.prefix + self.block + [self.mask_id] * (self.end - self.start - self.B)


def _options(model: torch.nn.Module, prompts: Sequence[Sequence[int]], params: SamplingParams, cfg: DllmConfig | None,
             gen_length: int | None, eos_token_ids: Sequence[int] | None) -> tuple[DllmConfig, int, int, frozenset[int]]:
    """Validated options shared by both loops: (cfg, block length, gen_length, EOS ids); one ValueError per mistake."""
    cfg = cfg or DllmConfig()
    check_params(params)
    block = cfg.block_length(DEFAULT_BLOCK_LENGTH)
    steps = cfg.dllm_denoising_steps
    if steps is not None and block % steps:
        raise ValueError(f"dllm_denoising_steps {steps} must divide the block length {block}")
    t = float(cfg.dllm_confidence_threshold)
    if not 0.0 < t <= 1.0:
        raise ValueError(f"dllm_confidence_threshold must be in (0, 1], got {t}")
    if gen_length is None:
        if params.max_tokens is None:
            raise ValueError("LLaDA decoding needs gen_length or SamplingParams.max_tokens (the canvas length)")
        gen_length = -(-int(params.max_tokens) // block) * block
    if isinstance(gen_length, bool) or not isinstance(gen_length, int) or gen_length < 1 or gen_length % block:
        raise ValueError(f"gen_length must be a positive multiple of the block length {block}, got {gen_length!r}")
    if params.max_tokens is not None and params.max_tokens > gen_length:
        raise ValueError(f"max_tokens {params.max_tokens} exceeds gen_length {gen_length}")
    mc = model.config
    longest = max((len(p) for p in prompts), default=0)
    if longest + gen_length > mc.max_position_embeddings:
        raise ValueError(f"a prompt of {longest} tokens plus gen_length {gen_length} exceeds the model's "
                         f"{mc.max_position_embeddings} positions")
    eos = frozenset(mc.eos_token_ids if eos_token_ids is None else eos_token_ids)
    return cfg, block, gen_length, eos


def _record(seq: CanvasState, refreshed: bool) -> None:
    """Note a step's kind and its block's start before it runs."""
    seq.out.refreshed.append(refreshed)
    seq.out.context_per_step.append(seq.start)


@torch.inference_mode()
def generate_llada_reference(model: torch.nn.Module, prompt: Sequence[int], params: SamplingParams,
                             cfg: DllmConfig | None = None, gen_length: int | None = None,
                             eos_token_ids: Sequence[int] | None = None) -> LladaOutput:
    """Decode one prompt by recomputing the whole canvas at every step (LLaDA's generate), no KV cache."""
    cfg, block, gen_length, eos = _options(model, [prompt], params, cfg, gen_length, eos_token_ids)
    dev = model_device(model)
    seq = CanvasState(prompt, params, cfg, block, model.mask_token_id, eos, gen_length, dev)
    while not seq.done:
        _record(seq, True)
        cand = seq.candidates()
        ids = seq.canvas()
        meta = BidirectionalMetadata.build([len(ids)], [0], [0], None, 1, dev)
        hidden = model(torch.tensor(ids, dtype=torch.long, device=dev), None, None, meta)
        rows = torch.tensor([seq.start + j for j in cand], dtype=torch.long, device=dev)
        seq.step(model.compute_logits(hidden.index_select(0, rows)), cand)
    return seq.out


class PrefixCachedLoop:
    """Fast-dLLM's prefix-cached decoding of a batch of prompts, one forward per step for every live sequence."""

    def __init__(self, model: torch.nn.Module, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 cfg: DllmConfig | None = None, gen_length: int | None = None, refresh_interval: int = 0,
                 eos_token_ids: Sequence[int] | None = None, kv_block_size: int = 16,
                 kv_dtype: torch.dtype | None = None) -> None:
        """Validate the options, lay out each canvas and allocate each prefix's KV pages (prompt + gen_length)."""
        if isinstance(refresh_interval, bool) or not isinstance(refresh_interval, int) or refresh_interval < 0:
            raise ValueError(f"refresh_interval must be an integer >= 0, got {refresh_interval!r}")
        cfg, block, gen_length, eos = _options(model, prompts, params, cfg, gen_length, eos_token_ids)
        self.model, self.interval, self.page = model, refresh_interval, kv_block_size
        self.device = model_device(model)
        self.seqs = [CanvasState(p, params, cfg, block, model.mask_token_id, eos, gen_length, self.device)
                     for p in prompts]
        self.block_step = [0] * len(self.seqs)          # steps taken in each sequence's active block
        self.tables: list[list[int]] = []
        acc = 0
        for s in self.seqs:
            n = -(-s.end // kv_block_size)
            self.tables.append(list(range(acc, acc + n)))
            acc += n
        mc = model.config
        self.kv = allocate_kv_cache(mc.num_hidden_layers, max(acc, 1), kv_block_size, mc.num_key_value_heads,
                                    mc.head_dim, kv_dtype or next(model.parameters()).dtype, self.device)

    def refreshes(self, i: int) -> bool:
        """Whether sequence i's next step recomputes the whole canvas: a block's first step, or every
        `refresh_interval` steps of it."""
        j = self.block_step[i]
        return j == 0 or (self.interval > 0 and j % self.interval == 0)

    @torch.inference_mode()
    def step(self) -> bool:
        """One forward for every live sequence and its commits; False (nothing run) once all are done."""
        live = [i for i, s in enumerate(self.seqs) if not s.done]
        if not live:
            return False
        ids: list[int] = []
        rows: list[int] = []
        qlens, ctxs, writes, cands = [], [], [], []
        for i in live:
            s = self.seqs[i]
            full = self.refreshes(i)
            _record(s, full)
            first = 0 if full else s.start                  # the cached path starts at the active block
            cand = s.candidates()
            rows.extend(len(ids) + s.start - first + j for j in cand)
            ids.extend(s.canvas()[first:])
            qlens.append(s.end - first)
            ctxs.append(first)
            writes.append(s.start if full else 0)           # a full forward keeps the prefix's K/V
            cands.append(cand)
        meta = BidirectionalMetadata.build(qlens, ctxs, writes, [self.tables[i] for i in live], self.page,
                                           self.device)
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=self.device), None, self.kv, meta)
        logits = self.model.compute_logits(hidden.index_select(0, torch.tensor(rows, dtype=torch.long,
                                                                               device=self.device)))
        off = 0
        for i, cand in zip(live, cands):
            s = self.seqs[i]
            blocks = s.out.num_blocks
            s.step(logits[off:off + len(cand)], cand)
            off += len(cand)
            self.block_step[i] = 0 if s.out.num_blocks != blocks else self.block_step[i] + 1
        return True

    def outputs(self) -> list[LladaOutput]:
        """Each prompt's output (final once step() returns False)."""
        return [s.out for s in self.seqs]


def generate_llada_cached(model: torch.nn.Module, prompts: Sequence[Sequence[int]], params: SamplingParams,
                          cfg: DllmConfig | None = None, gen_length: int | None = None, refresh_interval: int = 0,
                          eos_token_ids: Sequence[int] | None = None, kv_block_size: int = 16,
                          kv_dtype: torch.dtype | None = None) -> list[LladaOutput]:
    """Decode a batch of prompts with Fast-dLLM's prefix cache (module docstring); refresh_interval 1: exact."""
    loop = PrefixCachedLoop(model, prompts, params, cfg, gen_length, refresh_interval, eos_token_ids, kv_block_size,
                            kv_dtype)
    while loop.step():
        pass
    return loop.outputs()


__all__ = ["DEFAULT_BLOCK_LENGTH", "CanvasState", "LladaOutput", "PrefixCachedLoop", "generate_llada_cached",
           "generate_llada_reference"]
