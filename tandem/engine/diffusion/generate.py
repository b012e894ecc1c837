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

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from tandem.engine.attention.metadata import allocate_kv_cache
from tandem.engine.diffusion.unmasking import DllmConfig, sample_tokens, select_commits
from tandem.engine.models.sdar import BlockDiffusionMetadata
from tandem.engine.sampling_params import SamplingParams

_UNSUPPORTED = {"min_p": 0.0, "min_tokens": 0, "logprobs": None, "prompt_logprobs": None, "presence_penalty": 0.0,
                "frequency_penalty": 0.0, "repetition_penalty": 1.0, "structured_output": None, "logit_bias": None}


@dataclass
class DiffusionOutput:
    """One prompt's decoded tokens and how they were committed."""

    token_ids: list[int]                  # generated tokens (the stopping EOS included), at most max_tokens
    finish_reason: str                    # "stop" (EOS or a stop token id) or "length" (max_tokens)
    commits_per_step: list[int] = field(default_factory=list)   # tokens each denoise step committed
    num_blocks: int = 0                   # blocks decoded

    @property
    def num_steps(self) -> int:
        """Denoise steps (model forwards over the active block) this prompt took."""
        return len(self.commits_per_step)

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens committed per denoise step."""
        return sum(self.commits_per_step) / max(1, len(self.commits_per_step))


def _check_params(params: SamplingParams) -> None:
    """Refuse the sampling fields the diffusion loops do not implement, rather than ignore them."""
    bad = [k for k, default in _UNSUPPORTED.items() if getattr(params, k) != default]
    if params.stop:
        bad.append("stop")
    if bad:
        raise ValueError(f"block-diffusion decoding does not support {', '.join(bad)}")


class _Seq:
    """One prompt's decoding state: the committed prefix, the active block, and its stop rules."""

    def __init__(self, prompt: Sequence[int], params: SamplingParams, cfg: DllmConfig, block: int, mask_id: int,
                 eos: frozenset[int], max_len: int, device: torch.device) -> None:
        """The first block: the prompt's leftover tokens, then masks; the prompt's whole blocks are the prefix."""
        P = len(prompt)
        if P < 1:
            raise ValueError("an empty prompt")
        self.params, self.B, self.mask_id = params, block, mask_id
        self.quota = cfg.quota(block)
        self.strategy, self.threshold = cfg.dllm_unmasking_strategy, float(cfg.dllm_confidence_threshold)
        self.eos = frozenset() if params.ignore_eos else eos | frozenset(params.stop_token_ids or ())
        room = max_len - P
        if room < 1:
            raise ValueError(f"a prompt of {P} tokens leaves no room under the model's {max_len} positions")
        self.max_tokens = room if params.max_tokens is None else min(int(params.max_tokens), room)
        self.P, self.limit = P, P + self.max_tokens
        start = P // block * block
        self.prefix: list[int] = list(prompt[:start])        # positions < the active block's start
        self.block: list[int] = list(prompt[start:]) + [mask_id] * (block - (P - start))
        # which block positions are still to decode (not token equality: a prompt may hold the mask token)
        self.undecoded: list[bool] = [False] * (P - start) + [True] * (block - (P - start))
        self.generator = None
        if params.seed is not None and params.temperature != 0.0:
            self.generator = torch.Generator(device=device).manual_seed(int(params.seed))
        self.out = DiffusionOutput([], "", [], 0)
        self.n_cached = 0                                     # cached variant: prefix tokens whose K/V are written

    @property
    def start(self) -> int:
        """The active block's first position."""
        return len(self.prefix)

    @property
    def done(self) -> bool:
        """True once the output is final."""
        return bool(self.out.finish_reason)

    def candidates(self) -> list[int]:
        """Offsets in the block of the masked positions still to decode (before the max_tokens limit)."""
        s = self.start
        return [j for j, u in enumerate(self.undecoded) if u and s + j < self.limit]

    def step(self, logits: Tensor, cand: list[int]) -> None:
        """Sample the candidates' logits [n, V] (changed in place), commit by the strategy; finish a full block.

        The mask token is never sampled: committing it would leave the position masked forever.
        """
        p = self.params
        logits[:, self.mask_id] = float("-inf")
        tokens, conf = sample_tokens(logits, p.temperature, p.top_k, p.top_p, self.generator)
        chosen = select_commits(conf, self.strategy, self.quota, self.threshold).tolist()
        toks = tokens.tolist()
        for j, c, t in zip(cand, chosen, toks):
            if c:
                self.block[j] = t
                self.undecoded[j] = False
        self.out.commits_per_step.append(sum(chosen))
        if len(cand) == sum(chosen):
            self._finish_block()

    def _finish_block(self) -> None:
        """Append the block's generated tokens; stop at the first EOS or at max_tokens, else start the next block."""
        s = self.start
        self.out.num_blocks += 1
        gen = [t for j, t in enumerate(self.block) if self.P <= s + j < self.limit]
        for t in gen:
            self.out.token_ids.append(t)
            if t in self.eos:
                self.out.finish_reason = "stop"
                return
        if len(self.out.token_ids) >= self.max_tokens:
            self.out.finish_reason = "length"
            return
        self.prefix.extend(self.block)
        self.block = [self.mask_id] * self.B
        self.undecoded = [True] * self.B


def _setup(model: torch.nn.Module, params: SamplingParams, cfg: DllmConfig | None,
           eos_token_ids: Sequence[int] | None) -> tuple[DllmConfig, int, frozenset[int], int]:
    """The validated options, block length, EOS ids and position limit shared by both loops."""
    cfg = cfg or DllmConfig()
    _check_params(params)
    mc = model.config
    block = cfg.block_length(model.diffusion_block_size)
    cfg.quota(block)
    eos = frozenset(mc.eos_token_ids if eos_token_ids is None else eos_token_ids)
    return cfg, block, eos, int(mc.max_position_embeddings)


def _device(model: torch.nn.Module) -> torch.device:
    """Where the model's weights are (inputs and generators go there)."""
    return next(model.parameters()).device


@torch.inference_mode()
def generate_reference(model: torch.nn.Module, prompt: Sequence[int], params: SamplingParams,
                       cfg: DllmConfig | None = None, eos_token_ids: Sequence[int] | None = None) -> DiffusionOutput:
    """Decode one prompt by full recomputation: every step runs prefix + active block, no KV cache."""
    cfg, block, eos, max_len = _setup(model, params, cfg, eos_token_ids)
    dev = _device(model)
    seq = _Seq(prompt, params, cfg, block, model.mask_token_id, eos, max_len, dev)
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
                    kv_block_size: int = 16, kv_dtype: torch.dtype | None = None) -> list[DiffusionOutput]:
    """Decode a batch of prompts with each prefix's K/V cached (written once per block); one forward per step."""
    cfg, block, eos, max_len = _setup(model, params, cfg, eos_token_ids)
    dev = _device(model)
    seqs = [_Seq(p, params, cfg, block, model.mask_token_id, eos, max_len, dev) for p in prompts]
    mc = model.config
    pages = [-(-(s.limit + block) // kv_block_size) for s in seqs]     # room for the prefix + the active block
    tables, acc = [], 0
    for n in pages:
        tables.append(list(range(acc, acc + n)))
        acc += n
    kv = allocate_kv_cache(mc.num_hidden_layers, max(acc, 1), kv_block_size, mc.num_key_value_heads, mc.head_dim,
                           kv_dtype or next(model.parameters()).dtype, dev)
    while True:
        live = [i for i, s in enumerate(seqs) if not s.done]
        if not live:
            return [s.out for s in seqs]
        positions, ctx, write, ids, cands, rows = [], [], [], [], [], []
        for i in live:
            s = seqs[i]
            pending = s.prefix[s.n_cached:]                   # completed blocks (or prompt blocks) not cached yet
            positions.append(range(s.n_cached, s.start + block))
            ctx.append(s.n_cached)
            write.append(len(pending))
            cand = s.candidates()
            cands.append(cand)
            rows.extend(len(ids) + len(pending) + j for j in cand)
            ids.extend(pending + s.block)
        meta = BlockDiffusionMetadata.build(positions, ctx, write, [tables[i] for i in live], kv_block_size, block,
                                            dev)
        hidden = model(torch.tensor(ids, dtype=torch.long, device=dev), None, kv, meta)
        logits = model.compute_logits(hidden.index_select(0, torch.tensor(rows, dtype=torch.long, device=dev)))
        off = 0
        for i, cand in zip(live, cands):
            s = seqs[i]
            s.n_cached = s.start
            s.step(logits[off:off + len(cand)], cand)
            off += len(cand)
